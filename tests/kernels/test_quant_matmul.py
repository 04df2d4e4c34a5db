"""Fused dequantize-matmul kernels against gguf's numpy dequantizers (float64 matmul) and the XLA path.

Random block bytes (f16 scales kept to a modest finite range) packed through QuantizedTensor.from_gguf. On CPU
the kernels run interpreted; on a GPU (luxjax.ops.backend.interpret() is False) the same tests run compiled.
"""
from __future__ import annotations

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend, linear as linear_mod
from luxjax.ops.linear import LayerSlice
from pallas_kernels.quant_matmul import (
    SKINNY_MAX_ROWS, BlockSizes, quant_matmul, quant_matmul_many, quant_matmul_reference)

TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
F16_OFFSETS = {T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}
# (rows of x, out, in, x dtype): GEMV reduce (1, 2, 3), skinny dot at 16 rows (9, 16) and at 32 (20), tiled GEMM
# (40); odd out pads the tile.
CASES = [(1, 67, 512, jnp.float32), (2, 48, 2048, jnp.bfloat16), (3, 64, 768, jnp.bfloat16),
         (9, 40, 512, jnp.bfloat16), (16, 97, 256, jnp.float32), (20, 160, 512, jnp.bfloat16),
         (40, 64, 512, jnp.bfloat16)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}  # of sum |x||w|: float32 accumulation / bf16 rounding of W and y


