"""Qwen35ImageProcessor against transformers' Qwen2VLImageProcessorPil: the same float32 bits, the same grids."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from luxjax.errors import ModelFormatError
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.vision.data_url import MIME_TO_FORMAT, EncodedImage
from luxjax.vision.decode import decode_image, prepare_pil_image
from luxjax.vision.hashing import image_hash
from luxjax.vision.limits import ImageLimits
from luxjax.vision.preprocess import ImagePreprocessor
from vision_helpers import FIXTURES, IMAGES, data_url, encode, fresh_seed, photo_like, tiny_config

TINY = tiny_config()
CONFIGS = {
    "tiny": TINY,
    "released": {**TINY, "size": {"shortest_edge": 65536, "longest_edge": 16777216}},
    "top_level_min_max": {**TINY, "min_pixels": 200_000, "max_pixels": 400_000},
    "clip_stats": {
        **TINY,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 3136, "longest_edge": 1003520},
    },
}
LIMITS = ImageLimits()


def assert_bit_identical(make_oracle, config: dict, oracle_images, our_images, context: str = ""):
    expected = make_oracle(config)(oracle_images)
    ours = Qwen35ImageProcessor.from_preprocessor_config(config)(our_images)
    assert ours.pixel_values.dtype == np.float32, context
    np.testing.assert_array_equal(ours.grid_thw, expected["image_grid_thw"], err_msg=context)
    assert ours.pixel_values.shape == expected["pixel_values"].shape, context
    assert np.array_equal(ours.pixel_values, expected["pixel_values"]), (
        f"{context}: max |diff| {np.abs(ours.pixel_values - expected['pixel_values']).max()}"
    )
    assert ours.num_tokens == [int(t * h * w) // 4 for t, h, w in ours.grid_thw], context
    assert ours.hashes == [image_hash(im) for im in our_images], context


def decoded(data: bytes, fmt: str) -> Image.Image:
    return decode_image(EncodedImage(data, fmt, "image/x"), "image 1", LIMITS)


def opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_real_images(make_oracle, config_name):
    files = ["photo-desk.jpeg", "photo-board.jpg", "chart-rgba.png"]
    blobs = [(IMAGES / f).read_bytes() for f in files]
    formats = ["JPEG", "JPEG", "PNG"]
    assert_bit_identical(
        make_oracle,
        CONFIGS[config_name],
        [opened(b) for b in blobs],
        [decoded(b, f) for b, f in zip(blobs, formats)],
        config_name,
    )


@pytest.mark.parametrize(
    "reference, files",
    [("ref_one_image", ["photo-desk.jpeg"]), ("ref_two_images", ["photo-board.jpg", "chart-rgba.png"])],
)
def test_stored_transformers_outputs(reference, files):
    stored = np.load(FIXTURES / "qwen35-tiny-a" / f"{reference}.npz")
    images = [decoded((IMAGES / f).read_bytes(), "PNG" if f.endswith(".png") else "JPEG") for f in files]
    ours = Qwen35ImageProcessor.from_preprocessor_config(TINY)(images)
    assert np.array_equal(ours.pixel_values, stored["pixel_values"])
    np.testing.assert_array_equal(ours.grid_thw, stored["image_grid_thw"])


def _mode_image(rng, mode: str, width: int, height: int) -> Image.Image:
    rgb = Image.fromarray(photo_like(rng, width, height))
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
        base = rgb.convert(mode[:-1])
        base.putalpha(alpha)
        return base
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    if mode == "P":
        return rgb.quantize(colors=64)
    return rgb.convert(mode)


ENCODED_CASES = {
    "png-L": ("L", "PNG", {}),
    "png-LA": ("LA", "PNG", {}),
    "png-P": ("P", "PNG", {}),
    "png-P-transparency": ("P", "PNG", {"transparency": 3}),
    "png-L-transparency": ("L", "PNG", {"transparency": 128}),
    "png-RGB-transparency": ("RGB", "PNG", {"transparency": (10, 200, 30)}),
    "png-RGBA": ("RGBA", "PNG", {}),
    "png-I;16": ("I;16", "PNG", {}),
    "png-1": ("1", "PNG", {}),
    "jpeg-RGB": ("RGB", "JPEG", {"quality": 90}),
    "jpeg-L": ("L", "JPEG", {}),
    "jpeg-CMYK": ("CMYK", "JPEG", {}),
    "bmp-RGB": ("RGB", "BMP", {}),
    "bmp-P": ("P", "BMP", {}),
    "webp-RGB": ("RGB", "WEBP", {"quality": 80}),
    "webp-RGBA": ("RGBA", "WEBP", {"lossless": True}),
    "gif-P": ("P", "GIF", {}),
    "gif-P-transparency": ("P", "GIF", {"transparency": 7}),
}


@pytest.mark.parametrize("case", list(ENCODED_CASES))
def test_encoded_modes(make_oracle, case):
    mode, fmt, save_args = ENCODED_CASES[case]
    seed = fresh_seed()
    data = encode(_mode_image(np.random.default_rng(seed), mode, 123, 77), fmt, **save_args)
    as_opened = opened(data)
    assert as_opened.mode == mode or fmt == "WEBP", (case, as_opened.mode)
    assert_bit_identical(make_oracle, TINY, [as_opened], [decoded(data, fmt)], f"{case} seed={seed}")


@pytest.mark.parametrize("mode", ["I", "F", "I;16", "CMYK", "1", "PA", "RGBa", "LA"])
def test_in_memory_modes(make_oracle, mode):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    if mode == "I":
        image = Image.fromarray(rng.integers(-1000, 70000, (50, 90), dtype=np.int32))
    elif mode == "F":
        image = Image.fromarray(rng.uniform(-20, 300, (50, 90)).astype(np.float32))
    elif mode == "PA":
        image = _mode_image(rng, "P", 90, 50).convert("PA")
    elif mode == "RGBa":
        image = _mode_image(rng, "RGBA", 90, 50).convert("RGBa")
    else:
        image = _mode_image(rng, mode, 90, 50)
    assert image.mode == mode
    ours = prepare_pil_image(image, "image 1", LIMITS)
    assert_bit_identical(make_oracle, TINY, [image], [ours], f"{mode} seed={seed}")


@pytest.mark.parametrize(
    "width, height, config_name",
    [(5, 7, "tiny"), (1, 1, "tiny"), (1, 1, "released"), (4000, 21, "tiny"), (21, 4000, "top_level_min_max"),
     (33, 32, "tiny"), (31, 33, "clip_stats"), (3000, 2000, "released"), (3000, 2000, "tiny"), (641, 479, "tiny")],
)
def test_sizes(make_oracle, width, height, config_name):
    seed = fresh_seed()
    image = Image.fromarray(photo_like(np.random.default_rng(seed), width, height))
    assert_bit_identical(make_oracle, CONFIGS[config_name], [image], [image], f"{width}x{height} seed={seed}")


def test_random_batches(make_oracle):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for _ in range(3):
        config_name = rng.choice(list(CONFIGS))
        images = []
        for _ in range(int(rng.integers(1, 4))):
            width = int(rng.integers(1, 900))
            height = int(np.clip(rng.integers(1, 900), width / 200 + 1, width * 200))
            images.append(_mode_image(rng, str(rng.choice(["RGB", "RGBA", "L", "P"])), width, height))
        ours = [prepare_pil_image(im, "image 1", LIMITS) for im in images]
        sizes = [im.size for im in images]
        assert_bit_identical(make_oracle, CONFIGS[config_name], images, ours, f"seed={seed} {config_name} {sizes}")


def test_num_tokens_matches_oracle(make_oracle):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for config_name, config in CONFIGS.items():
        oracle, ours = make_oracle(config), Qwen35ImageProcessor.from_preprocessor_config(config)
        for _ in range(200):
            width, height = (int(v) for v in rng.integers(1, 5000, size=2))
            if max(width, height) / min(width, height) > 200:
                continue
            expected = oracle.get_number_of_image_patches(height, width) // 4
            assert ours.num_tokens(width, height) == expected, f"seed={seed} {config_name} {width}x{height}"


def test_exif_rotated_jpeg_matches_transformers_load_image(make_oracle):
    from transformers.image_utils import load_image

    seed = fresh_seed()
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(photo_like(np.random.default_rng(seed), 120, 60)), "JPEG", exif=exif)
    ours = decoded(data, "JPEG")
    assert ours.size == (60, 120)
    oracle_input = load_image(data_url(data, "image/jpeg"))
    assert_bit_identical(make_oracle, TINY, [oracle_input], [ours], f"seed={seed}")


def test_is_an_image_preprocessor():
    assert isinstance(Qwen35ImageProcessor(), ImagePreprocessor)
    empty = Qwen35ImageProcessor()([])
    assert empty.pixel_values.shape == (0, 1536) and empty.grid_thw.shape == (0, 3) and empty.num_images == 0


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK", "I;16", "1"])
def test_converts_non_rgb_input(make_oracle, mode):
    """PIL images handed to the processor itself (Model.image_inputs) in any mode: converted as transformers'
    processor converts them, and hashed like the same image converted on the chat path."""
    seed = fresh_seed()
    image = _mode_image(np.random.default_rng(seed), mode, 70, 45)
    expected = make_oracle(TINY)([image])
    ours = Qwen35ImageProcessor.from_preprocessor_config(TINY)([image])
    np.testing.assert_array_equal(ours.grid_thw, expected["image_grid_thw"], err_msg=f"{mode} seed={seed}")
    assert np.array_equal(ours.pixel_values, expected["pixel_values"]), f"{mode} seed={seed}"
    assert ours.hashes == [image_hash(prepare_pil_image(image, "image 1", LIMITS))], f"{mode} seed={seed}"


def test_config_parsing():
    assert Qwen35ImageProcessor.from_preprocessor_config(CONFIGS["top_level_min_max"]).min_pixels == 200_000
    processor = Qwen35ImageProcessor.from_preprocessor_config(TINY)
    assert (processor.min_pixels, processor.max_pixels, processor.patch_size) == (4096, 131072, 16)
    assert Qwen35ImageProcessor.from_preprocessor_config({**TINY, "image_mean": 0.25}).image_mean == (0.25,) * 3
    for broken in (
        {**TINY, "do_normalize": False},
        {**TINY, "resample": 2},
        {k: v for k, v in TINY.items() if k != "size"},
        {k: v for k, v in TINY.items() if k != "patch_size"},
        {**TINY, "image_std": [0.5, 0.5]},
    ):
        with pytest.raises(ModelFormatError):
            Qwen35ImageProcessor.from_preprocessor_config(broken)


def test_supported_formats_cover_mime_aliases():
    assert MIME_TO_FORMAT["image/jpg"] == MIME_TO_FORMAT["image/jpeg"] == "JPEG"
