"""Pallas kernels vs the XLA ops at Qwen3.5-27B shapes (GPU). Prints a markdown table; --out writes JSON;
--sweep adds rows timing other BlockSizes (the data behind each kernel's get_default).

Each case runs the op `n` times inside one jitted, unrolled loop, each call's input depending on the last
output, so Python dispatch stays out of the per-call time. Inputs that fit in L2 (60 MB on
an H200) stay there between iterations: the smallest decode cases measure L2, not HBM.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# the repository root, for running this file as a script from anywhere
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import dense_gemm, gated_delta  # noqa: E402
from pallas_kernels import prefill_attention as prefill  # noqa: E402
from pallas_kernels import vision_attention as vision  # noqa: E402

from luxjax.ops.attention import xla_block_diagonal_attention, xla_cached_attention  # noqa: E402
from luxjax.ops.delta_rule import chunk_gated_delta_rule, chunk_inputs, recurrent_gated_delta_rule  # noqa: E402
from pallas_kernels.decode_attention import (  # noqa: E402
    BlockSizes, decode_attention, gated_decode_attention, gated_decode_attention_reference)
from pallas_kernels.gated_delta import gated_delta_chunked, gated_delta_recurrent  # noqa: E402
from pallas_kernels.prefill_attention import prefill_attention  # noqa: E402
from pallas_kernels.vision_attention import vision_attention  # noqa: E402

from benchmarks.timing import call_kernels_ms  # noqa: E402

HBM_TBS, BF16_TFLOPS = 4.1, 790.0
HQ, HKV, D = 24, 4, 256  # 27B full-attention layers
DN_HEADS, DN_KEY_HEADS, DN_DIM = 48, 16, 128  # 27B DeltaNet layers


def time_op(fn, *args, n: int = 20, reps: int = 3) -> float:
    """Median seconds per call of fn(*args)."""

    @jax.jit
    def loop(*args):
        def body(_, c):
            out = fn(args[0] + c.astype(args[0].dtype), *args[1:])
            return (jax.tree.leaves(out)[0].ravel()[0] * 0).astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, jnp.float32(0), unroll=True)

    loop(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loop(*args).block_until_ready()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def normal(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def decode_cases(rng):
    S_alloc = 8192
    for B in (1, 4, 16):
        for valid in (1024, 4096):
            q = normal(rng, (B, 1, HQ, D))
            k, v = normal(rng, (B, S_alloc, HKV, D)), normal(rng, (B, S_alloc, HKV, D))
            start = jnp.full((B,), valid - 1, jnp.int32)
            f = lambda q, k, v, s, op: op(q, k, v, s, scale=D**-0.5)  # noqa: E731
            t_pl = time_op(lambda q, k, v, s: f(q, k, v, s, decode_attention), q, k, v, start)
            t_xla = time_op(lambda q, k, v, s: f(q, k, v, s, xla_cached_attention), q, k, v, start)
            t_xla_tight = time_op(lambda q, k, v, s: f(q, k, v, s, xla_cached_attention), q, k[:, :valid],
                                  v[:, :valid], start)
            gbs = 2 * B * valid * HKV * D * 2 / t_pl / 1e9
            yield dict(kernel="decode attention", shape=f"B={B} valid={valid} (cache {S_alloc})", pallas_us=t_pl * 1e6,
                       xla_us=t_xla * 1e6, xla_tight_cache_us=t_xla_tight * 1e6, metric=f"{gbs:.0f} GB/s",
                       of_peak=gbs / (HBM_TBS * 1e3))


def donated_cache_ms(op, caches, *args) -> float:
    """GPU ms of one call of op(*args, k_cache, v_cache) -> (out, k_cache, v_cache), the caches donated and fed back
    (undonated, every call would first copy the whole caches it writes a row of)."""
    step = jax.jit(lambda k_cache, v_cache, *rest: op(*rest, k_cache, v_cache), donate_argnums=(0, 1))
    state = {"caches": tuple(jnp.copy(c) for c in caches)}

    def call():
        out, *state["caches"] = step(*state["caches"], *args)
        return out

    return call_kernels_ms(call)


def gated_decode_cases(rng, sweep: bool = False):
    """A gated attention layer's decode token (norms, rotary, cache writes, attention, gate) at the 27B's shapes:
    the three kernels of gated_decode_attention against the XLA ops (its reference), GPU kernel time of one call
    (all its launches, the caches donated); with sweep, other split counts of the attention kernel."""
    S_alloc, rd, L = 8192, 64, 2
    for B in (1, 4):
        for valid in (1024, 4096):
            q_gate = normal(rng, (B, HQ, 2 * D))
            k_new, v_new = normal(rng, (B, HKV, D)), normal(rng, (B, HKV, D))
            norms = [normal(rng, (L, D), jnp.float32) for _ in range(2)]
            angles = rng.uniform(-30, 30, (B, rd // 2))
            cos, sin = (jnp.asarray(f(np.concatenate([angles, angles], -1)), jnp.float32) for f in (np.cos, np.sin))
            caches = [normal(rng, (L, B, S_alloc, HKV, D)) for _ in range(2)]
            start, active = jnp.full((B,), valid - 1, jnp.int32), jnp.ones((B,), bool)
            kw = dict(rotary_dim=rd, scale=D**-0.5, eps=1e-6)

            def op(fn):
                return lambda q_gate, k, v, qn, kn, cos, sin, kc, vc: fn(
                    q_gate, k, v, qn, kn, jnp.int32(1), cos, sin, kc, vc, jnp.int32(1), start, active, **kw)

            args = (q_gate, k_new, v_new, *norms, cos, sin)
            xla_ms = donated_cache_ms(op(gated_decode_attention_reference), caches, *args)
            default = BlockSizes.get_default(B, HKV, S_alloc, D)
            for splits in sorted({default.num_splits, *((8, 16, 32, 64) if sweep else ())}):
                bs = dataclasses.replace(default, num_splits=splits)
                ms = donated_cache_ms(op(functools.partial(gated_decode_attention, block_sizes=bs)), caches, *args)
                gbs = 2 * B * valid * HKV * D * 2 / (ms / 1e3) / 1e9
                yield dict(kernel="gated decode attention" + (" (default)" if splits == default.num_splits else ""),
                           shape=f"B={B} valid={valid} (cache {S_alloc}) splits={splits}", pallas_us=ms * 1e3,
                           xla_us=xla_ms * 1e3, metric=f"{gbs:.0f} GB/s", of_peak=gbs / (HBM_TBS * 1e3))


def prefill_cases(rng):
    T = 1024
    for prefix in (0, 3072):
        S = prefix + T
        q = normal(rng, (1, T, HQ, D))
        k, v = normal(rng, (1, S, HKV, D)), normal(rng, (1, S, HKV, D))
        start = jnp.full((1,), prefix, jnp.int32)
        t_pl = time_op(lambda q, k, v, s: prefill_attention(q, k, v, s, scale=D**-0.5), q, k, v, start, n=10)
        t_xla = time_op(lambda q, k, v, s: xla_cached_attention(q, k, v, s, scale=D**-0.5), q, k, v, start, n=10)
        pairs = T * prefix + T * (T + 1) / 2
        tflops = 4 * pairs * HQ * D / t_pl / 1e12
        yield dict(kernel="prefill attention", shape=f"T={T} prefix={prefix}", pallas_us=t_pl * 1e6,
                   xla_us=t_xla * 1e6, metric=f"{tflops:.0f} TFLOP/s", of_peak=tflops / BF16_TFLOPS)


def vision_cases(rng):
    H, Dv = 16, 72
    for sizes in ((3900,), (975,) * 4):
        seg = jnp.asarray(np.concatenate([np.full(n, i) for i, n in enumerate(sizes)]), jnp.int32)
        N = seg.shape[0]
        q, k, v = (normal(rng, (N, H, Dv)) for _ in range(3))
        t_pl = time_op(lambda q, k, v, s: vision_attention(q, k, v, s, scale=Dv**-0.5), q, k, v, seg, n=10)
        t_xla = time_op(lambda q, k, v, s: xla_block_diagonal_attention(q, k, v, s, scale=Dv**-0.5), q, k, v, seg,
                        n=10)
        shape = f"images {'+'.join(map(str, sizes))} x {H}h x {Dv}d"
        t_cudnn = cudnn_vision_time(q, k, v, seg)
        for name, t in (("vision attention", t_pl), ("vision attention, cuDNN packed", t_cudnn)):
            if t is None:
                continue
            tflops = 4 * sum(n * n for n in sizes) * H * Dv / t / 1e12
            yield dict(kernel=name, shape=shape, pallas_us=t * 1e6, xla_us=t_xla * 1e6, metric=f"{tflops:.0f} TFLOP/s",
                       of_peak=tflops / BF16_TFLOPS)


def cudnn_vision_time(q, k, v, seg):
    """Seconds per call of the vision op's cuDNN path (segments prepared once, as the tower does), or None where
    cuDNN's packed attention is unavailable."""
    from luxjax.ops import attention, backend

    if not backend.cudnn_packed_attention():
        return None
    segments = attention.image_segments(seg)
    return time_op(lambda q, k, v: attention.cudnn_block_diagonal_attention(q, k, v, segments, scale=q.shape[-1]**-0.5),
                   q, k, v, n=10)


