"""Decode attention (one query token per sequence) over a KV cache: flash-decoding with GQA and split-K.

One program per (batch, kv head, split) handles all q heads of its kv head, so each K/V row is read once. Each
program walks only the valid part of its split ([0, start[b]] cut into `num_splits` pieces), so the cost follows
the real lengths, not the cache size S. Partial results (unnormalised output, running max, running sum) are
merged by a small XLA step (decode_attention) or a kernel (gated_decode_attention).

The caches may come stacked over a decoder's scanned layers ([L, B, S, Hkv, D] and a layer index): the kernel then
reads its layer where it lies. A slice taken outside the kernel is copied first (an H200 decode profile of the
27B: a 4 MB copy of each of K and V per attention layer and step at batch 1).

gated_decode_attention is a gated attention layer's whole decode token after its projections (Qwen3.5's: q and k
normed and rotated, the token's k and v written to the caches in place, attention, the output times the sigmoid of
a gate) in three launches; in XLA these were ~20 small launches per layer. On an H200 (27B IQ4_XS, batch 1) that
took a decode step from 1,209 to 1,049 launches and 8.52 to 8.33 ms of kernels, 120.4 to 122.9 tokens/s
(benchmarks/RESULTS.md, session 25).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from luxjax.ops.deferred import NormedInput
from pallas_kernels.common import NEG, dot


# Most splits by default: on an H200 (27B shapes, B = 1, an 8,192-row cache, benchmarks/bench_kernels.py --only
# gated_decode --sweep) 64 splits took 4-5 us longer than 32 at 1,024 and 4,096 valid rows, the merge's extra chunks
# and programs costing more than the shorter walks save.
MAX_SPLITS = 32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_k: int = 64
    num_splits: int | None = None  # rounded up to a power of two; None: enough for ~2 programs per GPU core
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, batch: int, kv_heads: int, seq_len: int, head_dim: int) -> "BlockSizes":
        block_k = 64 if head_dim <= 128 else 32
        splits = max(1, min(-(-264 // (batch * kv_heads)), -(-seq_len // (4 * block_k)), MAX_SPLITS))
        return cls(block_k=block_k, num_splits=1 << (splits.bit_length() - 1))  # a power of two: _partials


def _decode_kernel(
    q_ref,  # [B, Hkv, block_h, D]  (q heads of one kv head, zero-padded to block_h rows)
    k_ref,  # [L, B, S, Hkv, D]: the caches of L layers
    v_ref,  # [L, B, S, Hkv, D]
    len_ref,  # [B] int32: number of visible cache rows (start + 1)
    layer_ref,  # [1] int32: the layer read
    o_ref,  # [B, Hkv, splits, block_h, D] float32, unnormalised
    m_ref,  # [B, Hkv, splits, block_h] float32, running max
    l_ref,  # [B, Hkv, splits, block_h] float32, running sum
    *,
    scale: float,
    block_k: int,
    num_splits: int,
):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_h, head_dim = q_ref.shape[2], q_ref.shape[3]
    n = len_ref[b]
    per_split = pl.cdiv(pl.cdiv(n, num_splits), block_k) * block_k
    lo = j * per_split
    hi = jnp.minimum(lo + per_split, n)
    q = q_ref[b, h]  # [block_h, D]
    layer = layer_ref[0]

    def body(i, carry):
        acc, m, l = carry
        first = lo + i * block_k
        idx = first + jnp.arange(block_k)
        valid = idx < hi
        k = plgpu.load(k_ref.at[layer, b, pl.ds(first, block_k), h, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[layer, b, pl.ds(first, block_k), h, :], mask=valid[:, None], other=0.0)
        s = dot(q, k, ((1,), (1,))) * scale  # [block_h, block_k]
        s = jnp.where(valid[None, :], s, NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return acc, m_new, l * corr + p.sum(axis=1)

    init = (jnp.zeros((block_h, head_dim), jnp.float32), jnp.full((block_h,), NEG, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), body, init)
    o_ref[b, h, j] = acc
    m_ref[b, h, j] = m
    l_ref[b, h, j] = l


def _check_caches(B: int, Hq: int, D: int, k_cache, v_cache):
    if k_cache.ndim != 5 or k_cache.shape[1] < B or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must be [(L,) >= B={B}, S, kv heads, D] alike")
    if Hq % k_cache.shape[3]:
        raise ValueError(f"{Hq=} q heads must be a multiple of {k_cache.shape[3]} kv heads")
    if D < 16 or D & (D - 1) or k_cache.shape[4] != D:
        raise ValueError(f"head dim {D=} must be a power of two >= 16 (Triton block shapes) and the caches'")


def _block_h(rep: int) -> int:
    """Rows of a program's q tile: its kv head's q heads, padded (tl.dot needs >= 16 rows)."""
    return max(16, pl.next_power_of_2(rep))


def _partials(qg, k_cache, v_cache, start, layer, *, scale: float, block_sizes: BlockSizes | None, interpret: bool,
              debug: bool):
    """The split-K partial results (o, m, l) of q grouped by kv head, qg [B, Hkv, block_h, D], over layer `layer`
    of the stacked caches [L, B, S, Hkv, D]."""
    B, Hkv, _, D = qg.shape
    S = k_cache.shape[2]
    bs = block_sizes or BlockSizes.get_default(B, Hkv, S, D)
    block_h = qg.shape[2]
    lengths = jnp.clip(start.astype(jnp.int32) + 1, 1, S)
    splits = pl.next_power_of_2(bs.num_splits or 1)  # so that the gated merge loads whole chunks of them
    kernel = functools.partial(_decode_kernel, scale=scale, block_k=bs.block_k, num_splits=splits)
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv, splits),
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, splits, block_h, D), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, splits, block_h), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, splits, block_h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="decode_attention",
    )(qg, k_cache, v_cache, lengths, jnp.reshape(layer, (1,)).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def decode_attention(q, k_cache, v_cache, start, *, layer=None, scale: float, block_sizes: BlockSizes | None = None,
                     interpret: bool = False, debug: bool = False):
    """q [B, 1, Hq, D]; k_cache, v_cache [Bc, S, Hkv, D], or stacked over layers [L, Bc, S, Hkv, D] with `layer`
    the one read (an int32 scalar), Bc >= B (sequence b reads their row b); start [B]: the query sees cache rows
    0..start[b]. Returns [B, 1, Hq, D] in q.dtype."""
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    B, T, Hq, D = q.shape
    if T != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {T=}")
    _check_caches(B, Hq, D, k_cache, v_cache)
    Hkv = k_cache.shape[3]
    rep = Hq // Hkv
    qg = jnp.pad(q.reshape(B, Hkv, rep, D), ((0, 0), (0, 0), (0, _block_h(rep) - rep), (0, 0)))
    o, m, l = _partials(qg, k_cache, v_cache, start, layer, scale=scale, block_sizes=block_sizes,
                        interpret=interpret, debug=debug)
    w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, Hkv, splits, block_h]; empty splits weigh 0
    out = (o * w[..., None]).sum(axis=2) / (l * w).sum(axis=2)[..., None]
    return out[:, :, :rep].reshape(B, 1, Hq, D).astype(q.dtype)


def rotary_fits(rotary_dim: int, head_dim: int) -> bool:
    """Whether gated_decode_attention rotates rotary_dim leading columns of a head: an even width whose halves are a
    power of two (Triton block shapes), within the head."""
    half = rotary_dim // 2
    return rotary_dim % 2 == 0 and 0 < half and half & (half - 1) == 0 and rotary_dim <= head_dim


def _normed_rotated(load, weight, cos, sin, *, width: int, rotary_dim: int, eps: float, dtype):
    """One head row's zero-centred RMS norm (NormedInput's form, rounded to dtype) and its rotary embedding on the
    leading rotary_dim columns (layers.rope.apply_rotary's rotate_half pairing, in dtype arithmetic):
    (the normed row [width], the rotated halves [rotary_dim / 2] each). load / weight / cos / sin: a column range
    (pl.ds) -> that part of the row, of the norm weight, of cos and sin."""
    whole = pl.ds(0, width)
    x = load(whole).astype(jnp.float32)
    inv_rms = NormedInput.inverse_rms(jnp.sum(x * x), width, eps)

    def normed(values, cols):
        return NormedInput.form(values, inv_rms, weight(cols), dtype)

    half = rotary_dim // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    x1, x2 = normed(load(lo), lo), normed(load(hi), hi)  # loaded again: Triton lowers no slicing of a loaded row
    c1, c2, s1, s2 = (f(cols).astype(dtype) for f in (cos, sin) for cols in (lo, hi))
    return normed(x, whole), x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


def _store_rotated(ref, at: tuple, parts, *, rotary_dim: int, where=None):
    """A normed, rotated row (_normed_rotated's parts) into ref's row at index `at` (all but the last axis): the
    rotated halves and, past rotary_dim, the normed row. where: a condition for the stores (pl.when)."""
    full, r1, r2 = parts
    half, width = rotary_dim // 2, full.shape[0]

    def store():
        ref[(*at, pl.ds(0, half))] = r1.astype(ref.dtype)
        ref[(*at, pl.ds(half, half))] = r2.astype(ref.dtype)
        if rotary_dim < width:
            plgpu.store(ref.at[(*at, pl.ds(0, width))], full.astype(ref.dtype), mask=jnp.arange(width) >= rotary_dim)

    if where is None:
        store()
    else:
        pl.when(where)(store)


def _inputs_kernel(
    ints_ref,  # [2] int32: the caches' layer, the norm weights' layer
    start_ref,  # [B] int32: the row this token goes to (tokens cached before it)
    active_ref,  # [B] int32: nonzero for the sequences taking this token
    q_gate_ref,  # [B, Hq, 2 * D]: per q head its query, then its output gate
    k_ref,  # [B, Hkv, D]
    v_ref,  # [B, Hkv, D]
    q_norm_ref,  # [Lp, D]
    k_norm_ref,  # [Lp, D]
    cos_ref,  # [B, rotary_dim] float32
    sin_ref,  # [B, rotary_dim] float32
    k_in_ref,  # [L, B, S, Hkv, D], aliased to k_cache_ref
    v_in_ref,  # [L, B, S, Hkv, D], aliased to v_cache_ref
    qg_ref,  # [B, Hkv, block_h, D]: out, the kv head's q heads normed and rotated, zero rows below them
    k_cache_ref,
    v_cache_ref,
    *,
    rotary_dim: int,
    eps: float,
):
    """Program (b, h, r): of kv head h of sequence b, q head r of its group (r < rep), or (r = rep) the token's k
    and v, written to the caches, and the group's zero rows below its q heads. A program per row: each is a chain of
    dependent round trips to memory (the row, its norm, the stores), so rows side by side finish sooner than rows one
    after another (one program per kv head took 4.9 us a layer on an H200)."""
    del k_in_ref, v_in_ref  # written through their aliases only
    b, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_h, D = qg_ref.shape[2], qg_ref.shape[3]
    rep = q_gate_ref.shape[1] // k_ref.shape[1]
    layer, param_layer, row = ints_ref[0], ints_ref[1], start_ref[b]
    cos = lambda cols: cos_ref[b, cols]  # noqa: E731
    sin = lambda cols: sin_ref[b, cols]  # noqa: E731
    shape = dict(width=D, rotary_dim=rotary_dim, eps=eps)

    @pl.when(r < rep)
    def _():
        parts = _normed_rotated(lambda cols: q_gate_ref[b, h * rep + r, cols],
                                lambda cols: q_norm_ref[param_layer, cols], cos, sin, dtype=qg_ref.dtype, **shape)
        _store_rotated(qg_ref, (b, h, r), parts, rotary_dim=rotary_dim)

    @pl.when(r == rep)
    def _():
        for pad in range(rep, block_h):
            qg_ref[b, h, pad, :] = jnp.zeros((D,), qg_ref.dtype)
        parts = _normed_rotated(lambda cols: k_ref[b, h, cols], lambda cols: k_norm_ref[param_layer, cols], cos,
                                sin, dtype=k_ref.dtype, **shape)
        writes = (active_ref[b] != 0) & (row < k_cache_ref.shape[2])  # idle slots and rows past the end: dropped
        _store_rotated(k_cache_ref, (layer, b, row, h), parts, rotary_dim=rotary_dim, where=writes)

        @pl.when(writes)
        def _():
            v_cache_ref[layer, b, row, h, :] = v_ref[b, h, :].astype(v_cache_ref.dtype)


MERGE_CHUNK = 16  # split-K partials the merge kernel loads at once


def _gated_merge_kernel(o_ref, m_ref, l_ref, q_gate_ref, out_ref, *, rep: int):
    """Program (b, hq): q head hq of sequence b: its split-K partials merged, times sigmoid(its gate). The splits
    (a power of two) are loaded MERGE_CHUNK at a time, each chunk's loads at once (one at a time, in a loop, the
    merge took 5.4 us at 16 splits on an H200: a round trip each)."""
    b, hq = pl.program_id(0), pl.program_id(1)
    h, r = jax.lax.div(hq, rep), jax.lax.rem(hq, rep)  # jnp's floor forms do not lower to Triton
    splits, D = o_ref.shape[2], o_ref.shape[4]
    chunk = min(splits, MERGE_CHUNK)

    def merge(c, carry):  # online over chunks: the running max, the weighted sums of o and l
        m, acc, total = carry
        js = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        m_c, l_c, o_c = m_ref[b, h, js, r], l_ref[b, h, js, r], o_ref[b, h, js, r, :]  # [chunk], [chunk, D]
        m_new = jnp.maximum(m, jnp.max(m_c))
        w = jnp.exp(m_c - m_new)  # empty splits (m = NEG) weigh 0
        old = jnp.exp(m - m_new)
        return m_new, acc * old + jnp.sum(o_c * w[:, None], axis=0), total * old + jnp.sum(l_c * w)

    init = (jnp.float32(NEG), jnp.zeros((D,), jnp.float32), jnp.float32(0.0))
    _, acc, total = jax.lax.fori_loop(0, splits // chunk, merge, init)
    dtype = out_ref.dtype
    gate = jax.nn.sigmoid(q_gate_ref[b, hq, pl.ds(D, D)].astype(jnp.float32)).astype(dtype)
    out_ref[b, hq, :] = (acc / total).astype(dtype) * gate


@functools.partial(jax.jit, static_argnames=("rotary_dim", "scale", "eps", "block_sizes", "interpret", "debug"))
def gated_decode_attention(q_gate, k, v, q_norm, k_norm, param_layer, cos, sin, k_cache, v_cache, layer, start,
                           active, *, rotary_dim: int, scale: float, eps: float,
                           block_sizes: BlockSizes | None = None, interpret: bool = False, debug: bool = False):
    """A gated attention layer's decode token from its projections, in three launches, the caches written where
    they lie: q_gate [B, Hq, 2 * D] (per q head its query, then its output gate), k, v [B, Hkv, D]; q and k get a
    zero-centred RMS norm (weights q_norm, k_norm [Lp, D] at `param_layer` of their stacks, eps) and the rotary
    embedding on their leading rotary_dim columns (cos, sin [B, rotary_dim] float32); the token's k and v go to row
    start[b] of layer `layer` of the caches [L, Bc, S, Hkv, D] (Bc >= B: sequence b is their row b, and rows from B
    on are left alone) for the active [B] sequences; the query attends to rows 0 .. start[b] (decode_attention's
    kernel) and its output is multiplied by sigmoid(gate).
    Returns (out [B, Hq, D] in q_gate's dtype, k_cache, v_cache), the caches aliased to the inputs.
    The same values as the XLA ops in that order (gated_decode_attention_reference), each rounded to the dtype
    where they round; in XLA the norms, rotary, cache writes, the q heads' padding, the partials' merge and the gate
    were ~20 small launches per attention layer and step."""
    B, Hq, two_d = q_gate.shape
    D = two_d // 2
    _check_caches(B, Hq, D, k_cache, v_cache)
    Hkv = k_cache.shape[3]
    if not rotary_fits(rotary_dim, D) or k.shape != (B, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"rotary_dim {rotary_dim} must be twice a power of two <= {D}; k {k.shape}, v {v.shape} "
                         f"must be [{B}, {Hkv}, {D}]")
    rep = Hq // Hkv
    block_h = _block_h(rep)
    qg, k_cache, v_cache = pl.pallas_call(
        functools.partial(_inputs_kernel, rotary_dim=rotary_dim, eps=eps),
        grid=(B, Hkv, rep + 1),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, block_h, D), q_gate.dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={10: 1, 11: 2},  # k_cache, v_cache
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        debug=debug,
        name="decode_attention_inputs",
    )(jnp.stack([layer, param_layer]).astype(jnp.int32), start.astype(jnp.int32), active.astype(jnp.int32), q_gate,
      k, v, q_norm, k_norm, cos.astype(jnp.float32), sin.astype(jnp.float32), k_cache, v_cache)
    o, m, l = _partials(qg, k_cache, v_cache, start, layer, scale=scale, block_sizes=block_sizes,
                        interpret=interpret, debug=debug)
    out = pl.pallas_call(
        functools.partial(_gated_merge_kernel, rep=rep),
        grid=(B, Hq),
        out_shape=jax.ShapeDtypeStruct((B, Hq, D), q_gate.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        debug=debug,
        name="decode_attention_gated_merge",
    )(o, m, l, q_gate)
    return out, k_cache, v_cache


def gated_decode_attention_reference(q_gate, k, v, q_norm, k_norm, param_layer, cos, sin, k_cache, v_cache, layer,
                                     start, active, *, rotary_dim: int, scale: float, eps: float):
    """gated_decode_attention by the XLA ops (luxjax.layers and luxjax.ops.attention), on arrays."""
    from luxjax.layers.rope import apply_rotary
    from luxjax.ops.attention import write_kv, xla_cached_attention
    from luxjax.ops.linear import LayerSlice

    def norm(x, weights):  # ZeroCenteredRMSNorm's, its weight at param_layer of the stack
        y = x.astype(jnp.float32)
        return NormedInput(y, jnp.sum(y * y, axis=-1), weights, param_layer, x.dtype, eps).value()

    D = k.shape[-1]
    q_gate = q_gate[:, None]  # [B, 1, Hq, 2D]
    q, gate = norm(q_gate[..., :D], q_norm), q_gate[..., D:]
    cos, sin = cos[:, None, :rotary_dim], sin[:, None, :rotary_dim]
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(norm(k[:, None], k_norm), cos, sin)
    valid = active[:, None]
    k_cache = write_kv(LayerSlice(k_cache, layer), k, start, valid).stacked  # in the stack, as the model's XLA path
    v_cache = write_kv(LayerSlice(v_cache, layer), v[:, None], start, valid).stacked
    out = xla_cached_attention(q, k_cache[layer], v_cache[layer], start, scale=scale)
    return (out * jax.nn.sigmoid(gate))[:, 0], k_cache, v_cache


def decode_attention_reference(q, k_cache, v_cache, start, *, scale: float):
    from luxjax.ops.attention import xla_cached_attention

    return xla_cached_attention(q, k_cache, v_cache, start, scale=scale)
