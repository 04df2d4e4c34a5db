"""How the decoder groups layers stored alike into scans (decoder.scan_segments).

A quantization mix stores some layers differently; each scan needs its layers stacked alike, so the segments must
tile the layers with steps that are stored identically, and a periodic mix (llama.cpp's Q4_K_M) must come out as
a few scans with multi-repeat steps rather than one scan per repeat. That the grouped decoder computes the same
model is checked end to end by tests/checkpoint/test_gguf_model_parity.py (the tiny Q4_K_M file, grouped, against
its F32 copy, one scan).
"""
from __future__ import annotations

import numpy as np
import pytest

from luxjax.models.qwen35.decoder import MAX_GROUP, PREFIX, scan_segments

PATTERN = ("linear_attention",) * 3 + ("full_attention",)


class FakeWeights:
    """storage_signature from a per-layer list of storage kinds."""

    def __init__(self, kinds):
        self.kinds = kinds

    def storage_signature(self, prefix):
        layer = int(prefix[len(f"{PREFIX}layers."):].rstrip("."))
        return (self.kinds[layer],)


def check_tiling(segments, kinds, repeats):
    """Segments tile [0, repeats) in order; every step of a segment is stored like its first."""
    period = len(PATTERN)
    assert segments[0][0] == 0 and segments[-1][1] == repeats, segments
    for (first, last, group), nxt in zip(segments, segments[1:] + ((repeats, None, None),)):
        assert last == nxt[0], f"segments leave a gap or overlap: {segments}"
        assert 1 <= group <= MAX_GROUP and (last - first) % group == 0, segments
        step = kinds[first * period:(first + group) * period]
        for r in range(first, last, group):
            assert kinds[r * period:(r + group) * period] == step, f"steps of {(first, last, group)} differ"


def llama_cpp_q4_k_m(n_layers):
    """Which layers llama.cpp gives Q6_K in a Q4_K_M file (its use_more_bits rule for ffn_down)."""
    return ["Q6_K" if i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2 else "Q4_K"
            for i in range(n_layers)]


def test_uniform_storage_is_one_scan():
    assert scan_segments(FakeWeights(["Q4_K"] * 64), None, PATTERN, 16) == ((0, 16, 1),)


@pytest.mark.parametrize("n_layers", [8, 32, 48, 64])
def test_q4_k_m_mix_needs_few_layer_bodies(n_layers):
    """The 27B's 64 layers: the first and last eighth uniform, the middle periodic in three repeats -> 3 scans,
    4 + 12 + 4 layer bodies (one scan per change of storage would compile 14 x 4 = 56)."""
    kinds, repeats = llama_cpp_q4_k_m(n_layers), n_layers // len(PATTERN)
    segments = scan_segments(FakeWeights(kinds), None, PATTERN, repeats)
    check_tiling(segments, kinds, repeats)
    bodies = sum(group for _, _, group in segments)
    one_per_change = sum(1 for r in range(repeats) if r == 0 or kinds[r * 4:r * 4 + 4] != kinds[r * 4 - 4:r * 4])
    assert bodies <= one_per_change, f"{segments}: {bodies} bodies, more than {one_per_change}"
    if n_layers == 64:
        assert segments == ((0, 2, 1), (2, 14, 3), (14, 16, 1))


def test_random_mixes_tile_with_identical_steps():
    rng = np.random.default_rng()
    for _ in range(200):
        repeats = int(rng.integers(1, 17))
        period = int(rng.integers(1, 6))
        motif = list(rng.integers(0, 3, period * 4))
        kinds = [motif[i % len(motif)] if rng.random() > 0.1 else 9 for i in range(repeats * 4)]
        segments = scan_segments(FakeWeights(kinds), None, PATTERN, repeats)
        check_tiling(segments, kinds, repeats)
        assert sum(group for _, _, group in segments) <= repeats, segments
