"""Decode, prefill and vision attention kernels vs the XLA attention ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import rel_err

from luxjax.ops import backend
from pallas_kernels import decode_attention as da
from pallas_kernels import prefill_attention as pa
from pallas_kernels import vision_attention as va

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,splits", [(4, 4, 64, 1), (4, 2, 128, 3), (6, 2, 64, None)])
def test_decode_attention(seed, interpret, dtype, hq, hkv, d, splits):
    rng = np.random.default_rng(seed)
    B, S = 3, 77  # S not a multiple of block_k
    q = _normal(rng, (B, 1, hq, d), dtype)
    k, v = _normal(rng, (B, S, hkv, d), dtype), _normal(rng, (B, S, hkv, d), dtype)
    start = jnp.asarray([0, rng.integers(1, S - 1), S - 1], jnp.int32)
    blocks = da.BlockSizes(block_k=16, num_splits=splits)
    out = da.decode_attention(q, k, v, start, scale=d**-0.5, block_sizes=blocks, interpret=interpret)
    ref = da.decode_attention_reference(q, k, v, start, scale=d**-0.5)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"decode {hq=} {hkv=} {d=} {splits=} {dtype.__name__}: rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_reads_a_layer_of_stacked_caches(seed, interpret, dtype):
    """Caches stacked over layers, one layer read in place: the same result as the reference on that layer alone
    (each layer holds different values, so reading another one fails)."""
    rng = np.random.default_rng(seed)
    L, B, S, hq, hkv, d = 3, 2, 45, 4, 2, 64
    q = _normal(rng, (B, 1, hq, d), dtype)
    k, v = _normal(rng, (L, B, S, hkv, d), dtype), _normal(rng, (L, B, S, hkv, d), dtype)
    start = jnp.asarray(rng.integers(0, S, B), jnp.int32)
    layer = int(rng.integers(0, L))
    out = da.decode_attention(q, k, v, start, layer=jnp.int32(layer), scale=d**-0.5,
                              block_sizes=da.BlockSizes(block_k=16, num_splits=2), interpret=interpret)
    ref = da.decode_attention_reference(q, k[layer], v[layer], start, scale=d**-0.5)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"layer {layer} of {L}, {dtype.__name__}: rel err {err:.2e}, seed {seed}"


# (q heads, kv heads, head dim, rotary dim): three q heads a kv head (not a power of two), a rotary part as wide as
# the head (no unrotated columns), a quarter-width rotary part as in Qwen3.5 (its 27B: 24, 4, 256, 64).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,rd,splits", [(6, 2, 64, 16, 3), (4, 4, 32, 32, None), (8, 2, 128, 32, 2)])
def test_gated_decode_attention_matches_the_xla_ops(seed, interpret, dtype, hq, hkv, d, rd, splits):
    """The three-kernel decode token of a gated attention layer (q/k norms, rotary, the cache rows written in place,
    attention, the sigmoid gate) against the XLA ops in that order: the output, and the whole cache stacks (the token's
    k and v in its layer and row, nothing else moved: one sequence idle, one at the cache's last row)."""
    rng = np.random.default_rng(seed)
    L, B, S = 3, 3, 37
    q_gate = _normal(rng, (B, hq, 2 * d), dtype)
    k, v = _normal(rng, (B, hkv, d), dtype), _normal(rng, (B, hkv, d), dtype)
    q_norm, k_norm = (jnp.asarray(0.3 * rng.standard_normal((L, d)), jnp.float32) for _ in range(2))
    angles = rng.uniform(-30, 30, (B, rd // 2))
    cos, sin = (jnp.asarray(f(np.concatenate([angles, angles], axis=-1)), jnp.float32) for f in (np.cos, np.sin))
    k_cache, v_cache = _normal(rng, (L, B, S, hkv, d), dtype), _normal(rng, (L, B, S, hkv, d), dtype)
    start = jnp.asarray([rng.integers(0, S - 1), rng.integers(0, S - 1), S - 1], jnp.int32)
    active = jnp.asarray([True, False, True])
    layer = int(rng.integers(0, L))
    layer, param_layer = jnp.int32(layer), jnp.int32((layer + rng.integers(1, L)) % L)  # two different layers
    args = (q_gate, k, v, q_norm, k_norm, param_layer, cos, sin, k_cache, v_cache, layer, start, active)
    kw = dict(rotary_dim=rd, scale=d**-0.5, eps=1e-6)
    blocks = da.BlockSizes(block_k=16, num_splits=splits)
    out, k_got, v_got = da.gated_decode_attention(*args, **kw, block_sizes=blocks, interpret=interpret)
    ref, k_want, v_want = da.gated_decode_attention_reference(*args, **kw)
    where = f"{hq=} {hkv=} {d=} {rd=} {dtype.__name__}, layer {int(layer)}, seed {seed}"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{where}: output rel err {err:.2e}"
    # the rotated k: one rounding of float32 values apart at most (each a few units: 1/16 is one bf16 step at 8)
    atol = {jnp.float32: 1e-5, jnp.bfloat16: 0.07}[dtype]
    for name, got, want in (("k", k_got, k_want), ("v", v_got, v_want)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=atol,
                                   err_msg=f"{where}: {name} cache")
    untouched = np.ones((L, B, S), bool)
    untouched[int(layer), [0, 2], np.asarray(start)[[0, 2]]] = False
    for name, got, before in (("k", k_got, k_cache), ("v", v_got, v_cache)):
        assert np.array_equal(np.asarray(got)[untouched], np.asarray(before)[untouched]), f"{where}: {name} rows moved"


def test_gated_decode_fused_declines_what_its_kernels_cannot_take(monkeypatch):
    """The fused decode path is chosen only for stacked caches with the Pallas kernels on, a power-of-two head dim,
    rotary halves of a power-of-two width within the head and whole q head groups; anything else keeps the XLA ops."""
    from luxjax.ops import attention, backend
    from luxjax.ops.linear import LayerSlice

    def caches(kv_heads, d):
        stack = LayerSlice(jnp.zeros((2, 1, 8, kv_heads, d)), jnp.int32(0))
        return stack, stack

    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    assert attention.gated_decode_fused(*caches(4, 256), 24, 256, 64)  # Qwen3.5-27B
    assert attention.gated_decode_fused(*caches(2, 64), 4, 64, 64)  # rotary over the whole head
    declined = {"head dim 96": (caches(2, 96), 4, 96, 32), "rotary halves of 12": (caches(2, 64), 4, 64, 24),
                "rotary wider than the head": (caches(2, 64), 4, 64, 128), "5 q heads on 2": (caches(2, 64), 5, 64, 16),
                "odd rotary width 17": (caches(2, 64), 4, 64, 17),
                "caches as arrays": ((jnp.zeros((1, 8, 2, 64)),) * 2, 4, 64, 16)}
    for why, (kv, heads, d, rd) in declined.items():
        assert not attention.gated_decode_fused(*kv, heads, d, rd), why
    monkeypatch.setattr(backend, "use_pallas", lambda: False)
    assert not attention.gated_decode_fused(*caches(4, 256), 24, 256, 64), "the XLA path chosen"


def test_write_kv_into_a_layer_of_stacked_caches(seed):
    """write_kv on a LayerSlice writes each valid token's row into that layer of the stack and nothing else (invalid
    tokens and rows past the end dropped), against a plain loop."""
    from luxjax.ops.attention import write_kv
    from luxjax.ops.linear import LayerSlice

    rng = np.random.default_rng(seed)
    L, B, S, T, h, d = 3, 3, 10, 4, 2, 8
    stack = _normal(rng, (L, B, S, h, d), jnp.float32)
    new = _normal(rng, (B, T, h, d), jnp.float32)
    start = jnp.asarray([0, rng.integers(1, S - T), S - 2], jnp.int32)  # the last runs past the end
    valid = jnp.asarray(rng.random((B, T)) < 0.7)
    layer = int(rng.integers(0, L))
    got = write_kv(LayerSlice(stack, jnp.int32(layer)), new, start, valid)
    want = np.array(stack)
    for b in range(B):
        for t in range(T):
            if valid[b, t] and start[b] + t < S:
                want[layer, b, start[b] + t] = new[b, t]
    np.testing.assert_array_equal(np.asarray(got.stacked), want)
    assert int(got.index) == layer


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 64), (6, 2, 128), (6, 2, 64)])
def test_prefill_attention(seed, interpret, dtype, hq, hkv, d):
    rng = np.random.default_rng(seed)
    B, S, T = 2, 61, 13  # T odd; the second sequence has a prefix, the first starts at 0
    q = _normal(rng, (B, T, hq, d), dtype)
    k, v = _normal(rng, (B, S, hkv, d), dtype), _normal(rng, (B, S, hkv, d), dtype)
    start = jnp.asarray([0, rng.integers(1, S - T)], jnp.int32)
    blocks = pa.BlockSizes(block_m=16, block_k=16)
    out = pa.prefill_attention(q, k, v, start, scale=d**-0.5, block_sizes=blocks, interpret=interpret)
    ref = pa.prefill_attention_reference(q, k, v, start, scale=d**-0.5)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"prefill {hq=} {hkv=} {d=} {dtype.__name__}: rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("d", [128, 256])
