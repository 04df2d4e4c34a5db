"""The vision tower's per-patch layout computed on the device from the images' grid (vision_tower.grid_layout,
frame_grid, attention.grid_segments) against transformers' own precompute helpers (transformers.vision_utils, the
functions Qwen3_5VisionModel.forward calls): position-table taps and weights, rotary position ids, and the
attention segments, on random batches of images and clips of random sizes; and the backend's use of it (one
compile for any image count up to cuDNN's packed-segment limit)."""
from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids)

from luxjax.models.qwen35.config import VisionConfig
from luxjax.models.qwen35.vision_tower import frame_grid, grid_layout
from luxjax.ops.attention import MAX_PACKED_SEGMENTS, grid_segments

MERGE = 2


def vision_config(side: int) -> VisionConfig:
    return VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                        num_position_embeddings=side * side, spatial_merge_size=MERGE)


def random_grid(rng, frames: int) -> np.ndarray:
    """1-4 images (or clips of up to `frames` frames) of even patch sizes, some far from square."""
    n = int(rng.integers(1, 5))
    t = rng.integers(1, frames + 1, n)
    h, w = (MERGE * rng.integers(1, 24, n) for _ in range(2))
    return np.stack([t, h, w], 1).astype(np.int64)


@pytest.fixture
def rng_seed():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return np.random.default_rng(seed), seed


@jax.jit(static_argnames=("cfg", "padded"))
def layout_on_device(grid, cfg, padded):
    return grid_layout(grid, cfg, padded)


@pytest.mark.parametrize("frames", [1, 3])
def test_positions_match_transformers(rng_seed, frames):
    rng, seed = rng_seed
    side = int(rng.choice([6, 48]))  # a table smaller and larger than the images
    grid = random_grid(rng, frames)
    total = int(np.prod(grid, 1).sum())
    rows = len(grid) + int(rng.integers(0, 3))  # zero rows pad the image count
    padded = total + int(rng.integers(0, 100))
    device_grid = np.zeros((rows, 3), np.int32)
    device_grid[: len(grid)] = grid
    taps, weights, rope_ids, ids, sizes = map(np.asarray, layout_on_device(device_grid, vision_config(side), padded))

    grid_t = torch.from_numpy(grid)
    want_taps, want_weights = (x.numpy() for x in get_vision_interpolation_indices_and_weights(
        grid_t, side, mode="bilinear", align_corners=True, spatial_merge_size=MERGE))
    msg = f"seed {seed}, side {side}, grid {grid.tolist()}"
    if jax.default_backend() == "cpu":  # IEEE float32 as the reference: the same taps, weights to rounding
        np.testing.assert_array_equal(taps[:total], want_taps, err_msg=msg)
        np.testing.assert_allclose(weights[:total], want_weights, rtol=0, atol=1e-6, err_msg=msg)
    # Everywhere, the resampled table rows (what the tower adds): XLA:GPU's float32 division may round the source
    # coordinate (up to side - 1) a few units in the last place apart from torch's, which moves the weights by
    # as much and may flip a tap whose weight is then ~0; the rows move continuously, by at most ~4 such units.
    table = rng.standard_normal((side * side, 8)).astype(np.float32)
    got_rows = (table[taps[:total]] * weights[:total, :, None]).sum(1)
    want_rows = (table[want_taps] * want_weights[:, :, None]).sum(1)
    bound = 16 * side * np.finfo(np.float32).eps * np.abs(table).max()
    np.testing.assert_allclose(got_rows, want_rows, rtol=0, atol=bound, err_msg=msg)
    np.testing.assert_array_equal(rope_ids[:total], get_vision_position_ids(grid_t, MERGE).numpy(), err_msg=msg)
    np.testing.assert_array_equal(ids[:total], np.repeat(np.arange(len(grid)), np.prod(grid, 1)), err_msg=msg)
    np.testing.assert_array_equal(sizes, np.prod(device_grid, 1), err_msg=msg)
    assert (ids[total:] == -1).all() and not taps[total:].any() and not weights[total:].any(), msg
    assert not rope_ids[total:].any(), msg


def test_segments_are_the_reference_frames(rng_seed):
    """One attention segment per frame of each clip, as transformers' cu_seqlens; padding rows add none."""
    rng, seed = rng_seed
    grid = random_grid(rng, 3)
    frames = frame_grid(grid, int(grid[:, 0].sum()) + int(rng.integers(0, 4)))
    total = int(np.prod(grid, 1).sum())
    padded = total + int(rng.integers(0, 50))
    _, _, _, ids, sizes = layout_on_device(frames, vision_config(48), padded)
    fits_when_traced = []

    def segments_of(ids, sizes):
        segments = grid_segments(ids, sizes)
        fits_when_traced.append(segments.fits)  # a Python bool: the attention path is chosen without a branch
        return segments

    segments = jax.jit(segments_of)(ids, sizes)
    cu_seqlens = get_vision_cu_seqlens(torch.from_numpy(grid)).numpy()
    count = len(cu_seqlens) - 1
    msg = f"seed {seed}, grid {grid.tolist()}, frame rows {len(frames)}"
    offsets, lengths = np.asarray(segments.offsets), np.asarray(segments.lengths)
    np.testing.assert_array_equal(offsets[: count + 1], cu_seqlens, err_msg=msg)
    assert (offsets[count + 1:] == -1).all(), msg
    np.testing.assert_array_equal(lengths[:count], np.diff(cu_seqlens), err_msg=msg)
    assert (lengths[count:] == -1).all(), msg
    assert fits_when_traced == [len(frames) <= MAX_PACKED_SEGMENTS], msg
    runs = np.asarray(segments.ids)[:total]
    np.testing.assert_array_equal(runs, np.repeat(np.arange(count), np.diff(cu_seqlens)), err_msg=msg)


def test_image_count_needs_no_new_compile(fixture_model_f32, rng_seed):
    """One image and then two of the same patch total run through one compiled tower (the grid is padded to a
    fixed row count), and the two images encoded together give the rows each gives alone."""
    from luxjax.models.qwen35 import model as qwen
    from luxjax.vision.types import ImageInputs

    rng, seed = rng_seed
    backend = fixture_model_f32.backend
    patch_dim, merge = backend.cfg.vision.patch_dim, backend.merge

    def inputs(grids):
        grids = np.asarray(grids)
        pixels = rng.standard_normal((int(np.prod(grids, 1).sum()), patch_dim)).astype(np.float32)
        return ImageInputs(pixels, grids, [int(np.prod(g)) // merge**2 for g in grids])

    backend.encode_images(inputs([[1, 8, 8]]))
    compiled = qwen.encode_images._cache_size()
    pair = inputs([[1, 4, 8], [1, 8, 4]])
    together = np.asarray(backend.encode_images(pair))
    assert qwen.encode_images._cache_size() == compiled, "a second image compiled the tower again"
    rows = np.cumsum([0] + pair.num_tokens)
    for i, grid in enumerate(pair.grid_thw):
        patches = slice(rows[i] * merge**2, rows[i + 1] * merge**2)
        alone = np.asarray(backend.encode_images(ImageInputs(pair.pixel_values[patches], grid[None],
                                                             [pair.num_tokens[i]])))
        np.testing.assert_allclose(together[rows[i]:rows[i + 1]], alone, rtol=0, atol=1e-5,
                                   err_msg=f"image {i} encoded beside another, seed {seed}")
