"""Fused multiply-add a * b + c inside Pallas kernels on Triton.

Why: Pallas's Triton lowering emits a multiply and an add as two instructions, and they reach the GPU unfused (an
H200 profile of the packed GEMV counted 0 fused among 36.8 million float32 instructions), while the decode GEMVs
are bound by instruction issue. `fma` lowers to MLIR's math.fma there: one FFMA on NVIDIA (seen in the H200's
SASS; on AMD LLVM's fma gives v_fma_f32, not run here), rounded once. Everywhere else (XLA, interpreted kernels)
it is a * b + c.

The Triton rule is registered through Pallas's private lowering table; if that table moves in a later JAX, `fma`
falls back to a * b + c (the kernels stay correct, only slower) and `FUSED` says so.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

fma_p = Primitive("luxjax_fma")
fma_p.def_impl(lambda a, b, c: a * b + c)
fma_p.def_abstract_eval(lambda a, b, c: a)
mlir.register_lowering(fma_p, mlir.lower_fun(lambda a, b, c: a * b + c, multiple_results=False))


def _register_triton_rule() -> bool:
    try:
        from jax._src.lib.mlir.dialects import math as math_dialect
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    if not isinstance(getattr(lowering, "triton_lowering_rules", None), dict):
        return False
    lowering.triton_lowering_rules[fma_p] = lambda ctx, a, b, c: math_dialect.fma(a, b, c)
    return True


FUSED = _register_triton_rule()


def fma(a, b, c) -> jax.Array:
    """a * b + c, broadcast to one float32 shape, rounded once where the kernel is compiled for a GPU."""
    a, b, c = (jnp.asarray(v, jnp.float32) for v in (a, b, c))
    if not FUSED:
        return a * b + c
    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    return fma_p.bind(*(jnp.broadcast_to(v, shape) for v in (a, b, c)))
