"""Elementwise primitives that lower to one GPU instruction inside Pallas kernels on Triton, and to their plain-JAX
reference everywhere else (XLA, interpreted kernels, platforms without the instruction).

The Triton rule declares an external function by name (a libdevice function or an LLVM intrinsic, which Triton
links or LLVM resolves) through Pallas's private lowering table, as fma.py does for math.fma. If that table moves
in a later JAX, `registered` is False and callers keep their portable forms.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir


def native_elementwise(name: str, reference: Callable, symbol: str, platforms: tuple[str, ...]
                       ) -> tuple[Primitive, bool]:
    """A primitive of three same-shape operands with reference's value (and result type: the last operand's):
    lowered to a call of `symbol` in Triton kernels compiled for one of `platforms`, to reference elsewhere.
    Returns (primitive, whether the Triton rule is registered)."""
    prim = Primitive(name)
    prim.def_impl(reference)
    prim.def_abstract_eval(lambda *args: args[-1])
    mlir.register_lowering(prim, mlir.lower_fun(reference, multiple_results=False))
    return prim, _register_triton_rule(prim, reference, symbol, platforms)


def _register_triton_rule(prim: Primitive, reference: Callable, symbol: str, platforms: tuple[str, ...]) -> bool:
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    tt_dialect = getattr(lowering, "tt_dialect", None)  # the Triton dialect bindings Pallas lowers with
    if not isinstance(getattr(lowering, "triton_lowering_rules", None), dict) or tt_dialect is None:
        return False
    portable = lowering.lower_fun(reference, multiple_results=False)

    def rule(ctx, *args):
        if ctx.context.platform not in platforms:
            return portable(ctx, *args)
        return tt_dialect.extern_elementwise(args[-1].type, list(args), libname="", libpath="", symbol=symbol,
                                             pure=True)

    lowering.triton_lowering_rules[prim] = rule
    return True


def bind(prim: Primitive, registered: bool, reference: Callable, *args) -> jax.Array:
    """prim on args broadcast to one shape, or reference where the rule is not registered."""
    if not registered:
        return reference(*args)
    shape = jax.numpy.broadcast_shapes(*(a.shape for a in args))
    return prim.bind(*(jax.numpy.broadcast_to(a, shape) for a in args))
