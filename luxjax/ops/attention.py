"""Attention ops: causal attention of a chunk of queries over a per-sequence KV cache, and the vision tower's
block-diagonal attention. Each public function picks the Pallas kernel (luxjax.ops.backend.use_pallas() and a
supported shape) or the XLA path below, which is also the kernels' test oracle; on CUDA the block-diagonal
attention takes cuDNN's fused attention where it runs (backend.cudnn_packed_attention).

q [B, T, Hq, D] (already rotated); k_cache, v_cache [B, S, Hkv, D] already holding this chunk's keys at
positions start[b] .. start[b]+T-1. Query t of sequence b sees cache slots 0 .. start[b]+t. GQA: query head h
uses kv head h // (Hq // Hkv). Softmax in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from luxjax.ops import backend
from luxjax.ops.linear import LayerSlice, layer_stacks, layer_value


def _pow2_head_dim(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def cached_attention(q, k_cache, v_cache, start, *, scale: float):
    """q [B, T, Hq, D] over k_cache, v_cache [B, S, Hkv, D] (or LayerSlices of stacked caches); query t sees cache
    rows 0 .. start[b]+t."""
    kv_heads = (k_cache.stacked if isinstance(k_cache, LayerSlice) else k_cache).shape[-2]
    if backend.use_pallas() and _pow2_head_dim(q.shape[-1]) and q.shape[2] % kv_heads == 0:
        if q.shape[1] == 1:
            from pallas_kernels.decode_attention import decode_attention

            if isinstance(k_cache, LayerSlice) and isinstance(v_cache, LayerSlice):
                return decode_attention(q, k_cache.stacked, v_cache.stacked, start, layer=k_cache.index,
                                        scale=scale, interpret=backend.interpret())
            return decode_attention(q, layer_value(k_cache), layer_value(v_cache), start, scale=scale,
                                    interpret=backend.interpret())
        from pallas_kernels.prefill_attention import prefill_attention

        return prefill_attention(q, layer_value(k_cache), layer_value(v_cache), start, scale=scale,
                                 interpret=backend.interpret())
    return xla_cached_attention(q, layer_value(k_cache), layer_value(v_cache), start, scale=scale)


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


def gated_decode_fused(k_cache, v_cache, heads: int, head_dim: int, rotary_dim: int) -> bool:
    """Whether gated_decode_attention takes a decode token: the caches as LayerSlices of their stacks, the Pallas
    kernels chosen, a power-of-two head dim, rotary halves of a power-of-two width, whole q head groups."""
    if not (isinstance(k_cache, LayerSlice) and isinstance(v_cache, LayerSlice) and backend.use_pallas()):
        return False
    from pallas_kernels.decode_attention import rotary_fits

    return _pow2_head_dim(head_dim) and rotary_fits(rotary_dim, head_dim) and heads % k_cache.stacked.shape[-2] == 0


def gated_decode_attention(q_gate, k, v, q_norm, k_norm, cos, sin, k_cache: LayerSlice, v_cache: LayerSlice, start,
                           active, *, scale: float, eps: float):
    """A gated attention layer's decode token (pallas_kernels.decode_attention.gated_decode_attention, where
    gated_decode_fused says so): q_gate [B, Hq, 2D] (per head the query, then the output gate), k, v [B, Hkv, D];
    q_norm, k_norm: the zero-centred RMS norms' weights [D], or LayerSlices of their stacks (read there); cos, sin
    [B, rotary_dim]; the caches' layer gets the token's k and v at row start[b] for the active [B] sequences.
    Returns (out [B, Hq, D] = attention * sigmoid(gate), k_cache, v_cache as LayerSlices of the new stacks)."""
    from pallas_kernels.decode_attention import gated_decode_attention as kernel

    stacks, param_layer = layer_stacks((q_norm, k_norm))
    out, ks, vs = kernel(q_gate, k, v, *stacks, param_layer, cos, sin, k_cache.stacked, v_cache.stacked,
                         k_cache.index, start, active, rotary_dim=cos.shape[-1], scale=scale, eps=eps,
                         interpret=backend.interpret())
    return out, k_cache.of(ks), v_cache.of(vs)


def write_kv(cache, new, start, valid):
    """cache [B, S, H, D] <- new [B, T, H, D] at rows start[b] .. start[b]+T-1 of each sequence, for the tokens
    with valid [B, T] set. Invalid tokens (chunk padding, idle slots) and rows past the end are dropped. A LayerSlice
    cache gets the rows written into its stack (returned as a LayerSlice of the new stack)."""
    if isinstance(cache, LayerSlice):
        B, T = new.shape[:2]  # the stack: [L, B, S, H, D]
        rows = jnp.where(valid, start[:, None] + jnp.arange(T)[None, :], cache.stacked.shape[2])
        return cache.scatter((jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)), rows), new)
    S = cache.shape[1]

    def one(c, n, s, v):
        rows = jnp.where(v, s + jnp.arange(n.shape[0]), S)
        return c.at[rows].set(n.astype(c.dtype), mode="drop")

    return jax.vmap(one)(cache, new, start, valid)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ImageSegments:
    """The images of a vision batch: ids [N] (one id per image, each a contiguous run of patches; -1 = padding),
    and the runs as cuDNN's packed-sequence attention takes them: lengths [M] and offsets [M + 1] of the first
    max_segments runs (-1 past the last), and fits: whether every run is among them. Computed once per tower call
    (image_segments), not once per layer."""

    ids: jax.Array
    lengths: jax.Array
    offsets: jax.Array
    fits: jax.Array | bool  # bool scalar; a Python bool where known when tracing (grid_segments)


MAX_PACKED_SEGMENTS = 32  # images per tower call on cuDNN's packed path; a call with more takes the kernel


def image_segments(ids: jax.Array, max_segments: int = MAX_PACKED_SEGMENTS) -> ImageSegments:
    """ImageSegments of patch image ids [N] (contiguous runs, -1 = padding)."""
    ids = jnp.asarray(ids, jnp.int32)
    starts_here = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]]) & (ids >= 0)
    ends_here = jnp.concatenate([ids[1:] != ids[:-1], jnp.ones((1,), bool)]) & (ids >= 0)
    starts = jnp.nonzero(starts_here, size=max_segments, fill_value=-1)[0].astype(jnp.int32)
    ends = jnp.nonzero(ends_here, size=max_segments, fill_value=-2)[0].astype(jnp.int32) + 1
    count = jnp.sum(starts_here)
    kept = jnp.minimum(count, max_segments)
    lengths = jnp.where(starts >= 0, ends - starts, -1)
    end_of_kept = jnp.where(kept > 0, ends[jnp.maximum(kept - 1, 0)], 0)
    offsets = jnp.where(jnp.arange(max_segments + 1) == kept, end_of_kept,
                        jnp.concatenate([starts, jnp.full((1,), -1, jnp.int32)]))
    return ImageSegments(ids, lengths, offsets, count <= max_segments)


def grid_segments(ids: jax.Array, sizes: jax.Array) -> ImageSegments:
    """ImageSegments of images laid back to back with patch counts sizes [M] (zeros only after the last image, as
    a bucketed image count pads it); ids [N] their patches' image ids. The image count is known when tracing, so
    `fits` is a Python bool: the attention path is then chosen without a runtime branch."""
    M = sizes.shape[0]
    present = sizes > 0
    count = jnp.sum(present)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    return ImageSegments(ids, jnp.where(present, sizes, -1).astype(jnp.int32),
                         jnp.where(jnp.arange(M + 1) <= count, offsets, -1), M <= MAX_PACKED_SEGMENTS)


def block_diagonal_attention(q, k, v, segments, *, scale: float):
    """Bidirectional attention confined to each image: q, k, v [N, H, D] -> [N, H, D]; segments: ImageSegments,
    or the patch image ids [N] themselves (contiguous runs; -1 = padding, whose rows come out zero).

    On CUDA cuDNN's fused attention takes the images packed in one call (backend.cudnn_packed_attention), else
    the Pallas kernel, else XLA."""
    ids = segments.ids if isinstance(segments, ImageSegments) else segments
    if _cudnn_applies(q) and backend.cudnn_packed_attention():
        packed = segments if isinstance(segments, ImageSegments) else image_segments(ids)
        return _branch(packed.fits, lambda: cudnn_block_diagonal_attention(q, k, v, packed, scale=scale),
                       lambda: _kernel_block_diagonal_attention(q, k, v, ids, scale=scale))
    return _kernel_block_diagonal_attention(q, k, v, ids, scale=scale)


def _branch(pred, if_true, if_false):
    """if_true() or if_false(): chosen while tracing where pred is a Python bool, else by lax.cond."""
    if isinstance(pred, bool):
        return if_true() if pred else if_false()
    return jax.lax.cond(pred, if_true, if_false)


def _cudnn_applies(q) -> bool:
    """cuDNN's fused attention: 16-bit inputs, head dim a multiple of 8 up to 128."""
    return q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128


