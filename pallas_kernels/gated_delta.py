"""Gated DeltaNet kernels: the recurrent (decode) update, the in-place decode step on layer-stacked states with the
kernel before it that turns a decode token's projections into its delta-rule inputs (causal conv, norms, gates;
conv window and pending row updated in place), and the scan of the chunked (prefill) form.

The recurrence acts on each column of the state S [dk, dv] independently (S^T k, the rank-one update and
S^T q all keep columns apart), so programs split dv into blocks: grid (B, H, dv / block_v), the state block
stays in registers for the whole sequence and is read and written once.

Chunked form: the parallel, per-chunk part (the UT transform, a 64x64 unitriangular inverse, and the decay
products) runs in XLA by default (luxjax.ops.delta_rule.chunk_inputs, float32 GEMMs), or, with
BlockSizes.prepare_in_kernel, in `gated_delta_chunk_prepare`: one program per (sequence, value head, chunk) takes
k k^T and q k^T, the UT system, its inverse and the decayed q and k in registers. Its inverse is the block doubling
of delta_rule.unit_lower_inverse written with whole-tile products: with X_b the block-diagonal matrix of the
inverses of the b x b diagonal blocks, X_2b = X_b - X_b (A o M_b) X_b, where M_b selects the lower-left b x b block
inside each 2b x 2b diagonal block; the same intermediate products as the recursion, so the same numerical
behaviour. Not the default: on an H200 at the 27B shapes it took 402 us per layer against XLA's 264, nearly all of
it the TF32x3 emulation of float32 products (all dots in plain TF32: 182 us; without the inverse: 268 us).
The scan kernel does the sequential part, the scan over chunks, which XLA runs as one small loop iteration per
chunk; on the way it writes out the state entering one given chunk of each sequence (the DeltaNet cache's
state at the last 64-token boundary). Compiled dots use TF32x3 (three TF32 tensor-core products, float32-level
error) on CUDA unless BlockSizes.dot_precision = "ieee", plain float32 products on other platforms (ROCm:
TF32X3_PLATFORMS); interpreted dots use Precision.HIGHEST like the XLA path.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from luxjax.ops import backend
from luxjax.ops.delta_rule import token_offsets
from pallas_kernels.common import NEG, dot


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1
    dot_precision: str = "tf32x3"  # or "ieee" (chunked form only)
    prepare_in_kernel: bool = False  # chunked form: the per-chunk part by gated_delta_chunk_prepare (module doc)

    @classmethod
    def get_default(cls, dv: int, *, recurrent: bool = False) -> "BlockSizes":
        # H200 sweep at 48 heads, dk = dv = 128: recurrent best near block_v 64, chunked scan at 32 / 4 warps.
        return cls(block_v=min(64 if recurrent else 32, dv))


# Where compiled float32 dots may be TF32x3. Triton's AMD backend lists "ieee" alone among its float32 dot input
# precisions (HIPOptions.allowed_dot_input_precisions in the versions read), so on ROCm, untried here, the dots
# stay plain float32 products (full float32 precision, slower).
TF32X3_PLATFORMS = ("cuda",)


def _precision(bs: BlockSizes, interpret: bool):
    if interpret or bs.dot_precision == "ieee" or backend.gpu_platform() not in TF32X3_PLATFORMS:
        return jax.lax.Precision.HIGHEST
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _recurrent_kernel(
    q_ref,  # [B, H, T, dk]
    k_ref,  # [B, H, T, dk]
    v_ref,  # [B, H, T, dv]
    g_ref,  # [B, H, T]
    beta_ref,  # [B, H, T]
    s0_ref,  # [B, H, dk, dv]
    o_ref,  # [B, H, T, dv]
    s_ref,  # [B, H, dk, dv]
    *,
    block_v: int,
):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)

    def step(t, s):  # s [dk, block_v]
        q, k = q_ref[b, h, t, :], k_ref[b, h, t, :]  # [dk]
        s = s * jnp.exp(g_ref[b, h, t])
        delta = beta_ref[b, h, t] * (v_ref[b, h, t, cols] - jnp.sum(s * k[:, None], axis=0))  # [block_v]
        s = s + k[:, None] * delta[None, :]
        o_ref[b, h, t, cols] = jnp.sum(s * q[:, None], axis=0)
        return s

    s_ref[b, h, :, cols] = jax.lax.fori_loop(0, q_ref.shape[2], step, s0_ref[b, h, :, cols])


def _chunk_scan_kernel(
    nv_ref,  # [B, H, n, C, dv]  new values (UT-transformed v)
    kc_ref,  # [B, H, n, C, dk]  k_cumdecay
    qd_ref,  # [B, H, n, C, dk]  q * exp(cum g)
    kd_ref,  # [B, H, n, C, dk]  k * exp(g to chunk end)
    intra_ref,  # [B, H, n, C, C] decayed causal q k^T
    cd_ref,  # [B, H, n]          chunk decay
    s0_ref,  # [B, H, dk, dv]
    block_ref,  # [B] int32       the chunk whose entering state goes to bd_ref (0..n)
    o_ref,  # [B, H, n, C, dv]
    s_ref,  # [B, H, dk, dv]
    bd_ref,  # [B, H, dk, dv]     the state entering chunk block_ref[b]
    *,
    block_v: int,
    precision,
):
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    n = nv_ref.shape[2]
    boundary_block = block_ref[b]

    _dot = functools.partial(dot, precision=precision)

    def keep_boundary(c, s):
        @pl.when(c == boundary_block)
        def _():
            bd_ref[b, h, :, cols] = s

    def step(c, s):  # s [dk, block_v]
        keep_boundary(c, s)
        v_new = nv_ref[b, h, c, :, cols] - _dot(kc_ref[b, h, c], s, ((1,), (0,)))  # [C, block_v]
        o_ref[b, h, c, :, cols] = _dot(qd_ref[b, h, c], s, ((1,), (0,))) + _dot(intra_ref[b, h, c], v_new,
                                                                                 ((1,), (0,)))
        return s * cd_ref[b, h, c] + _dot(kd_ref[b, h, c], v_new, ((0,), (0,)))

    final = jax.lax.fori_loop(0, n, step, s0_ref[b, h, :, cols])
    s_ref[b, h, :, cols] = final
    keep_boundary(n, final)


def _unit_lower_inverse(a, precision):
    """inv(I + a) for a strictly lower-triangular tile a [C, C] (C a power of two) by whole-tile block doubling
    (module doc): X_2 = I - (a o M_1), then X_2b = X_b - X_b ((a o M_b) X_b) for b = 2, 4, ..., C / 2."""
    C = a.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)

    def lower_left(log_b):  # the (i, j) in the lower-left b x b block of a 2b x 2b diagonal block
        same_pair = (i >> (log_b + 1)) == (j >> (log_b + 1))
        return same_pair & ((i >> log_b) & 1 == 1) & ((j >> log_b) & 1 == 0)

    x = jnp.where(i == j, 1.0, 0.0) - jnp.where(lower_left(0), a, 0.0)
    for log_b in range(1, C.bit_length() - 1):
        off_block = jnp.where(lower_left(log_b), a, 0.0)
        x = x - dot(x, dot(off_block, x, ((1,), (0,)), precision), ((1,), (0,)), precision)
    return x


def _chunk_prepare_kernel(
    q_ref,  # [B, Hk, Tp, dk]  L2-normalised, scaled
    k_ref,  # [B, Hk, Tp, dk]
    v_ref,  # [B, H, Tp, dv]
    beta_ref,  # [B, H, Tp]
    cum_ref,  # [B, H, Tp]      running sums of g within each chunk
    nv_ref,  # [B, H, n, C, dv]  outputs as chunk_inputs returns them
    kc_ref,  # [B, H, n, C, dk]
    qd_ref,  # [B, H, n, C, dk]
    kd_ref,  # [B, H, n, C, dk]
    intra_ref,  # [B, H, n, C, C]
    *,
    group: int,
    tiled: bool,
    precision,
):
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    C = nv_ref.shape[3]
    key_head = h % q_ref.shape[1] if tiled else h // group
    rows = pl.ds(c * C, C)
    q, k = q_ref[b, key_head, rows, :], k_ref[b, key_head, rows, :]
    beta, cum = beta_ref[b, h, rows], cum_ref[b, h, rows]
    cum_end = cum_ref[b, h, c * C + C - 1]

    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    pair_decay = jnp.exp(jnp.where(i >= j, cum[:, None] - cum[None, :], NEG))  # 0 above the diagonal
    intra_ref[b, h, c] = dot(q, k, ((1,), (1,)), precision) * pair_decay
    ut = jnp.where(i > j, beta[:, None] * dot(k, k, ((1,), (1,)), precision) * pair_decay, 0.0)
    inverse = _unit_lower_inverse(ut, precision)
    decay = jnp.exp(cum)
    nv_ref[b, h, c] = dot(inverse, v_ref[b, h, rows, :] * beta[:, None], ((1,), (0,)), precision)
    kc_ref[b, h, c] = dot(inverse, k * (beta * decay)[:, None], ((1,), (0,)), precision)
    qd_ref[b, h, c] = q * decay[:, None]
    kd_ref[b, h, c] = k * jnp.exp(cum_end - cum)[:, None]


def _check(v, state, dk: int, block_v: int):
    B, H, T, dv = v.shape
    if state.shape != (B, H, dk, dv):
        raise ValueError(f"state shape {state.shape} must be {(B, H, dk, dv)}")
    if dv % block_v or block_v < 16 or dk < 16 or dk & (dk - 1) or block_v & (block_v - 1):
        raise ValueError(f"need power-of-two dk={dk} >= 16 and block_v={block_v} >= 16 dividing dv={dv}")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "debug"))
def gated_delta_recurrent(q, k, v, g, beta, state, *, block_sizes: BlockSizes | None = None,
                          interpret: bool = False, debug: bool = False):
    """Token-by-token form (decode: T = 1). q, k [B, H, T, dk]; v [B, H, T, dv]; g, beta [B, H, T];
    state [B, H, dk, dv] float32. Returns (out [B, H, T, dv] float32, final state)."""
    B, H, T, dk = q.shape
    dv = v.shape[-1]
    bs = block_sizes or BlockSizes.get_default(dv, recurrent=True)
    _check(v, state, dk, bs.block_v)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return pl.pallas_call(
        functools.partial(_recurrent_kernel, block_v=bs.block_v),
        grid=(B, H, dv // bs.block_v),
        out_shape=[jax.ShapeDtypeStruct((B, H, T, dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, H, dk, dv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="gated_delta_recurrent",
    )(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(state))


def gated_delta_chunk_prepare(q, k, v, g, beta, *, chunk: int = 64, head_order: str = "grouped", precision=None,
                               num_warps: int = 4, interpret: bool = False, debug: bool = False):
    """luxjax.ops.delta_rule.chunk_inputs (same arguments and results) with its per-chunk products in one kernel;
    the decays' running sums (compensated, see delta_rule.compensated_cumsum) are taken in XLA first. `precision`:
    the tiles' dot precision (default: TF32x3 compiled, HIGHEST interpreted)."""
    from luxjax.ops.delta_rule import compensated_cumsum, padded_to_chunks

    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk {chunk} must be a power of two >= 16")
    q, k, v, g, beta = padded_to_chunks(*(x.astype(jnp.float32) for x in (q, k, v, g, beta)), chunk, head_order)
    B, k_heads, Tp, dk = q.shape
    H, dv = v.shape[1], v.shape[-1]
    n = Tp // chunk
    cum = compensated_cumsum(g.reshape(B, H, n, chunk))
    if precision is None:
        precision = _precision(BlockSizes(), interpret)
    per_chunk = lambda *tail: jax.ShapeDtypeStruct((B, H, n, chunk, *tail), jnp.float32)  # noqa: E731
    outs = pl.pallas_call(
        functools.partial(_chunk_prepare_kernel, group=H // k_heads, tiled=head_order == "tiled",
                          precision=precision),
        grid=(B, H, n),
        out_shape=[per_chunk(dv), per_chunk(dk), per_chunk(dk), per_chunk(dk), per_chunk(chunk)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        debug=debug,
        name="gated_delta_chunk_prepare",
    )(q, k, v, beta, cum.reshape(B, H, n * chunk))
    return (*outs, jnp.exp(cum[..., -1]))


@functools.partial(jax.jit, static_argnames=("chunk", "head_order", "block_sizes", "interpret", "debug"))
def gated_delta_chunked(q, k, v, g, beta, state, *, chunk: int = 64, boundary_block=None, head_order: str = "grouped",
                        block_sizes: BlockSizes | None = None, interpret: bool = False, debug: bool = False):
    """Chunked form (prefill), same arguments and result as gated_delta_recurrent; T padded to a multiple of
    `chunk` internally (padding carries beta = g = 0). Given boundary_block ([B] int32, 0..number of chunks), also
    returns the state entering that chunk, like luxjax.ops.delta_rule.chunk_gated_delta_rule. q and k may have
    fewer heads than v (key heads shared in `head_order`, see luxjax.ops.delta_rule)."""
    from luxjax.ops.delta_rule import chunk_inputs

    B, _, T, dk = q.shape
    H, dv = v.shape[1], v.shape[-1]
    bs = block_sizes or BlockSizes.get_default(dv)
    _check(v, state, dk, bs.block_v)
    if bs.prepare_in_kernel:
        xs = gated_delta_chunk_prepare(q, k, v, g, beta, chunk=chunk, head_order=head_order,
                                       precision=_precision(bs, interpret), interpret=interpret, debug=debug)
    else:
        xs = chunk_inputs(q, k, v, g, beta, chunk, head_order)
    n = xs[0].shape[2]
    block = jnp.full((B,), n, jnp.int32) if boundary_block is None else boundary_block.astype(jnp.int32)
    state_shape = jax.ShapeDtypeStruct((B, H, dk, dv), jnp.float32)
    out, final, boundary = pl.pallas_call(
        functools.partial(_chunk_scan_kernel, block_v=bs.block_v, precision=_precision(bs, interpret)),
        grid=(B, H, dv // bs.block_v),
        out_shape=[jax.ShapeDtypeStruct((B, H, n, chunk, dv), jnp.float32), state_shape, state_shape],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        debug=debug,
        name="gated_delta_chunk_scan",
    )(*xs, state.astype(jnp.float32), block)
    out = out.reshape(B, H, n * chunk, dv)[:, :, :T]
    return (out, final) if boundary_block is None else (out, final, boundary)


def gated_delta_reference(q, k, v, g, beta, state):
    """Token-by-token XLA form, the oracle for both kernels."""
    from luxjax.ops.delta_rule import recurrent_gated_delta_rule

    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def _decode_step_kernel(
    tokens_ref,  # [B, width]: this token's q, k (normalised, q scaled), v, g, beta packed (token_offsets)
    layer_ref,  # [1] int32: the layer of the stacks
    pick_ref,  # [B] int32: nonzero where the new state also becomes the boundary
    state_in_ref,  # [L, B, H, dv, dk] value-major, aliased to state_ref
    boundary_in_ref,  # [L, B, H, dv, dk], aliased to boundary_ref
    o_ref,  # [B, H, dv]
    state_ref,  # [L, B, H, dv, dk]
    boundary_ref,  # [L, B, H, dv, dk]
    *,
    block_v: int,
    k_heads: int,
    tiled: bool,
):
    del boundary_in_ref  # written through its alias only
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads, dv, dk = state_ref.shape[2:]
    at = token_offsets(k_heads, dk, heads, dv)
    key_head = h % k_heads if tiled else h // (heads // k_heads)
    layer = layer_ref[0]
    rows = pl.ds(j * block_v, block_v)
    q = tokens_ref[b, pl.ds(at["q"] + key_head * dk, dk)]  # [dk]
    k = tokens_ref[b, pl.ds(at["k"] + key_head * dk, dk)]
    v = tokens_ref[b, pl.ds(at["v"] + h * dv + j * block_v, block_v)]  # [block_v]
    g, beta = tokens_ref[b, at["g"] + h], tokens_ref[b, at["beta"] + h]
    s = state_in_ref[layer, b, h, rows, :] * jnp.exp(g)  # [block_v, dk]: value rows
    delta = beta * (v - jnp.sum(s * k[None, :], axis=1))  # [block_v]
    s = s + delta[:, None] * k[None, :]
    o_ref[b, h, rows] = jnp.sum(s * q[None, :], axis=1)
    state_ref[layer, b, h, rows, :] = s

    @pl.when(pick_ref[b] != 0)
    def _():
        boundary_ref[layer, b, h, rows, :] = s


DECODE_STEP_BLOCK_V = 16  # value rows per program: 384 programs at 48 heads of 128, batch 1


@functools.partial(jax.jit, static_argnames=("k_heads", "head_order", "block_v", "interpret", "debug"))
def gated_delta_decode_step(tokens, state, boundary, layer, pick, *, k_heads: int, head_order: str = "grouped",
                            block_v: int = DECODE_STEP_BLOCK_V, interpret: bool = False, debug: bool = False):
    """One decode token of the delta rule on states stacked over a decoder's layers, updated where they lie.

    tokens [B, width] float32: each sequence's token packed as token_offsets says (q, k per key head, L2-normalised,
    q scaled by dk^-0.5; the k_heads key heads shared by the H value heads in `head_order`, see
    luxjax.ops.delta_rule; v; g; beta); state, boundary [L, Bc, H, dv, dk] float32, value-major (the DeltaNet cache's
    layout), Bc >= B (sequence b is their row b; rows from B on are left alone); layer: the layer stepped; pick [B]
    bool: the sequences whose new state also becomes their boundary.
    Returns (out [B, H, dv] float32, state, boundary), the stacks aliased to the inputs (in place in a layer scan's
    carry): of layer `layer`, every state row is rewritten and the boundary rows of the picked sequences; nothing else
    is read or written. As slices, XLA copied the layer's state out, rewrote it whole and rewrote the boundary on every
    step (an H200 decode profile of the 27B at batch 1: ~13 us per DeltaNet layer and step for the copies, XLA's two
    reduce fusions and the write-backs; this kernel 3.7 us). The token comes packed, as gated_delta_decode_inputs
    writes it, so that no slicing of it runs between the two kernels."""
    B = tokens.shape[0]
    H, dv, dk = state.shape[2:]
    if state.shape[1] < B or boundary.shape != state.shape:
        raise ValueError(f"state {state.shape} and boundary {boundary.shape} must be [L, >= {B}, H, dv, dk]")
    if tokens.shape[1] != token_offsets(k_heads, dk, H, dv)["width"]:
        raise ValueError(f"tokens {tokens.shape} do not pack {k_heads} key heads of {dk} and {H} value heads of {dv}")
    if state.dtype != jnp.float32 or boundary.dtype != jnp.float32:  # updated in place: no conversion
        raise ValueError(f"state and boundary must be float32, got {state.dtype} and {boundary.dtype}")
    if H % k_heads or dv % block_v or dk & (dk - 1) or block_v & (block_v - 1):
        raise ValueError(f"need {H} value heads sharing {k_heads} key heads, power-of-two dk={dk} and block_v="
                         f"{block_v} dividing dv={dv}")
    return pl.pallas_call(
        functools.partial(_decode_step_kernel, block_v=block_v, k_heads=k_heads, tiled=head_order == "tiled"),
        grid=(B, H, dv // block_v),
        out_shape=[jax.ShapeDtypeStruct((B, H, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(boundary.shape, jnp.float32)],
        input_output_aliases={3: 1, 4: 2},
        compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        debug=debug,
        name="gated_delta_decode_step",
    )(tokens.astype(jnp.float32), jnp.reshape(layer, (1,)).astype(jnp.int32), pick.astype(jnp.int32), state,
      boundary)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _softplus(x):
    """log(1 + e^x) as jax.nn.softplus computes it (logaddexp(x, 0))."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _decode_inputs_kernel(
    layer_ref,  # [2] int32: the layer of the cache stacks, the layer of the parameter stacks
    active_ref,  # [B] int32: nonzero for the sequences taking this token
    row_ref,  # [B] int32: the pending row the token goes to
    qkv_ref,  # [B, C] float32: in_proj_qkv's output (q, k, v channels before the conv)
    b_ref,  # [B, H]: in_proj_b's output (beta before its sigmoid)
    a_ref,  # [B, H]: in_proj_a's output
    conv_w_ref,  # [Lp, C, taps]: the causal conv's weights, stacked over layers
    a_log_ref,  # [Lp, H]
    dt_bias_ref,  # [Lp, H]
    conv_in_ref,  # [L, B, taps - 1, C] float32: the last inputs of the conv, aliased to conv_ref
    pending_in_ref,  # [L, B, BLOCK, width] float32, aliased to pending_ref
    tokens_ref,  # [B, width]: out, the token's delta-rule inputs packed (token_offsets)
    conv_ref,
    pending_ref,
    *,
    k_heads: int,
    tile: int,
    eps: float,
):
    """Program (b, p): channels [p * tile, (p + 1) * tile) of sequence b, one head of q, k or v (dk = dv = tile)."""
    del pending_in_ref  # written through its alias only
    b, p = pl.program_id(0), pl.program_id(1)
    heads = a_ref.shape[1]
    at = token_offsets(k_heads, tile, heads, tile)
    layer, param_layer, active, row = layer_ref[0], layer_ref[1], active_ref[b] != 0, row_ref[b]
    cols = pl.ds(pl.multiple_of(p * tile, tile), tile)
    taps = conv_w_ref.shape[2]
    window = [conv_in_ref[layer, b, i, cols] for i in range(taps - 1)] + [qkv_ref[b, cols].astype(jnp.float32)]
    acc = jnp.zeros((tile,), jnp.float32)
    for j in range(taps):  # in the XLA form's order
        acc = acc + window[j] * conv_w_ref[param_layer, cols, j].astype(jnp.float32)
    x = acc * _sigmoid(acc)  # SiLU
    is_q, is_k = p < k_heads, (p >= k_heads) & (p < 2 * k_heads)
    normalised = x * jnp.where(is_q | is_k, lax.rsqrt(jnp.sum(x * x) + eps), 1.0)
    y = jnp.where(is_q, normalised * tile**-0.5, jnp.where(is_q | active, normalised, 0.0))
    tokens_ref[b, cols] = y

    @pl.when(active)
    def _():
        for i in range(taps - 1):
            conv_ref[layer, b, i, cols] = window[i + 1]
        pending_ref[layer, b, row, cols] = y

    @pl.when(p >= 2 * k_heads)
    def _():
        h = p - 2 * k_heads
        beta = jnp.where(active, _sigmoid(b_ref[b, h].astype(jnp.float32)), 0.0)
        g = -jnp.exp(a_log_ref[param_layer, h].astype(jnp.float32)) * _softplus(
            a_ref[b, h].astype(jnp.float32) + dt_bias_ref[param_layer, h].astype(jnp.float32))
        g = jnp.where(active, g, 0.0)
        tokens_ref[b, at["g"] + h] = g
        tokens_ref[b, at["beta"] + h] = beta

        @pl.when(active)
        def _():
            pending_ref[layer, b, row, at["g"] + h] = g
            pending_ref[layer, b, row, at["beta"] + h] = beta


@functools.partial(jax.jit, static_argnames=("k_heads", "eps", "interpret", "debug"))
def gated_delta_decode_inputs(qkv, b, a, conv_weight, a_log, dt_bias, param_layer, conv, pending, layer, active, row,
                              *, k_heads: int, eps: float = 1e-6, interpret: bool = False, debug: bool = False):
    """A Gated DeltaNet decode token's delta-rule inputs from its projections, in one launch, with the layer's conv
    window and pending row updated where they lie in their stacks.

    qkv [B, C] (C = 2 * k_heads * d + H * d: q, k, v channels of head size d), b, a [B, H]: the projections of this
    token; conv_weight [Lp, C, taps], a_log, dt_bias [Lp, H]: the layer's parameters at `param_layer` of their
    stacks (read in place: as operands, the layer scan's slices of them were copies); conv [L, Bc, taps - 1, C]
    float32: the conv's last inputs, stacked over layers; pending [L, Bc, BLOCK, width] float32: the rows since the
    last block boundary (Bc >= B: sequence b is their row b, and rows from B on are left alone); layer: the caches'
    layer; active [B] bool: the sequences taking a token (the others keep every field and get k = v = g = beta = 0);
    row [B]: the pending row each token goes to. Per channel: the causal conv over [window; token], SiLU; q and k
    L2-normalised per head (eps), q scaled by d^-0.5; beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias).
    Returns (tokens [B, width] packed as token_offsets says, conv, pending), the stacks aliased to the inputs.
    In XLA this was ~9 small fusions per layer and step (the window's slice and write-back, the norms, the masks,
    the packing and the row's scatter: ~14 us per DeltaNet layer in an H200 decode profile of the 27B); this kernel
    takes ~2.7 us there (benchmarks/RESULTS.md, session 19)."""
    B, C = qkv.shape
    heads, taps = a.shape[1], conv_weight.shape[2]
    d = C // (2 * k_heads + heads)
    at = token_offsets(k_heads, d, heads, d)
    if (C != at["g"] or d & (d - 1) or conv.shape[2:] != (taps - 1, C) or conv.shape[1] < B
            or pending.shape[1] != conv.shape[1]):
        raise ValueError(f"qkv {qkv.shape} must hold {2 * k_heads} + {heads} heads of one power-of-two size, conv "
                         f"{conv.shape} be [L, >= {B}, {taps - 1}, {C}] and pending {pending.shape} as many")
    if pending.shape[3] != at["width"] or conv.dtype != jnp.float32 or pending.dtype != jnp.float32:
        raise ValueError(f"pending {pending.shape} {pending.dtype} must be float32 rows of {at['width']}, conv "
                         f"{conv.dtype} float32")
    return pl.pallas_call(
        functools.partial(_decode_inputs_kernel, k_heads=k_heads, tile=d, eps=eps),
        grid=(B, 2 * k_heads + heads),
        out_shape=[jax.ShapeDtypeStruct((B, at["width"]), jnp.float32), jax.ShapeDtypeStruct(conv.shape, conv.dtype),
                   jax.ShapeDtypeStruct(pending.shape, pending.dtype)],
        input_output_aliases={9: 1, 10: 2},  # conv, pending
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        debug=debug,
        name="gated_delta_decode_inputs",
    )(jnp.stack([layer, param_layer]).astype(jnp.int32), active.astype(jnp.int32), row.astype(jnp.int32), qkv, b,
      a, conv_weight, a_log, dt_bias, conv, pending)
