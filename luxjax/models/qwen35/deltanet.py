"""Gated DeltaNet layer of the Qwen3.5 decoder: causal depthwise conv with state, beta/decay gates,
L2-normalised q/k, the gated delta rule (fp32 state), gated RMSNorm output.

The layer works on float32 activations in both compute modes. In bfloat16 mode the projections whose outputs
feed q, k, beta and the decay take their float32 inputs through ops.linear.split_linear_many (x's bf16 high and low
parts through bf16 products) rather than rounding them to bf16: rounding this layer's inputs to bf16 was most of
bf16 mode's error, and nearly all of that through q and k. Measured against transformers' float32 logits on random
checkpoints (RMS error, ratio2-interval3 seeds 11 / 22 / 33, three image prompts each): every projection split
0.081 / 0.096 / 0.066; q, k, beta and the decay split (the rule since) 0.089 / 0.103 / 0.077; none split 0.094 /
0.114 / 0.094; transformers' own bf16 0.121 / 0.123 / 0.152. In prefill each split output costs a second GEMM:
splitting all of them took 17 ms of a 1,012-token prefill of the 27B shapes on an H200 (benchmarks/RESULTS.md,
2026-12-02, session 17), v, z and the output projection about 13 of it. Rounding the weights alone costs nothing
measurable.

Prefill runs the chunked form on blocks of 64 tokens counted from the sequence start, whatever the prefill chunks:
the cache keeps, besides the current state, the state at the last multiple of 64 tokens and the delta-rule inputs
of the tokens since, and a chunk continues that block. Every block then sees the same inputs as in a one-pass
prefill, and on the CPU chunked prefill reproduces the one pass exactly (fixture, chunks of 1, 7 and 64; with
blocks counted per chunk, chunks of 1 and 7 were 1.6e-4..1.5e-3 off in the logits). Costs: at most one more block
per prefill call, a row write and a select per decode step, and per slot 5.8 MB per layer at the 27B shapes
(16 key / 48 value heads of 128: 278 MB over its 48 DeltaNet layers, next to the state's 151 MB)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from luxjax.layers.basic import GatedRMSNorm, KernelParam, Linear, row_sum
from luxjax.models.qwen35.config import TextConfig
from luxjax.ops.delta_rule import (
    decode_inputs_fused, gated_delta_decode_inputs, gated_delta_decode_step, gated_delta_rule)
from luxjax.ops.linear import LayerSlice, layer_value, linear_many, split_linear_many


BLOCK = 64  # the chunked form's block of tokens; prefill keeps the blocks at multiples of BLOCK from token 0


class DeltaInputs(NamedTuple):
    """The delta rule's inputs per token, token-major: q, k [B, T, k_heads, k_dim] L2-normalised (q also scaled),
    kept per key head (expanded to the value heads where the rule runs); v [B, T, v_heads, v_dim];
    g, beta [B, T, v_heads]."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array

    def packed(self) -> jax.Array:
        """[B, T, width]: side by side, as DeltaNetCache.pending keeps them (one array: one row write per step)."""
        B, T = self.g.shape[:2]
        return jnp.concatenate([x.reshape(B, T, -1) for x in self], axis=-1)


def input_shapes(k_heads: int, k_dim: int, v_heads: int, v_dim: int) -> DeltaInputs:
    """The per-token shapes of DeltaInputs' fields."""
    return DeltaInputs((k_heads, k_dim), (k_heads, k_dim), (v_heads, v_dim), (v_heads,), (v_heads,))


def unpack(rows, shapes: DeltaInputs) -> DeltaInputs:
    """DeltaInputs from rows [B, T, width] packed by DeltaInputs.packed."""
    ends = np.cumsum([math.prod(s) for s in shapes])
    return DeltaInputs(*(rows[..., end - math.prod(s) : end].reshape(*rows.shape[:2], *s)
                         for s, end in zip(shapes, ends)))


class DeltaNetCache(NamedTuple):
    conv: jax.Array  # [B, kernel-1, conv_dim] float32: the last inputs of the causal conv
    # The delta rule's state [B, v_heads, k_dim, v_dim] kept value-major, [B, v_heads, v_dim, k_dim] (as_cached):
    state: jax.Array  # float32, after every cached token (decode steps from it)
    boundary: jax.Array  # like state: after the cached tokens up to the last multiple of BLOCK
    pending: jax.Array  # [B, BLOCK, width] float32: DeltaInputs.packed of the tokens since, rows < start % BLOCK


