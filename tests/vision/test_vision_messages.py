"""parse_messages: parts in display order, decoded images with indices and hashes, every refusal named."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from luxjax.errors import ImageInputError, RequestError
from luxjax.vision.hashing import image_hash
from luxjax.vision.limits import MiB, ImageLimits
from luxjax.vision.messages import ChatMessage, ImagePart, TextPart, parse_messages
from vision_helpers import IMAGES, encode, image_part

LIMITS = ImageLimits()
MARKERS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
PNG = (IMAGES / "chart-rgba.png").read_bytes()
JPEG = (IMAGES / "photo-desk.jpeg").read_bytes()


def small_png(value: int = 0) -> bytes:
    return encode(Image.new("RGB", (8, 6), (value, 0, 0)), "PNG")


def refusal(messages, limits: ImageLimits = LIMITS, error_type=ImageInputError) -> RequestError:
    with pytest.raises(error_type) as caught:
        parse_messages(messages, limits, MARKERS)
    return caught.value


def test_parts_in_display_order_with_indices_and_hashes():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"}, image_part(JPEG, "image/jpeg"),
            {"type": "text", "text": "with"}, image_part(PNG, "image/png"), {"type": "text", "text": "please."},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
        {"role": "user", "content": [{"type": "image", "image": Image.new("L", (40, 30), 7)}]},
    ]
    parsed = parse_messages(messages, LIMITS, MARKERS)
    assert [m.role for m in parsed] == ["system", "user", "assistant", "tool", "user"]
    assert parsed[0] == ChatMessage("system", (TextPart("Be brief."),), {})
    kinds = [type(p).__name__ for p in parsed[1].parts]
    assert kinds == ["TextPart", "ImagePart", "TextPart", "ImagePart", "TextPart"]
    assert [p.text for p in parsed[1].parts if isinstance(p, TextPart)] == ["Compare", "with", "please."]
    images = parsed[1].images + parsed[4].images
    assert [im.index for im in images] == [0, 1, 2]
    assert [im.image.size for im in images] == [(640, 488), (744, 397), (40, 30)]
    assert all(im.image.mode == "RGB" and im.hash == image_hash(im.image) for im in images)
    assert parsed[2].parts == () and parsed[2].extra == {"tool_calls": [{"id": "1"}]}
    assert parsed[3].extra == {"tool_call_id": "1"}


def test_same_pixels_same_hash_across_formats():
    pixels = np.random.default_rng().integers(0, 256, (20, 30, 3), dtype=np.uint8)
    parts = [image_part(encode(Image.fromarray(pixels), fmt), mime)
             for fmt, mime in [("PNG", "image/png"), ("BMP", "image/bmp"), ("WEBP", "image/webp")]]
    parts.append(image_part(encode(Image.fromarray(pixels), "WEBP", lossless=True), "image/webp"))
    parsed = parse_messages([{"role": "user", "content": parts}], LIMITS, MARKERS)
    png, bmp, lossy_webp, lossless_webp = parsed[0].images
    assert png.hash == bmp.hash == lossless_webp.hash
    assert lossy_webp.hash != png.hash


@pytest.mark.parametrize("role", ["system", "developer", "assistant", "tool"])
def test_images_refused_outside_user_messages(role):
    error = refusal([{"role": "user", "content": [image_part(small_png(), "image/png")]},
                     {"role": role, "content": [image_part(small_png(), "image/png")]}])
    assert error.status == 400
    assert error.message.startswith("image 2 (messages[1].content[0]): ") and f"not in {role} messages" in error.message


def test_too_many_images_refused_before_decoding():
    corrupt_but_well_formed = image_part(b"\x89PNG\r\n\x1a\n" + b"junk", "image/png")
    content = [corrupt_but_well_formed] * 17
    error = refusal([{"role": "user", "content": content}])
    assert error.status == 400 and error.message.startswith("image 17 ") and "at most 16 images" in error.message
    error = refusal([{"role": "user", "content": content[:3]}], ImageLimits(max_images=2))
    assert error.message.startswith("image 3 ") and "at most 2 images" in error.message


def test_total_bytes_refused_before_decoding():
    part = image_part(b"\x89PNG\r\n\x1a\n" + bytes(11 * MiB), "image/png")
    error = refusal([{"role": "user", "content": [part, part, part]}])
    assert error.status == 413 and error.message.startswith("image 3 (messages[0].content[2]): ")
    assert "32 MiB" not in error.message and str(32 * MiB) in error.message


def test_images_are_counted_across_messages():
    error = refusal([{"role": "user", "content": [image_part(small_png(), "image/png")]},
                     {"role": "user", "content": [image_part(JPEG, "image/png")]}])
    assert error.message.startswith("image 2 (messages[1].content[0]): ") and "declares image/png" in error.message


def test_decode_errors_name_the_image():
    error = refusal([{"role": "user", "content": [image_part(small_png(), "image/png"),
                                                  image_part(JPEG[: len(JPEG) // 2], "image/jpeg")]}])
    assert error.status == 400 and error.message.startswith("image 2 ") and "truncated or corrupt" in error.message


@pytest.mark.parametrize("marker", MARKERS)
@pytest.mark.parametrize("role", ["system", "user", "assistant", "developer", "tool"])
def test_markers_refused_in_string_content(marker, role):
    error = refusal([{"role": role, "content": f"look {marker} here"}], error_type=RequestError)
    assert error.status == 400 and error.code == "reserved_marker"
    assert repr(marker) in error.message and "messages[0].content" in error.message


def test_markers_refused_in_text_parts():
    content = [{"type": "text", "text": "fine"}, {"type": "text", "text": "x<|vision_start|>"}]
    error = refusal([{"role": "user", "content": content}], error_type=RequestError)
    assert "messages[0].content[1]" in error.message and "'<|vision_start|>'" in error.message


@pytest.mark.parametrize(
    "messages, expected",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hi"], "messages[0] must be an object"),
        ([{"content": "hi"}], 'missing field "role"'),
        ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
        ([{"role": "user"}], '"content" must be a string or a list'),
        ([{"role": "user", "content": [{"text": "no type"}]}], 'must be an object with a "type"'),
        ([{"role": "user", "content": [{"type": "text"}]}], 'needs a string field "text"'),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "unknown content part type"),
    ],
)
def test_malformed_messages_refused(messages, expected):
    error = refusal(messages, error_type=RequestError)
    assert error.status == 400 and expected in error.message


def test_image_part_field_errors():
    error = refusal([{"role": "user", "content": [{"type": "image_url"}]}])
    assert error.message.startswith("image 1 (messages[0].content[0]): ") and '"image_url"' in error.message
    error = refusal([{"role": "user", "content": [{"type": "image", "image": "https://x/y.png"}]}])
    assert error.message.startswith("image 1 ") and "PIL image" in error.message
    error = refusal([{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA"}]}])
    assert "not a string" in error.message


def test_image_part_is_frozen_data():
    parsed = parse_messages([{"role": "user", "content": [image_part(small_png(9), "image/png")]}], LIMITS, MARKERS)
    part = parsed[0].parts[0]
    assert isinstance(part, ImagePart) and part.image.getpixel((0, 0)) == (9, 0, 0)
    with pytest.raises(AttributeError):
        part.index = 3
