"""Chat content parts -> template text: image_url parts become the model's image placeholder, in place."""

from __future__ import annotations

from typing import Any, Optional


def flatten_content(content: list[dict[str, Any]], images: list[Any], placeholder: Optional[str]) -> str:
    """The text of a message's parts; each image_url part is replaced by `placeholder` and its url appended to
    `images` (in order). A model without images (placeholder None) refuses any non-text part."""
    kinds = {p.get("type") for p in content} - {"text"}
    if placeholder is None and kinds:
        raise ValueError(f"This model does not accept {', '.join(sorted(kinds))} content.")
    if kinds - {"image_url"}:
        raise ValueError(f"This model does not accept {', '.join(sorted(kinds - {'image_url'}))} content.")
    pieces = []
    for part in content:
        if part.get("type") == "text":
            pieces.append(part["text"])
            continue
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str) or not url:
            raise ValueError("messages: an image_url content part needs a string image_url.url")
        images.append(url)
        pieces.append(placeholder or "")
    return "".join(pieces)
