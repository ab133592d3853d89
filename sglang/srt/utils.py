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


def kill_process_tree(parent_pid: Optional[int] = None, include_parent: bool = True, skip_pid: Optional[int] = None,
                      grace_s: float = 5.0) -> None:
    """End a process and all its descendants (SGLang's helper of this name; its tests stop servers with it).

    `parent_pid` None means this process, which is then never ended itself, only its descendants. Each process gets
    SIGTERM first, so a server can remove its socket folder; whatever still runs after `grace_s` seconds is killed.
    Returns once all of them are gone."""
    import psutil

    if parent_pid is None:
        parent_pid, include_parent = os.getpid(), False
    try:
        parent = psutil.Process(parent_pid)
        targets = [p for p in parent.children(recursive=True) if p.pid != skip_pid]
    except psutil.NoSuchProcess:
        return
    if include_parent and parent_pid != os.getpid():
        targets.append(parent)
    for p in targets:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    from sglang.utils import kill_survivors

    kill_survivors(targets, grace_s)