def test_prefill_attention_default_tiles(monkeypatch, platform, d, dtype, seed, interpret):
    """The default tiles of each platform (ROCm's smaller, for gfx942's 64 KiB of LDS) and input width (float32's
    smaller: on a GPU, tiles that do not fit its shared memory fail to compile) at the head dims that take
    different ones, against the reference: rows past one tile and a cached prefix."""
    monkeypatch.setattr(backend, "gpu_platform", lambda: platform)
    rng = np.random.default_rng(seed)
    B, S, T, hq, hkv = 1, 200, 47, 6, 2  # 141 query rows: two 128-row tiles, three of 64, five of 32
    q = _normal(rng, (B, T, hq, d), dtype)
    k, v = _normal(rng, (B, S, hkv, d), dtype), _normal(rng, (B, S, hkv, d), dtype)
    start = jnp.asarray([rng.integers(1, S - T)], jnp.int32)
    tiles = pa.BlockSizes.get_default(d, dtype)  # passed on: the jitted kernel's cache does not know the platform
    out = pa.prefill_attention(q, k, v, start, scale=d**-0.5, block_sizes=tiles, interpret=interpret)
    err = rel_err(out, pa.prefill_attention_reference(q, k, v, start, scale=d**-0.5))
    assert err < TOL[dtype], f"{platform} {tiles} {d=} {dtype.__name__}: rel err {err:.2e}, seed {seed}"


