"""Images from user input, validated: PIL images (offline), data URLs, file:// paths under an allowed directory,
http(s) URLs (size- and time-limited). Every error is a `MultiModalInputError` naming the request field."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from typing import Any

MAX_IMAGE_BYTES = 20 * 2**20  # an encoded image larger than this is refused before decoding
MAX_IMAGE_SIDE = 8192  # pixels per side
MAX_IMAGE_PIXELS = 32 * 2**20  # width x height
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
HTTP_TIMEOUT_S = 10.0


class MultiModalInputError(ValueError):
    """A bad image in a request; `param` is the request field at fault (the message starts with it too)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.message, self.param = f"{param}: {message}", param


def check_image(image: Any, param: str) -> Any:
    """A PIL image within the size limits, in RGB (what the image processors take)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise MultiModalInputError(f"an image must be a PIL.Image.Image, got {type(image).__name__}.", param)
    w, h = image.size
    if w < 1 or h < 1:
        raise MultiModalInputError(f"the image is empty ({w}x{h}).", param)
    if max(w, h) > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
        raise MultiModalInputError(f"the image is {w}x{h}: over the limit of {MAX_IMAGE_SIDE} pixels per side and "
                                   f"{MAX_IMAGE_PIXELS} pixels in all.", param)
    try:
        return image if image.mode == "RGB" else image.convert("RGB")
    except Exception as e:  # a truncated or corrupt file is only found when its pixels are read
        raise MultiModalInputError(f"the image data could not be decoded ({type(e).__name__}: {e}).", param) from e


def decode_image_bytes(data: bytes, param: str) -> Any:
    """The image an encoded file holds (PNG, JPEG, WebP, GIF, BMP), checked and in RGB."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise MultiModalInputError(f"the image is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}.", param)
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MultiModalInputError("the data is not an image in a format that can be decoded (supported: "
                                   f"{', '.join(SUPPORTED_FORMATS)}).", param) from None
    except Exception as e:
        raise MultiModalInputError(f"the image data could not be decoded ({type(e).__name__}: {e}).", param) from e
    if image.format not in SUPPORTED_FORMATS:
        raise MultiModalInputError(f"unsupported image format {image.format}; supported: "
                                   f"{', '.join(SUPPORTED_FORMATS)}.", param)
    w, h = image.size  # (from the header: checked before the pixels are decoded)
    if max(w, h) > MAX_IMAGE_SIDE or w * h > MAX_IMAGE_PIXELS:
        raise MultiModalInputError(f"the image is {w}x{h}: over the limit of {MAX_IMAGE_SIDE} pixels per side and "
                                   f"{MAX_IMAGE_PIXELS} pixels in all.", param)
    try:
        image.load()
    except Exception as e:
        raise MultiModalInputError(f"the image data could not be decoded ({type(e).__name__}: {e}).", param) from e
    return check_image(image, param)


def _data_url(url: str, param: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep:
        raise MultiModalInputError("a data URL must look like data:image/png;base64,<data>.", param)
    mime, _, encoding = header.partition(";")
    if mime and not mime.startswith("image/"):
        raise MultiModalInputError(f"unsupported media type {mime!r} (an image/* data URL is expected).", param)
    if encoding != "base64":
        raise MultiModalInputError("only base64 data URLs are supported (data:image/...;base64,...).", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MultiModalInputError(f"the data URL is not valid base64 ({e}).", param) from e


def _local_file(url: str, param: str, allowed_local_media_path: str | None) -> bytes:
    if not allowed_local_media_path:
        raise MultiModalInputError("file:// URLs are refused (start the server with --allowed-local-media-path DIR "
                                   "to allow files under DIR).", param)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise MultiModalInputError(f"the file is not under the allowed local media path {root}.", param)
    if not os.path.isfile(path):
        raise MultiModalInputError("the file does not exist.", param)
    if os.path.getsize(path) > MAX_IMAGE_BYTES:
        raise MultiModalInputError(f"the file is over the limit of {MAX_IMAGE_BYTES} bytes.", param)
    with open(path, "rb") as f:
        return f.read()


def _http(url: str, param: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:  # noqa: S310 (http(s) only, checked above)
            data = r.read(MAX_IMAGE_BYTES + 1)
    except Exception as e:
        raise MultiModalInputError(f"the image could not be fetched ({type(e).__name__}: {e}).", param) from e
    if len(data) > MAX_IMAGE_BYTES:
        raise MultiModalInputError(f"the image is over the limit of {MAX_IMAGE_BYTES} bytes.", param)
    return data


def load_image_url(url: Any, param: str, allowed_local_media_path: str | None = None) -> Any:
    """The image a URL names: data:image/...;base64, file:// (under `allowed_local_media_path`), http(s)://."""
    if not isinstance(url, str) or not url:
        raise MultiModalInputError("an image URL must be a non-empty string.", param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, param)
    elif scheme == "file":
        data = _local_file(url, param, allowed_local_media_path)
    elif scheme in ("http", "https"):
        data = _http(url, param)
    else:
        raise MultiModalInputError("unsupported image URL scheme (data:, file:// or http(s):// are taken).", param)
    return decode_image_bytes(data, param)
