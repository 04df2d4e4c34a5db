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


def unit_lower_solve(system, rhs):
    """X with system @ X = rhs for a unit lower-triangular `system` [..., C, C] (its diagonal is not read).

    On the CPU this is forward substitution in plain XLA ops: XLA:CPU (jaxlib 0.10.2, 2 cores) deadlocks now and
    then when the triangular-solve custom call runs in the backward pass inside the layer scan, which stalled
    training on CPU. Elsewhere it is lax's triangular solve."""
    if jax.default_backend() != "cpu":
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    strictly_lower = jnp.tril(system, -1)

    def row(i, x):
        xi = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2) - _mm(jax.lax.dynamic_index_in_dim(strictly_lower, i, -2), x)
        return jax.lax.dynamic_update_index_in_dim(x, xi, i, axis=-2)

    return jax.lax.fori_loop(1, system.shape[-1], row, rhs)


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
    cum = jnp.cumsum(chunked(g), axis=-1)  # [B,H,n,C]

    upper = jnp.triu(jnp.ones((chunk, chunk), dtype=bool), 1)
    pair_decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut_system = _mm(k_beta, jnp.swapaxes(k, -1, -2)) * pair_decay
    intra = _mm(q, jnp.swapaxes(k, -1, -2)) * pair_decay
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]

    # (I + strictly_lower(ut)) X = rhs; the reference ignores the diagonal (unitriangular solve).
    system = jnp.where(jnp.tril(jnp.ones((chunk, chunk), dtype=bool), -1), ut_system, 0.0) + jnp.eye(chunk)
    rhs = jnp.concatenate([v_beta, decayed_k_beta], axis=-1)
    solved = unit_lower_solve(system, rhs)
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
