"""OpenAI `image_url` content parts -> the encoded image bytes they carry.

Only base64 data URLs are accepted; the server never fetches remote or local files. The declared MIME type must
agree with the format sniffed from the bytes. Error messages never contain the payload (see `redact`).
"""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from luxjax.errors import ImageInputError
from luxjax.vision.limits import ImageLimits

MIME_TO_FORMAT = {
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/png": "PNG",
    "image/gif": "GIF",
    "image/bmp": "BMP",
    "image/webp": "WEBP",
}
FORMAT_TO_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "GIF": "image/gif", "BMP": "image/bmp",
                  "WEBP": "image/webp"}
SUPPORTED_TYPES_TEXT = "image/jpeg, image/png, image/gif, image/bmp or image/webp"
DETAILS = (None, "auto", "low", "high")  # OpenAI's image_url.detail values (accepted; the model's rule sizes images)

_DATA_URL = re.compile(r"data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)
_BASE64_PAYLOAD = re.compile(r"(data:[^;,\s\"'<>]*(?:;[^;,\s\"'<>]*)*;base64,)([A-Za-z0-9+/=_-]+)", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class EncodedImage:
    data: bytes
    format: str  # PIL format name: JPEG, PNG, GIF, BMP, WEBP
    mime: str  # as declared by the client, lower-cased


def redact(text: str) -> str:
    """Replace every base64 data-URL payload in `text` with `<base64 N bytes>` (N = payload characters)."""
    return _BASE64_PAYLOAD.sub(lambda m: f"{m.group(1)}<base64 {len(m.group(2))} bytes>", text)


def sniff_format(data: bytes) -> str | None:
    """The image format named by the leading magic bytes, or None when it is not one we accept."""
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if data.startswith(b"BM"):
        return "BMP"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def parse_image_url(image_url: object, label: str, limits: ImageLimits) -> EncodedImage:
    """Validate the `image_url` field of a content part and decode its data URL.

    label names the image in messages, e.g. "image 2 (messages[1].content[0])".
    """
    if isinstance(image_url, str):
        raise ImageInputError(
            f'{label}: "image_url" must be an object {{"url": "data:image/...;base64,..."}}, not a string',
            code="invalid_image_url",
        )
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise ImageInputError(f'{label}: "image_url" needs a string field "url"', code="invalid_image_url")
    if image_url.get("detail") not in DETAILS:
        raise ImageInputError(f'{label}: "detail" must be "auto", "low" or "high" (every image is read at the '
                              "model's own resolution rule whichever it is)", code="invalid_image_url")
    url = image_url["url"]
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise ImageInputError(
            f"{label}: this server does not fetch remote images (http/https URLs); "
            "send the image inline as a base64 data URL (data:image/png;base64,...)",
            code="remote_image_url",
        )
    if scheme.startswith("file:"):
        raise ImageInputError(
            f"{label}: this server does not read local files (file:// URLs); "
            "send the image inline as a base64 data URL (data:image/png;base64,...)",
            code="remote_image_url",
        )
    return _decode_data_url(url, label, limits)


def _decode_data_url(url: str, label: str, limits: ImageLimits) -> EncodedImage:
    header = _DATA_URL.match(url)
    if header is None:
        raise ImageInputError(
            f"{label}: malformed image URL; expected a data URL of the form data:image/png;base64,<data>",
            code="invalid_image_url",
        )
    mime = header.group(1).strip().lower()
    params = [p.strip().lower() for p in header.group(2).split(";")[1:]]
    if "base64" not in params:
        raise ImageInputError(
            f"{label}: malformed data URL; only base64 data URLs are accepted "
            f"(data:{mime[:40] or 'image/png'};base64,...)",
            code="invalid_image_url",
        )
    if not mime:
        raise ImageInputError(f"{label}: the data URL declares no media type", code="invalid_image_url")
    declared_format = MIME_TO_FORMAT.get(mime)
    if declared_format is None:
        raise ImageInputError(
            f"{label}: unsupported image type {mime[:40]!r}; send {SUPPORTED_TYPES_TEXT}", code="unsupported_image"
        )
    payload = _WHITESPACE.sub("", url[header.end():])  # clients may wrap base64 in lines
    if len(payload) * 3 // 4 > limits.max_image_bytes + 2:  # refused before decoding (exact up to padding)
        raise _too_large(label, len(payload) * 3 // 4, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{label}: the data URL's base64 payload is invalid", code="invalid_image_url") from None
    if not data:
        raise ImageInputError(f"{label}: the data URL's payload is empty", code="invalid_image_url")
    if len(data) > limits.max_image_bytes:
        raise _too_large(label, len(data), limits)
    actual_format = sniff_format(data)
    if actual_format is None:
        raise ImageInputError(
            f"{label}: the bytes are not a supported image format; send {SUPPORTED_TYPES_TEXT}",
            code="unsupported_image",
        )
    if actual_format != declared_format:
        raise ImageInputError(
            f"{label}: the data URL declares {mime} but the bytes are {FORMAT_TO_MIME[actual_format]}",
            code="image_type_mismatch",
        )
    return EncodedImage(data=data, format=actual_format, mime=mime)


def _too_large(label: str, size: int, limits: ImageLimits) -> ImageInputError:
    return ImageInputError(
        f"{label}: the encoded image is {size} bytes, over the limit of {limits.max_image_bytes} bytes",
        status=413,
        code="image_too_large",
    )


def check_total_image_bytes(total: int, label: str, limits: ImageLimits) -> None:
    """Refuse a request whose images together (up to and including `label`) exceed the per-request byte budget."""
    if total > limits.max_total_bytes:
        raise ImageInputError(
            f"{label}: with this image the request's images total {total} bytes, "
            f"over the limit of {limits.max_total_bytes} bytes per request",
            status=413,
            code="images_too_large",
        )
