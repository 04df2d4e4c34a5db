"""OpenAI chat messages -> ChatMessage lists with decoded images, validated against ImageLimits.

Runs off the event loop (in a worker thread): decoding images is CPU work. Structure, counts and byte budgets
are all checked before the first image is decoded.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from luxjax.errors import ImageInputError, RequestError
from luxjax.vision.data_url import EncodedImage, check_total_image_bytes, parse_image_url
from luxjax.vision.decode import decode_image, prepare_pil_image
from luxjax.vision.hashing import image_hash
from luxjax.vision.limits import ImageLimits

ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_ROLES = ("user",)


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    image: Image.Image  # RGB
    index: int  # 0-based position among the request's images (prompt order)
    hash: str


Part = TextPart | ImagePart


@dataclass(frozen=True)
class ChatMessage:
    role: str
    parts: tuple[Part, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)  # other keys (name, tool_calls, ...) passed through

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.parts if isinstance(p, ImagePart)]


@dataclass(frozen=True)
class _PendingImage:
    source: EncodedImage | Image.Image
    index: int
    label: str


def parse_messages(
    messages: Sequence[Mapping[str, Any]], limits: ImageLimits, markers: tuple[str, ...]
) -> list[ChatMessage]:
    """Validate messages, decode their images (in display order) and return them as parts.

    markers: the model's reserved image/vision tokens; text that contains one is refused, so that a client
    cannot forge image placeholders.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise RequestError('"messages" must be a non-empty list', param="messages")
    parsed: list[tuple[Mapping[str, Any], str, list[TextPart | _PendingImage]]] = []
    images: list[_PendingImage] = []
    total_bytes = 0
    for i, message in enumerate(messages):
        role = _role(message, i)
        pieces: list[TextPart | _PendingImage] = []
        for j, part in _content_parts(message, role, i):
            where = f"messages[{i}].content" if j is None else f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                pieces.append(TextPart(_text(part, where, markers)))
                continue
            if kind not in ("image_url", "image"):
                raise RequestError(f"{where}: unknown content part type {str(kind)[:40]!r}", param="messages")
            label = f"image {len(images) + 1} ({where})"
            if role not in IMAGE_ROLES:
                raise ImageInputError(f"{label}: images are only accepted in user messages, not in {role} messages")
            if len(images) == limits.max_images:
                raise ImageInputError(f"{label}: a request may carry at most {limits.max_images} images")
            source = _image_source(part, kind, label, limits)
            if isinstance(source, EncodedImage):
                total_bytes += len(source.data)
                check_total_image_bytes(total_bytes, label, limits)
            pending = _PendingImage(source, len(images), label)
            images.append(pending)
            pieces.append(pending)
        parsed.append((message, role, pieces))
    decoded = [_decode(p, limits) for p in images]
    return [
        ChatMessage(
            role=role,
            parts=tuple(decoded[p.index] if isinstance(p, _PendingImage) else p for p in pieces),
            extra={k: v for k, v in message.items() if k not in ("role", "content")},
        )
        for message, role, pieces in parsed
    ]


def _role(message: object, i: int) -> str:
    if not isinstance(message, Mapping):
        raise RequestError(f"messages[{i}] must be an object", param="messages")
    role = message.get("role")
    if role is None:
        raise RequestError(f'messages[{i}]: missing field "role"', param="messages")
    if role not in ROLES:
        raise RequestError(f"messages[{i}]: unknown role {str(role)[:40]!r}; expected one of {ROLES}", param="messages")
    return role


def _content_parts(message: Mapping[str, Any], role: str, i: int) -> list[tuple[int | None, Mapping[str, Any]]]:
    """(part index or None for string content, part) pairs."""
    content = message.get("content")
    if isinstance(content, str):
        return [(None, {"type": "text", "text": content})]
    if content is None and role == "assistant":  # an assistant turn that only calls tools
        return []
    if not isinstance(content, list):
        raise RequestError(f'messages[{i}]: "content" must be a string or a list of parts', param="messages")
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or "type" not in part:
            raise RequestError(f'messages[{i}].content[{j}] must be an object with a "type"', param="messages")
    return list(enumerate(content))


def _text(part: Mapping[str, Any], where: str, markers: tuple[str, ...]) -> str:
    text = part.get("text")
    if not isinstance(text, str):
        raise RequestError(f'{where}: a text part needs a string field "text"', param="messages")
    for marker in markers:
        if marker in text:
            raise RequestError(
                f"{where}: the text contains the reserved marker {marker!r}; send images as image_url parts instead",
                param="messages",
                code="reserved_marker",
            )
    return text


def _image_source(part: Mapping[str, Any], kind: str, label: str, limits: ImageLimits) -> EncodedImage | Image.Image:
    if kind == "image_url":
        if "image_url" not in part:
            raise ImageInputError(f'{label}: an image_url part needs the field "image_url"', code="invalid_image_url")
        return parse_image_url(part["image_url"], label, limits)
    image = part.get("image")
    if not isinstance(image, Image.Image):
        raise ImageInputError(
            f'{label}: an "image" part must carry a PIL image in "image" (in-process use); over HTTP send an '
            "image_url part with a base64 data URL"
        )
    return image


def _decode(pending: _PendingImage, limits: ImageLimits) -> ImagePart:
    if isinstance(pending.source, EncodedImage):
        image = decode_image(pending.source, pending.label, limits)
    else:
        image = prepare_pil_image(pending.source, pending.label, limits)
    return ImagePart(image=image, index=pending.index, hash=image_hash(image))
