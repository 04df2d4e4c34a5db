"""Packed GGUF weights: dequantization bit-identical to gguf.quants (the oracle), row lookups, linear, bytes."""
from __future__ import annotations

from pathlib import Path

import gguf
import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from luxjax.checkpoint.quants import (
    QuantizedTensor, dequantize, dequantize_rows, tensor_nbytes, to_device_weight,
)
from luxjax.ops.linear import embedding_lookup, linear

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"

QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.MXFP4,
               T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
# gguf.quants has a quantizer for these: realistic blocks from random floats.
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
# Byte offsets of the float16 scales in each block, read off gguf.quants' dequantize_blocks.
F16_OFFSETS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,), T.MXFP4: (),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,),
}

dequantize_jit = jax.jit(dequantize, static_argnums=1)


def oracle(raw: np.ndarray, ggml_type: T, shape) -> np.ndarray:
    with np.errstate(all="ignore"):  # NaN/Inf scales in adversarial blocks
        return gguf.quants.dequantize(raw, ggml_type).reshape(shape)


def assert_bits_equal(got, want: np.ndarray, msg: str) -> None:
    """Same float32 bits everywhere (signed zeros included); NaN only where the oracle has NaN."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{msg}: NaN positions differ"
    bad = got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan]
    assert not bad.any(), f"{msg}: {bad.sum()} values differ, e.g. {got[~nan][bad][:4]} vs {want[~nan][bad][:4]}"


def random_blocks(rng: np.random.Generator, ggml_type: T, rows: int, blocks: int, finite: bool) -> np.ndarray:
    """Random block bytes [rows, blocks*type_size]; with finite=True the f16 scales are finite (incl. subnormal)."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, blocks, type_size), dtype=np.uint8)
    if finite:
        for off in F16_OFFSETS[ggml_type]:
            bits = raw[..., off:off + 2].copy().view(np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & ~np.uint16(0x4000), bits)
            raw[..., off:off + 2] = bits.view(np.uint8)
    return raw.reshape(rows, blocks * type_size)


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("finite", [True, False], ids=["finite-scales", "any-bytes"])
def test_random_blocks_bit_identical(ggml_type, finite, seed):
    rng = np.random.default_rng(seed)
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    rows, blocks = int(rng.choice([1, 3, 5, 7])), int(rng.integers(2, 5))
    shape = (rows, blocks * block_size)
    raw = random_blocks(rng, ggml_type, rows, blocks, finite)
    qt = QuantizedTensor.from_gguf(raw, ggml_type, shape)
    assert_bits_equal(dequantize_jit(qt, jnp.float32), oracle(raw, ggml_type, shape),
                      f"{ggml_type.name} shape {shape} seed {seed}")


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_floats_bit_identical(ggml_type, seed):
    rng = np.random.default_rng(seed)
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    shape = (2, 3, 4 * block_size)  # 3-D: rows run over the flattened leading axes
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e2, (2, 3, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, ggml_type)
    assert_bits_equal(dequantize_jit(QuantizedTensor.from_gguf(raw, ggml_type, shape), None),
                      oracle(raw, ggml_type, shape), f"{ggml_type.name} seed {seed}")


