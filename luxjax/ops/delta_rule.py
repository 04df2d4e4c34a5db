"""Gated delta rule (Gated DeltaNet's recurrence), XLA path.

Shapes: q, k [B, H, T, dk]; v [B, H, T, dv]; g (log decay), beta [B, H, T]; state [B, H, dk, dv]. All float32:
q and k arrive L2-normalised, q already scaled by dk^-0.5. gated_delta_rule and the chunked form also take q and k
with fewer heads than v (Qwen3.5's key heads, each shared by H / Hk value heads): head_order says which key head a
value head h reads, h // (H / Hk) ("grouped", transformers' order) or h % Hk ("tiled", llama.cpp's GGUF order).
Per token t:
    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
The chunked form computes the same function with matmuls over chunks of `chunk` tokens (prefill); the recurrent
form steps token by token (decode). Padded tokens must carry beta = 0 and g = 0 so they leave the state alone.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from luxjax.ops import backend
from luxjax.ops.linear import LayerSlice, layer_stacks, layer_value

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


HEAD_ORDERS = ("grouped", "tiled")


def expand_key_heads(x, v_heads: int, head_order: str = "grouped"):
    """q or k [B, Hk, ...] -> [B, v_heads, ...] in `head_order` (see the module doc)."""
    r = v_heads // x.shape[1]
    if r == 1:
        return x
    if head_order == "tiled":
        return jnp.tile(x, (1, r) + (1,) * (x.ndim - 2))
    return jnp.repeat(x, r, axis=1)


def padded_to_chunks(q, k, v, g, beta, chunk: int, head_order: str):
    """The chunked form's arguments checked (head_order; value heads sharing the key heads evenly) and padded along T
    to a multiple of `chunk` (padding carries beta = g = 0, so it leaves the state alone)."""
    if head_order not in HEAD_ORDERS:
        raise ValueError(f"head_order {head_order!r}; expected one of {HEAD_ORDERS}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"{v.shape[1]} value heads do not share {q.shape[1]} key heads evenly")
    pad = (-q.shape[2]) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    return q, k, v, g, beta


def chunk_inputs(q, k, v, g, beta, chunk: int = 64, head_order: str = "grouped"):
    """The parallel part of the chunked (UT-transform) form: everything except the scan over chunks.
    Returns (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay), each [B, H, n, ...] per value head.
    q and k may have fewer heads (key heads, see the module doc): their chunk products k k^T and q k^T are then
    taken once per key head, and the value heads' factors (beta, decays) applied after."""
    q, k, v, g, beta = padded_to_chunks(q, k, v, g, beta, chunk, head_order)
    H, dv = v.shape[1], v.shape[-1]
    n = q.shape[2] // chunk

    def chunked(x):
        return x.reshape(x.shape[0], x.shape[1], n, chunk, *x.shape[3:])

    def per_value_head(x):  # [B, Hk, ...] -> [B, H, ...]: a broadcast that XLA fuses into its consumers
        return expand_key_heads(x, H, head_order)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    cum = compensated_cumsum(g)  # [B, H, n, C]

    upper = jnp.triu(jnp.ones((chunk, chunk), dtype=bool), 1)
    pair_decay = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    k_t = jnp.swapaxes(k, -1, -2)
    # the chunk products once per key head; (beta k) k^T as beta_i (k k^T)_ij
    ut_system = beta[..., :, None] * per_value_head(_mm(k, k_t)) * pair_decay
    intra = per_value_head(_mm(q, k_t)) * pair_decay
    q, k = per_value_head(q), per_value_head(k)
    k_beta = k * beta[..., None]
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]

    # X = inv(I + strictly_lower(ut)) rhs; the reference ignores the diagonal and multiplies by the inverse too.
    rhs = jnp.concatenate([v * beta[..., None], decayed_k_beta], axis=-1)
    solved = _mm(unit_lower_inverse(ut_system), rhs)
    new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]

    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, n]
    return new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, *, boundary_block=None,
                           head_order: str = "grouped"):
    """Chunked (UT-transform) form. Returns (out [B, H, T, dv], final state); given boundary_block ([B] int32, a
    chunk index from 0 to the number of chunks), also the state entering that chunk of each sequence (the final
    state at the number of chunks): the DeltaNet layer keeps it to resume prefill on an unchanged chunk grid."""
    B, H, T, dv = v.shape
    xs = chunk_inputs(q, k, v, g, beta, chunk, head_order)
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


