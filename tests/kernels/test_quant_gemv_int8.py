"""The int8 decode GEMV (pallas_kernels/quant_gemv_int8.py) and its integer dot product, against independent
oracles: numpy's int8 views of the words for dot4, gguf's numpy dequantizer and a float64 product for the GEMV, held
to the error bound that quantizing x in int8 levels allows (derived here from x, not from the kernel's code). Every
format the GEMV takes (IQ4_XS, Q4_K, Q5_K, Q6_K) runs through each product test.

On CPU the kernels run interpreted; on a GPU compiled (dot4 as DP4A, the codebook by byte permutes).
"""
from __future__ import annotations

import functools
import itertools

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from jax.experimental import pallas as pl

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend, linear as linear_mod
from luxjax.ops.deferred import GatedInput, GatedNormedInput, NormedInput
from luxjax.ops.linear import LayerSlice
from pallas_kernels import quant_gemv_int8 as qi
from pallas_kernels.dot4 import dot2, dot4
from test_quant_matmul import random_weight

FORMATS = [T.IQ4_XS, T.Q4_K, T.Q5_K, T.Q6_K]
by_name = pytest.mark.parametrize("ggml_type", FORMATS, ids=lambda t: t.name)


def _bytes(words: np.ndarray) -> np.ndarray:
    """uint32 words -> their four bytes as int8, low byte first (numpy's little-endian view)."""
    return np.ascontiguousarray(words.astype("<u4")).view(np.int8).reshape(*words.shape, 4).astype(np.int64)


def _halves(words: np.ndarray) -> np.ndarray:
    """uint32 words -> their two 16-bit halves as int16, low half first (numpy's little-endian view)."""
    return np.ascontiguousarray(words.astype("<u4")).view(np.int16).reshape(*words.shape, 2).astype(np.int64)


