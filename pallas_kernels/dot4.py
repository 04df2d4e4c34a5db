"""Four-way int8 dot product with int32 accumulate inside Pallas kernels on Triton.

dot4(a, b, c) -> int32 c + sum over i < 4 of (int8 byte i of a) * (int8 byte i of b), bytes signed, low byte first.

Why: the packed decode GEMV is bound by instruction issue, not memory (quant_matmul.py's docstring), and a float
multiply-add takes one weight per instruction. With x quantized to int8 (quant_gemv_int8.py), one instruction takes
four: DP4A on NVIDIA GPUs (sm_61 on), v_dot4_i32_i8 on AMD's. On CUDA the Triton rule calls LLVM's NVPTX intrinsic
`llvm.nvvm.idp4a.s.s` (an LLVM intrinsic, not hand-written PTX: Triton declares the symbol and LLVM resolves the
name). On ROCm, in XLA and in interpreted kernels it is the reference's shifts and multiplies, exact but not fast:
callers choose the integer path only where NATIVE_PLATFORMS holds the platform.

The Triton rule is registered through Pallas's private lowering table (pallas_kernels/native_op.py); if that table
moves in a later JAX, REGISTERED is False and callers keep their float decoders.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.native_op import bind, native_elementwise

NATIVE_PLATFORMS = ("cuda",)  # where the Triton rule is one instruction
_NVPTX_INTRINSIC = "llvm.nvvm.idp4a.s.s"


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