def l2_normalize(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(row_sum(x * x) + eps)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TextConfig, w):
        self.k_heads = cfg.linear_num_key_heads
        self.v_heads = cfg.linear_num_value_heads
        self.k_dim = cfg.linear_key_head_dim
        self.v_dim = cfg.linear_value_head_dim
        self.head_order = "tiled" if cfg.linear_value_head_order == "tiled" else "grouped"
        self.in_proj_qkv = Linear(w("in_proj_qkv.weight"))
        self.in_proj_z = Linear(w("in_proj_z.weight"))
        self.in_proj_b = Linear(w("in_proj_b.weight"))
        self.in_proj_a = Linear(w("in_proj_a.weight"))
        conv = w("conv1d.weight")  # [conv_dim, 1, kernel] as stored
        self.conv_weight = KernelParam(conv.reshape(conv.shape[0], conv.shape[-1]))
        self.dt_bias = KernelParam(w("dt_bias"))
        self.A_log = KernelParam(w("A_log"))
        self.norm = GatedRMSNorm(w("norm.weight"), cfg.rms_norm_eps)
        self.out_proj = Linear(w("out_proj.weight"))

    def _conv(self, qkv, cache_conv, valid_len):
        """Causal depthwise conv over [previous inputs; this chunk] with float32 accumulation (the reference conv
        rounds once, not per tap), then SiLU. Returns the new conv state: the last kernel-1 inputs up to each
        sequence's last valid token."""
        w = layer_value(self.conv_weight.get_value()).astype(jnp.float32)
        kernel = w.shape[-1]
        T = qkv.shape[1]
        xs = jnp.concatenate([cache_conv.astype(qkv.dtype), qkv], axis=1)  # [B, K-1+T, C]
        xf = xs.astype(jnp.float32)
        out = sum(xf[:, j : j + T, :] * w[:, j] for j in range(kernel)).astype(qkv.dtype)
        new_conv = take_rows(xs, valid_len, kernel - 1)
        return jax.nn.silu(out.astype(jnp.float32)).astype(qkv.dtype), new_conv

    def _heads_major(self, tokens: DeltaInputs):
        """The delta rule's arguments [B, heads, T, ...] from token-major inputs; q and k keep their key heads (the
        rule shares each among its value heads in self.head_order)."""
        return tuple(jnp.swapaxes(x, 1, 2) for x in tokens)

    def _prefill_rule(self, tokens: DeltaInputs, cache: DeltaNetCache, start, valid_len, block_aligned: bool):
        """Chunked form from `boundary` over [pending tokens; this chunk]: its blocks start at multiples of BLOCK
        from token 0 whatever the chunking, so every block sees the inputs it sees in a one-pass prefill and the
        float32 results do not depend on the chunk size. Returns (out [B, T, v_heads, v_dim], new cache fields).
        block_aligned (no pending rows): the chunk's inputs go to the rule as they are, not packed into a buffer
        behind the pending rows and unpacked again (two copies of them fewer)."""
        T = tokens.q.shape[1]
        if block_aligned:
            buffer_rows = -(-T // BLOCK) * BLOCK
            inputs = DeltaInputs(*(pad_rows(x, buffer_rows) for x in tokens))
            offset, filled = jnp.zeros_like(valid_len), valid_len
        else:  # room for up to BLOCK - 1 pending rows and the block holding the last token, whole
            offset = start % BLOCK  # = the pending rows
            buffer_rows = -(-(BLOCK + T) // BLOCK) * BLOCK
            buffer = place_after_pending(cache.pending, tokens.packed(), offset, buffer_rows)
            inputs = unpack(buffer, input_shapes(self.k_heads, self.k_dim, self.v_heads, self.v_dim))
            filled = offset + valid_len
        out, state, boundary = gated_delta_rule(*self._heads_major(inputs), as_cached(cache.boundary), chunked=True,
                                                boundary_block=filled // BLOCK, head_order=self.head_order)
        out = take_rows(jnp.swapaxes(out, 1, 2), offset, T)
        return out, (as_cached(state), as_cached(boundary), last_block_rows(inputs, filled))

    def _decode(self, qkv, b, a, cache: DeltaNetCache, start, valid):
        """Recurrent form from `state` for one token; its inputs join the pending rows, and when they complete a
        block the boundary moves to the new state (the pending rows then count from 0 again: prefill reads only
        rows < start % BLOCK). Idle rows (valid False) keep every field. Fields given as LayerSlices of the stacked
        caches (decode) are updated in their stacks: the token's inputs, conv window and pending row by one kernel
        where luxjax.ops.delta_rule.decode_inputs_fused says so, the state by gated_delta_decode_step.
        Returns (out [B, 1, v_heads, v_dim], (conv, state, boundary, pending))."""
        if qkv.shape[1] != 1:
            raise ValueError(f"the recurrent (decode) form takes one token per sequence, got {qkv.shape[1]}")
        active, row = valid[:, 0], start % BLOCK
        if decode_inputs_fused(cache.conv, cache.pending, self.k_dim, self.v_dim):
            packed, conv, pending = gated_delta_decode_inputs(
                qkv[:, 0], b[:, 0], a[:, 0], self.conv_weight.get_value(), self.A_log.get_value(),
                self.dt_bias.get_value(), cache.conv, cache.pending, active, row, k_heads=self.k_heads)
        else:
            tokens, conv = self._token_inputs(qkv, b, a, layer_value(cache.conv), valid)
            packed = tokens.packed()[:, 0]
            pending = write_row(cache.pending, packed[:, None], row, active)
        out, state, boundary = gated_delta_decode_step(packed, self.k_heads, cache.state, cache.boundary,
                                                       active & (row == BLOCK - 1), head_order=self.head_order)
        return jnp.swapaxes(out, 1, 2), (conv, state, boundary, pending)

    def _token_inputs(self, qkv, b, a, conv_window, valid) -> tuple[DeltaInputs, jax.Array]:
        """The delta rule's inputs of a chunk from its projections (qkv [B, T, C], b, a [B, T, v_heads]) and the conv
        window before it: the causal conv and SiLU, q and k L2-normalised (q scaled), beta and the decay; padded
        tokens (valid False) get k = v = g = beta = 0. Returns (inputs, the conv window after the chunk)."""
        B, T, _ = qkv.shape
        qkv, new_conv = self._conv(qkv, conv_window, jnp.sum(valid, axis=1).astype(jnp.int32))
        new_conv = new_conv.astype(conv_window.dtype)
        key_dim = self.k_heads * self.k_dim
        q = qkv[..., :key_dim].reshape(B, T, self.k_heads, self.k_dim)
        k = qkv[..., key_dim : 2 * key_dim].reshape(B, T, self.k_heads, self.k_dim)
        v = qkv[..., 2 * key_dim :].reshape(B, T, self.v_heads, self.v_dim)

        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        a_log, dt_bias = (layer_value(p.get_value()).astype(jnp.float32) for p in (self.A_log, self.dt_bias))
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)

        q = l2_normalize(q.astype(jnp.float32)) * (self.k_dim**-0.5)
        k = jnp.where(valid[..., None, None], l2_normalize(k.astype(jnp.float32)), 0.0)
        v = jnp.where(valid[..., None, None], v.astype(jnp.float32), 0.0)
        return DeltaInputs(q, k, v, g, beta), new_conv

    def __call__(self, x, cache: DeltaNetCache, start, valid, *, chunked: bool, dtype, block_aligned: bool = False
                 ) -> tuple[jax.Array, DeltaNetCache]:
        """x [B, T, hidden] float32; start [B] tokens already cached; valid [B, T] bool (a prefix of each row):
        padded tokens leave the state unchanged. `dtype`: the compute mode (bfloat16: projections through
        split_linear_many, see the module doc). block_aligned (chunked form): the caller knows every start is a
        multiple of BLOCK (no pending rows), so the chunked form runs one block fewer; a wrong claim gives wrong
        results. Cache fields may come as LayerSlices of caches stacked over the scanned layers (decode; see
        _decode); the chunked form reads the layer's values."""
        B, T, _ = x.shape
        x = x.astype(jnp.float32)
        qkv, z, b, a = self._project(x, (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a),
                                     (2 * self.k_heads * self.k_dim, 0, None, None), dtype)
        z = z.reshape(B, T, self.v_heads, self.v_dim)
        if chunked:
            cache = DeltaNetCache(*(layer_value(c) for c in cache))
            tokens, conv = self._token_inputs(qkv, b, a, cache.conv, valid)
            valid_len = jnp.sum(valid, axis=1).astype(jnp.int32)
            out, (state, boundary, pending) = self._prefill_rule(tokens, cache, start, valid_len, block_aligned)
        else:
            out, (conv, state, boundary, pending) = self._decode(qkv, b, a, cache, start, valid)
        # the norm goes to out_proj unformed (luxjax.ops.deferred): the int8 GEMV's quantization forms it
        out = self.norm.deferred(out.astype(x.dtype).reshape(B, T, -1), z.reshape(B, T, -1))
        return self._project(out, (self.out_proj,), (0,), dtype)[0], DeltaNetCache(conv, state, boundary, pending)

    @staticmethod
    def _project(x, linears, low_rows, dtype):
        """The projections of float32 x: float32 products in float32 mode; in bfloat16 mode split_linear_many, whose
        low_rows say which outputs also get x's low part in prefill (module doc): q and k (the leading rows of
        in_proj_qkv), beta's and the decay's."""
        weights = [p.weight.get_value() for p in linears]
        if dtype == jnp.float32:
            return linear_many(x, weights)
        return split_linear_many(x, weights, low_rows)


def place_after_pending(pending, chunk, offset, buffer_rows: int):
    """[pending rows; this chunk's rows; zeros] [B, buffer_rows, width]: the chunk written at row `offset` [B], the
    pending count. The zero rows after the chunk (beta = g = k = 0) leave the state as it is."""
    tail = jnp.zeros((pending.shape[0], buffer_rows - BLOCK, pending.shape[2]), pending.dtype)
    buffer = jnp.concatenate([first_rows(pending, offset), tail], axis=1)
    return jax.vmap(lambda b, c, o: jax.lax.dynamic_update_slice_in_dim(b, c, o, axis=0))(buffer, chunk, offset)


def take_rows(x, begin, size: int):
    """Rows [begin, begin + size) of each sequence: x [B, rows, ...], begin [B]."""
    return jax.vmap(lambda r, b: jax.lax.dynamic_slice_in_dim(r, b, size, axis=0))(x, begin)


def last_block_rows(inputs: DeltaInputs, filled):
    """The rows of the block holding token `filled` [B] (the next pending rows), packed, zero from that token on.
    inputs: the buffer the rule ran on, its rows a whole number of blocks."""
    block_start = filled // BLOCK * BLOCK
    block = DeltaInputs(*(take_rows(x, block_start, BLOCK) for x in inputs))
    return first_rows(block.packed(), filled - block_start)


def pad_rows(x, rows: int):
    """x [B, T, ...] with zero rows appended up to `rows`."""
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def first_rows(x, count):
    """x [B, rows, width] with the rows from count [B] on zeroed."""
    keep = jnp.arange(x.shape[1])[None, :] < count[:, None]
    return jnp.where(keep[..., None], x, 0.0)


def write_row(rows, token, row, active):
    """rows [B, BLOCK, width] with token [B, 1, width] written at row `row` [B] of the active sequences (idle ones'
    target a row past the end: none written). An array gets a select (XLA fuses it with the write of the layer's
    slice back into the stacked cache); a LayerSlice of the stacked rows gets the row scattered into the stack, so
    one row is written, not the layer's whole [B, BLOCK, width] slice (2.6 MB per DeltaNet layer and step at the
    27B shapes and batch 1)."""
    if isinstance(rows, LayerSlice):  # the stack [L, Bc, BLOCK, width]: the first B sequences' rows
        block = rows.stacked.shape[2]
        return rows.scatter((jnp.arange(token.shape[0]), jnp.where(active, row, block)), token[:, 0])
    target = jnp.where(active, row, rows.shape[1])
    at = jnp.arange(rows.shape[1])[None, :, None] == target[:, None, None]
    return jnp.where(at, token.astype(rows.dtype), rows)


def as_cached(state):
    """The delta rule's state [..., k_dim, v_dim] as DeltaNetCache keeps it, [..., v_dim, k_dim], and back (its own
    inverse). Value-major because the decode step's products sum over k_dim: XLA:GPU wants that axis minor and, with
    the state cached key-major, transposed the whole stacked state and boundary on the way in and out of every
    decode step (H200, IQ4_XS 27B: ~0.3 of 13.6 ms of kernels per step; batch-1 decode 72.7 -> 78.2 tokens/s
    without them). The chunked form's kernel takes the state key-major, so prefill transposes its layer's slices
    instead (no measurable cost there)."""
    return jnp.swapaxes(state, -1, -2)


def empty_deltanet_cache(cfg: TextConfig, batch: int) -> DeltaNetCache:
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = jnp.zeros((batch, v_heads, v_dim, k_dim), jnp.float32)
    width = sum(math.prod(s) for s in input_shapes(k_heads, k_dim, v_heads, v_dim))
    return DeltaNetCache(
        conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jnp.float32),
        state=state,
        boundary=state,
        pending=jnp.zeros((batch, BLOCK, width), jnp.float32),
    )
