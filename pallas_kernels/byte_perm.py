"""Byte permute inside Pallas kernels on Triton: four bytes picked from eight, one instruction on NVIDIA GPUs.

byte_perm(a, b, selector) -> uint32 whose byte i is byte (selector >> 4i) & 7 of the eight bytes [a's 0..3, b's
0..3] (low byte first). Selector nibbles must be below 8 (callers mask them): the instruction gives a nibble's upper
bit a sign-replicating meaning, which nothing here uses and the XLA form does not model, and on CUDA nothing masks
it off.

Why: a 16-entry byte table held in four registers turns eight 4-bit codes into eight table bytes in a handful of
permutes (the IQ4 codebook lookup of quant_decode.py), and a permute also places a byte under a float's magic
exponent in one step. On CUDA the Triton rule calls LLVM's NVPTX intrinsic `llvm.nvvm.prmt` (one PRMT; an LLVM
intrinsic, as dot4's, not hand-written PTX). libdevice's __nv_byte_perm, used before, ANDs every selector with
0x7777 first, which LLVM drops only where it can prove those bits clear: in the IQ4 lookup it kept two ANDs per
eight codes (the int8 GEMV's K step 228 -> 213 SASS instructions without them; IQ4_XS 27B batch-1 decode on an H200
123.7 -> 127.4 tokens/s: benchmarks/RESULTS.md, session 32). There is no such call on ROCm (AMD's v_perm_b32 has no
ocml/ockl entry), so there, and in XLA and interpreted kernels, it is shifts and masks, exact but not fast: callers
choose it only where NATIVE_PLATFORMS holds the platform.

The Triton rule is registered through Pallas's private lowering table (pallas_kernels/native_op.py); if that table
moves in a later JAX, REGISTERED is False and the kernels fall back to their arithmetic decoders.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.native_op import bind, native_elementwise

NATIVE_PLATFORMS = ("cuda",)  # where the Triton rule is one instruction


def byte_perm_reference(a, b, selector) -> jax.Array:
    """The permute in uint32 shifts and masks (the XLA form, and the Triton form off NATIVE_PLATFORMS)."""
    a, b, selector = (jnp.asarray(v).astype(jnp.uint32) for v in (a, b, selector))
    out = jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape, selector.shape), jnp.uint32)
    for i in range(4):
        index = (selector >> (4 * i)) & 7
        source = jnp.where(index < 4, a, b)
        byte = (source >> (8 * (index & 3))) & 0xFF
        out = out | (byte << (8 * i))
    return out


_NVPTX_INTRINSIC = "llvm.nvvm.prmt"  # prmt.b32, default mode
byte_perm_p, REGISTERED = native_elementwise("luxjax_byte_perm", byte_perm_reference, _NVPTX_INTRINSIC,
                                               NATIVE_PLATFORMS)


def byte_perm(a, b, selector) -> jax.Array:
    """uint32 byte i = byte ((selector >> 4i) & 7) of [a, b], broadcast to one shape (see the module doc)."""
    a, b, selector = (jnp.asarray(v).astype(jnp.uint32) for v in (a, b, selector))
    return bind(byte_perm_p, REGISTERED, byte_perm_reference, a, b, selector)