def test_prefill_rows_past_cache_end(seed, interpret):
    """A bucketed chunk whose padded tail runs past the cache: those rows see the whole cache, like XLA."""
    rng = np.random.default_rng(seed)
    q, k, v = (_normal(rng, s, jnp.float32) for s in [(1, 9, 2, 64), (1, 20, 1, 64), (1, 20, 1, 64)])
    start = jnp.asarray([15], jnp.int32)
    out = pa.prefill_attention(q, k, v, start, scale=0.125, block_sizes=pa.BlockSizes(16, 16), interpret=interpret)
    err = rel_err(out, pa.prefill_attention_reference(q, k, v, start, scale=0.125))
    assert err < 2e-5, f"rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("d,pieces", [(72, ((0, 64), (64, 16))), (80, ((0, 64), (64, 16))), (40, ((0, 32), (32, 16))),
                                      (24, ((0, 16), (16, 16))), (100, ((0, 64), (64, 64))), (64, ((0, 64),)),
                                      (16, ((0, 16),)), (8, ((0, 16),))])
def test_vision_head_dim_pieces(d, pieces):
    assert va.head_dim_pieces(d) == pieces


# Images (segment sizes, each a contiguous run) then padding rows (segment -1); N is odd in every case. The head
# dims cover a masked 16-column tail (72: Qwen3.5's tower, 40, 24), an exact one (80), powers of two (64, 128) and
# a head narrower than one piece (8).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d,sizes,pad", [(72, (20, 7, 19), 7), (80, (33,), 0), (40, (5, 40), 2),
                                         (24, (17, 1, 30), 3), (64, (12, 21), 4), (8, (9, 18), 2),
                                         (128, (5, 40), 2), (72, (3, 70, 37), 5)])
