"""y = x @ W.T for dense or packed quantized weights, and embedding lookups.

`_impl` is the single dispatch point: packed weights in a format with a fused kernel, with at most
_PALLAS_MAX_ROWS rows of x (decode), go to the Pallas dequantize-matmul when luxjax.ops.backend chooses Pallas
(GPU by default, LUXJAX_KERNELS overrides); everything else takes the XLA path, which dequantizes inside the
jitted graph and is the kernels' oracle. Prefill stays on XLA: the fused GEMM measured 116 TFLOP/s on an H200
(Q8_0, M=1024) where XLA's dequantize-then-cuBLAS runs near the ~590 TFLOP/s bf16 rate.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from luxjax.checkpoint.quants import QuantizedTensor, Weight, dequantize, dequantize_rows
from luxjax.ops import backend
from pallas_kernels.quant_decode import KERNEL_FORMATS

_PALLAS_MAX_ROWS = 16  # the streaming GEMV regime of quant_matmul


def _xla_linear(x: jax.Array, w: Weight, out_dtype=None) -> jax.Array:
    """Weights dequantized (or cast) to x's dtype, float32 accumulation, result in out_dtype (default x's)."""
    w = dequantize(w, x.dtype)
    # float32 mode means full float32 products: GPUs would otherwise round inputs to TF32.
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                        precision=precision)
    return y.astype(out_dtype or x.dtype)


def _pallas_linear(x: jax.Array, w: QuantizedTensor, out_dtype=None) -> jax.Array:
    from pallas_kernels.quant_matmul import quant_matmul  # Pallas imports only once Pallas is chosen

    y = quant_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype=out_dtype, interpret=backend.interpret())
    return y.reshape(*x.shape[:-1], w.shape[0])


def _kernel_applies(x: jax.Array, w: Weight) -> bool:
    return (isinstance(w, QuantizedTensor) and w.ggml_type in KERNEL_FORMATS and w.ndim == 2
            and 0 < math.prod(x.shape[:-1]) <= _PALLAS_MAX_ROWS
            and x.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) and backend.use_pallas())


def _impl(x: jax.Array, w: Weight, out_dtype=None) -> jax.Array:
    return (_pallas_linear if _kernel_applies(x, w) else _xla_linear)(x, w, out_dtype)


def linear(x: jax.Array, w: Weight, out_dtype=None) -> jax.Array:
    """x [..., in] @ W.T for W [out, in] (jnp array or QuantizedTensor) -> [..., out] in out_dtype (default: x's;
    float32 keeps the accumulator unrounded, e.g. for logits)."""
    return _impl(x, w, out_dtype)


def split_linear(x: jax.Array, w: Weight) -> jax.Array:
    """float32 x [..., in] @ W.T for low-precision (bf16 or packed) W at bf16 matmul speed: x is split into its
    bf16 high part and the bf16 rounding of the rest, both go through one bf16 product (stacked as rows, so W is read
    once where the rows allow), and the two float32 results are summed. x keeps about 16 significant bits instead
    of bf16's 8: for the layers whose bf16 input rounding dominates the error (Qwen3.5's DeltaNet)."""
    hi = x.astype(jnp.bfloat16)
    lo = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantizedTensor) and rows <= _PALLAS_MAX_ROWS < 2 * rows:  # keep both halves on the kernel
        return linear(hi, w, jnp.float32) + linear(lo, w, jnp.float32)
    both = linear(jnp.stack([hi, lo]), w, jnp.float32)
    return both[0] + both[1]


def embedding_lookup(w: Weight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the table w [vocab, dim] in `dtype`; packed tables decode only the gathered rows."""
    return dequantize_rows(w, ids, dtype)
