"""y = x @ W.T for dense or packed quantized weights, and embedding lookups.

`_impl` is the single dispatch point: the XLA path below dequantizes inside the jitted graph; fused
Pallas dequant-matmul kernels replace it there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from luxjax.checkpoint.quants import Weight, dequantize, dequantize_rows


def _xla_linear(x: jax.Array, w: Weight) -> jax.Array:
    """Weights dequantized (or cast) to x's dtype, float32 accumulation, result in x's dtype."""
    w = dequantize(w, x.dtype)
    # float32 mode means full float32 products: GPUs would otherwise round inputs to TF32.
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision)
    return y.astype(x.dtype)


_impl = _xla_linear


def linear(x: jax.Array, w: Weight) -> jax.Array:
    """x [..., in] @ W.T for W [out, in] (jnp array or QuantizedTensor) -> [..., out] in x.dtype."""
    return _impl(x, w)


def embedding_lookup(w: Weight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the table w [vocab, dim] in `dtype`; packed tables decode only the gathered rows."""
    return dequantize_rows(w, ids, dtype)