def test_vision_attention(seed, interpret, dtype, d, sizes, pad):
    rng = np.random.default_rng(seed)
    seg = jnp.asarray(np.concatenate([np.full(n, i) for i, n in enumerate(sizes)] + [np.full(pad, -1)]), jnp.int32)
    N, H = seg.shape[0], 3
    q, k, v = (_normal(rng, (N, H, d), dtype) for _ in range(3))
    blocks = va.BlockSizes(block_q=16, block_k=16)
    out = va.vision_attention(q, k, v, seg, scale=d**-0.5, block_sizes=blocks, interpret=interpret)
    ref = va.vision_attention_reference(q, k, v, seg, scale=d**-0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"vision {d=} {sizes=} {pad=} {dtype.__name__}: rel err {err:.2e}, seed {seed}"
    assert not np.asarray(out[N - pad:], np.float32).any(), "padding rows must be zero"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vision_attention_scores_rising_across_key_blocks(seed, interpret, dtype):
    """Keys whose norms grow along the sequence: rows' running maxima rise by ~200 (base 2) over later key blocks
    (both images, masked and unmasked blocks), so the online softmax must rescale mid-loop; without it the
    probabilities overflow float32 (a kernel rescaling only at the first block failed here)."""
    rng = np.random.default_rng(seed)
    d, sizes, pad = 72, (70, 45), 3
    seg = jnp.asarray(np.concatenate([np.full(n, i) for i, n in enumerate(sizes)] + [np.full(pad, -1)]), jnp.int32)
    N, H = seg.shape[0], 2
    ramp = np.linspace(0.2, 40.0, N)[:, None, None]  # late scores reach ~200 in base 2: 2^200 overflows float32
    q = _normal(rng, (N, H, d), dtype)
    k = jnp.asarray(rng.standard_normal((N, H, d)) * ramp, dtype)
    v = _normal(rng, (N, H, d), dtype)
    blocks = va.BlockSizes(block_q=16, block_k=16)
    out = va.vision_attention(q, k, v, seg, scale=d**-0.5, block_sizes=blocks, interpret=interpret)
    ref = va.vision_attention_reference(q, k, v, seg, scale=d**-0.5)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rising scores {dtype.__name__}: rel err {err:.2e}, seed {seed}"


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 16), (16, 32)])
def test_vision_unmasked_key_blocks_are_exactly_the_clean_ones(seed, block_q, block_k):
    """_key_ranges' unmasked key blocks, against a brute-force check of every (query block, key block) pair: the
    pair needs no mask iff all its queries and keys lie in one image; the range covers every such block."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 60, size=int(rng.integers(1, 5)))
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(sizes)] + [np.full(int(rng.integers(0, 9)), -1)])
    _, _, clean = va._key_ranges(jnp.asarray(seg, jnp.int32), block_q, block_k)
    N = len(seg)
    for i, (first, end) in enumerate(np.asarray(clean)):
        queries = seg[i * block_q : (i + 1) * block_q]
        want = [kb for kb in range(-(-N // block_k)) if (kb + 1) * block_k <= N and queries.min() >= 0
                and len(set(queries) | set(seg[kb * block_k : (kb + 1) * block_k])) == 1]
        assert list(range(first, end)) == want, f"query block {i} of {seg.tolist()}: {first, end} vs {want}"


def test_ops_dispatch_to_kernels(seed, monkeypatch):
    """The ops layer's Pallas branch (forced on; interpreted on CPU) computes what its XLA path computes."""
    from luxjax.ops import attention, backend

    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    rng = np.random.default_rng(seed)
    k, v = _normal(rng, (1, 40, 2, 64), jnp.float32), _normal(rng, (1, 40, 2, 64), jnp.float32)
    for T, start in [(1, 30), (5, 20)]:
        q, s = _normal(rng, (1, T, 4, 64), jnp.float32), jnp.asarray([start], jnp.int32)
        err = rel_err(attention.cached_attention(q, k, v, s, scale=0.125),
                      attention.xla_cached_attention(q, k, v, s, scale=0.125))
        assert err < 2e-5, f"cached_attention {T=}: rel err {err:.2e}, seed {seed}"
    seg = jnp.asarray([0] * 9 + [1] * 4 + [-1] * 2, jnp.int32)
    q = _normal(rng, (15, 2, 72), jnp.float32)
    err = rel_err(attention.block_diagonal_attention(q, q, q, seg, scale=0.1),
                  attention.xla_block_diagonal_attention(q, q, q, seg, scale=0.1))
    assert err < 2e-5, f"block_diagonal_attention: rel err {err:.2e}, seed {seed}"