def random_weight(rng, ggml_type, out: int, k: int) -> tuple[QuantizedTensor, np.ndarray]:
    """Random blocks whose f16 scales are finite, of either sign, magnitude about 2^-8..2^4; and W in float64."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (out, k // block, type_size), dtype=np.uint8)
    for off in F16_OFFSETS[ggml_type]:
        raw[..., off + 1] = (rng.integers(0x1C, 0x4C, raw.shape[:2]) | (rng.integers(0, 2, raw.shape[:2]) << 7))
    raw = raw.reshape(out, -1)
    dense = gguf.quants.dequantize(raw, ggml_type).reshape(out, k).astype(np.float64)
    return QuantizedTensor.from_gguf(raw, ggml_type, (out, k)), dense


def check(got, x, dense, dtype, msg, tol=None):
    """|got - x @ dense.T| per output, in float64, against tol (default TOL[dtype]) of sum |x||w|."""
    tol = TOL[dtype] if tol is None else tol
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    want, scale = x64 @ dense.T, np.abs(x64) @ np.abs(dense).T
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want) / scale
    assert np.all(np.isfinite(got)), f"{msg}: non-finite output"
    assert err.max() <= tol, f"{msg}: max error {err.max():.3g} of sum|x||w| > {tol:.0e}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,out,k,dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_kernel_matches_dequantized_matmul(ggml_type, m, out, k, dtype, seed):
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, ggml_type, out, k)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = quant_matmul(x, w, interpret=backend.interpret())
    msg = f"{ggml_type.name} x[{m},{k}] {jnp.dtype(dtype).name} W[{out},{k}] seed {seed}"
    assert got.dtype == x.dtype, f"{msg}: dtype {got.dtype}"
    check(got, x, dense, dtype, msg)
    check(linear_mod._xla_linear(x, w), x, dense, dtype, f"{msg} (XLA path)")


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.IQ4_XS], ids=lambda t: t.name)
def test_explicit_block_sizes_pad_rows_and_m(ggml_type, seed):
    """Tiles that divide neither out nor M, and a K step of one block; for the skinny dot and for the GEMV reduce
    over three rows of x per program."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, ggml_type, 45, 768)
    x = jnp.asarray(rng.standard_normal((19, 768)), jnp.float32)
    for bs in (BlockSizes(16, 32, 1, 4, 2), BlockSizes(3, 8, 1, 4, 2)):
        got = quant_matmul(x, w, block_sizes=bs, interpret=backend.interpret())
        check(got, x, dense, jnp.float32, f"{ggml_type.name} {bs} seed {seed}")
    check(quant_matmul_reference(x, w), x, dense, jnp.float32, f"{ggml_type.name} reference seed {seed}")


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.IQ4_XS, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("m,splits", [(1, 2), (1, 4), (5, 2)])
def test_k_splits_sum_every_part(ggml_type, m, splits, seed):
    """K split over programs (float32 partial sums added after the kernel): every part counted once, for the GEMV
    and the skinny dot."""
    rng = np.random.default_rng(seed)
    block = GGML_QUANT_SIZES[ggml_type][0]
    k = 8 * max(block, 64)
    w, dense = random_weight(rng, ggml_type, 48, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    bs = BlockSizes(1 if m == 1 else 16, 16, 1, 4, 2, splits=splits)
    got = quant_matmul(x, w, block_sizes=bs, interpret=backend.interpret())
    check(got, x, dense, jnp.float32, f"{ggml_type.name} x[{m},{k}] {splits} splits seed {seed}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_reduce_with_x_widened_before_or_in_the_kernel(ggml_type, m, seed):
    """bf16 x widened to float32 before the GEMV reduce (BlockSizes.x_float32) or inside it: the same float32
    products, so both within float32 accumulation of the float64 product (not bit for bit: the compiler may sum in
    another order)."""
    rng = np.random.default_rng(seed)
    block = GGML_QUANT_SIZES[ggml_type][0]
    k = 4 * max(block, 64)
    w, dense = random_weight(rng, ggml_type, 32, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = {wide: quant_matmul(x, w, block_sizes=BlockSizes(m, 16, 1, 4, 2, x_float32=wide), out_dtype=jnp.float32,
                              interpret=backend.interpret()) for wide in (False, True)}
    msg = f"{ggml_type.name} x[{m},{k}] seed {seed}"
    for wide, y in got.items():
        check(y, x, dense, jnp.float32, f"{msg} x_float32={wide}")


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,dtype", [(1, jnp.float32), (2, jnp.bfloat16), (12, jnp.bfloat16)])
def test_many_weights_in_one_launch(ggml_type, m, dtype, seed):
    """quant_matmul_many (GEMV reduce at 1-2 rows, skinny dot at 12): each output is x times its own weight, for
    weights of unequal rows side by side, stacked (layer chosen, read in place) or not (odd rows padded)."""
    rng = np.random.default_rng(seed)
    block = GGML_QUANT_SIZES[ggml_type][0]
    k, layers = 4 * max(block, 64), 3
    layer = int(rng.integers(0, layers))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    for stacked, outs in ((True, (64, 16, 48)), (False, (40, 17))):
        pairs = [[random_weight(rng, ggml_type, out, k) for _ in range(layers)] for out in outs]
        if stacked:
            ws = tuple(jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in per]) for per in pairs)
            got = quant_matmul_many(x, ws, jnp.int32(layer), interpret=backend.interpret())
        else:
            got = quant_matmul_many(x, tuple(per[layer][0] for per in pairs), interpret=backend.interpret())
        assert len(got) == len(outs)
        for i, (y, per) in enumerate(zip(got, pairs)):
            check(y, x, per[layer][1], dtype, f"{ggml_type.name} weight {i} of {outs} stacked={stacked} "
                                              f"layer {layer} x[{m}] seed {seed}")


def test_linear_many_puts_each_format_in_one_launch(monkeypatch, seed):
    """linear_many on packed layer slices of one layer: one fused-kernel launch per format (two Q4_K weights
    together, the Q6_K one alone), outputs in the order given, up to the skinny dot's 32 rows (a decode of 17-32
    sequences too); a prefill-sized x takes no fused launch. (The int8 GEMV, which takes these formats' decode rows
    by default, is switched off: its own grouping is tested in test_quant_gemv_int8.py.)"""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    monkeypatch.setattr(backend, "int8_activations", lambda: False)
    k, layers = 512, 2
    layer = jnp.int32(int(rng.integers(0, layers)))
    specs = [(T.Q4_K, 48), (T.Q6_K, 32), (T.Q4_K, 16)]
    pairs = [[random_weight(rng, t, out, k) for _ in range(layers)] for t, out in specs]
    ws = [LayerSlice(jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in per]), layer) for per in pairs]
    for rows in (1, 16, int(rng.integers(17, SKINNY_MAX_ROWS + 1)), SKINNY_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: linear_mod.linear_many(x, ws))(x))
        launches = (jaxpr.count("name=quant_matmul_q4_k"), jaxpr.count("name=quant_matmul_q6_k"))
        assert launches == ((1, 1) if rows <= SKINNY_MAX_ROWS else (0, 0)), f"{rows} rows: launches {launches}"
        for i, (y, per) in enumerate(zip(linear_mod.linear_many(x, ws), pairs)):
            check(y, x, per[int(layer)][1], jnp.float32, f"weight {i} {specs[i]}, {rows} rows, seed {seed}")