def deltanet_inputs(rng, B, T, key_heads: int = DN_HEADS):
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(normal(rng, (B, key_heads, T, DN_DIM), jnp.float32)) * DN_DIM**-0.5
    k = unit(normal(rng, (B, key_heads, T, DN_DIM), jnp.float32))
    v = normal(rng, (B, DN_HEADS, T, DN_DIM), jnp.float32)
    g = -jax.nn.softplus(normal(rng, (B, DN_HEADS, T), jnp.float32))
    beta = jax.nn.sigmoid(normal(rng, (B, DN_HEADS, T), jnp.float32))
    return q, k, v, g, beta, normal(rng, (B, DN_HEADS, DN_DIM, DN_DIM), jnp.float32)


def deltanet_cases(rng):
    for B in (1, 16):
        args = deltanet_inputs(rng, B, 1)
        t_pl = time_op(gated_delta_recurrent, *args)
        t_xla = time_op(recurrent_gated_delta_rule, *args)
        gbs = 2 * B * DN_HEADS * DN_DIM * DN_DIM * 4 / t_pl / 1e9
        yield dict(kernel="DeltaNet recurrent", shape=f"B={B} T=1", pallas_us=t_pl * 1e6, xla_us=t_xla * 1e6,
                   metric=f"{gbs:.0f} GB/s", of_peak=gbs / (HBM_TBS * 1e3))
    args = deltanet_inputs(rng, 1, 1012, DN_KEY_HEADS)
    t_xla = time_op(chunk_gated_delta_rule, *args, n=5)
    for prepare in (True, False):
        bs = gated_delta.BlockSizes(prepare_in_kernel=prepare)
        t_pl = time_op(lambda *a: gated_delta_chunked(*a, block_sizes=bs), *args, n=5)
        yield dict(kernel="DeltaNet chunked" + ("" if prepare else ", per-chunk part in XLA"),
                   shape=f"B=1 T=1012 {DN_KEY_HEADS} key heads", pallas_us=t_pl * 1e6, xla_us=t_xla * 1e6,
                   metric="", of_peak=None)
    q, k, v, g, beta, _ = args
    xla_ms = call_kernels_ms(jax.jit(chunk_inputs), q, k, v, g, beta)
    for warps in (4, 8):
        prepare = jax.jit(functools.partial(gated_delta.gated_delta_chunk_prepare, num_warps=warps))
        ms = call_kernels_ms(prepare, q, k, v, g, beta)
        if ms is None or xla_ms is None:  # no GPU trace: wall time
            ms = 1e3 * time_op(prepare, q, k, v, g, beta, n=3)
            xla_ms = 1e3 * time_op(chunk_inputs, q, k, v, g, beta, n=3)
        yield dict(kernel=f"DeltaNet per-chunk part ({warps} warps), GPU time", shape="B=1 T=1012",
                   pallas_us=ms * 1e3, xla_us=xla_ms * 1e3, metric="", of_peak=None)


