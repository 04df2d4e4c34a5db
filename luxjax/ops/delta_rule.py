"""Gated delta rule (Gated DeltaNet's recurrence), XLA path.

Shapes: q, k [B, H, T, dk]; v [B, H, T, dv]; g (log decay), beta [B, H, T]; state [B, H, dk, dv]. All float32:
q and k arrive L2-normalised, q already scaled by dk^-0.5. Per token t:
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
The chunked form computes the same function with matmuls over chunks of `chunk` tokens (prefill); the recurrent
form steps token by token (decode). Padded tokens must carry beta = 0 and g = 0 so they leave the state alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from luxjax.ops import backend

HIGHEST = jax.lax.Precision.HIGHEST


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token form. Returns (out [B, H, T, dv], final state)."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,H,dk], [B,H,dk], [B,H,dv], [B,H], [B,H]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)
        return s, o_t

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 2), state


def unit_lower_inverse(system):
    """The inverse of a unit lower-triangular matrix [..., n, n] (float32): the diagonal and the strictly-upper
    part of `system` are not read.

    Recursive block doubling in batched matmuls only: inv([[A11, 0], [A21, A22]]) = [[I11, 0], [-I22 A21 I11, I22]],
    the two diagonal blocks' inverses I11, I22 taken in one batched call per level, log2(n) levels down to 1x1
    blocks (= 1). It replaces a triangular solve: on a GPU lax's solve is cuBLAS batched trsm, which took 15.9 ms of
    a 168 ms prefill (1,012 tokens, H200); on the CPU its custom call deadlocks XLA:CPU now and then in a backward
    pass (jaxlib 0.10.2, 2 cores: two LAPACK trsm calls at once, each waiting on the intra-op pool both occupy), and
    the forward substitution that stood in for it there had a 7x slower gradient. A size that is no power of two
    is padded with an identity block (the inverse of [[A, 0], [0, I]] is [[inv(A), 0], [0, I]]) and sliced back."""
    n = system.shape[-1]
    size = 1 << (n - 1).bit_length()
    strictly_lower = jnp.tril(system, -1)
    if size != n:
        strictly_lower = jnp.pad(strictly_lower, [(0, 0)] * (system.ndim - 2) + [(0, size - n)] * 2)
    return _unit_lower_inverse_pow2(strictly_lower)[..., :n, :n]


def _unit_lower_inverse_pow2(strictly_lower):
    """inv(I + strictly_lower) for a strictly lower-triangular [..., n, n], n a power of two."""
    n = strictly_lower.shape[-1]
    if n == 1:
        return jnp.ones_like(strictly_lower)
    h = n // 2
    diagonal_blocks = jnp.stack([strictly_lower[..., :h, :h], strictly_lower[..., h:, h:]])
    top_left, bottom_right = _unit_lower_inverse_pow2(diagonal_blocks)
    bottom_left = -_mm(bottom_right, _mm(strictly_lower[..., h:, :h], top_left))
    top = jnp.concatenate([top_left, jnp.zeros_like(top_left)], axis=-1)
    bottom = jnp.concatenate([bottom_left, bottom_right], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _two_sum(a, b):
    """a + b as the rounded sum and its exact rounding error (Knuth's TwoSum)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def _double_float_add(x, y):
    (x_hi, x_lo), (y_hi, y_lo) = x, y
    s, err = _two_sum(x_hi, y_hi)
    err = err + (x_lo + y_lo)
    hi = s + err
    return hi, err - (hi - s)


def compensated_cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis, correctly rounded to within about half a float32 unit: running sums carried
    as double-float pairs through an associative scan. Why: the chunked form exponentiates differences of the
    decays' running sums, so their rounding error becomes a relative error of every decay factor; jnp.cumsum's
    (up to 3 units in the last place, measured) doubled the chunked form's error against a float64 recurrence on a
    random checkpoint's real inputs, where PyTorch's CPU cumsum accumulates in float64."""
    return lax.associative_scan(_double_float_add, (x, jnp.zeros_like(x)), axis=-1)[0]


def chunk_inputs(q, k, v, g, beta, chunk: int = 64):
    """The parallel part of the chunked (UT-transform) form: everything except the scan over chunks.
    Returns (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay), each [B, H, n, ...]."""
    T = q.shape[2]
    pad = (-T) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    B, H, Tp, dk = q.shape
    dv = v.shape[-1]
    n = Tp // chunk

    def chunked(x):
        return x.reshape(B, H, n, chunk, *x.shape[3:])

    v_beta = chunked(v * beta[..., None])
    k_beta = chunked(k * beta[..., None])
    q, k = chunked(q), chunked(k)
    cum = compensated_cumsum(chunked(g))  # [B,H,n,C]

    upper = jnp.triu(jnp.ones((chunk, chunk), dtype=bool), 1)
    pair_decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut_system = _mm(k_beta, jnp.swapaxes(k, -1, -2)) * pair_decay
    intra = _mm(q, jnp.swapaxes(k, -1, -2)) * pair_decay
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]

    # X = inv(I + strictly_lower(ut)) rhs; the reference ignores the diagonal and multiplies by the inverse too.
    rhs = jnp.concatenate([v_beta, decayed_k_beta], axis=-1)
    solved = _mm(unit_lower_inverse(ut_system), rhs)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]

    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B,H,n]
    return new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, *, boundary_block=None):
    """Chunked (UT-transform) form. Returns (out [B, H, T, dv], final state); given boundary_block ([B] int32, a
    chunk index from 0 to the number of chunks), also the state entering that chunk of each sequence (the final
    state at the number of chunks): the DeltaNet layer keeps it to resume prefill on an unchanged chunk grid."""
    B, H, T, _ = q.shape
    dv = v.shape[-1]
    xs = chunk_inputs(q, k, v, g, beta, chunk)
    n = xs[0].shape[2]
    block = jnp.full((B,), n, jnp.int32) if boundary_block is None else boundary_block
    per_sequence = lambda x: x[:, None, None, None]  # noqa: E731

    def step(carry, xs):
        s, entering = carry
        c, nv, kc, qd, kd, at, cd = xs
        entering = jnp.where(per_sequence(c == block), s, entering)
        v_new = nv - _mm(kc, s)
        out = _mm(qd, s) + _mm(at, v_new)
        s = s * cd[..., None, None] + _mm(jnp.swapaxes(kd, -1, -2), v_new)
        return (s, entering), out

    chunks = tuple(jnp.moveaxis(x, 2, 0) for x in xs)
    (state, entering), out = jax.lax.scan(step, (state, state), (jnp.arange(n), *chunks))
    out = jnp.moveaxis(out, 0, 2).reshape(B, H, -1, dv)[:, :, :T]
    if boundary_block is None:
        return out, state
    return out, state, jnp.where(per_sequence(block == n), state, entering)


def gated_delta_rule(q, k, v, g, beta, state, *, chunked: bool, boundary_block=None):
    """The one entry point models call: chunked (prefill) or recurrent (decode) form; `boundary_block` (chunked
    form only): see chunk_gated_delta_rule. The chunked form takes the Pallas scan kernel when luxjax.ops.backend
    says so (2x XLA on an H200 at T=1012). The recurrent form stays on XLA: its fused elementwise update ran near
    HBM peak, faster than the Pallas recurrent kernel (29 vs 47 us at B=16, 48 heads)."""
    if chunked:
        if backend.use_pallas() and _kernel_supported(q, v):
            from pallas_kernels.gated_delta import gated_delta_chunked

            return gated_delta_chunked(q, k, v, g, beta, state, boundary_block=boundary_block,
                                       interpret=backend.interpret())
        return chunk_gated_delta_rule(q, k, v, g, beta, state, boundary_block=boundary_block)
    if boundary_block is not None:
        raise ValueError("boundary_block is an output of the chunked form only")
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def _kernel_supported(q, v) -> bool:
    dk, dv = q.shape[-1], v.shape[-1]
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))
