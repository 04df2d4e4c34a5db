"""Packed ggml weights (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS) decoded to a dense matrix by a Pallas kernel on Triton, for
prefill-sized products that then run on the vendor GEMM (cuBLAS / rocBLAS).

Why: a prefill is compute-bound, and the vendor GEMM on dense bf16 outruns a fused dequantize-GEMM (quant_matmul's
tiled regime) by far, so the packed weights are decoded first. XLA's own decode (luxjax.checkpoint.quant_formats,
table gathers and byte unpacking) reached ~2 TB/s on an H200: 33 ms of a 163 ms IQ4_XS prefill at the 27B shapes.
This kernel decodes with the fused kernel's decoders (quant_decode.py: byte permutes for the IQ4 codebook on CUDA)
and writes each value once.

The decoders emit the values of a block in their own order. `dequantize_in_kernel_order` writes them either as they
come (W's columns permuted as `x_in_kernel_order` permutes x's, so x_perm @ W_perm.T == x @ W.T: contiguous stores,
but x must be permuted, one copy of a [T, K] activation per product) or, with natural_order, each piece stored
at its own columns of W (no permute of x). Every format's pieces keep their free axes in W's order; where they fix
W's innermost axis (IQ4_XS: one piece per byte of a packed word), the pieces are interleaved in registers first so
the stores stay contiguous (stored one value in four, the kernel ran 4x slower). NATURAL_ORDER holds each format's
choice.

stacked: W stacked over layers, one layer read in place (a slice taken outside the kernel would be copied first).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops.linear import vendor_matmul
from pallas_kernels.fma import fma
from pallas_kernels.quant_decode import KERNEL_CONSTANTS, KERNEL_FORMATS, in_kernel_order, kernel_magic
from pallas_kernels.quant_matmul import WHOLE, RowView, blocks_per_step, uses_byte_perm

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # W rows per program
    blocks_k: int  # ggml blocks per program (lowered to a power of two dividing the blocks per row)
    num_warps: int = 4

    @classmethod
    def get_default(cls, ggml_type) -> BlockSizes:
        """The fastest of an H200 sweep at 17408 x 5120 and 5120 x 17408 (2026-12-01, benchmarks/RESULTS.md): 16 rows
        of one 256-value block for every K-quant and IQ4_XS, 8 rows of 32 blocks for Q8_0 (32-value blocks)."""
        return cls(8, 32) if KERNEL_FORMATS[ggml_type].block == 32 else cls(16, 1)


def _natural_index(x_perm: tuple[int, ...], index: tuple[int, ...]) -> tuple:
    """A piece's index into the permuted block (fixing its first len(index) axes) as an index into the natural
    block [*x_split]: the fixed axes at their places, the free ones whole (kept in order: see _free_axes_in_order)."""
    fixed = dict(zip(x_perm, index))
    return tuple(fixed.get(axis, slice(None)) for axis in range(len(x_perm)))


def _free_axes_in_order(x_perm: tuple[int, ...], fixed: int) -> bool:
    free = x_perm[fixed:]
    return list(free) == sorted(free)


def _kernel(*refs, names, stacked, pieces, x_perm, use_byte_perm, interpret):
    # [layer], constants, planes [(L,) rows, blocks, *plane] whole, o [BN, KB, *block: natural or permuted]
    refs = list(refs)
    layer_ref = refs.pop(0) if stacked else None
    const_ref, o_ref, plane_refs = refs[0], refs[-1], refs[1:-1]
    block_n, kb = o_ref.shape[:2]
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    blocks = pl.ds(pl.multiple_of(pl.program_id(1) * kb, kb), kb)
    prefix = (layer_ref[0], rows) if stacked else (rows,)
    planes = {name: RowView(ref, prefix) for name, ref in zip(names, plane_refs)}
    magic = kernel_magic(const_ref, use_byte_perm=use_byte_perm, interpret=interpret)
    for pc in pieces(planes, blocks, magic):
        terms = [(values * pc.scale if pc.offset is None else fma(values, pc.scale, pc.offset), index)
                 for values, index in pc.terms]
        if x_perm is not None:
            terms = _in_natural_order(terms, x_perm, inner=o_ref.ndim - 3)
        for w, index in terms:
            o_ref[(slice(None), slice(None), *index)] = w.astype(o_ref.dtype)


def _in_natural_order(terms, x_perm: tuple[int, ...], inner: int):
    """Terms (values, index into the permuted block) as (values, index into the natural block). Where the terms fix
    the natural block's innermost axis (IQ4_XS: one term per byte of a packed word), the terms that differ only there
    are interleaved into one (values [..., size]), so that stores stay contiguous instead of one value in `size`."""
    if not terms or not terms[0][1] or x_perm[len(terms[0][1]) - 1] != inner:
        return [(values, _natural_index(x_perm, index)) for values, index in terms]
    groups: dict[tuple, list] = {}
    for values, index in terms:
        groups.setdefault(index[:-1], []).append((index[-1], values))
    out = []
    for prefix, members in groups.items():
        members.sort(key=lambda m: m[0])
        assert [m[0] for m in members] == list(range(len(members))), "a group must cover the innermost axis"
        index = _natural_index(x_perm, (*prefix, slice(None)))
        out.append((_interleave([m[1] for m in members]), index))
    return out


def _interleave(tiles: list) -> jax.Array:
    """[t_0, ..., t_{n-1}] (n a power of two, equal shapes [...]) -> [..., n] with [..., j] = t_j, from two-way
    joins along a new last axis (the only concatenation Pallas lowers to Triton)."""
    if len(tiles) == 1:
        return tiles[0][..., None]
    evens, odds = _interleave(tiles[0::2]), _interleave(tiles[1::2])  # [..., n / 2]: t_{2a}, t_{2a+1}
    pairs = jnp.concatenate([evens[..., None], odds[..., None]], axis=-1)  # [..., n / 2, 2]: t_{2a+b}
    return pairs.reshape(*pairs.shape[:-2], 2 * pairs.shape[-2])


def x_in_kernel_order(x: jax.Array, ggml_type) -> jax.Array:
    """x [..., K] with its columns in the order of dequantize_in_kernel_order's (for a weight of `ggml_type`)."""
    return in_kernel_order(x, KERNEL_FORMATS[ggml_type]).reshape(x.shape)


