"""Block-diagonal (per image) bidirectional attention for the vision tower, flash style.

Equal segment ids must form contiguous runs (one run per image, -1 for padding). For each block of queries the
wrapper computes the key range spanned by the runs it touches, so a program reads only the keys of its own
images.

Triton tiles must be powers of two, so a head dim that is not one (72 for Qwen3.5's tower) is split into column
pieces (head_dim_pieces): the largest power of two <= D, then a tail window of the next power of two >= 16 over
the rest (72 -> 64 + 16 columns, not 128). Scores add the pieces' dot products; each piece keeps its own output
accumulator, and the pieces share the softmax's running max and sum (float32, base 2 with the scale folded in).
The kernel reads the unpadded q, k, v and writes the unpadded output: the tail window runs past column D (into
the next head's columns, or past the end of the array for the last head) and its loads and stores are masked to
columns < D. The arrays are viewed as [N, H * D] (a free reshape) so a window starts at h * D + offset: Pallas
rejects, at trace time, a window whose static start and size overrun a dimension of the ref, masked or not.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import NEG, dot

MIN_PIECE = 16  # narrowest Triton dot operand


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def get_default(cls, head_dim: int) -> "BlockSizes":
        if head_dim > 128:
            return cls(block_q=64, block_k=32, num_warps=8, num_stages=2)
        return cls(block_q=128, block_k=64, num_warps=8, num_stages=3)


def head_dim_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(first column, width) of the power-of-two column pieces that cover a head: one piece when head_dim is a
    power of two (at least MIN_PIECE wide), else the largest power of two <= head_dim and a tail of the next
    power of two >= MIN_PIECE over the remaining columns."""
    if head_dim <= MIN_PIECE:
        return ((0, MIN_PIECE),)
    main_width = 1 << (head_dim.bit_length() - 1)
    if main_width == head_dim:
        return ((0, main_width),)
    return ((0, main_width), (main_width, max(MIN_PIECE, pl.next_power_of_2(head_dim - main_width))))


