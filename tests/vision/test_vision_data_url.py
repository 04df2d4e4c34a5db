"""Data URL parsing: every refusal has its own status, code and message; payloads never leak."""
from __future__ import annotations

import base64

import numpy as np
import pytest
from PIL import Image

from luxjax.errors import ImageInputError
from luxjax.vision.data_url import EncodedImage, check_total_image_bytes, parse_image_url, redact, sniff_format
from luxjax.vision.limits import MiB, ImageLimits
from vision_helpers import IMAGES, data_url, encode

LABEL = "image 2 (messages[1].content[0])"
LIMITS = ImageLimits()
PNG = (IMAGES / "chart-rgba.png").read_bytes()
JPEG = (IMAGES / "photo-desk.jpeg").read_bytes()


def refusal(image_url, limits: ImageLimits = LIMITS) -> ImageInputError:
    with pytest.raises(ImageInputError) as caught:
        parse_image_url(image_url, LABEL, limits)
    error = caught.value
    assert error.message.startswith("image 2 "), error.message
    if isinstance(image_url, dict) and isinstance(image_url.get("url"), str):
        payload = image_url["url"].partition(",")[2]
        assert payload[:24] not in error.message or len(payload) < 8, "payload leaked into the error"
    return error


@pytest.mark.parametrize(
    "fmt, mime, expected",
    [("JPEG", "image/jpeg", "JPEG"), ("JPEG", "image/jpg", "JPEG"), ("PNG", "image/png", "PNG"),
     ("BMP", "image/bmp", "BMP"), ("WEBP", "image/webp", "WEBP"), ("PNG", "IMAGE/PNG", "PNG"),
     ("GIF", "image/gif", "GIF")],
)
def test_accepts_supported_formats(fmt, mime, expected):
    data = encode(Image.new("RGB", (8, 8), (1, 2, 3)), fmt)
    encoded = parse_image_url({"url": data_url(data, mime), "detail": "high"}, LABEL, LIMITS)
    assert encoded == EncodedImage(data, expected, mime.lower())


@pytest.mark.parametrize("detail", ["ultra", "", 1, ["high"]])
def test_refuses_unknown_detail(detail):
    error = refusal({"url": data_url(PNG, "image/png"), "detail": detail})
    assert error.status == 400 and '"detail"' in error.message


@pytest.mark.parametrize("detail", [None, "auto", "low", "high"])
def test_accepts_openai_details(detail):
    assert parse_image_url({"url": data_url(PNG, "image/png"), "detail": detail}, LABEL, LIMITS).data == PNG


def test_accepts_whitespace_in_base64():
    url = "data:image/png;base64," + base64.encodebytes(PNG).decode()  # 76-column lines
    assert parse_image_url({"url": url}, LABEL, LIMITS).data == PNG


@pytest.mark.parametrize("url", ["http://example.com/cat.png", "https://example.com/cat.png?sig=SECRET"])
def test_refuses_remote_urls(url):
    error = refusal({"url": url})
    assert error.status == 400 and error.code == "remote_image_url"
    assert "does not fetch remote images" in error.message and "base64 data URL" in error.message
    assert "SECRET" not in error.message


def test_refuses_file_urls():
    error = refusal({"url": "file:///etc/passwd"})
    assert error.status == 400 and "does not read local files" in error.message and "passwd" not in error.message


@pytest.mark.parametrize(
    "url", ["not a url", "data:image/png;base64", "/9j/4AAQSkZJRg==", "ftp://host/x.png", "data:image/png,abcd"]
)
def test_refuses_malformed_urls(url):
    error = refusal({"url": url})
    assert error.status == 400 and "malformed" in error.message


def test_refuses_missing_media_type():
    error = refusal({"url": "data:;base64," + base64.b64encode(PNG).decode()})
    assert error.status == 400 and "no media type" in error.message


