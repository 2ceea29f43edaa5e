"""Image inputs from OpenAI-style ``image_url`` values, decoded under a ``MediaPolicy``.

A ``data:`` URL (base64; an ``image/*`` media type or none) is decoded here. An ``http(s)://`` URL is fetched only
when the policy allows remote images (the server's ``--allow-remote-images``); refused, it is never fetched. Any other
scheme (``file://``, ``ftp://``) is refused. Every refusal is an ``ImageInputError`` naming the image (1-based, in
the request's order) and the reason; the HTTP layer answers it with a 400.

Only common raster formats are opened (``FORMATS``): Pillow would run Ghostscript for EPS, for example. An animated
image gives its first frame.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import time
import urllib.request
from dataclasses import dataclass
from typing import IO

from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
REMOTE_SCHEMES = ("http", "https")
CHUNK_BYTES = 1 << 16
# what Pillow raises for bytes it cannot decode
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


class ImageInputError(ValueError):
    """An image the request cannot use; the message reads ``image <n>: <reason>``."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: {reason}")
        self.index = index


@dataclass(frozen=True)
class MediaPolicy:
    """What the server accepts: remote URLs or not, at most ``max_bytes`` encoded and ``max_pixels`` decoded per image
    (the pixel bound guards against decompression bombs), and ``timeout_s`` for a whole remote fetch."""

    allow_remote: bool = False
    max_bytes: int = 20 * 2**20
    max_pixels: int = 64 * 2**20
    timeout_s: float = 10.0


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image, fully loaded and in its own mode (the image processor converts it to RGB, compositing any
    transparency onto white), and ``content_hash``: the sha256 hex digest of its encoded bytes, which the prefix cache
    keys on."""

    image: Image.Image
    content_hash: str


def image_data_url(entry: str) -> str:
    """An ``image_data`` entry (SGLang's ``/generate`` field: a URL or bare base64 data) as a URL."""
    return entry if ":" in entry[:16] else f"data:;base64,{entry}"


def load_image(url: str, index: int, policy: MediaPolicy) -> LoadedImage:
    """The image at ``url``, the ``index``-th (1-based) of its request. Raises ImageInputError."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        data = decode_data_url(url, index, policy)
    elif scheme in REMOTE_SCHEMES:
        data = fetch_remote(url, index, policy)
    else:
        raise ImageInputError(
            index, f"unsupported URL scheme {scheme!r}: send the image as a data: URL (base64)"
        )
    return LoadedImage(open_image(data, index, policy), hashlib.sha256(data).hexdigest())


def decode_data_url(url: str, index: int, policy: MediaPolicy) -> bytes:
    """The bytes of a ``data:[<media type>][;<parameter>...];base64,<data>`` URL."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageInputError(index, "malformed data URL: no ',' before the data")
    media_type, *parameters = header.split(";")
    if "base64" not in [p.strip().lower() for p in parameters]:
        raise ImageInputError(index, "malformed data URL: only base64 data URLs are supported")
    media_type = media_type.strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise ImageInputError(index, f"media type {media_type!r} is not an image")
    encoded = "".join(payload.split())
    # some clients leave the padding out
    encoded += "=" * (-len(encoded) % 4)
    if len(encoded) // 4 * 3 > policy.max_bytes + 2:
        raise too_large(index, policy)
    try:
        data = base64.b64decode(encoded, validate=True)
    except binascii.Error as error:
        raise ImageInputError(index, f"invalid base64 in the data URL ({error})") from error
    if len(data) > policy.max_bytes:
        raise too_large(index, policy)
    return data


def fetch_remote(url: str, index: int, policy: MediaPolicy) -> bytes:
    """The body at an http(s) URL, if the policy allows remote images: at most ``max_bytes``, within
    ``timeout_s`` in all."""
    if not policy.allow_remote:
        raise ImageInputError(
            index,
            "remote image URLs are refused by the server's media policy (start the server with "
            "--allow-remote-images to fetch them); send the image as a data: URL instead",
        )
    deadline = time.monotonic() + policy.timeout_s
    try:
        with urllib.request.urlopen(url, timeout=policy.timeout_s) as response:
            return read_bounded(response, index, policy, deadline)
    except ImageInputError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as error:
        raise ImageInputError(index, f"could not fetch {url!r} ({error})") from error


def read_bounded(response: IO[bytes], index: int, policy: MediaPolicy, deadline: float) -> bytes:
    """The response's body; refused past ``max_bytes`` (reading one byte more tells) or past the deadline."""
    body = bytearray()
    while len(body) <= policy.max_bytes:
        chunk = response.read(min(CHUNK_BYTES, policy.max_bytes + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
        if time.monotonic() > deadline:
            raise ImageInputError(index, f"fetching took longer than {policy.timeout_s} s")
    raise too_large(index, policy)


def open_image(data: bytes, index: int, policy: MediaPolicy) -> Image.Image:
    """The decoded, fully loaded image; its size is checked before its pixels are decoded."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UNREADABLE as error:
        raise unreadable(index, error) from error
    if image.width * image.height > policy.max_pixels:
        raise ImageInputError(
            index,
            f"{image.width}x{image.height} is {image.width * image.height} pixels, more than the "
            f"{policy.max_pixels} allowed",
        )
    try:
        image.load()
    except UNREADABLE as error:
        raise unreadable(index, error) from error
    return image


def unreadable(index: int, error: Exception) -> ImageInputError:
    return ImageInputError(index, f"not a readable image ({error})")


def too_large(index: int, policy: MediaPolicy) -> ImageInputError:
    return ImageInputError(index, f"the image is larger than the {policy.max_bytes} bytes allowed")
