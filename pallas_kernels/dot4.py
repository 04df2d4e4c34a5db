"""Four-way int8 and two-way int16 x int8 dot products with int32 accumulate inside Pallas kernels on Triton.

dot4(a, b, c) -> int32 c + sum over i < 4 of (int8 byte i of a) * (int8 byte i of b), bytes signed, low byte first.
dot2(a, b, c, high) -> int32 c + sum over i < 2 of (int16 half i of a) * (int8 byte 2 * high + i of b), signed: DP2A,
the same instruction count a weight as dot4 but with 16-bit x, so that x's two int8 levels take one sum (see
quant_gemv_int8's module doc).

Why: the packed decode GEMV is bound by instruction issue, not memory (quant_matmul.py's docstring), and a float
multiply-add takes one weight per instruction. With x quantized to int8 (quant_gemv_int8.py), one instruction takes
four: DP4A on NVIDIA GPUs (sm_61 on), v_dot4_i32_i8 on AMD's. On CUDA the Triton rule calls LLVM's NVPTX intrinsic
`llvm.nvvm.idp4a.s.s` (an LLVM intrinsic, not hand-written PTX: Triton declares the symbol and LLVM resolves the name;
`llvm.nvvm.idp2a.s.s` for dot2, its `high` an immediate). On ROCm, in XLA and in interpreted kernels it is the
reference's shifts and multiplies, exact but not fast: callers choose the integer path only where NATIVE_PLATFORMS
holds the platform.

The Triton rule is registered through Pallas's private lowering table (pallas_kernels/native_op.py); if that table
moves in a later JAX, REGISTERED is False and callers keep their float decoders.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.native_op import bind, native_elementwise

NATIVE_PLATFORMS = ("cuda",)  # where the Triton rule is one instruction
_NVPTX_INTRINSIC = "llvm.nvvm.idp4a.s.s"
_NVPTX_DP2A = "llvm.nvvm.idp2a.s.s"  # (a, b, i1 high, c)


def dot4_reference(a, b, c) -> jax.Array:
    """The dot product by sign-extending shifts and int32 multiply-adds (wrapping, as the instruction)."""
    a, b, c = (jnp.asarray(v).astype(jnp.int32) for v in (a, b, c))
    out = c
    for i in range(4):
        byte_a = (a << (24 - 8 * i)) >> 24  # arithmetic shift: byte i, sign-extended
        byte_b = (b << (24 - 8 * i)) >> 24
        out = out + byte_a * byte_b
    return out


dot4_p, REGISTERED = native_elementwise("luxjax_dot4", dot4_reference, _NVPTX_INTRINSIC, NATIVE_PLATFORMS)


def dot4(a, b, c) -> jax.Array:
    """int32 c + the dot product of a's and b's four signed bytes, broadcast to one shape (see the module doc)."""
    a, b, c = (jnp.asarray(v).astype(jnp.int32) for v in (a, b, c))
    return bind(dot4_p, REGISTERED, dot4_reference, a, b, c)


def dot2_reference(a, b, high, c) -> jax.Array:
    """c + a's two signed 16-bit halves times b's signed bytes 2 * high and 2 * high + 1 (wrapping, as the
    instruction)."""
    a, b, c = (jnp.asarray(v).astype(jnp.int32) for v in (a, b, c))
    shift = jnp.where(jnp.asarray(high), 16, 0)
    out = c
    for i in range(2):
        half_a = (a << (16 - 16 * i)) >> 16  # arithmetic shift: half i, sign-extended
        byte_b = (b << (24 - 8 * i - shift)) >> 24
        out = out + half_a * byte_b
    return out


dot2_p, DOT2_REGISTERED = native_elementwise("luxjax_dot2", dot2_reference, _NVPTX_DP2A, NATIVE_PLATFORMS)


def dot2(a, b, c, *, high: bool) -> jax.Array:
    """int32 c + a's two signed 16-bit halves times b's signed bytes 0, 1 (high: 2, 3), broadcast to one shape."""
    a, b, c = (jnp.asarray(v).astype(jnp.int32) for v in (a, b, c))
    return bind(dot2_p, DOT2_REGISTERED, dot2_reference, a, b, jnp.full(c.shape, high), c)
