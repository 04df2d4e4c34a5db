"""The dequantize kernel (pallas_kernels/quant_dequantize.py) against gguf's numpy dequantizers.

Random block bytes as in test_quant_matmul. The kernel writes W's columns in the decoders' order (x_in_kernel_order
says which) or in W's own (natural_order), and the product through either must equal x @ W.T. On CPU the kernel runs
interpreted, compiled on a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend, linear as linear_mod
from luxjax.ops.linear import LayerSlice
from pallas_kernels import quant_dequantize as qd
from pallas_kernels.quant_matmul import SKINNY_MAX_ROWS
from test_quant_matmul import TYPES, check, random_weight

# Relative error allowed against gguf's float32 values: float32 within one rounding of them (a fused multiply-add
# rounds once where gguf rounds twice); bf16 / f16 that, plus half a unit in the last place (2^-8 / 2^-11 of the
# value at most).
REL_TOL = {jnp.float32: 2.0**-23, jnp.bfloat16: 2.0**-8 + 2.0**-23, jnp.float16: 2.0**-11 + 2.0**-23}


def column_order(ggml_type, k: int, natural_order: bool = False) -> np.ndarray:
    """Which column of W each column of the kernel's output holds (x_in_kernel_order applied to 0..k-1)."""
    if natural_order:
        return np.arange(k)
    order = np.asarray(qd.x_in_kernel_order(jnp.arange(k, dtype=jnp.float32)[None], ggml_type))[0].astype(np.int64)
    assert np.array_equal(np.sort(order), np.arange(k)), "x_in_kernel_order must permute the columns"
    return order


def assert_values(got, dense: np.ndarray, dtype, msg: str):
    """got (kernel order) against float64 W's columns in that order, elementwise within REL_TOL[dtype]."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == dense.shape, f"{msg}: shape {got.shape} != {dense.shape}"
    err = np.abs(got - dense)
    bound = REL_TOL[dtype] * np.abs(dense) + (2.0**-25 if dtype == jnp.float16 else 0.0)  # half f16's subnormal step
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{msg}: at {worst} got {got[worst]!r}, want {dense[worst]!r}"


@pytest.mark.parametrize("natural_order", [False, True], ids=["kernel_order", "natural_order"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("out,k,dtype", [(67, 512, jnp.float32), (48, 1024, jnp.bfloat16), (16, 256, jnp.float16)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_kernel_decodes_every_weight(ggml_type, out, k, dtype, natural_order, seed):
    """Each value of the kernel's dense W is gguf's value of the column x_in_kernel_order names, or of its own column
    in natural order (odd row counts pad the row tile)."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, ggml_type, out, k)
    got = qd.dequantize_in_kernel_order(w, dtype=dtype, natural_order=natural_order, interpret=backend.interpret())
    assert got.dtype == dtype
    assert_values(got, dense[:, column_order(ggml_type, k, natural_order)], dtype,
                  f"{ggml_type.name} [{out},{k}] {natural_order=} seed {seed}")


@pytest.mark.parametrize("ggml_type", [T.IQ4_XS, T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_stacked_weight_reads_the_chosen_layer(ggml_type, seed):
    """A weight stacked over layers, decoded in place at a random layer, with tiles other than the default."""
    rng = np.random.default_rng(seed)
    layers, out, k = 3, 32, 512
    pairs = [random_weight(rng, ggml_type, out, k) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in pairs])
    layer = int(rng.integers(0, layers))
    for bs, natural in ((None, False), (qd.BlockSizes(8, 4, 4), False), (None, True)):
        got = qd.dequantize_in_kernel_order(stacked, jnp.int32(layer), dtype=jnp.float32, natural_order=natural,
                                            block_sizes=bs, interpret=backend.interpret())
        assert_values(got, pairs[layer][1][:, column_order(ggml_type, k, natural)], jnp.float32,
                      f"{ggml_type.name} layer {layer} {bs} {natural=} seed {seed}")


@pytest.mark.parametrize("natural_order", [False, True], ids=["kernel_order", "natural_order"])
@pytest.mark.parametrize("ggml_type", [T.Q6_K, T.IQ4_XS, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_dequantized_matmul_is_x_times_w(ggml_type, dtype, natural_order, seed):
    """x (with leading axes) through x_in_kernel_order times the kernel's W, or x itself times W in natural order:
    x @ W.T within the dtype's rounding."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, ggml_type, 40, 768)
    x = jnp.asarray(rng.standard_normal((3, 11, 768)), dtype)
    got = qd.dequantized_matmul(x, w, natural_order=natural_order, interpret=backend.interpret())
    assert got.shape == (3, 11, 40) and got.dtype == dtype
    check(got.reshape(33, 40), x.reshape(33, 768), dense, dtype, f"{ggml_type.name} seed {seed}")


def test_support_and_refusals():
    rng = np.random.default_rng(0)
    w, _ = random_weight(rng, T.Q4_K, 45, 256)
    assert qd.supported(w, jnp.bfloat16) and not qd.supported(w, jnp.int8)
    assert not qd.supported(w, jnp.bfloat16, stacked=True), "45 rows take no row tile of at least 4 in place"
    assert qd.supported(random_weight(rng, T.Q4_K, 40, 256)[0], jnp.bfloat16, stacked=True)
    raw = rng.integers(0, 256, (8, 256 // 32 * 18), dtype=np.uint8)
    q4_0 = QuantizedTensor.from_gguf(raw, T.Q4_0, (8, 256))
    assert not qd.supported(q4_0, jnp.float32)
    with pytest.raises(NotImplementedError, match="Q4_0"):
        qd.dequantize_in_kernel_order(q4_0, interpret=True)


@pytest.mark.parametrize("stacked", [False, True])
def test_linear_takes_the_kernel_for_prefill_sized_x(monkeypatch, stacked, seed):
    """linear(): prefill-sized x times a packed weight (or a layer slice of one, read in place) goes through the
    dequantize kernel when Pallas is chosen, decode-sized x through the fused GEMV; the values are x @ W.T."""
    rng = np.random.default_rng(seed)
    pairs = [random_weight(rng, T.IQ4_XS, 64, 512) for _ in range(2)]
    w = jax.tree.map(lambda *a: jnp.stack(a), *[p[0] for p in pairs]) if stacked else pairs[0][0]
    weight, dense = (LayerSlice(w, jnp.int32(1)), pairs[1][1]) if stacked else (w, pairs[0][1])
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    layers = []
    real = qd.dequantized_matmul
    monkeypatch.setattr(qd, "dequantized_matmul", lambda x, w, layer, **kw: layers.append(layer) or real(x, w, layer,
                                                                                                          **kw))
    x = jnp.asarray(rng.standard_normal((SKINNY_MAX_ROWS + 5, 512)), jnp.bfloat16)
    check(linear_mod.linear(x, weight), x, dense, jnp.bfloat16, f"stacked {stacked} seed {seed}")
    assert len(layers) == 1 and (layers[0] is not None) == stacked, layers
    for rows in (2, SKINNY_MAX_ROWS):  # decode of 2 and of 32 sequences
        linear_mod.linear(x[:rows], weight)
        assert len(layers) == 1, f"decode-sized x ({rows} rows) should take the fused GEMV"