GEMM_SHAPES = ((17408, 5120), (5120, 17408), (10240, 5120), (12288, 5120), (6144, 5120), (5120, 6144), (1024, 5120))
GEMM_SWEEP = (dense_gemm.BlockSizes(128, 256, 64, 8, 3), dense_gemm.BlockSizes(128, 256, 64, 8, 4),
              dense_gemm.BlockSizes(128, 128, 64, 4, 4), dense_gemm.BlockSizes(128, 128, 64, 8, 3),
              dense_gemm.BlockSizes(128, 256, 64, 8, 3, 2), dense_gemm.BlockSizes(128, 128, 64, 4, 4, 2),
              dense_gemm.BlockSizes(64, 256, 64, 4, 4), dense_gemm.BlockSizes(256, 128, 64, 8, 3))


def gemm_cases(rng, sweep: bool = False):
    """Prefill GEMMs at M = 1,024 on a 4-layer stack: the in-place kernel against XLA's dot on the layer's slice
    and on a separate array (cuBLAS alone). Outside a loop XLA reads the slice without copying it; inside the
    layer scan it copies (benchmarks/bench_layer_scan.py measures that setting)."""
    m, layers = 1024, 4
    for n, k in GEMM_SHAPES:
        w = normal(rng, (layers, n, k))
        x = normal(rng, (m, k))
        layer = jnp.int32(2)
        own = w[2] + 0
        xla = lambda x, w, i: jnp.dot(x, jax.lax.dynamic_index_in_dim(w, i, 0, False).T)  # noqa: E731
        t_pl = time_op(lambda x, w, i: dense_gemm.stacked_gemm(x, w, i), x, w, layer, n=10)
        t_xla = time_op(xla, x, w, layer, n=10)
        t_own = time_op(lambda x, w: jnp.dot(x, w.T), x, own, n=10)
        tflops = 2 * m * n * k / t_pl / 1e12
        tiles = dense_gemm.BlockSizes.get_default(m, n, k)
        yield dict(kernel="prefill GEMM, stacked bf16", shape=f"M={m} {n}x{k} {tiles}",
                   pallas_us=t_pl * 1e6, xla_us=t_xla * 1e6, xla_own_array_us=t_own * 1e6,
                   metric=f"{tflops:.0f} TFLOP/s (cuBLAS on its own array {2 * m * n * k / t_own / 1e12:.0f})",
                   of_peak=tflops / BF16_TFLOPS)
        for bs in GEMM_SWEEP if sweep else ():
            if n % bs.block_n or k % (bs.block_k * bs.splits):
                continue
            t = time_op(lambda x, w, i: dense_gemm.stacked_gemm(x, w, i, block_sizes=bs), x, w, layer, n=10)
            yield dict(kernel="sweep prefill GEMM", shape=f"{n}x{k} {bs}", pallas_us=t * 1e6, xla_us=t_xla * 1e6,
                       metric=f"{2 * m * n * k / t / 1e12:.0f} TFLOP/s", of_peak=None)
        del w, own


