"""Image URLs into images: png, jpeg and webp data URLs decode to their pictures with a hash of their bytes; every
bad input is an ImageInputError naming the image and the reason; remote URLs are refused without any network
access unless the policy allows them, and then fetched within the byte bound."""

from __future__ import annotations

import base64
import hashlib
import io
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from sglang_lite.multimodal.media import ImageInputError, MediaPolicy, load_image

POLICY = MediaPolicy()


def picture(width: int = 24, height: int = 16) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def urlopen(*args, **kwargs):
        pytest.fail("urlopen was called for a URL that must be refused")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


class FakeResponse(io.BytesIO):
    """What urlopen returns, counting the bytes read."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body)
        self.bytes_read = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.bytes_read += len(chunk)
        return chunk


@pytest.mark.parametrize(
    "fmt, media_type, options",
    [
        ("PNG", "image/png", {}),
        ("WEBP", "image/webp", {"lossless": True}),
        ("JPEG", "image/jpeg", {}),
    ],
)
def test_data_urls_round_trip(fmt: str, media_type: str, options: dict):
    data = encoded(picture(), fmt, **options)
    loaded = load_image(data_url(data, media_type), 1, POLICY)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(np.asarray(loaded.image.convert("RGB")), expected)
    assert loaded.content_hash == hashlib.sha256(data).hexdigest()
    if fmt != "JPEG":
        assert np.array_equal(np.asarray(loaded.image), np.asarray(picture()))


def test_a_data_url_without_a_media_type_opens():
    data = encoded(picture(), "PNG")
    loaded = load_image(f"data:;base64,{base64.b64encode(data).decode()}", 1, POLICY)
    assert loaded.image.size == (24, 16)


def test_the_hash_tells_images_apart():
    first = load_image(data_url(encoded(picture(), "PNG")), 1, POLICY)
    again = load_image(data_url(encoded(picture(), "PNG")), 2, POLICY)
    other = load_image(data_url(encoded(picture(24, 17), "PNG")), 3, POLICY)
    assert first.content_hash == again.content_hash != other.content_hash


def refused(url: str, match: str, policy: MediaPolicy = POLICY, index: int = 2) -> None:
    with pytest.raises(ImageInputError, match=f"^image {index}: .*{match}"):
        load_image(url, index, policy)


def test_bad_data_urls_are_refused_naming_the_image():
    png = base64.b64encode(encoded(picture(), "PNG")).decode()
    refused("data:image/png;base64" + png, "no ','")
    refused("data:image/png," + png, "only base64")
    refused("data:image/png;base64,@@not*base64@@", "invalid base64")
    refused(f"data:text/plain;base64,{png}", "'text/plain' is not an image")


def test_bytes_that_are_no_image_are_refused():
    refused(data_url(b"def f():\n    return 1\n"), "not a readable image")
    png = encoded(picture(), "PNG")
    refused(data_url(png[: len(png) // 2]), "not a readable image")


def test_an_image_over_the_byte_bound_is_refused():
    data = encoded(picture(), "PNG")
    refused(data_url(data), "larger than the 100 bytes", MediaPolicy(max_bytes=100))
    refused(data_url(data), "larger than", MediaPolicy(max_bytes=len(data) - 1))
    assert load_image(data_url(data), 1, MediaPolicy(max_bytes=len(data))).image.size == (24, 16)


def test_an_image_over_the_pixel_bound_is_refused():
    refused(data_url(encoded(picture(), "PNG")), "24x16 is 384 pixels", MediaPolicy(max_pixels=383))


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("url", ["http://example.com/a.png", "HTTPS://example.com/a.png"])
def test_remote_urls_are_refused_without_fetching(url: str):
    refused(url, "media policy .*--allow-remote-images")


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "/tmp/a.png"])
def test_other_schemes_are_refused(url: str):
    refused(url, "unsupported URL scheme")
    refused(url, "unsupported URL scheme", MediaPolicy(allow_remote=True))


def test_allowed_remote_urls_are_fetched(monkeypatch: pytest.MonkeyPatch):
    data = encoded(picture(), "PNG")
    calls = []

    def urlopen(url: str, timeout: float) -> FakeResponse:
        calls.append((url, timeout))
        return FakeResponse(data)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    policy = MediaPolicy(allow_remote=True, timeout_s=3.0)
    loaded = load_image("https://example.com/a.png", 1, policy)
    assert calls == [("https://example.com/a.png", 3.0)]
    assert loaded.content_hash == hashlib.sha256(data).hexdigest()
    assert np.array_equal(np.asarray(loaded.image), np.asarray(picture()))


def test_a_remote_body_over_the_byte_bound_is_refused_reading_one_byte_more(
    monkeypatch: pytest.MonkeyPatch,
):
    response = FakeResponse(bytes(10_000_000))
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: response)
    refused(
        "http://example.com/a.png", "larger than", MediaPolicy(allow_remote=True, max_bytes=1000)
    )
    assert response.bytes_read == 1001


def test_a_failed_fetch_is_refused(monkeypatch: pytest.MonkeyPatch):
    def urlopen(url: str, timeout: float):
        raise urllib.error.URLError("connection refused")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    refused("http://example.com/a.png", "could not fetch", MediaPolicy(allow_remote=True))
