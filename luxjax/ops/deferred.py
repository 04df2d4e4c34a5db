"""Inputs of a product handed over unformed: an MLP's activation (GatedInput), an RMS norm's output (NormedInput) or
the DeltaNet's gated per-head norm (GatedNormedInput).

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


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, size 1). On the CPU by folding the axis in halves, elementwise adds that sum
    each row in one order whatever the number of rows: XLA:CPU's reduce does not (jaxlib 0.10.2, measured: the sum of
    squares over [T, 2, 64] moved by 7.6e-6 between T = 16 and T = 256), which made a prompt's logits depend on its
    prefill chunking. As fast as the reduce there (and under grad); elsewhere the reduce."""
    if jax.default_backend() != "cpu":
        return jnp.sum(x, axis=-1, keepdims=True)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        folded = x[..., :half] + x[..., half : 2 * half]
        x = jnp.concatenate([folded, x[..., 2 * half :]], axis=-1) if x.shape[-1] % 2 else folded
    return x


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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GatedNormedInput:
    """w * rms_norm(x) * silu(gate) with the norm over each head of `head` consecutive values, rounded to x's dtype
    at each of the reference's steps (Qwen3.5's DeltaNet output norm, layers.basic.GatedRMSNorm): unformed whole, its
    sums of squares too. Where `head` divides 256 a head lies within one 256-value block of x, and where it also
    spans whole entries of the int8 GEMV's quantization kernel's view (64 values in IQ4_XS's order, 32 in the
    K-quants'), that kernel forms the norm from the blocks it loads (pallas_kernels/quant_gemv_int8.py). Formed by
    XLA it was a launch of its own per DeltaNet layer and decode step (~1.3 us on an H200); deferred, the 27B's
    IQ4_XS batch-1 decode went 119.5-119.9 -> 121.0-121.2 tokens/s on an H100, batch 4 263.2-264.2 -> 264.7-265.4
    (runs alternated; benchmarks/RESULTS.md, session 42). The weight [L, head] is kept stacked over layers with the
    layer to read."""

    x: jax.Array  # [..., heads * head]
    gate: jax.Array  # [..., heads * head]
    weight: jax.Array  # [L, head]
    layer: jax.Array  # int32 scalar: the weight's row
    eps: float = field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    @property
    def head(self) -> int:
        return self.weight.shape[-1]

    def reshape(self, *shape) -> GatedNormedInput:
        return GatedNormedInput(self.x.reshape(*shape), self.gate.reshape(*shape), self.weight, self.layer, self.eps)

    @staticmethod
    def form(x, gate, weight, inv_rms, dtype):
        """x times its head's inv_rms (broadcast), rounded to dtype; times weight in dtype; times silu(gate) in
        float32, rounded to dtype: layers.basic.GatedRMSNorm's steps."""
        normed = (x.astype(jnp.float32) * inv_rms).astype(dtype)
        y = weight.astype(dtype) * normed
        g = gate.astype(jnp.float32)
        return (y.astype(jnp.float32) * (g * jax.nn.sigmoid(g))).astype(dtype)

    def value(self) -> jax.Array:
        heads = self.x.reshape(*self.x.shape[:-1], -1, self.head)
        x = heads.astype(jnp.float32)
        inv_rms = NormedInput.inverse_rms(row_sum(x * x), self.head, self.eps)
        weight = jax.lax.dynamic_index_in_dim(self.weight, self.layer, 0, keepdims=False)
        gate = self.gate.reshape(heads.shape)
        return self.form(heads, gate, weight, inv_rms, self.x.dtype).reshape(self.x.shape)


Deferred = GatedInput | NormedInput | GatedNormedInput


def materialize(x):
    """x formed: an array as it is, a deferred input's value."""
    return x.value() if isinstance(x, Deferred) else x