def random_operands(rng, a_extreme: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random uint32 words a, b and int32 c [8, 128]; the first two lanes the extremes: a_extreme times 0x80808080
    (every byte -128) from 0 and from 2^31 - 1 (a sum that wraps past int32)."""
    a, b = (rng.integers(0, 2**32, (8, 128), dtype=np.uint32) for _ in range(2))
    c = rng.integers(-2**31, 2**31, (8, 128), dtype=np.int64).astype(np.int32)
    a[0, :2], b[0, :2], c[0, :2] = a_extreme, 0x80808080, (0, 2**31 - 1)
    return a, b, c


def wrapped(products: np.ndarray, c: np.ndarray) -> np.ndarray:
    """c + the sum of products over the last axis, wrapped to int32 as the instruction does."""
    return (products.sum(-1) + c.astype(np.int64) + 2**31) % 2**32 - 2**31


def applied(op, a, b, c, in_kernel: bool, interpret: bool) -> np.ndarray:
    """op(a, b, c) inside a Pallas kernel or as a jitted XLA function."""
    if not in_kernel:
        return np.asarray(jax.jit(op)(a, b, c))

    def kernel(a_ref, b_ref, c_ref, o_ref):
        o_ref[...] = op(a_ref[...], b_ref[...], c_ref[...])

    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(c.shape, jnp.int32), interpret=interpret)(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)))


@pytest.mark.parametrize("in_kernel", [False, True], ids=["xla", "pallas"])
def test_dot4_matches_integer_products(in_kernel, seed, interpret):
    a, b, c = random_operands(np.random.default_rng(seed), 0x80808080)  # -128 * -128 four times
    want = wrapped(_bytes(a) * _bytes(b), c)
    np.testing.assert_array_equal(applied(dot4, a, b, c, in_kernel, interpret), want, err_msg=f"seed {seed}")


@pytest.mark.parametrize("in_kernel", [False, True], ids=["xla", "pallas"])
@pytest.mark.parametrize("high", [False, True], ids=["low", "high"])
def test_dot2_matches_integer_products(in_kernel, high, seed, interpret):
    """dot2: a's two signed 16-bit halves times b's signed bytes 0, 1 (high: 2, 3), plus c, wrapping as int32."""
    a, b, c = random_operands(np.random.default_rng(seed), 0x80008000)  # -32768 * -128 twice
    want = wrapped(_halves(a) * _bytes(b)[..., 2 * high: 2 * high + 2], c)
    got = applied(lambda a, b, c: dot2(a, b, c, high=high), a, b, c, in_kernel, interpret)
    np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


def random_x(rng, m: int, k: int, dtype) -> jax.Array:
    """Values over many scales (log-normal magnitudes, either sign), a group of zeros and one of tiny values."""
    x = rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((m, k)))
    x[0, 32:64] = 0.0
    if k > 96:
        x[-1, 64:96] *= 1e-35
    return jnp.asarray(x, dtype)


def x_error_bound(x: np.ndarray, levels: int) -> np.ndarray:
    """Per value, the most that x's int8 levels can miss it by: half the finest step of its group of 32, whose
    coarsest step is max|x| / 127 (groups smaller than qi.TINY may drop out), plus float32 rounding of what each
    level leaves (2^-23 of the group's largest: at three levels the bound itself is 2^-22)."""
    groups = np.abs(x).reshape(*x.shape[:-1], -1, qi.GROUP)
    step = np.maximum(groups.max(-1, keepdims=True), qi.TINY) / 127 / qi.LEVEL_STEP ** (levels - 1)
    return np.broadcast_to(step / 2 * (1 + 1e-5) + 2.0**-23 * groups.max(-1, keepdims=True), groups.shape).reshape(
        x.shape)


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_quantized_x_within_its_bound(levels, seed):
    rng = np.random.default_rng(seed)
    x = random_x(rng, 3, 512, jnp.float32)
    q, d = qi.quantize_x(x, levels)
    assert q.dtype == jnp.int8 and d.shape == (3, 512 // qi.GROUP)
    q, d = np.asarray(q, np.float64), np.asarray(d, np.float64)
    assert np.abs(q).max() <= 127
    steps = d[:, None, :, None] / qi.LEVEL_STEP ** np.arange(levels)[None, :, None, None]  # [m, levels, groups, 1]
    rebuilt = (q.reshape(3, levels, -1, qi.GROUP) * steps).sum(1).reshape(3, 512)
    x64 = np.asarray(x, np.float64)
    excess = np.abs(rebuilt - x64) - x_error_bound(x64, levels)
    assert excess.max() <= 0, f"seed {seed}: {levels} levels miss x by more than their bound"
    # the bound is tight where it matters: each group's largest value takes level 0's full range
    kept = np.abs(x64).reshape(3, -1, qi.GROUP).max(-1) >= qi.TINY
    assert kept.sum() < kept.size and np.all(np.abs(q[:, 0]).reshape(3, -1, qi.GROUP).max(-1)[kept] >= 126)


def by_position(words: np.ndarray, paired: bool) -> np.ndarray:
    """A quantization kernel's int32 words [M, slots, ...] -> the integer each gives a dot product's byte position
    of its word [M, S, ..., 4] (spelled out here, not taken from the kernel's code): where paired (qi.pairs_levels),
    slots 0 and 1 hold 16-bit values v ~ x / (d / 128) (dot2's operands: slot 0's low and high halves for positions
    0 and 1, slot 1's for 2 and 3), then a slot of bytes per further level (S = levels - 1); else a slot of bytes per
    level (S = levels)."""
    if not paired:
        return _bytes(words)
    pairs = np.concatenate([_halves(words[:, 0]), _halves(words[:, 1])], axis=-1)[:, None]
    return np.concatenate([pairs, _bytes(words[:, 2:])], axis=1)


def rebuilt_x(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x from the integers of each value [M, S, K] (by_position's, in value order) and the kernel's scale of each 32
    [M, K / 32]: sum_s values_s * scale / 128^s (where paired the scale is max / 127 / 128 and the first values are
    the 16-bit ones)."""
    m, slots, k = values.shape
    steps = scales.astype(np.float64)[:, None, :, None] / qi.LEVEL_STEP ** np.arange(slots)[None, :, None, None]
    return (values.reshape(m, slots, -1, qi.GROUP) * steps).sum(1).reshape(m, k)


def unpermute_words(words: np.ndarray, paired: bool) -> np.ndarray:
    """int32 words [M, slots, K / 256, 4, 2, 2, 4] -> each value's integers [M, S, K] (by_position), by the layout
    the GEMV's decoder wants (spelled out here, not taken from the kernel's code): word (g2, gp, h, w) of a block
    holds, at byte position 2*b + hi, its value 64*g2 + 32*gp + 16*hi + 4*w + 2*h + b."""
    at = by_position(words, paired)  # [..., g2, gp, h, w, position]
    m, slots, blocks = at.shape[:3]
    q = np.zeros((m, slots, blocks, 256), np.int64)
    for g2, gp, h, w, b, hi in np.ndindex(4, 2, 2, 4, 2, 2):
        q[..., 64 * g2 + 32 * gp + 16 * hi + 4 * w + 2 * h + b] = at[:, :, :, g2, gp, h, w, 2 * b + hi]
    return q.reshape(m, slots, blocks * 256)


def want_scales(x, paired: bool) -> np.ndarray:
    """max |x| / 127 of each 32 values in float32 (groups below qi.TINY as if at it), / 128 where paired."""
    groups = np.abs(np.asarray(jnp.asarray(x, jnp.float32))).reshape(x.shape[0], -1, qi.GROUP)
    d = np.maximum(groups.max(-1), np.float32(qi.TINY)) / np.float32(127)
    return d / np.float32(qi.LEVEL_STEP) if paired else d


def check_ties(values: np.ndarray, x64: np.ndarray, paired: bool, msg: str):
    """The last group of the last row holds n + 0.5 (max 127: steps of 1): level 0 rounds them to the even
    neighbour; paired, the 16-bit values hold them exactly (128 x)."""
    got = values[-1, 0, -31:]
    want = 128 * x64[-1, -31:] if paired else 2 * np.round(x64[-1, -31:] / 2)
    np.testing.assert_array_equal(got, want, err_msg=f"{msg}: ties")


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m, k", [(1, 1280), (3, 768), (4, 256)])
def test_quantize_kernel_words(levels, dtype, m, k, seed, interpret):
    """The quantization kernel's words and scales: x rebuilt from them (numpy reading the layout) within the
    bound; scales max|x| / 127 per 32; ties rounded to even. (Not bit for bit the XLA form's: a compiler may divide
    by a reciprocal or fuse the remainder's multiply-add in one and not the other, and a level then moves by one.)"""
    rng = np.random.default_rng(seed)
    x = np.array(random_x(rng, m, k, jnp.float32))
    x[-1, -32:] = rng.integers(-126, 127, 32) + 0.5  # level 0 steps of 1 with ties (max |x| = 127)
    x[-1, -32] = 127.0
    x = jnp.asarray(x, dtype)
    words, scales = qi.quantized_words(x, levels, interpret=interpret)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    paired = qi.pairs_levels(m, levels)
    d = np.asarray(scales).reshape(m, -1)
    # XLA may divide by 127 as a multiply by its reciprocal: within one float32 rounding of the quotient
    np.testing.assert_allclose(d, want_scales(x, paired), rtol=1.2e-7, atol=0, err_msg=f"seed {seed}")
    q = unpermute_words(np.asarray(words), paired)
    assert np.abs(q[:, 0]).max() <= (127 * 128 if paired else 127) and np.abs(q[:, 1:]).max(initial=0) <= 127
    excess = np.abs(rebuilt_x(q, d) - x64) - x_error_bound(x64, levels)
    assert excess.max() <= 0, f"seed {seed}: the kernel's levels miss x by more than their bound"
    check_ties(q, x64, paired, f"seed {seed}")


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m, k", [(1, 1280), (3, 512)])
def test_natural_quantize_kernel_words(levels, dtype, m, k, seed, interpret):
    """The value-order quantization kernel (the K-quants' x): its words read back as bytes in memory
    order rebuild x within the bound; its scales are max|x| / 127 of each 32 (given per 16 values); its sums are
    each 16 values' float sum of x as given, before quantization, and its level sums those of the bytes read back;
    ties rounded to even."""
    rng = np.random.default_rng(seed)
    x = np.array(random_x(rng, m, k, jnp.float32))
    x[-1, -32:] = rng.integers(-126, 127, 32) + 0.5
    x[-1, -32] = 127.0
    x = jnp.asarray(x, dtype)
    words, scales, sums, level_sums = qi.natural_words(x, levels, interpret=interpret)
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    paired = qi.pairs_levels(m, levels)
    q = by_position(np.asarray(words), paired)  # word i's position b is value 4i + b
    q = q.reshape(m, q.shape[1], k)
    assert np.abs(q[:, 0]).max() <= (127 * 128 if paired else 127) and np.abs(q[:, 1:]).max(initial=0) <= 127
    d = np.asarray(scales).reshape(m, -1, 2)
    np.testing.assert_array_equal(d[..., 0], d[..., 1], err_msg="one scale per 32 values, given twice")
    np.testing.assert_allclose(d[..., 0], want_scales(x, paired), rtol=1.2e-7, atol=0, err_msg=f"seed {seed}")
    excess = np.abs(rebuilt_x(q, d[..., 0]) - x64) - x_error_bound(x64, levels)
    assert excess.max() <= 0, f"seed {seed}: the kernel's levels miss x by more than their bound"
    want_sums = x64.reshape(m, -1, 16).sum(-1)
    np.testing.assert_allclose(np.asarray(sums, np.float64).reshape(m, -1), want_sums, rtol=0,
                               atol=1e-6 * np.abs(x64).reshape(m, -1, 16).sum(-1).max(), err_msg=f"seed {seed}: sums")
    # each slot's sums over 16 values: paired, the 16-bit values' in slot 0 (and zeros in slot 1, whose words hold
    # the other half of those values), then each further level's
    want_level_sums = q.reshape(m, q.shape[1], -1, 16).sum(-1)
    if paired:
        want_level_sums = np.concatenate([want_level_sums[:, :1], 0 * want_level_sums[:, :1], want_level_sums[:, 1:]],
                                         axis=1)
    np.testing.assert_array_equal(np.asarray(level_sums).reshape(m, levels, -1), want_level_sums,
                                  err_msg=f"seed {seed}: level sums")
    check_ties(q, x64, paired, f"seed {seed}")


def check_against_bound(got, x, dense, levels: int, msg: str):
    """|got - x @ W.T| <= sum |w| * (x's quantization bound) + float32 accumulation (1e-6 of sum |x||w|)."""
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    want = x64 @ dense.T
    allowed = x_error_bound(x64, levels) @ np.abs(dense).T + 1e-6 * (np.abs(x64) @ np.abs(dense).T)
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{msg}: shape {got.shape}"
    assert np.all(np.isfinite(got)), f"{msg}: non-finite output"
    worst = (np.abs(got - want) / allowed).max()
    assert worst <= 1, f"{msg}: error {worst:.3g} times the bound"


CASES = [(1, 37, 512, jnp.bfloat16), (2, 48, 768, jnp.float32), (3, 64, 1024, jnp.float32),
         (4, 16, 2048, jnp.bfloat16), (1, 32, 256, jnp.float16)]


@by_name
@pytest.mark.parametrize("m,out,k,dtype", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_int8_gemv_matches_dequantized_matmul(ggml_type, m, out, k, dtype, seed, interpret):
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, ggml_type, out, k)
    x = random_x(rng, m, k, dtype)
    got = qi.int8_quant_matmul(x, w, out_dtype=jnp.float32, interpret=interpret)
    check_against_bound(got, x, dense, qi.levels_for(dtype), f"{ggml_type.name} x[{m},{k}] "
                                                             f"{jnp.dtype(dtype).name} W[{out}] seed {seed}")
    y = qi.int8_quant_matmul(x, w, interpret=interpret)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(got.astype(dtype)), err_msg="out_dtype rounds once")


# How far a float32 evaluation of silu(gate) * up may be from the exact value, relative (XLA's, measured: 2^-22.3 on
# this CPU, 2^-22.1 on an H200).
SWIGLU_EVAL_ERROR = 2.0**-18


def rounded_to(v, dtype) -> np.ndarray:
    """float64 v through float32 rounded to dtype (JAX's rounding), back in float64."""
    return np.asarray(jnp.asarray(v, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def rounding_oracle(exact: np.ndarray, dtype, eval_error: float) -> tuple[np.ndarray, np.ndarray]:
    """(exact rounded to dtype, per value the most a float32 evaluation within eval_error (relative) of exact may
    move it by): where exact lies within eval_error of a rounding boundary of dtype, either neighbour is right, so
    the allowance is one step of dtype there."""
    x = rounded_to(exact, dtype)
    low, high = (rounded_to(exact * (1 + sign * eval_error), dtype) for sign in (-1, 1))
    return x, np.abs(high - low) + eval_error * np.abs(exact)


def swiglu_oracle(gate: np.ndarray, up: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """silu(gate) * up in float64 by numpy, rounded to dtype (rounding_oracle)."""
    with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for very negative gate: silu is -0 there
        exact = gate / (1 + np.exp(-gate)) * up
    return rounding_oracle(exact, dtype, SWIGLU_EVAL_ERROR)


@by_name
@pytest.mark.parametrize("m,dtype", [(1, jnp.bfloat16), (3, jnp.float32), (4, jnp.bfloat16)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_int8_gemv_forms_a_gated_input(ggml_type, m, dtype, seed, interpret):
    """A GatedInput (an MLP's gate and up, unformed): the quantization kernel forms silu(gate) * up rounded to gate's
    dtype, so the product is that activation times W within x's quantization bound (numpy's activation, gguf's
    dequantization, float64)."""
    rng = np.random.default_rng(seed)
    out, k = 48, 768
    w, dense = random_weight(rng, ggml_type, out, k)
    gate, up = (np.asarray(jnp.asarray(random_x(rng, m, k, jnp.float32) * 0.5, dtype).astype(jnp.float32), np.float64)
                for _ in range(2))
    x, x_slack = swiglu_oracle(gate, up, dtype)
    gated = GatedInput(jnp.asarray(gate, dtype), jnp.asarray(up, dtype))
    got = np.asarray(qi.int8_quant_matmul(gated, w, out_dtype=jnp.float32, interpret=interpret), np.float64)
    levels = qi.levels_for(dtype)
    allowed = ((x_error_bound(x, levels) + x_slack) @ np.abs(dense).T + 1e-6 * (np.abs(x) @ np.abs(dense).T))
    worst = (np.abs(got - x @ dense.T) / allowed).max()
    assert worst <= 1, f"{ggml_type.name} gated x[{m},{k}] {jnp.dtype(dtype).name} seed {seed}: {worst:.3g} x bound"


def test_gated_linear_forms_the_activation_in_the_int8_gemv(monkeypatch, seed, interpret):
    """ops.linear.gated_linear: with the int8 GEMV taking W (1..4 rows of a layer slice), no activation outside the
    kernels; past its rows, the activation formed by XLA and the float kernels'
    product (its tensor-core regime: W decoded to bf16, within 2^-8 of each product); both within their bounds of
    numpy's activation times gguf's dequantization. Compiled on a GPU: interpreted there, XLA compiles the kernel's
    body and drops its rounding to bf16 (excess precision, XLA:GPU's default: on an H200, 581 of 1,024 words of x
    differed from those of the activation formed first, none with --xla_allow_excess_precision=false; 3-4x the
    bound here)."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: interpret)
    out, k, layers = 32, 512, 2
    pairs = [random_weight(rng, T.IQ4_XS, out, k) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in pairs])
    layer = int(rng.integers(0, layers))
    weight, dense = LayerSlice(stacked, jnp.int32(layer)), pairs[layer][1]
    for rows in (2, 5):
        gate, up = (jnp.asarray(random_x(rng, rows, k, jnp.float32) * 0.5, jnp.bfloat16) for _ in range(2))
        jaxpr = jax.make_jaxpr(lambda g, u: linear_mod.gated_linear(g, u, weight))(gate, up)
        outside = [e.primitive.name for e in jaxpr.eqns if e.primitive.name == "logistic"]
        int8 = rows <= qi.MAX_ROWS
        assert ("name=int8_gemv_iq4_xs" in str(jaxpr)) == int8 and bool(outside) != int8, f"{rows} rows"
        x, x_slack = swiglu_oracle(np.asarray(gate, np.float64), np.asarray(up, np.float64), jnp.bfloat16)
        got = np.asarray(linear_mod.gated_linear(gate, up, weight, jnp.float32), np.float64)
        bound, rounding = (x_error_bound(x, 2), 1e-6) if int8 else (0, 2.0**-8)
        allowed = (bound + x_slack) @ np.abs(dense).T + rounding * (np.abs(x) @ np.abs(dense).T)
        worst = (np.abs(got - x @ dense.T) / allowed).max()
        assert worst <= 1, f"gated_linear, {rows} rows, seed {seed}: {worst:.3g} x bound"


# How far a float32 evaluation of x * rsqrt(sum_sq / K + eps) * (1 + w) may be from the exact value of its float32
# inputs, relative: a division, an rsqrt (GPUs' are within 2 units in the last place) and two products.
NORM_EVAL_ERROR = 8 * 2.0**-24
EPS = 1e-6


def random_norm(rng, m: int, k: int, layers: int):
    """A zero-centred RMS norm's inputs: the residual x [m, k] float32, its row sums of squares [m] (float32 of
    numpy's float64), and norm weights [layers, k] float32 around zero (some below -1: negative scales)."""
    x = np.asarray(random_x(rng, m, k, jnp.float32), np.float64)
    sum_sq = np.asarray((x * x).sum(-1), np.float32).astype(np.float64)
    weights = np.asarray(rng.standard_normal((layers, k)) * 0.6, np.float32).astype(np.float64)
    return x, sum_sq, weights


@by_name
@pytest.mark.parametrize("m,dtype", [(1, jnp.float32), (2, jnp.bfloat16), (4, jnp.float32)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_int8_gemv_forms_a_normed_input(ggml_type, m, dtype, seed, interpret):
    """A NormedInput (an RMS norm's output, unformed, its weight read from a stack at a layer): the quantization
    kernel forms x * rsqrt(sum_sq / K + eps) * (1 + w) rounded to its dtype, so the product is that times W within
    x's quantization bound (numpy's norm in float64, gguf's dequantization)."""
    rng = np.random.default_rng(seed)
    out, k, layers = 48, 768, 3
    w, dense = random_weight(rng, ggml_type, out, k)
    x, sum_sq, weights = random_norm(rng, m, k, layers)
    layer = int(rng.integers(1, layers))  # not the first: reading the wrong layer must show
    exact = x / np.sqrt(sum_sq[:, None] / k + EPS) * (1 + weights[layer])
    normed, slack = rounding_oracle(exact, dtype, NORM_EVAL_ERROR)
    deferred = NormedInput(jnp.asarray(x, jnp.float32), jnp.asarray(sum_sq, jnp.float32),
                           jnp.asarray(weights, jnp.float32), jnp.int32(layer), jnp.dtype(dtype), EPS)
    got = np.asarray(qi.int8_quant_matmul(deferred, w, out_dtype=jnp.float32, interpret=interpret), np.float64)
    allowed = ((x_error_bound(normed, qi.levels_for(dtype)) + slack) @ np.abs(dense).T
               + 1e-6 * (np.abs(normed) @ np.abs(dense).T))
    worst = (np.abs(got - normed @ dense.T) / allowed).max()
    assert worst <= 1, f"{ggml_type.name} normed x[{m},{k}] {jnp.dtype(dtype).name} seed {seed}: {worst:.3g} x bound"


def gated_norm_oracle(x, gate, weight, head: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(w * rms_norm(x) * silu(gate) per head of `head` values, in float64 by numpy with x's dtype's roundings where
    the reference rounds (after the norm, after the weight, at the end), per value how far an evaluation may be from
    it): in float32 a few units of its last place; in a 16-bit dtype a step of it at each of the three roundings,
    where a float32 evaluation may land on either side of a boundary."""
    heads = x.reshape(*x.shape[:-1], -1, head)
    normed = rounded_to(heads / np.sqrt((heads * heads).mean(-1, keepdims=True) + EPS), dtype)
    y = rounded_to(rounded_to(weight, dtype) * normed, dtype)
    out = swiglu_oracle(gate.reshape(heads.shape), y, dtype)[0].reshape(x.shape)  # silu(gate) * y, rounded
    relative = 2.0**-20 if jnp.dtype(dtype) == jnp.float32 else 3 * 2.0**-8
    return out, relative * np.abs(out)


@by_name
@pytest.mark.parametrize("head,m,dtype", [(64, 1, jnp.float32), (128, 2, jnp.bfloat16), (256, 4, jnp.float32),
                                          (32, 1, jnp.float32)], ids=lambda v: getattr(v, "__name__", str(v)))
def test_int8_gemv_forms_a_gated_normed_input(ggml_type, head, m, dtype, seed, interpret):
    """A GatedNormedInput (the DeltaNet's output norm per head, unformed, its weight read from a stack at a layer):
    the quantization kernel forms it from the blocks it loads where a head lies within a block and covers whole
    entries of the kernel's view (IQ4_XS: 64 values, the K-quants: 32), XLA before it elsewhere (a head of 32 for
    IQ4_XS: then the norm's rsqrt runs outside the kernels); either way the product is numpy's norm times gguf's
    dequantization within x's quantization bound."""
    rng = np.random.default_rng(seed)
    out, k, layers = 48, 512, 3
    w, dense = random_weight(rng, ggml_type, out, k)
    x = np.asarray(jnp.asarray(random_x(rng, m, k, jnp.float32), dtype).astype(jnp.float32), np.float64)
    gate = np.asarray(jnp.asarray(rng.standard_normal((m, k)) * 3, dtype).astype(jnp.float32), np.float64)
    weights = np.asarray(rng.standard_normal((layers, head)), np.float32).astype(np.float64)
    layer = int(rng.integers(1, layers))  # not the first: reading the wrong layer must show
    want, slack = gated_norm_oracle(x, gate, weights[layer], head, dtype)
    deferred = GatedNormedInput(jnp.asarray(x, dtype), jnp.asarray(gate, dtype), jnp.asarray(weights, jnp.float32),
                                jnp.int32(layer), EPS)

    def product(d):
        return qi.int8_quant_matmul(d, w, out_dtype=jnp.float32, interpret=interpret)

    in_kernel = head >= (64 if ggml_type == T.IQ4_XS else 32)
    jaxpr = jax.make_jaxpr(product)(deferred)
    assert ("rsqrt" in primitives_outside_kernels(jaxpr.jaxpr)) != in_kernel, f"head {head}"
    got = np.asarray(product(deferred), np.float64)
    allowed = ((x_error_bound(want, qi.levels_for(dtype)) + slack) @ np.abs(dense).T
               + 1e-6 * (np.abs(want) @ np.abs(dense).T))
    worst = (np.abs(got - want @ dense.T) / allowed).max()
    assert worst <= 1, (f"{ggml_type.name} gated norm x[{m},{k}] head {head} {jnp.dtype(dtype).name} seed {seed}: "
                        f"{worst:.3g} x bound")


def primitives_outside_kernels(jaxpr) -> set[str]:
    """The primitives of a jaxpr and of the jaxprs nested in it (jit calls), not looking inside Pallas kernels."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                names |= primitives_outside_kernels(sub)
    return names


def test_linear_many_forms_a_deferred_norm_in_the_int8_gemv(monkeypatch, seed, interpret):
    """ops.linear.linear_many on a norm handed over unformed (ZeroCenteredRMSNorm.deferred) with a layer slice of its
    stacked weight: at 1..4 rows the norm's rsqrt and scaling run in the GEMV's quantization kernel (none outside the
    kernels), past them XLA forms it for the float kernels; both within their bounds of numpy's norm times gguf's
    dequantization."""
    from luxjax.layers.basic import ZeroCenteredRMSNorm

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: interpret)
    out, k, layers = 32, 512, 2
    pairs = [[random_weight(rng, T.IQ4_XS, out, k) for _ in range(layers)] for _ in range(2)]
    stacks = [jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in p]) for p in pairs]
    for rows in (3, 6):
        x, _, weights = random_norm(rng, rows, k, layers)
        layer = int(rng.integers(0, layers))
        index = jnp.int32(layer)

        def project(x):  # the norm's weight as a decode step's layer scan hands it over: a slice of its stack
            norm = ZeroCenteredRMSNorm(LayerSlice(jnp.asarray(weights, jnp.float32), index), EPS)
            return linear_mod.linear_many(norm.deferred(x, jnp.bfloat16), [LayerSlice(s, index) for s in stacks],
                                          jnp.float32)

        jaxpr = jax.make_jaxpr(project)(jnp.asarray(x, jnp.float32))
        int8 = rows <= qi.MAX_ROWS
        assert ("name=int8_gemv_iq4_xs" in str(jaxpr)) == int8, f"{rows} rows"
        assert ("rsqrt" in primitives_outside_kernels(jaxpr.jaxpr)) != int8, f"{rows} rows"
        got = project(jnp.asarray(x, jnp.float32))
        exact = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * (1 + weights[layer])
        normed, slack = rounding_oracle(exact, jnp.bfloat16, 2.0**-20)  # the float32 mean square too
        for y, p in zip(got, pairs):
            dense = p[layer][1]
            bound, rounding = (x_error_bound(normed, 2), 1e-6) if int8 else (0, 2.0**-8)
            allowed = (bound + slack) @ np.abs(dense).T + rounding * (np.abs(normed) @ np.abs(dense).T)
            worst = (np.abs(np.asarray(y, np.float64) - normed @ dense.T) / allowed).max()
            assert worst <= 1, f"deferred norm, {rows} rows, seed {seed}: {worst:.3g} x bound"


def test_split_linear_forms_a_deferred_gated_norm_in_the_int8_gemv(monkeypatch, seed, interpret):
    """ops.linear.split_linear_many (the DeltaNet's out_proj in bf16 mode) on GatedRMSNorm.deferred with a layer
    slice of its stacked weight, float32 x and gate: at 1..4 rows the norm runs in the int8 GEMV's quantization kernel
    (no rsqrt outside the kernels), past them XLA forms it for the two bf16 parts' product (the float kernels' tensor-
    core regime: W decoded to bf16, within 2^-8 of each product); both within their bounds of numpy's norm times
    gguf's dequantization."""
    from luxjax.layers.basic import GatedRMSNorm

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: interpret)
    out, head, k, layers = 32, 128, 512, 2
    pairs = [random_weight(rng, T.IQ4_XS, out, k) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in pairs])
    weights = np.asarray(rng.standard_normal((layers, head)), np.float32).astype(np.float64)
    layer = int(rng.integers(0, layers))
    index = jnp.int32(layer)
    for rows in (2, 6):
        x = np.asarray(random_x(rng, rows, k, jnp.float32), np.float64)
        gate = np.asarray(jnp.asarray(rng.standard_normal((rows, k)) * 3, jnp.float32), np.float64)

        def project(x, gate):  # the weights as a decode step's layer scan hands them over: slices of their stacks
            norm = GatedRMSNorm(LayerSlice(jnp.asarray(weights, jnp.float32), index), EPS)
            return linear_mod.split_linear_many(norm.deferred(x, gate), [LayerSlice(stacked, index)], (0,))[0]

        args = (jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32))
        jaxpr = jax.make_jaxpr(project)(*args)
        int8 = rows <= qi.MAX_ROWS
        assert ("name=int8_gemv_iq4_xs" in str(jaxpr)) == int8, f"{rows} rows"
        assert ("rsqrt" in primitives_outside_kernels(jaxpr.jaxpr)) != int8, f"{rows} rows"
        want, slack = gated_norm_oracle(x, gate, weights[layer], head, jnp.float32)
        dense = pairs[layer][1]
        bound, rounding = (x_error_bound(want, 3), 1e-6) if int8 else (0, 2.0**-8)  # W decoded to bf16 there
        allowed = (bound + slack) @ np.abs(dense).T + rounding * (np.abs(want) @ np.abs(dense).T)
        worst = (np.abs(np.asarray(project(*args), np.float64) - want @ dense.T) / allowed).max()
        assert worst <= 1, f"deferred gated norm, {rows} rows, seed {seed}: {worst:.3g} x bound"


@by_name
@pytest.mark.parametrize("m,splits", [(1, None), (2, 4), (4, 1)])
def test_int8_gemv_reads_the_chosen_layer(ggml_type, m, splits, seed, interpret):
    rng = np.random.default_rng(seed)
    layers, out, k = int(rng.integers(2, 4)), 32, 1024
    pairs = [random_weight(rng, ggml_type, out, k) for _ in range(layers)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in pairs])
    layer = int(rng.integers(0, layers))
    x = random_x(rng, m, k, jnp.float32)
    bs = qi.BlockSizes(16, 1, 4, splits=splits)  # one block per step: each split runs several steps
    got = qi.int8_quant_matmul(x, stacked, jnp.int32(layer), block_sizes=bs, interpret=interpret)
    check_against_bound(got, x, pairs[layer][1], 3,
                        f"{ggml_type.name} layer {layer}/{layers} m={m} splits={splits} seed {seed}")


# (rows of x, x dtype, rows of each weight, block sizes): weights of unequal rows side by side; the streaming options
# (the next step's planes loaded ahead, all or the small ones, several row tiles per program, K splits, a row
# tile's rows in parts, the codes loaded as one run a row, the small planes in pieces: IQ4_XS's scales_l in two and,
# at one warp, in four) on whole-tile weights (x's 1,024 values are 4 blocks: one block per K step and no K split
# gives each program 4 steps a row tile)
MANY_CASES = [(1, jnp.float32, (48, 16, 80), None), (4, jnp.bfloat16, (32, 16), None),
              (2, jnp.float32, (32, 64), qi.BlockSizes(16, 1, 4, prefetch=True, splits=1)),
              (1, jnp.bfloat16, (64, 32), qi.BlockSizes(16, 1, 4, prefetch=True, splits=1, tiles=2)),
              (3, jnp.float32, (32, 32, 96), qi.BlockSizes(16, 1, 8, splits=2, tiles=2)),
              (1, jnp.bfloat16, (16, 48), qi.BlockSizes(16, 2, 4, prefetch=True, splits=2)),
              (1, jnp.bfloat16, (32, 48), qi.BlockSizes(16, 1, 8, prefetch="small", splits=1)),
              (4, jnp.float32, (32, 64), qi.BlockSizes(16, 1, 4, prefetch="small", splits=2, tiles=2)),
              (2, jnp.bfloat16, (48, 16), qi.BlockSizes(16, 2, 8, prefetch="small", splits=1)),
              (2, jnp.bfloat16, (32, 16), qi.BlockSizes(16, 1, 4, parts=2)),
              (1, jnp.float32, (48, 16), qi.BlockSizes(16, 2, 8, prefetch=True, splits=1, parts=2)),
              (3, jnp.float32, (32, 64), qi.BlockSizes(16, 1, 4, prefetch="small", splits=2, tiles=2, parts=4)),
              (2, jnp.bfloat16, (32, 16), qi.BlockSizes(16, 2, 4, flat=True)),
              (1, jnp.float32, (48, 16), qi.BlockSizes(16, 2, 8, prefetch=True, splits=1, parts=2, flat=True)),
              (4, jnp.bfloat16, (32, 64), qi.BlockSizes(16, 1, 4, prefetch="small", splits=2, tiles=2, flat=True)),
              (2, jnp.bfloat16, (32, 16), qi.BlockSizes(16, 2, 4, split_small=True)),
              (1, jnp.float32, (48, 16), qi.BlockSizes(16, 2, 1, prefetch="small", splits=1, flat=True,
                                                       split_small=True)),
              # LOADS_AT_ROWS' tiles at 4 rows: gate + up's, the DeltaNet's four's, q + k + v's
              (4, jnp.bfloat16, (32, 16), qi.BlockSizes(16, 4, 8, prefetch="small", flat=True, split_small=True)),
              (4, jnp.float32, (48, 16), qi.BlockSizes(16, 4, 8, flat=True, split_small=True)),
              (4, jnp.bfloat16, (16, 32), qi.BlockSizes(16, 4, 8, prefetch="small", split_small=True)),
              # TWO_PARTS_BELOW_MANY_TILES' tiles at one bf16 row (q + k + v's)
              (1, jnp.bfloat16, (32, 16, 16), qi.BlockSizes(16, 4, 8, parts=2))]


@by_name
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("m,dtype,outs,bs", MANY_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_int8_gemv_many_weights_in_one_launch(ggml_type, m, dtype, outs, bs, stacked, seed, interpret):
    """int8_quant_matmul_many: each output is x times its own weight (of the chosen layer when stacked), within x's
    quantization bound of gguf's dequantization; unstacked weights are padded to whole row tiles, not refused."""
    rng = np.random.default_rng(seed)
    k, layers = 1024, int(rng.integers(2, 4))
    layer = int(rng.integers(0, layers))
    pairs = [[random_weight(rng, ggml_type, out, k) for _ in range(layers)] for out in outs]
    x = random_x(rng, m, k, dtype)
    if stacked:
        ws = tuple(jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in per_layer]) for per_layer in pairs)
        got = qi.int8_quant_matmul_many(x, ws, jnp.int32(layer), block_sizes=bs, out_dtype=jnp.float32,
                                        interpret=interpret)
    else:
        if bs is not None and bs.tiles > 1:
            outs = tuple(out + 8 for out in outs)  # odd rows, padded to whole tiles of tiles * block_n
            pairs = [[random_weight(rng, ggml_type, out, k) for _ in range(layers)] for out in outs]
        got = qi.int8_quant_matmul_many(x, tuple(per_layer[layer][0] for per_layer in pairs), block_sizes=bs,
                                        out_dtype=jnp.float32, interpret=interpret)
    assert len(got) == len(outs)
    if stacked and (bs is None or bs.splits == 1):  # each weight's own array: nothing outside the kernels cuts them
        jaxpr = jax.make_jaxpr(lambda x, ws: qi.int8_quant_matmul_many(x, ws, jnp.int32(layer), block_sizes=bs,
                                                                       interpret=interpret))(x, ws)
        assert "slice" not in primitives_outside_kernels(jaxpr.jaxpr), "outputs sliced out of one array"
    for i, (y, per_layer) in enumerate(zip(got, pairs)):
        check_against_bound(y, x, per_layer[layer][1], qi.levels_for(dtype),
                            f"{ggml_type.name} weight {i} of {outs} ({'stacked' if stacked else 'unstacked'}, "
                            f"layer {layer}), "
                            f"x[{m}] {jnp.dtype(dtype).name}, {bs}, seed {seed}")


def test_linear_many_takes_one_int8_launch_per_format(monkeypatch, seed):
    """linear_many on packed layer slices of one layer: one int8 GEMV launch per format (two IQ4_XS weights in one,
    the Q6_K weight between them in its own), outputs in order within the bound; more rows than the int8 GEMV
    takes (from 5) go to the float kernels; slices of different layer indices are
    not put in one launch."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    k, layers = 512, 3
    layer = jnp.int32(int(rng.integers(0, layers)))
    pairs = {(t, out): [random_weight(rng, t, out, k) for _ in range(layers)]
             for t, out in ((T.IQ4_XS, 48), (T.Q6_K, 32), (T.IQ4_XS, 32))}
    stack = lambda ps: jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in ps])  # noqa: E731
    ws = [LayerSlice(stack(ps), layer) for ps in pairs.values()]
    denses = [ps[int(layer)][1] for ps in pairs.values()]
    for rows in (1, 3, 5):
        x = random_x(rng, rows, k, jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: linear_mod.linear_many(x, ws))(x))
        int8 = {T.IQ4_XS: rows <= 4, T.Q6_K: rows <= 4}
        for name, want in (("int8_gemv_iq4_xs", int8[T.IQ4_XS]), ("int8_gemv_q6_k", int8[T.Q6_K]),
                           ("quant_matmul_q6_k", not int8[T.Q6_K]), ("quant_matmul_iq4_xs", not int8[T.IQ4_XS])):
            assert jaxpr.count(f"name={name}") == want, f"{rows} rows: {jaxpr.count(f'name={name}')} of {name}"
        got = linear_mod.linear_many(x, ws)
        for i, (ggml_type, dense) in enumerate(zip([t for t, _ in pairs], denses)):
            if int8[ggml_type]:
                check_against_bound(got[i], x, dense, 3, f"linear_many weight {i}, {rows} rows, seed {seed}")
            else:  # the float kernels multiply x exactly
                x64 = np.asarray(x, np.float64)
                error = np.abs(np.asarray(got[i], np.float64) - x64 @ dense.T) / (np.abs(x64) @ np.abs(dense).T)
                assert error.max() < 1e-5, f"weight {i}, {rows} rows: {error.max():.3g}"
    other = [ws[0], LayerSlice(ws[2].stacked, jnp.int32(int(layer)))]  # an equal index, but not the same array
    jaxpr = str(jax.make_jaxpr(lambda x: linear_mod.linear_many(x, other))(random_x(rng, 1, k, jnp.float32)))
    assert jaxpr.count("name=int8_gemv_iq4_xs") == 2, "slices of separately given layer indices: a launch each"


def test_linear_takes_the_int8_gemv_for_decode_rows(monkeypatch, seed):
    """With Pallas chosen on a platform where the int8 GEMV runs (here: interpreted), linear() on IQ4_XS sends 1..4
    rows to it (a stacked layer slice and a plain weight) and more rows elsewhere; values within the bound."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    pairs = [random_weight(rng, T.IQ4_XS, 32, 512) for _ in range(2)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[w for w, _ in pairs])
    for rows, weight, dense in [(1, LayerSlice(stacked, jnp.int32(1)), pairs[1][1]), (4, pairs[0][0], pairs[0][1]),
                                (5, pairs[0][0], pairs[0][1])]:
        x = random_x(rng, rows, 512, jnp.float32)
        jaxpr = str(jax.make_jaxpr(lambda x: linear_mod.linear(x, weight))(x))
        assert ("int8_gemv_iq4_xs" in jaxpr) == (rows <= qi.MAX_ROWS), f"{rows} rows"
        if rows <= qi.MAX_ROWS:
            check_against_bound(linear_mod.linear(x, weight), x, dense, 3, f"linear, {rows} rows, seed {seed}")


def test_int8_gemv_refuses_what_it_cannot_take():
    w, _ = random_weight(np.random.default_rng(0), T.IQ4_XS, 16, 256)
    assert qi.supported((4, 256), w, stacked=False) and not qi.supported((5, 256), w, stacked=False)
    with pytest.raises(ValueError, match="x"):
        qi.int8_quant_matmul(jnp.zeros((5, 256)), w, interpret=True)
    with pytest.raises(ValueError, match="parts"):
        qi.int8_quant_matmul(jnp.zeros((1, 256)), w, block_sizes=qi.BlockSizes(16, 1, 4, parts=3), interpret=True)
    for other in (T.Q8_0, T.Q4_0):  # Q8_0: its float reduce measured as fast
        raw = np.zeros((16, 256 // 32 * (34 if other == T.Q8_0 else 18)), np.uint8)
        refused = QuantizedTensor.from_gguf(raw, other, (16, 256))
        assert not qi.supported((1, 256), refused, stacked=False), other.name
        with pytest.raises(NotImplementedError):
            qi.int8_quant_matmul(jnp.zeros((1, 256)), refused, interpret=True)
    q4, _ = random_weight(np.random.default_rng(0), T.Q4_K, 16, 256)
    assert not qi.supported_many((1, 256), (w, q4), stacked=False), "one format per launch"
    with pytest.raises(NotImplementedError, match="one format"):
        qi.int8_quant_matmul_many(jnp.zeros((1, 256)), (w, q4), interpret=True)
    q6, _ = random_weight(np.random.default_rng(0), T.Q6_K, 16, 256)
    assert qi.supported((4, 256), q6, stacked=False) and not qi.supported((5, 256), q6, stacked=False), \
        "Q6_K goes to the int8 GEMV for up to 4 rows (where it measured faster than the float reduce)"
    wide, _ = random_weight(np.random.default_rng(0), T.IQ4_XS, 16, 512)
    assert not qi.supported_many((1, 256), (w, wide), stacked=False), "every weight's in is x's"
    with pytest.raises(ValueError, match="every W"):
        qi.int8_quant_matmul_many(jnp.zeros((1, 256)), (w, wide), interpret=True)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), w)
    assert qi.supported_many((1, 256), (stacked,), stacked=True)
    deeper = jax.tree.map(lambda a: jnp.stack([a, a, a]), w)
    assert not qi.supported_many((1, 256), (stacked, deeper), stacked=True), "one depth of stacking"


def primitives_within(jaxpr) -> set[str]:
    """The primitives of a jaxpr and of every jaxpr nested in it, Pallas kernels' bodies included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= primitives_within(sub)
    return names


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_one_row_multiplies_16_bit_values(m, dtype, seed, interpret):
    """x's first two levels reach the GEMV kernel as 16-bit values, multiplied by dot2, at one row of x only
    (qi.PAIRED_ROWS: measured faster end to end at one row and slower at four), and its result stays within x's
    quantization bound either way (the values are checked for every format in the tests above)."""
    rng = np.random.default_rng(seed)
    w, dense = random_weight(rng, T.IQ4_XS, 32, 512)
    x = random_x(rng, m, 512, dtype)
    project = functools.partial(qi.int8_quant_matmul, w=w, out_dtype=jnp.float32, interpret=interpret)
    within = primitives_within(jax.make_jaxpr(project)(x).jaxpr)
    assert ("luxjax_dot2" in within) == (m == 1), f"{m} rows: dot2 {'missing' if m == 1 else 'taken'}"
    # dot4 for float32's third level at one row, for every level at more
    assert "luxjax_dot4" in within or m == 1 and dtype == jnp.bfloat16
    check_against_bound(project(x), x, dense, qi.levels_for(dtype), f"{m} rows {jnp.dtype(dtype).name} seed {seed}")


@by_name
def test_default_tiles_below_one_wave(ggml_type):
    """BlockSizes.get_default: products of fewer 16-row tiles than one wave of programs (the 27B's 5,120 outputs)
    take the format's FEW_TILES entry for their rows where its K splits divide the blocks, else the general tiles
    (which the K-quants never load ahead); the small planes load ahead exactly where SMALL_AHEAD names the format,
    regime and rows, and only for x in two levels; a row tile loads in two parts exactly where TWO_PARTS says, and
    in launches of fewer than MANY_TILES row tiles also where TWO_PARTS_BELOW_MANY_TILES says; its small planes
    in pieces exactly where LOADS_AT_ROWS says, and its codes as one run a row there only in launches of at least
    MANY_TILES row tiles."""
    def tiles(bs):
        return bs.block_n, bs.blocks_k, bs.num_warps, bs.splits

    def expected_prefetch(base, one_wave, rows, levels):
        small = levels == 2 and (ggml_type, one_wave, rows > 2) in qi.SMALL_AHEAD
        return "small" if small else base.prefetch

    few = qi.FEW_TILES[ggml_type]
    k_quant = ggml_type != T.IQ4_XS
    for rows, levels in itertools.product((1, 2, 3, 4), (2, 3)):
        got = qi.BlockSizes.get_default(rows, 5120, ggml_type, 68, levels)
        assert tiles(got) == tiles(few[rows > 2]), (rows, levels)
        assert got.prefetch == expected_prefetch(few[rows > 2], False, rows, levels), (rows, levels)
        wide = qi.BlockSizes.get_default(rows, 34816, ggml_type, 20, levels)
        assert tiles(wide) == (16, 4, 8, None)
        assert wide.prefetch == expected_prefetch(qi.BlockSizes(16, 4, 8, prefetch=False if k_quant else None),
                                                  True, rows, levels), (rows, levels)
        two_parts = (ggml_type, True, rows, levels)
        fewer = qi.BlockSizes.get_default(rows, 16 * (qi.MANY_TILES - 1), ggml_type, 20, levels)
        assert (wide.parts, fewer.parts, got.parts) == (
            2 if two_parts in qi.TWO_PARTS else 1,
            2 if two_parts in qi.TWO_PARTS | qi.TWO_PARTS_BELOW_MANY_TILES else 1, 1), (rows, levels)
        loads = (ggml_type, True, rows > 2) in qi.LOADS_AT_ROWS
        assert [(bs.split_small, bs.flat) for bs in (wide, fewer, got)] == [(loads, loads), (loads, False),
                                                                            (False, False)], (rows, levels)
    odd = qi.BlockSizes.get_default(1, 5120, ggml_type, 17, 3)  # 17 blocks: no whole K splits
    if few[0].splits:
        assert tiles(odd) == (16, 4, 8, None)
    narrow = qi.BlockSizes.get_default(1, 1024, ggml_type, 20)
    assert narrow.blocks_k == 1
    assert all((bs.prefetch is False) == k_quant for bs in (odd, narrow))


@pytest.mark.parametrize("setting,expected", [("on", True), ("off", False), ("", True)])
def test_int8_gemv_switch(monkeypatch, setting, expected):
    """LUXJAX_INT8_GEMV=off keeps decode GEMVs on exact x (the float reduce); anything but on/off is refused."""
    monkeypatch.setenv("LUXJAX_INT8_GEMV", setting)
    backend.int8_activations.cache_clear()
    try:
        assert qi.uses_int8(interpret=True) is expected
        monkeypatch.setenv("LUXJAX_INT8_GEMV", "fast")
        backend.int8_activations.cache_clear()
        with pytest.raises(ValueError, match="LUXJAX_INT8_GEMV"):
            qi.uses_int8(interpret=True)
    finally:
        backend.int8_activations.cache_clear()
