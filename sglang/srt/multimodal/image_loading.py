"""Decode the images of a request: data URIs, raw base64, local paths, bytes, PIL images and allowed URLs.

Every failure is an `ImageInputError` (a ValueError, so the API answers 400) whose message starts with the
field it concerns, e.g. `image_data[1]: ...`. Remote URLs are refused unless their host is in the allow-list
(`--allowed-image-url-domains` or SGLANG_ALLOWED_IMAGE_URL_DOMAINS; a domain also allows its subdomains), and
are fetched with a timeout and a byte limit. Local files are read only under `--allowed-local-media-path` (off
by default: a remote client should not make the server read its files).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlparse

ALLOWED_DOMAINS_ENV = "SGLANG_ALLOWED_IMAGE_URL_DOMAINS"
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageInputError(ValueError):
    pass


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    url_timeout: float = 5.0
    allowed_domains: tuple[str, ...] = ()
    # Local files are read only under this folder (--allowed-local-media-path); None: never.
    local_media_root: Optional[str] = None

    @classmethod
    def from_server_args(cls, args: Any) -> ImageLimits:
        listed = ",".join(filter(None, [getattr(args, "allowed_image_url_domains", None) or "",
                                        os.environ.get(ALLOWED_DOMAINS_ENV, "")]))
        domains = tuple(d.strip().lower().lstrip(".") for d in listed.split(",") if d.strip())
        return cls(
            max_bytes=int(getattr(args, "max_image_bytes", cls.max_bytes)),
            max_pixels=int(getattr(args, "max_image_pixels", cls.max_pixels)),
            url_timeout=float(getattr(args, "image_url_timeout", cls.url_timeout)),
            allowed_domains=domains,
            local_media_root=_real_dir(getattr(args, "allowed_local_media_path", None)),
        )

    def domain_allowed(self, host: str) -> bool:
        host = host.lower()
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


def load_image_input(item: Any, limits: ImageLimits, field: str = "image_data") -> Any:
    """The decoded (fully loaded, RGB-convertible) PIL image of one image_data item."""
    from PIL import Image

    if isinstance(item, Image.Image):
        _check_pixels(item.size, limits, field)
        return item
    if isinstance(item, dict):  # {"url": ...} as in OpenAI content parts
        url = item.get("url") if isinstance(item.get("url"), str) else item.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str):
            raise ImageInputError(f"{field}: an image object must have a string 'url'")
        item = url
    if isinstance(item, (bytes, bytearray)):
        return _decode(bytes(item), limits, field)
    if not isinstance(item, str):
        raise ImageInputError(f"{field}: unsupported image input of type {type(item).__name__}")
    if not item:
        raise ImageInputError(f"{field}: empty image string")
    if item.startswith(("http://", "https://")):
        return _decode(_fetch(item, limits, field), limits, field)
    if item.startswith("data:"):
        header, _, payload = item.partition(",")
        if ";base64" not in header:
            raise ImageInputError(f"{field}: only base64 data URIs are supported")
        return _decode(_b64(payload, field), limits, field)
    is_file_url = item.startswith("file://")
    if is_file_url:
        item = item[len("file://"):]
    if limits.local_media_root is None:
        # Without an allowed folder the file system is never consulted, so a request learns nothing of it.
        if is_file_url:
            raise ImageInputError(f"{field}: local files are not readable by this server (see "
                                  "--allowed-local-media-path)")
        return _decode(_b64(item, field), limits, field)
    if len(item) < 4096 and os.path.isfile(item):
        if not _inside(item, limits.local_media_root):
            raise ImageInputError(f"{field}: the file is outside --allowed-local-media-path")
        size = os.path.getsize(item)
        if size > limits.max_bytes:
            raise ImageInputError(f"{field}: image file is {size} bytes, over the limit of {limits.max_bytes}")
        with open(item, "rb") as f:
            return _decode(f.read(), limits, field)
    return _decode(_b64(item, field), limits, field)


def _real_dir(path: Optional[str]) -> Optional[str]:
    return os.path.realpath(path) if path else None


def _inside(path: str, root: str) -> bool:
    """Whether `path`, links resolved, lies in the folder `root` (so `..` and symlinks cannot leave it)."""
    real = os.path.realpath(path)
    return os.path.commonpath([real, root]) == root


def _b64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(
            f"{field}: not a readable file path, an allowed http(s) URL, a data URI or valid base64"
        ) from None


def _check_pixels(size: tuple[int, int], limits: ImageLimits, field: str) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise ImageInputError(
            f"{field}: image of {width}x{height} pixels is over the limit of {limits.max_pixels} pixels"
        )


def _decode(data: bytes, limits: ImageLimits, field: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageInputError(f"{field}: image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageInputError(f"{field}: cannot identify an image in the data (corrupt or not an image)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageInputError(f"{field}: image has too many pixels") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageInputError(f"{field}: corrupt image data ({e})") from None
    if image.format not in SUPPORTED_FORMATS:
        raise ImageInputError(
            f"{field}: unsupported image format {image.format}; supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    # The header gives the size before any pixel is decoded: refuse huge images before decoding them.
    _check_pixels(image.size, limits, field)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageInputError(f"{field}: corrupt image data ({e})") from None
    return image


def _fetch(url: str, limits: ImageLimits, field: str) -> bytes:
    import requests

    host = urlparse(url).hostname or ""
    if not limits.domain_allowed(host):
        raise ImageInputError(
            f"{field}: image URL host {host!r} is not allowed; the server fetches images only from the domains "
            f"given with --allowed-image-url-domains or {ALLOWED_DOMAINS_ENV}"
        )
    try:
        with requests.get(url, stream=True, timeout=limits.url_timeout, allow_redirects=False) as response:
            if response.status_code != 200:
                raise ImageInputError(f"{field}: fetching the image URL returned HTTP {response.status_code}")
            chunks, total = [], 0
            for chunk in response.iter_content(64 * 1024):
                total += len(chunk)
                if total > limits.max_bytes:
                    raise ImageInputError(f"{field}: image at URL is over the limit of {limits.max_bytes} bytes")
                chunks.append(chunk)
    except requests.RequestException as e:
        raise ImageInputError(f"{field}: cannot fetch the image URL ({type(e).__name__})") from None
    return b"".join(chunks)


def image_data_items(image_data: Any) -> Optional[list[Any]]:
    """The images of one request's image_data (one item or a list of items); None when it has none."""
    if image_data is None:
        return None
    items = list(image_data) if isinstance(image_data, (list, tuple)) else [image_data]
    items = [i for i in items if i is not None]
    return items or None