def _vision_kernel(
    q_ref,  # [N, H * D]
    k_ref,  # [N, H * D]
    v_ref,  # [N, H * D]
    seg_ref,  # [N] int32, -1 = padding
    lo_ref,  # [num_q_blocks] int32: first key any query of the block can see
    hi_ref,  # [num_q_blocks] int32: one past the last such key
    clean_ref,  # [num_q_blocks, 2] int32: key blocks [first, end) that need no mask (_key_ranges)
    o_ref,  # [N, H * D]
    *,
    head_dim: int,
    pieces: tuple[tuple[int, int], ...],
    scale_log2: float,  # softmax scale * log2(e): the softmax runs in base 2
    block_q: int,
    block_k: int,
):
    i, h = pl.program_id(0), pl.program_id(1)
    N = q_ref.shape[0]

    def window(ref, first_row, num_rows, piece):
        first_column, width = piece
        return ref.at[pl.ds(first_row, num_rows), pl.ds(h * head_dim + first_column, width)]

    def mask(row_ok, piece):
        """Rows row_ok (None: all) and, for a window past the head's last column, columns < head_dim."""
        first_column, width = piece
        if first_column + width <= head_dim:
            return None if row_ok is None else row_ok[:, None]
        columns_ok = (first_column + jnp.arange(width) < head_dim)[None, :]
        return columns_ok if row_ok is None else row_ok[:, None] & columns_ok

    def load_pieces(ref, first_row, num_rows, row_ok):
        def load(piece):
            piece_mask = mask(row_ok, piece)
            if piece_mask is None:  # Triton takes no fill value without a mask
                return plgpu.load(window(ref, first_row, num_rows, piece))
            return plgpu.load(window(ref, first_row, num_rows, piece), mask=piece_mask, other=0.0)

        return [load(piece) for piece in pieces]

    rows = i * block_q + jnp.arange(block_q)
    row_ok = rows < N
    q_pieces = load_pieces(q_ref, i * block_q, block_q, row_ok)
    seg_q = plgpu.load(seg_ref.at[pl.ds(i * block_q, block_q)], mask=row_ok, other=-1)
    first_block = lo_ref[i] // block_k

    def body(kb, carry, masked: bool):
        """One block of keys; unmasked blocks (every key in the query block's image) skip the segment test."""
        accs, m, l = carry
        in_range = kb * block_k + jnp.arange(block_k) < N if masked else None
        k_pieces = load_pieces(k_ref, kb * block_k, block_k, in_range)
        v_pieces = load_pieces(v_ref, kb * block_k, block_k, in_range)
        qk = sum(dot(q, k, ((1,), (1,))) for q, k in zip(q_pieces, k_pieces)) * scale_log2  # [block_q, block_k]
        if masked:
            seg_k = plgpu.load(seg_ref.at[pl.ds(kb * block_k, block_k)], mask=in_range, other=-2)
            same = (seg_q[:, None] == seg_k[None, :]) & (seg_q[:, None] >= 0)
            qk = jnp.where(same, qk, NEG)
        m_new = jnp.maximum(m, qk.max(axis=1))
        p = jnp.exp2(qk - m_new[:, None])
        if masked:
            p = jnp.where(same, p, 0.0)
        corr = jnp.exp2(m - m_new)
        p_in = p.astype(v_pieces[0].dtype)
        accs = tuple(acc * corr[:, None] + dot(p_in, v, ((1,), (0,))) for acc, v in zip(accs, v_pieces))
        return accs, m_new, l * corr + p.sum(axis=1)

    masked_body = functools.partial(body, masked=True)
    carry = (tuple(jnp.zeros((block_q, width), jnp.float32) for _, width in pieces),
             jnp.full((block_q,), NEG, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    end_block = pl.cdiv(hi_ref[i], block_k)
    clean_first = jnp.clip(clean_ref[i, 0], first_block, end_block)
    clean_end = jnp.clip(clean_ref[i, 1], clean_first, end_block)
    carry = jax.lax.fori_loop(first_block, clean_first, masked_body, carry)
    carry = jax.lax.fori_loop(clean_first, clean_end, functools.partial(body, masked=False), carry)
    accs, _, l = jax.lax.fori_loop(clean_end, end_block, masked_body, carry)
    inv_l = 1.0 / jnp.where(l > 0, l, 1.0)  # padding rows: l = 0, acc = 0 -> 0
    for piece, acc in zip(pieces, accs):
        plgpu.store(window(o_ref, i * block_q, block_q, piece), (acc * inv_l[:, None]).astype(o_ref.dtype),
                    mask=mask(row_ok, piece))


def _key_ranges(segment_ids, block_q: int, block_k: int):
    """Per query block: [lo, hi), the keys from the start of its first query's run to the end of its last's; and
    [num_q_blocks, 2] key blocks [first, end) whose keys all share the image of all its queries, which need no
    segment mask (most of an image's blocks; none for a query block spanning images or padding)."""
    N = segment_ids.shape[0]
    pos = jnp.arange(N, dtype=jnp.int32)
    changes = segment_ids[1:] != segment_ids[:-1]
    run_start = jax.lax.cummax(jnp.where(jnp.concatenate([jnp.array([True]), changes]), pos, 0))
    run_end = jax.lax.cummin(jnp.where(jnp.concatenate([changes, jnp.array([True])]), pos + 1, N), reverse=True)
    first = jnp.arange(0, N, block_q, dtype=jnp.int32)
    last = jnp.minimum(first + block_q, N) - 1
    one_image = (run_start[first] == run_start[last]) & (segment_ids[first] >= 0)
    clean_first = -(-run_start[first] // block_k)
    clean_end = jnp.where(one_image, jnp.maximum(run_end[first] // block_k, clean_first), clean_first)
    return run_start[first], run_end[last], jnp.stack([clean_first, clean_end], axis=1)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def vision_attention(q, k, v, segment_ids, *, scale: float, block_sizes: BlockSizes | None = None,
                     interpret: bool = False, debug: bool = False):
    """q, k, v [N, H, D]; segment_ids [N] (contiguous runs, -1 = padding) -> [N, H, D] in q.dtype; padding
    rows are zero."""
    N, H, D = q.shape
    if segment_ids.shape != (N,):
        raise ValueError(f"segment_ids shape {segment_ids.shape} must be ({N},)")
    bs = block_sizes or BlockSizes.get_default(D)
    segment_ids = segment_ids.astype(jnp.int32)
    lo, hi, clean = _key_ranges(segment_ids, bs.block_q, bs.block_k)
    kernel = functools.partial(_vision_kernel, head_dim=D, pieces=head_dim_pieces(D),
                               scale_log2=scale * math.log2(math.e), block_q=bs.block_q, block_k=bs.block_k)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, bs.block_q), H),
        out_shape=jax.ShapeDtypeStruct((N, H * D), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="vision_attention",
    )(q.reshape(N, H * D), k.reshape(N, H * D), v.reshape(N, H * D), segment_ids, lo, hi, clean)
    return out.reshape(N, H, D)


def vision_attention_reference(q, k, v, segment_ids, *, scale: float):
    from luxjax.ops.attention import xla_block_diagonal_attention

    return xla_block_diagonal_attention(q, k, v, segment_ids, scale=scale)
