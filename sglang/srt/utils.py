"""Small shared helpers of the runtime."""

from __future__ import annotations

import base64
import io
import os
from typing import Any, Optional

REQUEST_TIMEOUT_ENV = "REQUEST_TIMEOUT"
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif")


def load_image(image_file: Any) -> tuple[Any, Optional[tuple[int, int]]]:
    """Image from a PIL image, bytes, URL, file path, data URI or base64 string -> (PIL.Image, size or None)."""
    from PIL import Image

    if isinstance(image_file, Image.Image):
        return image_file, image_file.size
    if isinstance(image_file, (bytes, bytearray)):
        return Image.open(io.BytesIO(image_file)), None
    if not isinstance(image_file, str):
        raise ValueError(f"Unsupported image input of type {type(image_file).__name__}")
    if image_file.startswith(("http://", "https://")):
        import requests

        timeout = float(os.environ.get(REQUEST_TIMEOUT_ENV, "3"))
        response = requests.get(image_file, stream=True, timeout=timeout)
        response.raise_for_status()
        return Image.open(io.BytesIO(response.content)), None
    if image_file.lower().endswith(IMAGE_EXTENSIONS) and os.path.exists(image_file):
        return Image.open(image_file), None
    if image_file.startswith("data:"):
        image_file = image_file.split(",", 1)[1]
    try:
        return Image.open(io.BytesIO(base64.b64decode(image_file, validate=False))), None
    except Exception as e:
        raise ValueError(f"Invalid image input: {e}") from None