def _kernel_block_diagonal_attention(q, k, v, segment_ids, *, scale: float):
    if backend.use_pallas() and q.shape[-1] <= 256:
        from pallas_kernels.vision_attention import vision_attention

        return vision_attention(q, k, v, segment_ids, scale=scale, interpret=backend.interpret())
    return xla_block_diagonal_attention(q, k, v, segment_ids, scale=scale)


def cudnn_block_diagonal_attention(q, k, v, segments: ImageSegments, *, scale: float):
    """block_diagonal_attention by cuDNN's fused attention, the images as packed sequences of one batch row
    (JAX's cuDNN binding: jax.nn.dot_product_attention exposes no packing). Needs segments.fits."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    lengths, offsets = segments.lengths[None], segments.offsets[None]
    out = cudnn.dot_product_attention(q[None], k[None], v[None], None, None, lengths, lengths, offsets, offsets,
                                      scale=scale, mask_type=cudnn.MaskType.PADDING)[0]
    return jnp.where((segments.ids >= 0)[:, None, None], out, 0).astype(q.dtype)


def xla_block_diagonal_attention(q, k, v, segment_ids, *, scale: float):
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jnp.einsum("nhd,mhd->hnm", q, k, preferred_element_type=jnp.float32, precision=precision) * scale
    same = (segment_ids[:, None] == segment_ids[None, :]) & (segment_ids[:, None] >= 0)
    scores = jnp.where(same[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(same[None], probs, 0.0).astype(v.dtype)  # padding rows: all -inf -> nan; zero them
    out = jnp.einsum("hnm,mhd->nhd", probs, v, preferred_element_type=jnp.float32, precision=precision)
    return out.astype(q.dtype)
