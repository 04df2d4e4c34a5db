"""Decoding: bombs and odd shapes refused from the header alone, corrupt data refused, RGB exactly as transformers."""
from __future__ import annotations

import io
import resource
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from luxjax.errors import ImageInputError
from luxjax.vision.data_url import EncodedImage
from luxjax.vision.decode import check_dimensions, decode_image, prepare_pil_image, to_rgb
from luxjax.vision.limits import ImageLimits
from vision_helpers import IMAGES, encode, fresh_seed, photo_like

LABEL = "image 3 (messages[0].content[2])"
LIMITS = ImageLimits()


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose IHDR claims width x height RGB pixels (its IDAT holds only a first scanline's start)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(1024))) + chunk(
        b"IEND", b"")


def refusal(data: bytes, fmt: str, limits: ImageLimits = LIMITS) -> ImageInputError:
    with pytest.raises(ImageInputError) as caught:
        decode_image(EncodedImage(data, fmt, "image/x"), LABEL, limits)
    assert caught.value.status == 400 and caught.value.message.startswith("image 3 "), caught.value.message
    return caught.value


@pytest.fixture
def forbid_decoding(monkeypatch):
    def load(self):
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("side", [50000, 9000])
def test_png_bomb_refused_from_header(forbid_decoding, side):
    """50000^2 trips PIL's own DecompressionBombError; 9000^2 (81 M, below PIL's limits) trips ours."""
    data = png_declaring(side, side)
    assert len(data) < 200
    rss_before, started = max_rss_mib(), time.perf_counter()
    error = refusal(data, "PNG")
    assert time.perf_counter() - started < 1.0
    assert max_rss_mib() - rss_before < 50
    assert error.code == "image_too_large" and "over the limit of 67108864 pixels" in error.message
    if side == 9000:
        assert "9000x9000" in error.message


def test_pixel_limit_is_configurable(forbid_decoding):
    error = refusal(png_declaring(1000, 1000), "PNG", ImageLimits(max_pixels=999_999))
    assert "1000x1000 = 1000000 pixels" in error.message


@pytest.mark.parametrize("width, height", [(201, 1), (1, 201), (4021, 20)])
def test_extreme_aspect_refused(forbid_decoding, width, height):
    error = refusal(png_declaring(width, height), "PNG")
    assert error.code == "invalid_image_shape" and "aspect ratio" in error.message and "limit of 200" in error.message


def test_aspect_at_limit_accepted():
    check_dimensions(4000, 20, LABEL, LIMITS)
    image = decode_image(EncodedImage(encode(Image.new("L", (200, 1)), "PNG"), "PNG", "image/png"), LABEL, LIMITS)
    assert image.size == (200, 1) and image.mode == "RGB"


@pytest.mark.parametrize("fmt, cut", [("JPEG", 0.5), ("PNG", 0.5), ("PNG", 0.95), ("WEBP", 0.6), ("BMP", 0.5)])
def test_truncated_images_refused(fmt, cut):
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    seed = fresh_seed()
    data = encode(Image.fromarray(photo_like(np.random.default_rng(seed), 200, 150)), fmt)
    error = refusal(data[: int(len(data) * cut)], fmt)
    assert "truncated or corrupt" in error.message or "cannot be read" in error.message, f"seed={seed}"


def test_corrupt_png_refused():
    data = bytearray((IMAGES / "chart-rgba.png").read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)
    error = refusal(bytes(data), "PNG")
    assert "truncated or corrupt" in error.message


def test_garbage_after_magic_refused():
    error = refusal(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, "PNG")
    assert error.code == "invalid_image" and "cannot be read" in error.message


def test_real_files_decode_to_rgb():
    for name, fmt, size in [("photo-desk.jpeg", "JPEG", (640, 488)), ("chart-rgba.png", "PNG", (744, 397))]:
        image = decode_image(EncodedImage((IMAGES / name).read_bytes(), fmt, "image/x"), LABEL, LIMITS)
        assert image.mode == "RGB" and image.size == size


@pytest.mark.parametrize("orientation, size", [(1, (90, 40)), (3, (90, 40)), (6, (40, 90)), (8, (40, 90))])
def test_exif_orientation_applied(orientation, size):
    source = Image.new("RGB", (90, 40), (0, 0, 0))
    source.paste((255, 255, 255), (0, 0, 10, 10))  # a white corner, top left as displayed
    exif = Image.Exif()
    exif[0x0112] = orientation
    image = decode_image(EncodedImage(encode(source, "PNG", exif=exif), "PNG", "image/png"), LABEL, LIMITS)
    assert image.size == size
    expected_corner = {1: (0, 0), 3: (89, 39), 6: (39, 0), 8: (0, 89)}[orientation]
    assert image.getpixel(expected_corner) == (255, 255, 255)


ALL_MODES = ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBa", "CMYK", "YCbCr", "LAB", "HSV", "I", "I;16", "F"]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("transparency", [False, True])
def test_to_rgb_matches_transformers(mode, transparency):
    from transformers.image_transforms import convert_to_rgb

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(np.concatenate([photo_like(rng, 37, 23), rng.integers(0, 256, (23, 37, 1), np.uint8)], -1))
    if mode in ("I", "F", "I;16"):
        image = rgba.convert("L").convert(mode)
    elif mode == "PA":
        image = rgba.convert("RGB").quantize(16).convert("PA")
    else:
        image = rgba.convert(mode)
    if transparency:
        image.info["transparency"] = 5 if image.getbands() != ("R", "G", "B") else (5, 5, 5)
    ours = to_rgb(image)
    assert ours.mode == "RGB"
    assert np.array_equal(np.asarray(ours), convert_to_rgb(image, return_numpy=True)), f"{mode} seed={seed}"


def test_prepare_pil_image_checks_limits_and_converts():
    image = prepare_pil_image(Image.new("LA", (30, 20), (0, 0)), LABEL, LIMITS)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)  # transparent -> white
    with pytest.raises(ImageInputError, match="image 3 .*aspect ratio"):
        prepare_pil_image(Image.new("RGB", (402, 2)), LABEL, LIMITS)
    with pytest.raises(ImageInputError, match="image 3 .*over the limit of 100 pixels"):
        prepare_pil_image(Image.new("RGB", (11, 10)), LABEL, ImageLimits(max_pixels=100))


def test_unconvertible_mode_refused():
    la_premultiplied = Image.new("LA", (4, 4)).convert("La")
    with pytest.raises(ImageInputError, match="image 3 .*pixel mode La") as caught:
        prepare_pil_image(la_premultiplied, LABEL, LIMITS)
    assert caught.value.status == 400


@pytest.mark.parametrize("fmt", ["WEBP", "GIF"])
def test_decoding_keeps_the_first_frame_of_animations(fmt):
    frames = [Image.new("RGB", (16, 16), color) for color in [(255, 0, 0), (0, 0, 255)]]
    buffer = io.BytesIO()
    frames[0].save(buffer, fmt, save_all=True, append_images=frames[1:], lossless=True)
    image = decode_image(EncodedImage(buffer.getvalue(), fmt, f"image/{fmt.lower()}"), LABEL, LIMITS)
    assert image.getpixel((8, 8)) == (255, 0, 0)