def test_mxfp4_extreme_exponents(seed):
    """E8M0 0/1 give float32 subnormals (flushed by XLA:CPU arithmetic), 254/255 overflow to inf."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (4, 17), dtype=np.uint8)
    raw[:, 0] = [0, 1, 254, 255]
    raw[:, 1:] = np.arange(16, dtype=np.uint8) * 0x11  # every e2m1 code, low and high nibble
    assert_bits_equal(dequantize_jit(QuantizedTensor.from_gguf(raw, T.MXFP4, (4, 32)), None),
                      oracle(raw, T.MXFP4, (4, 32)), f"seed {seed}")


def fixture_tensors():
    for path in sorted(FIXTURES.glob("*.gguf")):
        for t in gguf.GGUFReader(path).tensors:
            yield path.name, t


def test_fixture_files_bit_identical():
    seen = set()
    for name, t in fixture_tensors():
        shape = tuple(int(s) for s in reversed(t.shape))  # ggml order -> numpy order
        w = to_device_weight(t.data, t.tensor_type, shape)
        if t.tensor_type in (T.F32, T.F16, T.BF16):
            assert isinstance(w, jax.Array), (name, t.name)
        assert w.nbytes == t.data.nbytes, (name, t.name)
        assert_bits_equal(dequantize_jit(w, jnp.float32), oracle(t.data, t.tensor_type, shape), f"{name}:{t.name}")
        seen.add(t.tensor_type)
    assert {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS} <= seen


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K, T.IQ4_XS, T.MXFP4], ids=lambda t: t.name)
def test_dequantize_rows_matches_full(ggml_type, seed):
    rng = np.random.default_rng(seed)
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    shape = (9, 2 * block_size)
    qt = QuantizedTensor.from_gguf(random_blocks(rng, ggml_type, 9, 2, True), ggml_type, shape)
    full = np.asarray(dequantize_jit(qt, None))
    ids = rng.integers(0, 9, (2, 3))
    rows = jax.jit(dequantize_rows)(qt, ids)
    assert rows.shape == (2, 3, shape[1])
    assert_bits_equal(rows, full[ids], f"{ggml_type.name} ids {ids.tolist()} seed {seed}")
    bf16 = jax.jit(embedding_lookup, static_argnums=2)(qt, ids[0], jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16, np.float32), full[ids[0]].astype(jnp.bfloat16).astype(np.float32))


def test_dequantize_rows_dense_table(seed):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((6, 8)).astype(np.float32)
    w = to_device_weight(table.astype(np.float16), T.F16, (6, 8))
    assert w.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(dequantize_rows(w, [5, 0], jnp.float32)),
                                  table.astype(np.float16)[[5, 0]].astype(np.float32))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.MXFP4],
                         ids=lambda t: t.name)
def test_linear_quantized(ggml_type, seed):
    rng = np.random.default_rng(seed)
    block_size, _ = GGML_QUANT_SIZES[ggml_type]
    shape = (7, 2 * block_size)
    raw = random_blocks(rng, ggml_type, 7, 2, True)
    if ggml_type == T.MXFP4:
        raw[:, ::17] = rng.integers(120, 136, raw[:, ::17].shape)  # moderate scales: keep the sum finite
    w = QuantizedTensor.from_gguf(raw, ggml_type, shape)
    assert w.nbytes <= 1.02 * raw.nbytes
    x = rng.standard_normal((2, 3, shape[1])).astype(np.float32)
    want = x @ oracle(raw, ggml_type, shape).T
    got = jax.jit(linear)(jnp.asarray(x), w)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 7)
    scale = np.abs(x) @ np.abs(oracle(raw, ggml_type, shape)).T  # bound on the rounding of each dot product
    np.testing.assert_array_less(np.abs(np.asarray(got) - want), 1e-5 * scale + 1e-30, err_msg=f"seed {seed}")


def test_linear_bf16_and_dense(seed):
    rng = np.random.default_rng(seed)
    raw = gguf.quants.quantize(rng.standard_normal((5, 64)).astype(np.float32), T.Q8_0)
    w = QuantizedTensor.from_gguf(raw, T.Q8_0, (5, 64))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    got = jax.jit(linear)(x, w)
    assert got.dtype == jnp.bfloat16
    dense = dequantize(w, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(linear(x, dense)))
    want = np.asarray(x, np.float32) @ np.asarray(dense, np.float32).T
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)


def test_pytree_and_nbytes(seed):
    rng = np.random.default_rng(seed)
    raw = random_blocks(rng, T.Q4_K, 3, 2, True)
    qt = QuantizedTensor.from_gguf(raw, T.Q4_K, (3, 512), dtype=jnp.bfloat16)
    leaves, treedef = jax.tree_util.tree_flatten(qt)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.shape, back.ggml_type, back.dtype) == ((3, 512), T.Q4_K, jnp.bfloat16)
    assert jax.eval_shape(dequantize, back).dtype == jnp.bfloat16
    dense = jnp.zeros((4, 4), jnp.float32)
    assert tensor_nbytes({"a": qt, "b": [dense, None]}) == raw.nbytes + 64
    assert qt.nbytes == raw.nbytes


def test_errors():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        QuantizedTensor.from_gguf(np.zeros(66, np.uint8), T.IQ2_XXS, (1, 256))
    with pytest.raises(ValueError, match="IQ2_XXS"):
        to_device_weight(np.zeros(66, np.uint8), T.IQ2_XXS, (1, 256))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedTensor.from_gguf(np.zeros(34, np.uint8), T.Q8_0, (1, 40))
    with pytest.raises(ValueError, match="bytes"):
        QuantizedTensor.from_gguf(np.zeros(33, np.uint8), T.Q8_0, (1, 32))
    with pytest.raises(ValueError, match="12345"):
        to_device_weight(np.zeros(4, np.uint8), 12345, (1,))