@pytest.mark.parametrize("payload", ["!!!!", "abc", "QUJD$A==", "QQ=Q"])
def test_refuses_bad_base64(payload):
    error = refusal({"url": "data:image/png;base64," + payload})
    assert error.status == 400 and "base64 payload is invalid" in error.message


def test_refuses_empty_payload():
    error = refusal({"url": "data:image/png;base64,"})
    assert error.status == 400 and "empty" in error.message


def test_refuses_unsupported_declared_type():
    tiff = encode(Image.new("RGB", (4, 4)), "TIFF")
    error = refusal({"url": data_url(tiff, "image/tiff")})
    assert error.status == 400 and error.code == "unsupported_image" and "image/tiff" in error.message


def test_refuses_unsupported_bytes():
    tiff = encode(Image.new("RGB", (4, 4)), "TIFF")
    error = refusal({"url": data_url(tiff, "image/png")})
    assert error.status == 400 and "not a supported image format" in error.message


@pytest.mark.parametrize("data, mime, actual", [(JPEG, "image/png", "image/jpeg"), (PNG, "image/jpeg", "image/png"),
                                                (PNG, "image/webp", "image/png"), (PNG, "image/gif", "image/png")])
def test_refuses_mime_mismatch(data, mime, actual):
    error = refusal({"url": data_url(data, mime)})
    assert error.status == 400 and error.code == "image_type_mismatch"
    assert f"declares {mime}" in error.message and f"bytes are {actual}" in error.message


def test_refuses_image_url_as_string():
    error = refusal(data_url(PNG, "image/png"))
    assert error.status == 400 and "not a string" in error.message


@pytest.mark.parametrize("image_url", [{}, {"url": 5}, None, ["data:"]])
def test_refuses_image_url_without_url(image_url):
    error = refusal(image_url)
    assert error.status == 400 and '"url"' in error.message


def test_refuses_oversized_image_at_default_limit():
    data = b"\x89PNG\r\n\x1a\n" + bytes(16 * MiB)
    error = refusal({"url": data_url(data, "image/png")})
    assert error.status == 413 and error.code == "image_too_large" and str(16 * MiB) in error.message


def test_refuses_oversized_image_exactly_after_decoding():
    limits = ImageLimits(max_image_bytes=len(PNG) - 1)
    error = refusal({"url": data_url(PNG, "image/png")}, limits)
    assert error.status == 413 and str(len(PNG)) in error.message
    assert parse_image_url({"url": data_url(PNG, "image/png")}, LABEL, ImageLimits(max_image_bytes=len(PNG)))


def test_total_bytes_budget():
    check_total_image_bytes(32 * MiB, LABEL, LIMITS)
    with pytest.raises(ImageInputError) as caught:
        check_total_image_bytes(32 * MiB + 1, LABEL, LIMITS)
    assert caught.value.status == 413 and caught.value.message.startswith("image 2 ")


def test_sniff_format():
    samples = (JPEG, PNG, b"BM" + bytes(20), b"RIFF\0\0\0\0WEBPVP8 ", b"GIF89a", b"GIF87a", b"II*\0", b"GIF90a")
    assert [sniff_format(d) for d in samples] == ["JPEG", "PNG", "BMP", "WEBP", "GIF", "GIF", None, None]


def test_redact_replaces_every_payload():
    payload = base64.b64encode(np.random.default_rng().bytes(300)).decode()
    text = (f'{{"url": "data:image/png;base64,{payload}"}} and data:image/jpeg;charset=x;base64,{payload[:40]} '
            f"'data:IMAGE/webp;BASE64,{payload}'")
    redacted = redact(text)
    assert payload[:16] not in redacted and payload[20:36] not in redacted
    assert f"data:image/png;base64,<base64 {len(payload)} bytes>" in redacted
    assert "data:image/jpeg;charset=x;base64,<base64 40 bytes>" in redacted
    assert redacted.endswith(f"data:IMAGE/webp;BASE64,<base64 {len(payload)} bytes>'")
    assert redact("no images here, data: none") == "no images here, data: none"