# Whether dequantized_matmul writes W in its own column order (no permute of x), per format. Q8_0 and Q6_K: their
# kernel order is W's. H200 (benchmarks/RESULTS.md, 2026-12-01 session 13), 1,012-row products at 17408 x 5120:
# natural order 0.314 (IQ4_XS), 0.317 (Q4_K), 0.326 ms (Q5_K) against 0.322, 0.327, 0.332 with x permuted.
NATURAL_ORDER = {ggml_type: True for ggml_type in KERNEL_FORMATS}
assert all(_free_axes_in_order(f.x_perm, len(f.x_perm) - len(f.piece)) for f in KERNEL_FORMATS.values())

MIN_STACKED_ROWS = 4  # smallest row tile for a stacked weight (whose rows cannot be padded to the tile)


def supported(w: QuantizedTensor, dtype, *, stacked: bool = False) -> bool:
    """Whether the kernel decodes w (one layer's shape, 2-D) to `dtype`; stacked: in place, which needs a row tile
    of at least MIN_STACKED_ROWS dividing the rows."""
    if w.ggml_type not in KERNEL_FORMATS or w.ndim != 2 or jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
        return False
    return not stacked or _row_tile(BlockSizes.get_default(w.ggml_type).block_n, w.shape[0]) >= MIN_STACKED_ROWS


def _row_tile(block_n: int, rows: int) -> int:
    """block_n halved until it divides rows."""
    while rows % block_n:
        block_n //= 2
    return block_n


@functools.partial(jax.jit, static_argnames=("dtype", "natural_order", "block_sizes", "interpret"))
def dequantize_in_kernel_order(w: QuantizedTensor, layer: jax.Array | None = None, *, dtype=jnp.bfloat16,
                               natural_order: bool = False, block_sizes: BlockSizes | None = None,
                               interpret: bool = False) -> jax.Array:
    """W [out, in] (or layer `layer` of W stacked over layers: every plane [L, rows, blocks, ...], w.shape one
    layer's) as a dense [out, in] array of `dtype`, columns in kernel order, or W's own with natural_order (see
    the module doc)."""
    fmt = KERNEL_FORMATS.get(w.ggml_type)
    if fmt is None or w.ndim != 2:
        raise NotImplementedError(f"no dequantize kernel for {w.ggml_type.name} {w.shape}")
    n, k = w.shape
    blocks = k // fmt.block
    bs = block_sizes or BlockSizes.get_default(w.ggml_type)
    kb = blocks_per_step(blocks, bs.blocks_k)
    stacked = layer is not None
    if stacked:  # stacked planes cannot be padded (that would copy them): the row tile must divide the rows
        block_n, pad = _row_tile(bs.block_n, n), 0
        planes = {name: w.planes[name].reshape(-1, n, blocks, *shape) for name, shape in fmt.planes.items()}
    else:
        block_n, pad = bs.block_n, -n % bs.block_n
        planes = {name: jnp.pad(w.planes[name].reshape(n, blocks, *shape), [(0, pad)] + [(0, 0)] * (1 + len(shape)))
                  for name, shape in fmt.planes.items()}
    rows = n + pad
    block_shape = fmt.x_split if natural_order else tuple(fmt.x_split[a] for a in fmt.x_perm)  # one block
    kernel = functools.partial(_kernel, names=tuple(planes), stacked=stacked, pieces=fmt.pieces,
                               x_perm=fmt.x_perm if natural_order else None,
                               use_byte_perm=uses_byte_perm(interpret), interpret=interpret)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, blocks, *block_shape), dtype),
        grid=(rows // block_n, blocks // kb),
        in_specs=[WHOLE] * (len(planes) + 1 + stacked),
        out_specs=pl.BlockSpec((block_n, kb, *block_shape), lambda i, j: (i, j) + (0,) * len(block_shape)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret, name=f"dequantize_{w.ggml_type.name.lower()}",
    )(*([jnp.reshape(layer, (1,)).astype(jnp.int32)] if stacked else []),
      jnp.asarray(KERNEL_CONSTANTS, jnp.uint32), *planes.values())
    return out.reshape(rows, k)[:n]


def dequantized_matmul(x: jax.Array, w: QuantizedTensor, layer: jax.Array | None = None, *, out_dtype=None,
                       natural_order: bool | None = None, interpret: bool = False) -> jax.Array:
    """x [..., in] @ W.T (W[layer] when stacked) through the kernel's dense W in x's dtype and one vendor GEMM with
    float32 accumulation (full float32 products for float32 x), result in out_dtype (default x's). natural_order:
    W written in its own column order (default: NATURAL_ORDER for its format), else x permuted to the kernel's."""
    if natural_order is None:
        natural_order = NATURAL_ORDER[w.ggml_type]
    w_dense = dequantize_in_kernel_order(w, layer, dtype=x.dtype, natural_order=natural_order, interpret=interpret)
    xp = x if natural_order else x_in_kernel_order(x, w.ggml_type)
    return vendor_matmul(xp, w_dense, out_dtype or x.dtype)