def test_k_splits_must_divide_the_blocks():
    w, _ = random_weight(np.random.default_rng(0), T.Q8_0, 16, 96)  # 3 blocks
    with pytest.raises(ValueError, match="splits"):
        quant_matmul(jnp.ones((1, 96), jnp.float32), w, block_sizes=BlockSizes(1, 16, 1, 4, 2, splits=2),
                     interpret=True)


def test_fma_is_registered_and_rounds_once(seed):
    """pallas_kernels.fma reaches Pallas's Triton lowering in this JAX (else kernels silently lose their fused
    multiply-adds), and inside a kernel it is a * b + c: exactly the float64 value rounded once on a GPU, within
    the rounding of a separate multiply and add when interpreted."""
    from jax.experimental import pallas as pl

    from pallas_kernels.fma import FUSED, fma

    assert FUSED, "the fma lowering rule could not be registered with this JAX's Pallas Triton lowering"
    rng = np.random.default_rng(seed)
    a, b, c = (jnp.asarray(rng.standard_normal((8, 128)), jnp.float32) for _ in range(3))

    def kernel(a_ref, b_ref, c_ref, o_ref):
        o_ref[...] = fma(a_ref[...], b_ref[...], c_ref[...])

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                         interpret=backend.interpret())(a, b, c)
    a64, b64, c64 = (np.asarray(v, np.float64) for v in (a, b, c))
    exact = a64 * b64 + c64
    if backend.interpret():
        ulp = np.spacing((np.abs(a64 * b64) + np.abs(c64)).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= ulp), "fma is not a * b + c"
    else:
        np.testing.assert_array_equal(np.asarray(got), exact.astype(np.float32))


def test_byte_perm_picks_the_selected_bytes(seed):
    """pallas_kernels.byte_perm reaches Pallas's Triton lowering, and inside a kernel (LLVM's llvm.nvvm.prmt when
    compiled on CUDA, shifts and masks elsewhere) and in XLA it gives byte i = byte ((s >> 4i) & 7) of [a, b],
    whatever the selector's upper 16 bits hold (the IQ4 lookup passes whole words of codes): checked against numpy
    indexing the eight little-endian bytes."""
    from jax.experimental import pallas as pl

    from pallas_kernels.byte_perm import REGISTERED, byte_perm

    assert REGISTERED, "the byte_perm lowering rule could not be registered with this JAX's Pallas Triton lowering"
    rng = np.random.default_rng(seed)
    a, b = (rng.integers(0, 2**32, (8, 128), dtype=np.uint32) for _ in range(2))
    picks = rng.integers(0, 8, (8, 128, 4))
    upper = (rng.integers(0, 8, (8, 128, 4)) << (4 * np.arange(4, 8))).sum(axis=-1)  # nibbles 4..7: unused
    selector = ((picks << (4 * np.arange(4))).sum(axis=-1) + upper).astype(np.uint32)
    eight = np.concatenate([a[..., None].view(np.uint8), b[..., None].view(np.uint8)], axis=-1)  # [8, 128, 8]
    want = np.take_along_axis(eight, picks, axis=-1).copy().view(np.uint32)[..., 0]

    def kernel(a_ref, b_ref, s_ref, o_ref):
        o_ref[...] = byte_perm(a_ref[...], b_ref[...], s_ref[...])

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.uint32),
                         interpret=backend.interpret())(a, b, selector)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(byte_perm)(a, b, selector)), want)


@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("byte_perm", [True, False], ids=["byte_perm", "arithmetic"])
def test_iq4_decoders_match_gguf(monkeypatch, m, byte_perm, seed):
    """Both IQ4 codebook decoders against gguf, whatever this platform would choose: byte permutes (what CUDA runs)
    and the polynomial (what ROCm runs)."""
    import pallas_kernels.quant_matmul as qm

    monkeypatch.setattr(qm, "uses_byte_perm", lambda interpret: byte_perm)
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, T.IQ4_XS, 24, 768)
    x = jnp.asarray(rng.standard_normal((m, 768)), jnp.float32)
    check(quant_matmul(x, w, interpret=backend.interpret()), x, dense, jnp.float32,
          f"IQ4_XS x[{m},768] byte_perm={byte_perm} seed {seed}")