def _random_runs(rng, max_runs: int) -> np.ndarray:
    """Patch image ids: 1..max_runs contiguous runs of random lengths, then 0..8 padding rows (-1)."""
    sizes = rng.integers(1, 40, size=int(rng.integers(1, max_runs + 1)))
    return np.concatenate([np.full(n, i) for i, n in enumerate(sizes)] + [np.full(int(rng.integers(0, 9)), -1)])


@pytest.mark.parametrize("max_segments", [1, 3, 8])
def test_image_segments_are_the_runs(seed, max_segments):
    """image_segments' packed-sequence lengths and offsets against the runs numpy finds; fits says whether every
    run is among the first max_segments."""
    from luxjax.ops.attention import image_segments

    rng = np.random.default_rng(seed)
    for _ in range(5):
        ids = _random_runs(rng, 6)
        starts = [i for i in range(len(ids)) if ids[i] >= 0 and (i == 0 or ids[i] != ids[i - 1])]
        ends = [i + 1 for i in range(len(ids)) if ids[i] >= 0 and (i + 1 == len(ids) or ids[i + 1] != ids[i])]
        seg = image_segments(jnp.asarray(ids, jnp.int32), max_segments)
        kept = min(len(starts), max_segments)
        want_lengths = [e - s for s, e in zip(starts, ends)][:kept] + [-1] * (max_segments - kept)
        want_offsets = starts[:kept] + [ends[kept - 1]] + [-1] * (max_segments - kept)
        assert np.asarray(seg.lengths).tolist() == want_lengths, f"{ids.tolist()}, seed {seed}"
        assert np.asarray(seg.offsets).tolist() == want_offsets, f"{ids.tolist()}, seed {seed}"
        assert bool(seg.fits) == (len(starts) <= max_segments), f"{ids.tolist()}, seed {seed}"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a CUDA GPU")
@pytest.mark.parametrize("d", [72, 64])
def test_cudnn_block_diagonal_attention(seed, d):
    """cuDNN's packed-sequence attention (where backend.cudnn_packed_attention finds it) and the op's choice of it,
    against the float32 XLA path; a batch with more images than MAX_PACKED_SEGMENTS takes the kernel instead."""
    from luxjax.ops import attention, backend

    backend.cudnn_packed_attention.cache_clear()
    outside = backend.cudnn_packed_attention()
    backend.cudnn_packed_attention.cache_clear()  # first asked while a jit traces (as by the tower): same answer
    inside = []
    jax.jit(lambda x: (inside.append(backend.cudnn_packed_attention()), x)[1])(jnp.zeros(1))
    assert inside == [outside]
    if not outside:
        pytest.skip("cuDNN packed attention is not available on this GPU stack")
    rng = np.random.default_rng(seed)
    for ids in (_random_runs(rng, 6), np.repeat(np.arange(attention.MAX_PACKED_SEGMENTS + 3), 3)):
        ids = jnp.asarray(ids, jnp.int32)
        q, k, v = (_normal(rng, (ids.shape[0], 3, d), jnp.bfloat16) for _ in range(3))
        ref = attention.xla_block_diagonal_attention(*(a.astype(jnp.float32) for a in (q, k, v)), ids, scale=d**-0.5)
        segments = attention.image_segments(ids)
        outs = {"op": attention.block_diagonal_attention(q, k, v, ids, scale=d**-0.5)}
        if bool(segments.fits):
            outs["cudnn"] = attention.cudnn_block_diagonal_attention(q, k, v, segments, scale=d**-0.5)
        for name, out in outs.items():
            err = rel_err(out, ref)
            assert err < TOL[jnp.bfloat16], f"{name} {d=} ids {np.asarray(ids).tolist()}: rel err {err:.2e}, {seed=}"
            assert not np.asarray(out[np.asarray(ids) < 0], np.float32).any(), "padding rows must be zero"
