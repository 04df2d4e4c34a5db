"""Packed decode GEMV on int8 dot products: y = x @ W.T for 1..4 rows of x and IQ4_XS W, Pallas on Triton.

Why: quant_matmul's GEMV reduce is bound by instruction issue (an H200 profile: 81% of issue slots busy, 28% of
memory throughput), at one float multiply-add per weight and row besides the decoding. Here the decoder's output
stays integer: the IQ4 codebook is looked up by byte permutes straight into signed bytes, and one dot4 (DP4A)
multiplies four of them by four int8 values of x and adds them to an int32. Measured on an H200 (17408 x 5120, one
row of bf16 x; benchmarks/RESULTS.md, 2026-12-02): 3.7 instructions per weight instead of 6.5, 25.6 instead of 33.4
us; the kernel is then bound by latency, not issue (4 warps: 80 registers, 29% of warps resident, 40% of DRAM
throughput, the x and scale tiles reaching the weights' register layout through shared memory and barriers).

x is quantized per 32 values (an IQ4_XS sub-block) in `levels` int8 levels: d = max|x| / 127 over the 32, level 0 the
rounding of x / d, each further level the rounding of what is left at 128 times finer steps. So x = d * (q0 + q1 /
128 + q2 / 128^2 ...) + e with |e| <= d / (2 * 128^(levels - 1)): two levels for 16-bit x (|e| <= max / 32,512 of
the 32: below bf16's own rounding of every value larger than max / 64), three for float32 x (max / 4,161,536:
what ops.linear.split_linear sends for the DeltaNet, whose inputs are kept in float32 for accuracy). The integer
sums are exact; each sub-block's level sums become floats (the 2^23 magic number), are combined and scaled once.

The kernel reads W's packed planes in place (stacked over layers, one layer at a time, as the decoder does), each
program owning BN output rows and streaming their blocks along K; x's levels are permuted (XLA, once per call) into
the order the byte permutes emit values, four to an int32 word. Used where dot4 and byte_perm are single
instructions (CUDA); elsewhere quant_matmul's float reduce stays (see uses_int8).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.ops import backend
from pallas_kernels import dot4
from pallas_kernels.dense_gemv import split_count, split_out_shape, sum_splits
from pallas_kernels.fma import fma
from pallas_kernels.quant_decode import (
    IQ4_SIGNED_TABLE_WORDS, KERNEL_FORMATS, MAGIC, SIGNED_MAGIC, _s2f, iq4_xs_scales, iq4_xs_signed_bytes,
    kernel_magic)
from pallas_kernels.quant_matmul import WHOLE, RowView, _pad_to, blocks_per_step, uses_byte_perm

MAX_ROWS = 4  # rows of x per program (each weight decoded once for all of them)
GROUP = 32  # values of x per int8 scale: one IQ4_XS sub-block
LEVEL_STEP = 128.0  # each level of x is this much finer than the last
TINY = 2.0**-100
FORMATS = (T.IQ4_XS,)
PLANES = ("d", "scales_h", "scales_l", "qs")  # IQ4_XS's, in the kernel's argument order
_CONSTANTS = (MAGIC, SIGNED_MAGIC, *IQ4_SIGNED_TABLE_WORDS)  # laid out as quant_decode.KERNEL_CONSTANTS


@dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output rows (W rows) per program
    blocks_k: int  # ggml blocks per K step (lowered to a power of two dividing the blocks per row)
    num_warps: int
    num_stages: int = 3
    splits: int | None = None  # programs sharing one row tile, each over 1/splits of K (None: enough for the GPU)

    @classmethod
    def get_default(cls, rows: int, n: int) -> BlockSizes:
        """Fastest of a sweep on an H200 (bench_decode_gemv.py --int8-sweep): 16 rows, 4 blocks per K step and 8
        warps; one block per step where the rows give fewer tiles than multiprocessors, so that K splits fill it."""
        return cls(16, 4 if n // 16 >= 132 else 1, 8)


def levels_for(dtype) -> int:
    """int8 levels of x: two for 16-bit x, three for float32 (see the module doc)."""
    return 3 if jnp.dtype(dtype) == jnp.float32 else 2


def quantize_x(x: jax.Array, levels: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (int8 levels [M, levels, K], scales d [M, K / GROUP] float32): x ~ d * sum_l q_l / 128^l per
    group of 32 values (error bound in the module doc)."""
    m, k = x.shape
    groups = x.astype(jnp.float32).reshape(m, k // GROUP, GROUP)
    # groups below 2^-100 quantize to zeros (their steps would be subnormal, which GPUs flush)
    d = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1, keepdims=True), TINY) / 127.0
    rest, qs = groups, []
    for level in range(levels):
        step = d / LEVEL_STEP**level  # exact: a power-of-two division
        q = jnp.clip(jnp.round(rest / step), -127, 127)
        qs.append(q.astype(jnp.int8))
        rest = rest - q * step
    return jnp.stack(qs, axis=1).reshape(m, levels, k), d[..., 0]


