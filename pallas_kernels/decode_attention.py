"""Decode attention (one query token per sequence) over a KV cache: flash-decoding with GQA and split-K.

One program per (batch, kv head, split) handles all q heads of its kv head, so each K/V row is read once. Each
program walks only the valid part of its split ([0, start[b]] cut into `num_splits` pieces), so the cost follows
the real lengths, not the cache size S. Partial results (unnormalised output, running max, running sum) are
merged by a small XLA step.

The caches may come stacked over a decoder's scanned layers ([L, B, S, Hkv, D] and a layer index): the kernel then
reads its layer where it lies. A slice taken outside the kernel is copied first (an H200 decode profile of the
27B: a 4 MB copy of each of K and V per attention layer and step at batch 1).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import NEG, dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_k: int = 64
    num_splits: int | None = None  # None: enough splits to give ~2 programs per GPU core
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def get_default(cls, batch: int, kv_heads: int, seq_len: int, head_dim: int) -> "BlockSizes":
        block_k = 64 if head_dim <= 128 else 32
        splits = max(1, min(-(-264 // (batch * kv_heads)), -(-seq_len // (4 * block_k))))
        return cls(block_k=block_k, num_splits=splits)


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


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def decode_attention(q, k_cache, v_cache, start, *, layer=None, scale: float, block_sizes: BlockSizes | None = None,
                     interpret: bool = False, debug: bool = False):
    """q [B, 1, Hq, D]; k_cache, v_cache [B, S, Hkv, D], or stacked over layers [L, B, S, Hkv, D] with `layer` the
    one read (an int32 scalar); start [B]: the query sees cache rows 0..start[b]. Returns [B, 1, Hq, D] in
    q.dtype."""
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    B, T, Hq, D = q.shape
    if k_cache.ndim != 5 or k_cache.shape[1] != B or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches {k_cache.shape}, {v_cache.shape} must be [(L,) B={B}, S, kv heads, D] alike")
    S, Hkv = k_cache.shape[2], k_cache.shape[3]
    if T != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {T=}")
    if Hq % Hkv:
        raise ValueError(f"{Hq=} q heads must be a multiple of {Hkv=} kv heads")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D=} must be a power of two >= 16 (Triton block shapes)")
    bs = block_sizes or BlockSizes.get_default(B, Hkv, S, D)
    rep = Hq // Hkv
    block_h = max(16, pl.next_power_of_2(rep))  # tl.dot needs >= 16 rows
    qg = jnp.pad(q.reshape(B, Hkv, rep, D), ((0, 0), (0, 0), (0, block_h - rep), (0, 0)))
    lengths = jnp.clip(start.astype(jnp.int32) + 1, 1, S)
    splits = bs.num_splits or 1
    kernel = functools.partial(_decode_kernel, scale=scale, block_k=bs.block_k, num_splits=splits)
    o, m, l = pl.pallas_call(
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
    w = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, Hkv, splits, block_h]; empty splits weigh 0
    out = (o * w[..., None]).sum(axis=2) / (l * w).sum(axis=2)[..., None]
    return out[:, :, :rep].reshape(B, 1, Hq, D).astype(q.dtype)


def decode_attention_reference(q, k_cache, v_cache, start, *, scale: float):
    from luxjax.ops.attention import xla_cached_attention

    return xla_cached_attention(q, k_cache, v_cache, start, scale=scale)
