"""Attention ops: causal attention of a chunk of queries over a per-sequence KV cache, and the vision tower's
block-diagonal attention. Each public function picks the Pallas kernel (luxjax.ops.backend.use_pallas() and a
supported shape) or the XLA path below, which is also the kernels' test oracle.

q [B, T, Hq, D] (already rotated); k_cache, v_cache [B, S, Hkv, D] already holding this chunk's keys at
positions start[b] .. start[b]+T-1. Query t of sequence b sees cache slots 0 .. start[b]+t. GQA: query head h
uses kv head h // (Hq // Hkv). Softmax in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from luxjax.ops import backend


def _pow2_head_dim(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def cached_attention(q, k_cache, v_cache, start, *, scale: float):
    """q [B, T, Hq, D] over k_cache, v_cache [B, S, Hkv, D]; query t sees cache rows 0 .. start[b]+t."""
    if backend.use_pallas() and _pow2_head_dim(q.shape[-1]) and q.shape[2] % k_cache.shape[2] == 0:
        if q.shape[1] == 1:
            from pallas_kernels.decode_attention import decode_attention as kernel
        else:
            from pallas_kernels.prefill_attention import prefill_attention as kernel
        return kernel(q, k_cache, v_cache, start, scale=scale, interpret=backend.interpret())
    return xla_cached_attention(q, k_cache, v_cache, start, scale=scale)


def xla_cached_attention(q, k_cache, v_cache, start, *, scale: float):
    B, T, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    rep = Hq // Hkv
    qg = q.reshape(B, T, Hkv, rep, D)
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum(
        "btgrd,bsgd->bgrts", qg, k_cache, preferred_element_type=jnp.float32, precision=precision
    ) * scale
    query_pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    visible = jnp.arange(S)[None, None, :] <= query_pos[:, :, None]  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v_cache, preferred_element_type=jnp.float32, precision=precision)
    return out.reshape(B, T, Hq, D).astype(q.dtype)


def write_kv(cache, new, start, valid):
    """cache [B, S, H, D] <- new [B, T, H, D] at rows start[b] .. start[b]+T-1 of each sequence, for the tokens
    with valid [B, T] set. Invalid tokens (chunk padding, idle slots) and rows past the end are dropped."""
    S = cache.shape[1]

    def one(c, n, s, v):
        rows = jnp.where(v, s + jnp.arange(n.shape[0]), S)
        return c.at[rows].set(n.astype(c.dtype), mode="drop")

    return jax.vmap(one)(cache, new, start, valid)


def block_diagonal_attention(q, k, v, segment_ids, *, scale: float):
    """Bidirectional attention confined to equal segment ids (one id per image, each a contiguous run;
    -1 = padding). q, k, v [N, H, D] -> [N, H, D]."""
    if backend.use_pallas() and q.shape[-1] <= 256:
        from pallas_kernels.vision_attention import vision_attention

        return vision_attention(q, k, v, segment_ids, scale=scale, interpret=backend.interpret())
    return xla_block_diagonal_attention(q, k, v, segment_ids, scale=scale)


def xla_block_diagonal_attention(q, k, v, segment_ids, *, scale: float):
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("nhd,mhd->hnm", q, k, preferred_element_type=jnp.float32, precision=precision) * scale
    same = (segment_ids[:, None] == segment_ids[None, :]) & (segment_ids[:, None] >= 0)
    scores = jnp.where(same[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(same[None], probs, 0.0).astype(v.dtype)  # padding rows: all -inf -> nan; zero them
    out = jnp.einsum("hnm,mhd->nhd", probs, v, preferred_element_type=jnp.float32, precision=precision)
    return out.astype(q.dtype)
