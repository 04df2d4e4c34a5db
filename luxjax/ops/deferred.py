"""Inputs of a product handed over unformed: an MLP's activation (GatedInput) or an RMS norm's output (NormedInput).

In a decode step these are each one small XLA launch between two GEMV launches (in a 27B step on an H200: 64
activations and 128 norms' scalings, ~1.6 us each), and the int8 GEMV quantizes its input in a kernel of its own
anyway: handed over unformed, that kernel forms them from the blocks it loads (pallas_kernels/quant_gemv_int8.py), by
the same `form` that `value()` applies to whole arrays everywhere else (the norms deferred: 1,481 -> 1,337 launches
and 8.79 -> 8.67 ms of kernels a step, with one output array per weight; benchmarks/RESULTS.md, session 24). Shapes
and dtypes are those of the formed value; `materialize` forms any of them (and passes arrays through) for consumers
that take arrays only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


def swiglu(gate, up):
    """silu(gate) * up in float32, rounded to gate's dtype: the MLP's activation (arrays, or a kernel's loads)."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GatedInput:
    """x = swiglu(gate, up): an MLP's activation, unformed."""

    gate: jax.Array  # [..., K]
    up: jax.Array  # [..., K]

    @property
    def shape(self):
        return self.gate.shape

    @property
    def dtype(self):
        return self.gate.dtype

    def reshape(self, *shape) -> GatedInput:
        return GatedInput(self.gate.reshape(*shape), self.up.reshape(*shape))

    form = staticmethod(swiglu)

    def value(self) -> jax.Array:
        return self.form(self.gate, self.up)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class NormedInput:
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), rounded to `dtype`: a zero-centred RMS norm's output (Qwen3.5's),
    unformed but for its reduction, sum_sq (the row sums of x^2; the rsqrt is left to the consumer too: computed
    after the reduction, XLA made it a launch of its own). The weight is kept stacked over layers with the layer to
    read, so a kernel reads it where it lies (a slice taken for it would be a copy of its own)."""

    x: jax.Array  # [..., K] float32
    sum_sq: jax.Array  # [...] float32
    weight: jax.Array  # [L, K]
    layer: jax.Array  # int32 scalar: the weight's row
    dtype: jnp.dtype = field(metadata=dict(static=True))
    eps: float = field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.x.shape

    def reshape(self, *shape) -> NormedInput:
        x = self.x.reshape(*shape)
        return NormedInput(x, self.sum_sq.reshape(x.shape[:-1]), self.weight, self.layer, self.dtype, self.eps)

    def astype(self, dtype):
        """The value in `dtype`, still deferred where that is one rounding of the float32 norm (from float32)."""
        dtype = jnp.dtype(dtype)
        if dtype == self.dtype or self.dtype == jnp.float32:
            return NormedInput(self.x, self.sum_sq, self.weight, self.layer, dtype, self.eps)
        return self.value().astype(dtype)

    @staticmethod
    def inverse_rms(sum_sq, width: int, eps: float):
        """rsqrt(sum_sq / width + eps): the norm's scale from the sum of squares of `width` values."""
        return jax.lax.rsqrt(sum_sq / width + eps)

    @staticmethod
    def form(x, inv_rms, weight, dtype):
        """x [..., K] float32 times inv_rms (broadcast over K) and 1 + weight [K], in float32, rounded to dtype."""
        return ((x.astype(jnp.float32) * inv_rms) * (1.0 + weight.astype(jnp.float32))).astype(dtype)

    def value(self) -> jax.Array:
        weight = jax.lax.dynamic_index_in_dim(self.weight, self.layer, 0, keepdims=False)
        inv_rms = self.inverse_rms(self.sum_sq, self.x.shape[-1], self.eps)
        return self.form(self.x, inv_rms[..., None], weight, self.dtype)


Deferred = GatedInput | NormedInput


def materialize(x):
    """x formed: an array as it is, a deferred input's value."""
    return x.value() if isinstance(x, Deferred) else x
