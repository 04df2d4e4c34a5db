"""Fused dequantize-matmul y = x @ W.T for ggml-packed W (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS), Pallas on Triton.

One kernel, three regimes chosen by the rows M of x:
- M <= the format's reduce_rows (decode GEMV; 1 to 4 rows): each program owns BN output rows and streams their
  packed blocks once along K, decoding each weight once; per row of x, each sub-block's integer values times x are
  summed unscaled, then scaled once into a float32 register tile (offsets times the sub-block's sum of x,
  precomputed), reduced once at the end;
- up to 32 rows (skinny GEMM): the same stream, x padded to 16 rows (32 above 16: a float32 x's two bf16 parts,
  ops.linear.split_linear, as one launch), one tensor-core `pl.dot` per piece;
  in both, K is split over several programs where there are too few row tiles to fill the GPU (float32 partial
  sums, added by XLA);
- M >= 33 (prefill GEMM): a [BM, BN] output tile per program; W decoded to x's dtype (bf16) in registers.
Weights never leave their packed planes; the wrapper only reshapes them (free) and permutes x into the order
the decoders emit values (quant_decode.py). float32 x uses exact float32 products (precision HIGHEST).
stacked_quant_matmul is the same kernel on a weight stacked over layers, reading one layer in place (decode);
quant_matmul_many runs several weights of one format (the projections of one input) as one launch.

The decode GEMV is bound by instruction issue, not by memory (an H200 profile: 81% of issue slots busy, 28% of
memory throughput), so the decoders count instructions: fused multiply-adds (pallas_kernels/fma.py), masks ORed
with a magic number held in a register, high nibbles decoded in place, and on CUDA the IQ4 codebook looked up by
byte permutes (pallas_kernels/byte_perm.py: 8.0 instead of 11.2 instructions per weight, 33.9 vs 46.8 us for
17408 x 5120 on an H200). On CUDA, IQ4_XS at 1..4 rows of x goes to quant_gemv_int8.py instead (x quantized to
int8 levels, four weights per integer dot-product instruction; ops.linear chooses).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor, dequantize
from luxjax.ops import backend
from pallas_kernels import byte_perm
from pallas_kernels.dense_gemv import (
    MIN_PROGRAMS, per_weight_tile, split_count, split_out_shape, sum_splits, weight_out_specs)
from pallas_kernels.fma import fma
from pallas_kernels.quant_decode import KERNEL_CONSTANTS, KERNEL_FORMATS, in_kernel_order, kernel_magic

GEMV_MAX_ROWS = 16  # x rows up to this take the streaming kernel at 16 rows (the 16 decoded sequences of a batch)
SKINNY_MAX_ROWS = 32  # ... up to this at 32 rows (both bf16 parts of float32 x: split_linear); more the tiled GEMM
REDUCE_MAX_ROWS = 8  # the GEMV reduce takes up to this many rows of x (the formats' defaults: KernelFormat.reduce_rows)


@dataclass(frozen=True)
class BlockSizes:
    block_m: int  # x rows per program (<= REDUCE_MAX_ROWS: GEMV reduce; 16, 32: skinny dot; more: GEMM)
    block_n: int  # output rows (W rows) per program
    blocks_k: int  # ggml blocks per K step (lowered to a power of two dividing blocks per row)
    num_warps: int
    num_stages: int
    splits: int | None = None  # programs sharing one row tile, each over a 1/splits of K (None: enough for the GPU)
    x_float32: bool | None = None  # GEMV reduce: x widened to float32 before the kernel (None: for one row of x)
    min_programs: int = MIN_PROGRAMS  # where splits is None, K is split until this many programs

    @property
    def widens_x(self) -> bool:
        """Whether the GEMV reduce gets x widened to float32 before the kernel (see _kernel)."""
        return self.block_m == 1 if self.x_float32 is None else self.x_float32

    @classmethod
    def get_default(cls, ggml_type, m: int) -> BlockSizes:
        """Fastest of a sweep on an H200 in the decoder's setting (a scan over stacked 17408 x 5120 layers read in
        place; benchmarks/bench_decode_gemv.py --sweep, 2026-11-29; the rows per regime and the halved K step of
        the reduce at 3-4 rows from --rows-sweep, 2026-12-01; the skinny dot's from --skinny-sweep, 2026-12-03);
        the prefill GEMM from an earlier sweep."""
        fmt = KERNEL_FORMATS[ggml_type]
        block = fmt.block
        if m <= fmt.reduce_rows:  # shorter K steps for several rows (registers), measured faster at 4 rows
            wide = _FLOAT32_X_TILES.get((ggml_type, m))
            block_n, values, warps = wide or _GEMV_TILES.get(ggml_type, (8, 512, 4))
            return cls(m, block_n, max(1, values // (block * (1 if m <= 2 else 2))), warps, 3,
                       x_float32=True if wide else None)
        if m <= SKINNY_MAX_ROWS:
            both_parts = m > GEMV_MAX_ROWS  # a float32 x's two bf16 parts, or 17-32 sequences (ops.linear)
            wide = _SKINNY_WIDE_TILES.get(ggml_type) if both_parts else None
            values, stages, min_programs = wide or _SKINNY_TILES[ggml_type]
            return cls(SKINNY_MAX_ROWS if both_parts else GEMV_MAX_ROWS, 64 if both_parts else 32,
                       max(1, values // block), 4, stages, min_programs=min_programs)
        return cls(64, 128, max(1, 64 // block), 4, 3)


# Swept per format: (block_n, values per K step, warps) of the GEMV reduce; values per K step of the skinny dot.
_GEMV_TILES = {T.IQ4_XS: (8, 1024, 8), T.Q4_K: (16, 512, 4), T.Q5_K: (8, 1024, 8), T.Q6_K: (8, 512, 4)}
# (block_n, values per K step, warps) with x widened to float32, where that changed the best tiles, by (format, rows
# of x): kernel times from a profiler trace on an H200, 17408 x 5120 and 5120 x 17408 (2026-12-01,
# benchmarks/RESULTS.md).
_FLOAT32_X_TILES = {(T.Q4_K, 1): (16, 1024, 8), (T.Q4_K, 2): (16, 1024, 8), (T.Q6_K, 1): (16, 1024, 8)}
# The skinny dot's (values per K step, stages, programs K splits aim for) per format, at 32 output rows a program (64
# at 32 rows of x) and 4 warps: the fastest on an H200 (bench_decode_gemv.py --skinny-sweep and --skinny-check,
# session 27), GPU us a layer at 16 rows of bf16 x, 17408 x 5120 / 5120 x 17408: IQ4_XS 79.2 / 78.6 at 512 values
# and one stage against 126.8 / 129.1 at 256 values and 3 stages (the previous default); Q4_K 75.7 / 82.4 against
# 93.1 / 95.9 at 3 stages; Q6_K 91.2 / 102.3 against 95.7 / 101.6. Q5_K (5120 x 17408) and Q8_0 (17408 x 5120) keep
# 3 stages: 108.9 and 77.2 against 132.3 and 85.0 at one. 8 warps measured slower, and 64 output rows at 16 rows of
# x (but for IQ4_XS 5120 x 17408: 74.1); at 32 rows of x (both parts of 16 float32 rows) 64 output rows won: IQ4_XS
# 16384 x 5120 66.5 against 90.3 at 32, 5120 x 6144 35.4 against 48.0; Q4_K 16384 x 5120 74.9 against 93.9; Q6_K
# 5120 x 6144 41.8 against 51.9. Then (--skinny-splits, session 28) more, shorter programs: a program runs its
# whole K, so few programs leave a last wave nearly empty (IQ4_XS 17408 x 5120 at 32 rows: 544 programs 95.5 us,
# 16384 x 5120's 512 programs 66.1). IQ4_XS and Q4_K at 256 values a step with K split up to 2,048 programs:
# IQ4_XS 17408 x 5120 at 16 rows 79.0 -> 58.8 us, 5120 x 17408 77.7 -> 68.6; at 32 rows 117.0 -> 73.9, 114.9 ->
# 85.2, 5120 x 6144 35.4 -> 26.9, 16384 x 5120 66.3 -> 71.7 (the one loss); Q4_K 17408 x 5120 at 32 rows 119.7 ->
# 79.0. The other formats the same way (session 29, --skinny-splits; old rule -> new): Q6_K at 256 values split to
# 2,048 programs, 5120 x 17408 at 16 rows 102.7 -> 81.6 us, 17408 x 5120 92.1 -> 73.5, 10240 x 5120 at 32 rows 67.8
# -> 60.3 (5120 x 17408 at 32 rows equal, 115.5); Q5_K at 256 values (was 512), 5120 x 17408 at 16 rows 109.0 ->
# 96.2, at 32 rows 264.1 -> 118.5; Q8_0 at 32 rows 32 values a step split to 2,048 programs, 17408 x 5120 109.3 ->
# 73.4, but at 16 rows that measured 108.7 against 77.7 for its 512 values, which it keeps there.
_SKINNY_TILES = {T.IQ4_XS: (256, 1, 2048), T.Q4_K: (256, 1, 2048), T.Q6_K: (256, 1, 2048), T.Q5_K: (256, 3, 2048),
                 T.Q8_0: (512, 3, MIN_PROGRAMS)}
_SKINNY_WIDE_TILES = {T.Q8_0: (32, 3, 2048)}  # at 32 rows of x, where they differ from _SKINNY_TILES


def blocks_per_step(blocks: int, wanted: int) -> int:
    kb = 1
    while kb * 2 <= wanted and blocks % (kb * 2) == 0:
        kb *= 2
    return kb


class RowView:
    """This program's BN rows (of layer `layer` when stacked) of a whole plane ref, indexed like a [BN, blocks, ...]
    block: view[:, sl, ...] -> ref[layer, rows, sl, ...] in one load (Triton lowers a single indexer), with the
    cache eviction policy `eviction` (Triton's: "evict_first" for bytes read once; None: the default)."""

    def __init__(self, ref, prefix, eviction: str | None = None):
        self._ref, self._prefix, self._eviction = ref, prefix, eviction

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if idx[0] != slice(None):
            raise IndexError("a row view is indexed over all its rows first")
        index = (*self._prefix, *idx[1:])
        if self._eviction is None:
            return self._ref[index]
        # integers as int32 scalars: the interpreter's discharge of plgpu.load takes no Python int index
        index = tuple(jnp.int32(i) if isinstance(i, int) else i for i in index)
        return plgpu.load(self._ref.at[index], eviction_policy=self._eviction)


WHOLE = pl.BlockSpec()  # the whole array: the kernel indexes its rows itself


def _kernel(*refs, names, tile_counts, stacked, pieces, piece, kb, steps, reduce, dot_dtype, precision, has_offset,
            use_byte_perm, interpret):
    """Program (i, j, split): rows i of x, row tile j of the weights' outputs side by side (weight w owns
    tile_counts[w] tiles), K steps split * steps ... of it. The GEMV reduce takes x in float32 where
    BlockSizes.widens_x says (one row; Q4_K's two): widening bf16 in the kernel cost 1.5 instructions per weight (an
    H200's SASS: each thread widens its own x elements, by a shift or a permute and a multiply by 2^16 each), a fifth
    of the loop; for IQ4_XS at two rows float32 x measured slower (twice the bytes of x per weight loaded)."""
    # [layer], constants, per weight its planes [(L,) rows, blocks, *plane] whole, x [BM, blocks, *x block],
    # [x group sums], per weight o [1, BM, BN]
    refs = list(refs)
    layer = refs.pop(0)[0] if stacked else None
    const_ref = refs.pop(0)
    o_refs = [refs.pop() for _ in tile_counts][::-1]
    xs_ref = refs.pop() if has_offset else None
    x_ref, plane_refs = refs.pop(), refs
    tile = pl.program_id(1)
    product = functools.partial(
        _product, names=names, x_ref=x_ref, xs_ref=xs_ref, layer=layer, split=pl.program_id(2),
        magic=kernel_magic(const_ref, use_byte_perm=use_byte_perm, interpret=interpret), pieces=pieces,
        piece=piece, kb=kb, steps=steps, reduce=reduce, dot_dtype=dot_dtype, precision=precision)
    per_weight_tile(tile, tile_counts, lambda i, local: product(
        plane_refs[len(names) * i: len(names) * (i + 1)], local, o_ref=o_refs[i]))


def _product(plane_refs, tile, *, names, x_ref, xs_ref, o_ref, layer, split, magic, pieces, piece, kb, steps,
             reduce, dot_dtype, precision):
    """o = x @ W[tile * BN : (tile + 1) * BN].T over this split's K steps, one weight's planes."""
    block_n = o_ref.shape[-1]
    rows = pl.ds(pl.multiple_of(tile * block_n, block_n), block_n)
    prefix = (rows,) if layer is None else (layer, rows)
    planes = {name: RowView(ref, prefix) for name, ref in zip(names, plane_refs)}

    def k_slice(s):
        """The blocks of K step s of this program's share of K."""
        return pl.ds(pl.multiple_of((split * steps + s) * kb, kb), kb)

    def reduce_step(s, accs):
        """One K step of the GEMV reduce for every row of x: each weight decoded once, then per row its sub-block's
        values times x summed, scaled once (plus offset times the sub-block's sum of x)."""
        sl = k_slice(s)
        for pc in pieces(planes, sl, magic):
            new = []
            for r, acc in enumerate(accs):
                part = None
                for values, xi in pc.terms:
                    x = x_ref[r, sl, *xi].astype(jnp.float32)[None]  # [1, KB, *piece]
                    part = values * x if part is None else fma(values, x, part)
                if pc.offset is not None:
                    acc = fma(pc.offset[..., 0], xs_ref[r, sl, *pc.terms[0][1]][None], acc)
                new.append(fma(jnp.sum(part, axis=-1), pc.scale[..., 0], acc))
            accs = tuple(new)
        return accs

    def dot_step(s, acc):
        sl = k_slice(s)
        for pc in pieces(planes, sl, magic):
            for values, xi in pc.terms:
                w = values * pc.scale if pc.offset is None else fma(values, pc.scale, pc.offset)
                x = x_ref[:, sl, *xi]  # [BM, KB, *piece]
                x = x.reshape(x.shape[0], -1).astype(dot_dtype)
                acc = acc + lax.dot_general(x, w.reshape(block_n, -1).astype(dot_dtype),
                                            (((1,), (1,)), ((), ())), precision=precision,
                                            preferred_element_type=jnp.float32)
        return acc

    if reduce:
        zeros = jnp.zeros((block_n, kb, *piece[:-1]), jnp.float32)
        accs = lax.fori_loop(0, steps, reduce_step, (zeros,) * o_ref.shape[1])
        for r, acc in enumerate(accs):
            while acc.ndim > 1:
                acc = acc.sum(axis=-1)
            o_ref[0, pl.ds(r, 1), :] = acc[None, :].astype(o_ref.dtype)
    else:
        acc = lax.fori_loop(0, steps, dot_step, jnp.zeros(o_ref.shape[1:], jnp.float32))
        o_ref[0] = acc.astype(o_ref.dtype)


def uses_byte_perm(interpret: bool) -> bool:
    """Whether the decoders look codes up by byte permutes: compiled where the GPU has the instruction (CUDA), and
    interpreted (its XLA form, so the tests check that decoder; the arithmetic one is checked on its own)."""
    if not byte_perm.REGISTERED:
        return False
    return interpret or backend.gpu_platform() in byte_perm.NATIVE_PLATFORMS


def _pad_to(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -a.shape[axis] % multiple
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def quant_matmul(x: jax.Array, w: QuantizedTensor, *, block_sizes: BlockSizes | None = None, out_dtype=None,
                 interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W.T for W [out, in] packed -> [M, out] in out_dtype (default x.dtype), written straight from
    the float32 accumulator."""
    return _quant_matmul(x, w, None, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret, debug=debug)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def stacked_quant_matmul(x: jax.Array, w: QuantizedTensor, layer: jax.Array, *, block_sizes: BlockSizes | None = None,
                         out_dtype=None, interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W[layer].T for W stacked over layers (every plane [L, rows, blocks, n]; w.shape is one layer's),
    read in place: slicing W[layer] outside the kernel would copy it first (see dense_gemv.py)."""
    return _quant_matmul(x, w, layer, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret, debug=debug)


@functools.partial(jax.jit, static_argnames=("block_sizes", "out_dtype", "interpret", "debug"))
def quant_matmul_many(x: jax.Array, ws: tuple[QuantizedTensor, ...], layer: jax.Array | None = None, *,
                      block_sizes: BlockSizes | None = None, out_dtype=None, interpret: bool = False,
                      debug: bool = False) -> tuple[jax.Array, ...]:
    """(x @ W.T for W in ws), or (x @ W[layer].T) for weights stacked over layers, in one launch: the projections of
    one input in one format (x permuted once, one grid over all their row tiles), as
    quant_gemv_int8.int8_quant_matmul_many for the int8 GEMV: each launch of a decode step costs its start and its
    last wave's idle multiprocessors, and a small weight alone cannot fill the GPU."""
    return _quant_matmul_many(x, tuple(ws), layer, block_sizes=block_sizes, out_dtype=out_dtype,
                              interpret=interpret, debug=debug)


def stacked_supported(x_shape, w: QuantizedTensor) -> bool:
    """Whether stacked_quant_matmul takes x [..., in] @ W[layer].T: a kernel format, 2-D layers, at most
    SKINNY_MAX_ROWS rows of x, and output rows that the row tiles divide (stacked planes are never padded)."""
    return supported_many(x_shape, (w,), stacked=True)


def supported_many(x_shape, ws, stacked: bool) -> bool:
    """Whether quant_matmul_many takes x [..., in] and the packed weights ws (stacked: each [L, out_i, in], one L):
    one kernel format, 2-D weights with x's in, at most SKINNY_MAX_ROWS rows of x, and (stacked) a row tile dividing
    every out_i."""
    m = math.prod(x_shape[:-1])
    if not ws or len({w.ggml_type for w in ws}) != 1 or ws[0].ggml_type not in KERNEL_FORMATS:
        return False
    if any(w.ndim != 2 or w.shape[1] != x_shape[-1] for w in ws) or not 0 < m <= SKINNY_MAX_ROWS:
        return False
    if stacked and len({w.planes[next(iter(w.planes))].shape[0] for w in ws}) != 1:
        return False
    return not stacked or _stacked_block_sizes(ws[0].ggml_type, m, math.gcd(*(w.shape[0] for w in ws))) is not None


def _stacked_block_sizes(ggml_type, m: int, n: int) -> BlockSizes | None:
    """The default tiles with block_n lowered to a power of two dividing n (stacked planes are not padded): at
    least 8 rows for the GEMV, 16 for a skinny dot; else None."""
    bs = BlockSizes.get_default(ggml_type, m)
    block_n = bs.block_n
    while n % block_n:
        block_n //= 2
    if block_n < (8 if bs.block_m <= REDUCE_MAX_ROWS else 16):
        return None
    return dataclasses.replace(bs, block_n=block_n)


def _quant_matmul(x, w, layer, *, block_sizes, out_dtype, interpret, debug):
    fmt = KERNEL_FORMATS.get(w.ggml_type)
    if fmt is None:
        raise NotImplementedError(f"no fused kernel for {w.ggml_type.name} (have {[t.name for t in KERNEL_FORMATS]})")
    return _quant_matmul_many(x, (w,), layer, block_sizes=block_sizes, out_dtype=out_dtype, interpret=interpret,
                              debug=debug)[0]


def _quant_matmul_many(x, ws, layer, *, block_sizes, out_dtype, interpret, debug):
    fmt = KERNEL_FORMATS.get(ws[0].ggml_type)
    if fmt is None or len({w.ggml_type for w in ws}) != 1:
        raise NotImplementedError(f"one fused-kernel format per launch, got {[w.ggml_type.name for w in ws]} "
                                  f"(have {[t.name for t in KERNEL_FORMATS]})")
    if x.ndim != 2 or any(w.ndim != 2 or x.shape[1] != w.shape[1] for w in ws):
        raise ValueError(f"x {x.shape} @ W.T needs x [M, in] and W [out, in] with equal in; W is "
                         f"{[w.shape for w in ws]}")
    m, k, ns = x.shape[0], x.shape[1], tuple(w.shape[0] for w in ws)
    bs = block_sizes or (BlockSizes.get_default(ws[0].ggml_type, m) if layer is None
                         else _stacked_block_sizes(ws[0].ggml_type, m, math.gcd(*ns)))
    if bs is None:
        raise ValueError(f"no row tile divides the rows {ns} of the stacked weights")
    reduce = bs.block_m <= REDUCE_MAX_ROWS
    blocks = k // fmt.block
    kb = blocks_per_step(blocks, bs.blocks_k)
    if layer is None:
        planes = [{name: _pad_to(w.planes[name].reshape(n, blocks, *shape), 0, bs.block_n)
                   for name, shape in fmt.planes.items()} for w, n in zip(ws, ns)]
    else:
        if any(n % bs.block_n for n in ns):
            raise ValueError(f"stacked weight rows {ns} must be multiples of block_n={bs.block_n}")
        planes = [{name: w.planes[name].reshape(-1, n, blocks, *shape) for name, shape in fmt.planes.items()}
                  for w, n in zip(ws, ns)]
    xp = in_kernel_order(x, fmt)
    if reduce and bs.widens_x:  # fused into the permute XLA already does: see _kernel
        xp = xp.astype(jnp.float32)
    xp = _pad_to(xp, 0, bs.block_m)
    padded = tuple(p[next(iter(p))].shape[0 if layer is None else 1] for p in planes)
    tile_counts = tuple(n // bs.block_n for n in padded)
    mp = xp.shape[0]
    x_inputs = [xp]
    if fmt.has_offset:  # each sub-block's sum of x, for the offsets (Q4_K / Q5_K minimums)
        xs = xp.astype(jnp.float32).sum(axis=-1)
        x_inputs.append(xs)
    splits = bs.splits or (1 if bs.block_m > SKINNY_MAX_ROWS else
                           split_count((mp // bs.block_m) * sum(tile_counts), blocks // kb,
                                       bs.min_programs))
    if blocks % (kb * splits):
        raise ValueError(f"{splits} K splits of {kb}-block steps do not divide {blocks} blocks")

    dot_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    out_dtype = out_dtype or x.dtype
    kernel = functools.partial(
        _kernel, names=tuple(fmt.planes), tile_counts=tile_counts, stacked=layer is not None, pieces=fmt.pieces,
        piece=fmt.piece, kb=kb, steps=blocks // (kb * splits), reduce=reduce, dot_dtype=dot_dtype,
        has_offset=fmt.has_offset, use_byte_perm=uses_byte_perm(interpret),
        interpret=interpret, precision=lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None)
    x_specs = [pl.BlockSpec((bs.block_m, *a.shape[1:]), lambda i, j, s, nd=a.ndim: (i,) + (0,) * (nd - 1))
               for a in x_inputs]
    flat_planes = [a for p in planes for a in p.values()]
    ys = pl.pallas_call(
        kernel,
        out_shape=tuple(split_out_shape(splits, mp, n, out_dtype) for n in padded),
        grid=(mp // bs.block_m, sum(tile_counts), splits),
        in_specs=[*(WHOLE for _ in range(len(flat_planes) + 1 + (layer is not None))), *x_specs],
        out_specs=weight_out_specs(tile_counts, (1, bs.block_m, bs.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name=f"quant_matmul_{ws[0].ggml_type.name.lower()}",
    )(*([] if layer is None else [jnp.reshape(layer, (1,)).astype(jnp.int32)]),
      jnp.asarray(KERNEL_CONSTANTS, jnp.uint32), *flat_planes, *x_inputs)
    return tuple(sum_splits(y, out_dtype)[:m, :n] for y, n in zip(ys, ns))


def quant_matmul_reference(x: jax.Array, w: QuantizedTensor, out_dtype=None) -> jax.Array:
    """Dequantize to float32, exact float32 matmul, result in out_dtype (default x.dtype)."""
    y = jnp.dot(x.astype(jnp.float32), dequantize(w, jnp.float32).T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)