def iq4_words(q: jax.Array) -> jax.Array:
    """int8 levels [M, L, K] -> int32 words [M, L, K / 256, 4, 2, 2, 4] in iq4_xs_signed_bytes' order: word
    (g2, gp, h, w) holds values 4w + 2h, 16 + 4w + 2h, 4w + 2h + 1, 16 + 4w + 2h + 1 of sub-block 2*g2 + gp."""
    m, levels, k = q.shape
    # a block's value 64*g2 + 32*gp + 16*hi + 4*w + 2*h + b goes to byte 2*b + hi of word (g2, gp, h, w)
    v = q.reshape(m, levels, k // 256, 4, 2, 2, 4, 2, 2)  # (g2, gp, hi, w, h, b)
    v = v.transpose(0, 1, 2, 3, 4, 7, 6, 8, 5)  # (g2, gp, h, w, b, hi)
    return lax.bitcast_convert_type(v.reshape(*v.shape[:7], 4), jnp.int32)


def _kernel(*refs, stacked, kb, steps, levels, interpret):
    # [layer], constants, planes (d, scales_h, scales_l, qs) whole, x words [BM, L, blocks, 4, 2, 2, 4],
    # x scales [BM, blocks, 4, 2], o [1, BM, BN]
    refs = list(refs)
    layer_ref = refs.pop(0) if stacked else None
    const_ref, *plane_refs, xq_ref, xd_ref, o_ref = refs
    block_n, rows = o_ref.shape[-1], o_ref.shape[1]
    out_rows = pl.ds(pl.multiple_of(pl.program_id(1) * block_n, block_n), block_n)
    split = pl.program_id(2)
    prefix = (layer_ref[0], out_rows) if stacked else (out_rows,)
    planes = {name: RowView(ref, prefix) for name, ref in zip(PLANES, plane_refs)}
    magic = kernel_magic(const_ref, use_byte_perm=True, interpret=interpret)

    def step(s, accs):
        sl = pl.ds(pl.multiple_of((split * steps + s) * kb, kb), kb)
        scale = iq4_xs_scales(planes, sl, magic)  # [BN, KB, 4, 2]
        halves = iq4_xs_signed_bytes(planes, sl, magic)  # 2 x [BN, KB, 4, 2, 4]
        new = []
        for r, acc in enumerate(accs):
            total = None
            for level in range(levels):
                isum = jnp.zeros(halves[0].shape, jnp.int32)
                for h, half in enumerate(halves):
                    isum = dot4.dot4(half, xq_ref[r, level, sl, :, :, h, :][None], isum)
                part = _s2f(jnp.sum(isum, axis=-1))  # [BN, KB, 4, 2], exact
                total = part if total is None else fma(part, LEVEL_STEP**-level, total)
            new.append(fma(total, scale * xd_ref[r, sl][None], acc))
        return tuple(new)

    zeros = jnp.zeros((block_n, kb, 4, 2), jnp.float32)
    accs = lax.fori_loop(0, steps, step, (zeros,) * rows)
    for r, acc in enumerate(accs):
        o_ref[0, pl.ds(r, 1), :] = acc.sum(axis=(1, 2, 3))[None, :].astype(o_ref.dtype)


def uses_int8(interpret: bool) -> bool:
    """Whether decode GEMVs take this kernel: where dot4 and byte_perm (quant_matmul.uses_byte_perm) are single
    instructions (CUDA), and interpreted (their XLA forms, so the tests check it); never with int8 activations off."""
    if not (backend.int8_activations() and dot4.REGISTERED and uses_byte_perm(interpret)):
        return False
    return interpret or backend.gpu_platform() in dot4.NATIVE_PLATFORMS


def supported(x_shape, w: QuantizedTensor, stacked: bool) -> bool:
    """Whether int8_quant_matmul takes x [..., in] @ W.T (W[layer].T when stacked)."""
    m, n = math.prod(x_shape[:-1]), w.shape[0]
    return (w.ggml_type in FORMATS and w.ndim == 2 and 0 < m <= MAX_ROWS
            and (not stacked or n % BlockSizes.get_default(m, n).block_n == 0))


@functools.partial(jax.jit, static_argnames=("block_sizes", "levels", "out_dtype", "interpret", "debug"))
def int8_quant_matmul(x: jax.Array, w: QuantizedTensor, layer: jax.Array | None = None, *,
                      block_sizes: BlockSizes | None = None, levels: int | None = None, out_dtype=None,
                      interpret: bool = False, debug: bool = False) -> jax.Array:
    """x [M, in] @ W.T (W[layer].T for W stacked over layers, every plane [L, rows, ...], read in place) -> [M, out]
    in out_dtype (default x's), M <= MAX_ROWS, x quantized to `levels` int8 levels (default levels_for(x.dtype))."""
    if w.ggml_type not in FORMATS:
        raise NotImplementedError(f"no int8 GEMV for {w.ggml_type.name} (have {[t.name for t in FORMATS]})")
    (m, k), n = x.shape, w.shape[0]
    if not 0 < m <= MAX_ROWS or w.ndim != 2 or k != w.shape[1]:
        raise ValueError(f"x {x.shape} @ W.T needs x [<= {MAX_ROWS}, in] and W [out, in]; W is {w.shape}")
    fmt = KERNEL_FORMATS[w.ggml_type]
    bs = block_sizes or BlockSizes.get_default(m, n)
    blocks = k // fmt.block
    kb = blocks_per_step(blocks, bs.blocks_k)
    if layer is None:  # rows padded to whole tiles (a stacked weight cannot be: it would be copied)
        planes = [_pad_to(w.planes[name].reshape(n, blocks, *fmt.planes[name]), 0, bs.block_n) for name in PLANES]
    elif n % bs.block_n:
        raise ValueError(f"stacked W's {n} rows must be a multiple of block_n={bs.block_n}")
    else:
        planes = [w.planes[name].reshape(-1, n, blocks, *fmt.planes[name]) for name in PLANES]
    np_ = planes[0].shape[-3]  # d: [(L,) rows, blocks, 1]
    levels = levels or levels_for(x.dtype)
    q, d = quantize_x(x, levels)
    xq, xd = iq4_words(q), d.reshape(m, blocks, 4, 2)
    splits = bs.splits or split_count(np_ // bs.block_n, blocks // kb)
    if blocks % (kb * splits):
        raise ValueError(f"{splits} K splits of {kb}-block steps do not divide {blocks} blocks")
    out_dtype = out_dtype or x.dtype
    kernel = functools.partial(_kernel, stacked=layer is not None, kb=kb, steps=blocks // (kb * splits),
                               levels=levels, interpret=interpret)
    x_specs = [pl.BlockSpec(a.shape, lambda i, j, s, nd=a.ndim: (0,) * nd) for a in (xq, xd)]
    y = pl.pallas_call(
        kernel,
        out_shape=split_out_shape(splits, m, np_, out_dtype),
        grid=(1, np_ // bs.block_n, splits),
        in_specs=[*(WHOLE for _ in range(len(planes) + 1 + (layer is not None))), *x_specs],
        out_specs=pl.BlockSpec((1, m, bs.block_n), lambda i, j, s: (s, 0, j)),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret, debug=debug, name=f"int8_gemv_{w.ggml_type.name.lower()}",
    )(*([] if layer is None else [jnp.reshape(layer, (1,)).astype(jnp.int32)]),
      jnp.asarray(_CONSTANTS, jnp.uint32), *planes, xq, xd)
    return sum_splits(y, out_dtype)[:, :n]