def gated_delta_rule(q, k, v, g, beta, state, *, chunked: bool, boundary_block=None, head_order: str = "grouped"):
    """The one entry point models call: chunked (prefill) or recurrent (decode) form; `boundary_block` (chunked
    form only): see chunk_gated_delta_rule; q and k may have fewer heads than v (see the module doc). The chunked
    form takes the Pallas scan kernel when luxjax.ops.backend says so (2x XLA on an H200 at T=1012). The recurrent
    form stays on XLA: its fused elementwise update ran near HBM peak, faster than the Pallas recurrent kernel (29
    vs 47 us at B=16, 48 heads)."""
    if chunked:
        if backend.use_pallas() and _dims_supported(q.shape[-1], v.shape[-1]):
            from pallas_kernels.gated_delta import gated_delta_chunked

            return gated_delta_chunked(q, k, v, g, beta, state, boundary_block=boundary_block, head_order=head_order,
                                       interpret=backend.interpret())
        return chunk_gated_delta_rule(q, k, v, g, beta, state, boundary_block=boundary_block, head_order=head_order)
    if boundary_block is not None:
        raise ValueError("boundary_block is an output of the chunked form only")
    q, k = (expand_key_heads(x, v.shape[1], head_order) for x in (q, k))
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def token_offsets(k_heads: int, dk: int, heads: int, dv: int) -> dict[str, int]:
    """Where a token's delta-rule inputs start in its packed row [q (Hk*dk), k (Hk*dk), v (H*dv), g (H), beta (H)]
    (the DeltaNet cache's pending rows and the decode kernels' tokens), and the row's width."""
    q, k, v = 0, k_heads * dk, 2 * k_heads * dk
    g = v + heads * dv
    return {"q": q, "k": k, "v": v, "g": g, "beta": g + heads, "width": g + 2 * heads}


def decode_inputs_fused(conv, pending, dk: int, dv: int) -> bool:
    """Whether gated_delta_decode_inputs takes a decode token: the conv window and pending rows as LayerSlices of
    their stacks, the Pallas kernels chosen, key and value heads of one power-of-two size."""
    return (isinstance(conv, LayerSlice) and isinstance(pending, LayerSlice) and backend.use_pallas()
            and dk == dv and _dims_supported(dk, dv))


def gated_delta_decode_inputs(qkv, b, a, conv_weight, a_log, dt_bias, conv: LayerSlice, pending: LayerSlice, active,
                              row, *, k_heads: int, eps: float = 1e-6):
    """A Gated DeltaNet decode token's packed delta-rule inputs from its projections (qkv [B, C], b, a [B, H]), the
    conv window and pending row written where they lie: pallas_kernels.gated_delta.gated_delta_decode_inputs, where
    decode_inputs_fused says so (the model's own XLA form otherwise). The parameters (conv_weight [C, taps], a_log,
    dt_bias [H]) may be LayerSlices of one layer of their stacks (read there) or arrays. Returns (tokens [B, width],
    conv, pending)."""
    from pallas_kernels.gated_delta import gated_delta_decode_inputs as kernel

    stacks, param_layer = layer_stacks((conv_weight, a_log, dt_bias))
    tokens, convs, rows = kernel(qkv, b, a, *stacks, param_layer, conv.stacked, pending.stacked, conv.index, active,
                                 row, k_heads=k_heads, eps=eps, interpret=backend.interpret())
    return tokens, conv.of(convs), pending.of(rows)


def gated_delta_decode_step(tokens, k_heads: int, state, boundary, pick, *, head_order: str = "grouped"):
    """One decode token on states cached value-major ([B, H, dv, dk], the DeltaNet cache's layout), either arrays or
    LayerSlices of stacks over a decoder's scanned layers. tokens [B, width]: q, k (Hk = k_heads key heads), v, g,
    beta packed as token_offsets says; pick [B] bool: sequences whose new state also becomes their boundary. Returns
    (out [B, H, 1, dv], state, boundary): LayerSlices of the updated stacks, stepped where they lie by the Pallas
    kernel where luxjax.ops.backend chooses it, else the recurrent form's state (an array) and the boundary written
    for the picked sequences (a select, or a scatter into a LayerSlice's stack). (gated_delta_rule's recurrent form
    stays on XLA: on separate arrays XLA's fusion was as fast; on the stacks the kernel saves the copies, see its
    docstring.)"""
    B = tokens.shape[0]
    H, dv, dk = (state.stacked if isinstance(state, LayerSlice) else state).shape[-3:]
    if (isinstance(state, LayerSlice) and isinstance(boundary, LayerSlice) and backend.use_pallas()
            and _dims_supported(dk, dv) and head_order in HEAD_ORDERS):
        from pallas_kernels.gated_delta import gated_delta_decode_step as kernel

        out, states, boundaries = kernel(tokens, state.stacked, boundary.stacked, state.index, pick, k_heads=k_heads,
                                         head_order=head_order, interpret=backend.interpret())
        return out[:, :, None], state.of(states), boundary.of(boundaries)
    at = token_offsets(k_heads, dk, H, dv)
    part = lambda name, *shape: tokens[:, at[name]: at[name] + math.prod(shape)].reshape(B, *shape)  # noqa: E731
    q, k = (jnp.swapaxes(part(name, 1, k_heads, dk), 1, 2) for name in ("q", "k"))  # [B, Hk, 1, dk]
    v = jnp.swapaxes(part("v", 1, H, dv), 1, 2)
    g, beta = (jnp.swapaxes(part(name, 1, H), 1, 2) for name in ("g", "beta"))
    out, new = gated_delta_rule(q, k, v, g, beta, jnp.swapaxes(layer_value(state), -1, -2), chunked=False,
                                head_order=head_order)
    new = jnp.swapaxes(new, -1, -2)
    if isinstance(boundary, LayerSlice):
        return out, new, boundary.put_sequences(pick, new)
    return out, new, jnp.where(pick.reshape(pick.shape + (1,) * (new.ndim - 1)), new, boundary)


def _dims_supported(dk: int, dv: int) -> bool:
    """Whether the Pallas delta-rule kernels take key and value heads of these sizes (powers of two, >= 16)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))
