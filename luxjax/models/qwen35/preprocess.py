"""Qwen3.5 image preprocessing, bit-identical to transformers 5.24's Qwen2VLImageProcessorPil.

The oracle: PIL bicubic resize of the uint8 RGB image to smart_resize's size, then `x.astype(float64) * rescale`
cast to float32, then `(x - mean) / std` in float32, then patchify. Every step after the resize is a function of
one uint8 value and its channel, so it is computed once for all 256 values per channel (a lookup table built with
the same numpy operations and dtypes); the images leave as PatchCodes (the pixels in patch order and that table),
which the tower's input code expands on the device: same bits, an eighth of the bytes to send.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from luxjax.errors import ModelFormatError
from luxjax.vision.decode import to_rgb
from luxjax.vision.hashing import image_hash
from luxjax.vision.patch_codes import PatchCodes
from luxjax.vision.types import ImageInputs

PIL_BICUBIC = 3
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize (qwen2_vl, 5.24): sides become multiples of `factor`, area within the bounds."""
    aspect = max(height, width) / min(height, width)
    if aspect > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {aspect}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen35ImageProcessor:
    """Defaults are those of the released Qwen3.5 checkpoints; load real values with from_preprocessor_config."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    _lookup: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if min(self.patch_size, self.merge_size, self.temporal_patch_size, self.min_pixels, self.max_pixels) < 1:
            raise ModelFormatError(f"image processor sizes must be positive: {self}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ModelFormatError(f"image_mean and image_std need 3 values: {self.image_mean}, {self.image_std}")
        object.__setattr__(self, "_lookup", self._normalized_values())

    @classmethod
    def from_preprocessor_config(cls, config: Mapping) -> Qwen35ImageProcessor:
        """From an HF preprocessor_config.json dict. Top-level min_pixels/max_pixels win over size.shortest_edge /
        size.longest_edge, as in transformers' constructor."""
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag) is False:
                raise ModelFormatError(f"preprocessor config sets {flag}=false, which luxjax does not support")
        if config.get("resample", PIL_BICUBIC) != PIL_BICUBIC:
            raise ModelFormatError(f"preprocessor config resample={config['resample']}; only bicubic (3) is supported")
        size = config.get("size") or {}
        min_pixels = _first_present(config.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
        max_pixels = _first_present(config.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
        missing = [k for k in ("patch_size", "merge_size", "temporal_patch_size") if k not in config]
        if missing:
            raise ModelFormatError(f"preprocessor config lacks {', '.join(missing)}")
        if min_pixels is None or max_pixels is None:
            raise ModelFormatError(
                "preprocessor config gives no pixel bounds (size.shortest_edge/longest_edge or min_pixels/max_pixels)"
            )
        return cls(
            patch_size=int(config["patch_size"]),
            merge_size=int(config["merge_size"]),
            temporal_patch_size=int(config["temporal_patch_size"]),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            image_mean=_three(config.get("image_mean", cls.image_mean)),
            image_std=_three(config.get("image_std", cls.image_std)),
            rescale_factor=float(config.get("rescale_factor", cls.rescale_factor)),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the image is resized to."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return w, h

    def num_tokens(self, width: int, height: int) -> int:
        w, h = self.resized_size(width, height)
        return (h // self.factor) * (w // self.factor)

    def __call__(self, images: Sequence[Image.Image]) -> ImageInputs:
        """pixel_values come as PatchCodes: the resized pixels' codes and the rescale + normalize table."""
        images = [to_rgb(image) for image in images]  # as transformers' do_convert_rgb; decoded images are RGB already
        codes, grids, tokens = [], [], []
        for image in images:
            pixels = self._resized_pixels(image)
            codes.append(self._patch_codes(pixels))
            grid_h, grid_w = pixels.shape[0] // self.patch_size, pixels.shape[1] // self.patch_size
            grids.append((1, grid_h, grid_w))
            tokens.append(grid_h * grid_w // self.merge_size**2)
        empty = np.zeros((0, 3, self.patch_size**2), np.uint8)
        return ImageInputs(
            pixel_values=PatchCodes(np.concatenate(codes) if codes else empty, self._lookup, self.temporal_patch_size),
            grid_thw=np.array(grids, dtype=np.int64).reshape(-1, 3),
            num_tokens=tokens,
            hashes=[image_hash(image) for image in images],
        )

    def _resized_pixels(self, image: Image.Image) -> np.ndarray:
        size = self.resized_size(image.width, image.height)
        if size != image.size:
            image = image.resize(size, resample=PIL_BICUBIC)
        return np.asarray(image)

    def _normalized_values(self) -> np.ndarray:
        """[3, 256] float32: what the oracle's rescale + normalize make of each uint8 value in each channel."""
        rescaled = (np.arange(256, dtype=np.uint8).astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.array(self.image_mean, dtype=np.float32)[:, None]
        std = np.array(self.image_std, dtype=np.float32)[:, None]
        return (rescaled[None, :] - mean) / std

    def _patch_codes(self, pixels: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 -> [H*W/p^2, 3, p*p] uint8; rows in (block_row, block_col, row, col) order, each row's
        pixels by (channel, py, px). With the table and the frame repeated over time, the oracle's patch rows."""
        p, m = self.patch_size, self.merge_size
        height, width, channels = pixels.shape
        blocks = pixels.reshape(height // (p * m), m, p, width // (p * m), m, p, channels)
        return blocks.transpose(0, 3, 1, 4, 6, 2, 5).reshape(-1, channels, p * p)


def _first_present(*values):
    return next((v for v in values if v is not None), None)


def _three(value) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ModelFormatError(f"expected 3 per-channel values, got {value}")
    return tuple(values)
