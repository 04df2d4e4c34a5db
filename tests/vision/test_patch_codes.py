"""PatchCodes: the compact form of preprocessed patches (uint8 codes and a per-channel value table), expanded on
the host and on the device, against rows built value by value."""
from __future__ import annotations

import secrets

import jax.numpy as jnp
import numpy as np
import pytest

from luxjax.vision.patch_codes import PatchCodes, expand_on_device


def rows_value_by_value(codes, table, repeat):
    patches, channels, n = codes.shape
    out = np.empty((patches, channels * repeat * n), np.float32)
    for p in range(patches):
        col = 0
        for c in range(channels):
            for _ in range(repeat):
                for i in range(n):
                    out[p, col] = table[c, codes[p, c, i]]
                    col += 1
    return out


@pytest.fixture
def random_codes():
    seed = secrets.randbelow(2**31)
    rng = np.random.default_rng(seed)
    patches, channels, n, repeat = (int(v) for v in rng.integers(1, 9, 4))
    codes = rng.integers(0, 256, (patches, channels, n), dtype=np.uint8)
    table = rng.standard_normal((channels, 256)).astype(np.float32)
    return PatchCodes(codes, table, repeat), seed


def test_expand_gives_each_value_from_its_channels_table(random_codes):
    pc, seed = random_codes
    want = rows_value_by_value(pc.codes, pc.table, pc.repeat)
    assert pc.shape == want.shape and len(pc) == want.shape[0], f"seed {seed}"
    np.testing.assert_array_equal(np.asarray(pc), want, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(pc.expand(), want, err_msg=f"seed {seed}")


def test_device_expansion_gives_the_same_rows(random_codes):
    pc, seed = random_codes
    rows = 16 * -(-len(pc) // 16)
    got = np.asarray(expand_on_device(jnp.asarray(pc.padded_codes(rows)), jnp.asarray(pc.table), pc.repeat))
    assert got.shape == (rows, pc.shape[1]), f"seed {seed}"
    np.testing.assert_array_equal(got[: len(pc)], rows_value_by_value(pc.codes, pc.table, pc.repeat),
                                  err_msg=f"seed {seed}")


def test_repr_shows_sizes_not_pixels(random_codes):
    pc, seed = random_codes
    text = repr(pc)
    assert f"{len(pc)} patches" in text and f"repeat {pc.repeat}" in text, f"seed {seed}: {text}"
    assert "array" not in text and "[" not in text, f"seed {seed}: {text}"


def test_malformed_codes_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        PatchCodes(np.zeros((2, 3, 4), np.int32), np.zeros((3, 256), np.float32))
    with pytest.raises(ValueError, match="table"):
        PatchCodes(np.zeros((2, 3, 4), np.uint8), np.zeros((2, 256), np.float32))
