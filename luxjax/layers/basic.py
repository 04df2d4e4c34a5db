"""Small NNX building blocks shared by models. Weights are given at construction (no random init):
a model is always built from a checkpoint, and packed quantized weights pass through untouched."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.ops.deferred import GatedNormedInput, NormedInput, row_sum
from luxjax.ops.linear import embedding_lookup, layer_stacks, linear


class MatrixParam(nnx.Param):
    """A Linear layer's weight matrix. Scanned decoder layers leave these stacked and pass each layer's as a
    LayerSlice (luxjax.ops.linear), so that decode kernels read them in place."""


class KernelParam(nnx.Param):
    """A small per-layer parameter that a decode kernel takes as an operand (the DeltaNet's conv taps and decay
    constants; the norm weights that the int8 GEMV's quantization reads: ZeroCenteredRMSNorm.deferred,
    GatedRMSNorm.deferred). Decode's layer scan leaves these stacked too, like MatrixParam, so code reading them
    takes layer_value: a kernel operand cannot fuse the scan's slice of it, and XLA copied each one out of its stack
    for every layer and step (an H200 decode profile of the 27B: three ~1.7 us copies per DeltaNet layer)."""


class Linear(nnx.Module):
    """y = x @ W.T (+ b). W is [out, in]: a dense array or a packed QuantizedTensor (or, inside a layer scan,
    a LayerSlice of either)."""

    def __init__(self, weight, bias=None):
        self.weight = MatrixParam(weight)
        self.bias = nnx.Param(bias) if bias is not None else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.add_bias(linear(x, self.weight.get_value()))

    def add_bias(self, y: jax.Array) -> jax.Array:
        """y plus the bias, if there is one: also for products computed beside others (linear_many)."""
        return y if self.bias is None else y + self.bias.get_value().astype(y.dtype)


class Embedding(nnx.Module):
    def __init__(self, weight):
        self.weight = nnx.Param(weight)

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        return embedding_lookup(self.weight.get_value(), ids, dtype)


class ZeroCenteredRMSNorm(nnx.Module):
    """Qwen3.5's RMSNorm: y = norm(x) * (1 + w), in float32, cast back to x's dtype. The weight is a KernelParam:
    `deferred` hands the norm to a product unformed, whose quantization kernel reads the weight in place."""

    def __init__(self, weight, eps: float):
        self.weight = KernelParam(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.deferred(x, x.dtype).value()

    def deferred(self, x: jax.Array, dtype) -> NormedInput:
        """The norm of x rounded to `dtype`, unformed but for its reduction (luxjax.ops.deferred): linear() and
        friends form it where they need an array, the int8 GEMV's quantization kernel as it loads x."""
        x = x.astype(jnp.float32)
        (stacked,), layer = layer_stacks((self.weight.get_value(),))
        return NormedInput(x, row_sum(x * x)[..., 0], stacked, layer, jnp.dtype(dtype), self.eps)


class GatedRMSNorm(nnx.Module):
    """DeltaNet output norm: w * norm(x) (rounded to x's dtype first, as the reference does) * silu(gate), the norm
    over x's last axis. The weight is a KernelParam: `deferred` hands the norm to a product unformed, whose
    quantization kernel reads the weight in place."""

    def __init__(self, weight, eps: float):
        self.weight = KernelParam(weight)
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return self.deferred(x, gate).value()

    def deferred(self, x: jax.Array, gate: jax.Array) -> GatedNormedInput:
        """The norm of x and gate [..., heads * head] (heads side by side, head = the weight's size), unformed
        (luxjax.ops.deferred): linear() and friends form it where they need an array, the int8 GEMV's
        quantization kernel as it loads x."""
        (stacked,), layer = layer_stacks((self.weight.get_value(),))
        return GatedNormedInput(x, gate.reshape(x.shape), stacked, layer, self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, weight, bias, eps: float):
        self.weight = nnx.Param(weight)
        self.bias = nnx.Param(bias)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight.get_value().astype(jnp.float32) + self.bias.get_value().astype(jnp.float32)
        return y.astype(x.dtype)