def sweep_cases(rng):
    """Per kernel, one shape timed under alternative BlockSizes."""
    q = normal(rng, (1, 1024, HQ, D))
    k, v = normal(rng, (1, 4096, HKV, D)), normal(rng, (1, 4096, HKV, D))
    start = jnp.full((1,), 3072, jnp.int32)
    for bs in [prefill.BlockSizes(64, 32, 8, 2), prefill.BlockSizes(64, 64, 8, 2), prefill.BlockSizes(128, 32, 8, 2),
               prefill.BlockSizes(128, 64, 8, 2), prefill.BlockSizes(64, 64, 4, 3)]:
        t = time_op(lambda q, k, v, s: prefill_attention(q, k, v, s, scale=D**-0.5, block_sizes=bs), q, k, v, start,
                    n=5)
        yield dict(kernel="sweep prefill", shape=f"prefix=3072 {bs}", pallas_us=t * 1e6, xla_us=float("nan"),
                   metric="", of_peak=None)
    seg = jnp.zeros((3900,), jnp.int32)
    qv, kv, vv = (normal(rng, (3900, 16, 72)) for _ in range(3))
    for bs in [vision.BlockSizes(128, 64, 8, 3), vision.BlockSizes(64, 64, 4, 3), vision.BlockSizes(128, 128, 8, 2),
               vision.BlockSizes(128, 128, 8, 3), vision.BlockSizes(64, 128, 4, 3), vision.BlockSizes(128, 64, 4, 3),
               vision.BlockSizes(128, 32, 4, 3)]:
        t = time_op(lambda q, k, v, s: vision_attention(q, k, v, s, scale=0.1, block_sizes=bs), qv, kv, vv, seg, n=5)
        yield dict(kernel="sweep vision", shape=f"3900 {bs}", pallas_us=t * 1e6, xla_us=float("nan"), metric="",
                   of_peak=None)
    for B in (1, 16):
        args = deltanet_inputs(rng, B, 1)
        for bv, warps in [(16, 4), (32, 4), (64, 4), (64, 8), (128, 8)]:
            bs = gated_delta.BlockSizes(block_v=bv, num_warps=warps)
            t = time_op(lambda *a: gated_delta_recurrent(*a, block_sizes=bs), *args)
            yield dict(kernel="sweep DeltaNet recurrent", shape=f"B={B} {bs}", pallas_us=t * 1e6,
                       xla_us=float("nan"), metric="", of_peak=None)
    args = deltanet_inputs(rng, 1, 1012)
    for bv, warps, prec in [(32, 4, "ieee"), (32, 8, "tf32x3"), (16, 4, "tf32x3"), (64, 8, "tf32x3"),
                            (32, 4, "tf32x3")]:
        bs = gated_delta.BlockSizes(block_v=bv, num_warps=warps, dot_precision=prec)
        t = time_op(lambda *a: gated_delta_chunked(*a, block_sizes=bs), *args, n=3)
        yield dict(kernel="sweep DeltaNet chunked", shape=f"T=1012 {bs}", pallas_us=t * 1e6, xla_us=float("nan"),
                   metric="", of_peak=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time alternative BlockSizes")
    parser.add_argument("--only", help="comma-separated groups to run: decode, gated_decode, prefill, gemm, vision, "
                        "deltanet, sweep")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print("| kernel | shape | Pallas us | XLA us | speed-up | achieved | of peak |\n|---|---|---|---|---|---|---|")
    gemm = functools.partial(gemm_cases, sweep=args.sweep)
    gemm.__name__ = "gemm_cases"
    gated = functools.partial(gated_decode_cases, sweep=args.sweep)
    gated.__name__ = "gated_decode_cases"
    groups = ((decode_cases, gated, prefill_cases, gemm, vision_cases, deltanet_cases)
              + ((sweep_cases,) if args.sweep else ()))
    if args.only:
        groups = [g for g in groups if g.__name__.removesuffix("_cases") in args.only.split(",")]
    for cases in groups:
        try:
            for row in cases(rng):
                rows.append(row)
                peak = f"{row['of_peak']:.0%}" if row["of_peak"] is not None else ""
                xla = f"{row['xla_us']:.1f}" + (f" (tight cache {row['xla_tight_cache_us']:.1f})"
                                                if "xla_tight_cache_us" in row else "")
                print(f"| {row['kernel']} | {row['shape']} | {row['pallas_us']:.1f} | {xla} | "
                      f"{row['xla_us'] / row['pallas_us']:.2f}x | {row['metric']} | {peak} |", flush=True)
        except Exception as e:  # one failing kernel must not hide the others' numbers
            print(f"| {cases.__name__} | FAILED: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            rows.append(dict(kernel=cases.__name__, error=f"{type(e).__name__}: {e}"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