@pytest.mark.parametrize("m", [1, 3, 20])
def test_float32_output_is_the_unrounded_accumulator(m, seed):
    """out_dtype=float32 with bf16 x: the same accumulator the bf16 output is rounded from, left unrounded."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, T.Q6_K, 40, 512)
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
    wide = quant_matmul(x, w, out_dtype=jnp.float32, interpret=backend.interpret())
    narrow = quant_matmul(x, w, interpret=backend.interpret())
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(wide.astype(jnp.bfloat16), np.float32), np.asarray(narrow, np.float32))
    assert np.any(np.asarray(wide) != np.asarray(wide.astype(jnp.bfloat16), np.float32)), "output was rounded"
    check(wide, x, dense, jnp.bfloat16, f"Q6_K x[{m},512] out float32 seed {seed}")


def test_linear_dispatches_to_kernel(monkeypatch, seed):
    """linear() takes the fused kernel for decode-sized x when Pallas is chosen (leading axes kept), not for prefill
    (tests/kernels/test_quant_dequantize.py follows that path)."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, T.Q6_K, 33, 512)
    x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.float32)
    calls = []
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    real = linear_mod._pallas_linear
    monkeypatch.setattr(linear_mod, "_pallas_linear", lambda *a: calls.append(1) or real(*a))
    got = linear_mod.linear(x, w)
    assert calls, "linear() did not take the Pallas kernel"
    assert got.shape == (2, 3, 33)
    check(got.reshape(6, 33), x.reshape(6, 512), dense, jnp.float32, f"linear Q6_K seed {seed}")
    wide = linear_mod.linear(x.astype(jnp.bfloat16), w, out_dtype=jnp.float32)
    assert len(calls) == 2 and wide.dtype == jnp.float32, "out_dtype must reach the kernel"
    decode_32 = jnp.asarray(rng.standard_normal((SKINNY_MAX_ROWS, 512)), jnp.bfloat16)  # 32 sequences' decode
    check(linear_mod.linear(decode_32, w), decode_32, dense, jnp.bfloat16, f"linear Q6_K, 32 rows, seed {seed}")
    assert len(calls) == 3, "32 rows (a decode step of 32 sequences) should take the fused kernel"
    linear_mod.linear(jnp.ones((SKINNY_MAX_ROWS + 1, 512), jnp.float32), w)
    assert len(calls) == 3, "prefill-sized x should not take the fused kernel"


@pytest.mark.parametrize("rows", [1, 2, 4, 9, 40])
@pytest.mark.parametrize("weight", ["bf16", "Q4_K"])
@pytest.mark.parametrize("pallas", [False, True])
def test_split_linear_keeps_float32_inputs(monkeypatch, seed, rows, weight, pallas):
    """split_linear (float32 x, low-precision W) lands within float32 rounding of the exact product of x and W as
    bf16 matmuls see it (stored or dequantized values rounded to bf16), far closer than the product of bf16-rounded
    x; on the kernel path (interpreted on CPU) too, for row counts whose stacked halves fit the kernel (9 -> one call
    each) or not (40 -> XLA). Packed W with few rows on the kernel path takes x whole (Q4_K at 1..4 rows: the int8
    GEMV, interpreted here, with x in three int8 levels), which never rounds W: there the exact dequantized W is the
    reference."""
    rng = np.random.default_rng(seed)
    out, k = 48, 512
    if weight == "bf16":
        w = jnp.asarray(rng.normal(0, 1, (out, k)), jnp.bfloat16)
        dense = np.asarray(w.astype(jnp.float32), np.float64)
    else:
        w, dense = random_weight(rng, T.Q4_K, out, k)
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    monkeypatch.setattr(backend, "use_pallas", lambda: pallas)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    if not (pallas and weight != "bf16" and rows <= 4):
        dense = np.asarray(jnp.asarray(dense, jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = x.astype(np.float64) @ dense.T
    got = np.asarray(linear_mod.split_linear(jnp.asarray(x), w), np.float64)
    rounded = np.asarray(linear_mod.linear(jnp.asarray(x, jnp.bfloat16), w, jnp.float32), np.float64)
    err, bf16_err = np.abs(got - exact).max(), np.abs(rounded - exact).max()
    scale = np.abs(x.astype(np.float64)) @ np.abs(dense).T
    assert err <= 2e-5 * scale.max() and err < bf16_err / 20, (seed, err, bf16_err)
