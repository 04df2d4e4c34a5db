"""Decode matmuls as the decoder runs them: a scan over layers, each reading its layer of a stacked weight in place
(pallas_kernels.dense_gemv / quant_matmul's stacked path), on the Qwen3.5-27B shapes, against the copy ceiling.

    python benchmarks/bench_decode_gemv.py [--sweep] [--seconds 400] [--json out.json]
    python benchmarks/bench_decode_gemv.py --rows-sweep --formats IQ4_XS,Q4_K,Q6_K   (the packed regimes by rows)
    python benchmarks/bench_decode_gemv.py --split-sweep   (the int8 GEMV's tiles for its 5,120-output products)
    python benchmarks/bench_decode_gemv.py --parts-sweep   (the int8 GEMV's row tiles loaded in parts)
    python benchmarks/bench_decode_gemv.py --group-parts-sweep   (the same on the decoder's own launches)
    python benchmarks/bench_decode_gemv.py --load-sweep   (the decoder's launches, their planes loaded each way)

GB/s = weight bytes / the product kernel's time per layer (x and y are negligible), as a profiler trace of one
jitted scan over enough layers (>= 256 MB) that no layer stays in the 60 MB L2 records it (median launch); on a CPU,
and in the `scan_gb_s` column, the scan's wall time per layer (median of 15 calls), which adds the loop's and the
small ops' cost per layer: on an H200 a 17408 x 5120 IQ4_XS layer measured ~687 GB/s that way (2026-12-01, session
8) and ~1,430 GB/s by its kernel's trace time (session 9), so sweeps rank by kernel time. The XLA row is the same
product on a separate (unstacked) array, wall time: what XLA's own GEMV reaches without the scan's slice copy.
--sweep first tries tile sizes per format at 1 and 16 rows on the first shape and uses the fastest for the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from benchmarks.quant_plan import random_packed  # noqa: E402
from benchmarks.timing import call_kernels_ms, kernel_ms, median_ms, write_rows  # noqa: E402
from luxjax.ops import backend  # noqa: E402
from luxjax.ops.linear import _xla_linear  # noqa: E402
from pallas_kernels import dense_gemv, quant_gemv_int8 as qi, quant_matmul as qm  # noqa: E402

SHAPES = [(17408, 5120), (5120, 17408), (10240, 5120), (12288, 5120)]  # (out, in)
FORMATS = ["bf16", "IQ4_XS", "Q4_K", "Q6_K", "Q5_K", "Q8_0"]
ROWS = (1, 4, 16)
STACK_BYTES = 256 * 2**20


def stacked_weight(fmt: str, out: int, k: int, key, stack_bytes: int = STACK_BYTES):
    """(stacked weight, layers, bytes per layer) with >= stack_bytes in all."""
    if fmt == "bf16":
        per_layer = 2 * out * k
        layers = max(2, -(-stack_bytes // per_layer))
        return jax.random.normal(key, (layers, out, k), jnp.bfloat16) * 0.02, layers, per_layer
    one = random_packed((out, k), T[fmt], key, jnp.bfloat16)
    layers = max(2, -(-STACK_BYTES // one.nbytes))
    ws = [one] + [random_packed((out, k), T[fmt], jax.random.fold_in(key, i), jnp.bfloat16) for i in range(1, layers)]
    return jax.tree.map(lambda *a: jnp.stack(a), *ws), layers, one.nbytes


def chain(x, y):
    """The next layer's input from this one's output, whatever their widths (keeps every product live)."""
    return x * 0.999 + (1e-3 * jnp.mean(y.astype(jnp.float32), axis=1, keepdims=True)).astype(x.dtype)


@functools.cache
def scan_fn(fmt: str, block_sizes):
    """jit(x, stacked) -> x after one in-place product per layer (each layer's input depends on the last)."""
    def product(x, w, i):
        if fmt == "bf16":
            return dense_gemv.stacked_gemv(x, w, i, block_sizes=block_sizes, interpret=backend.interpret())
        if isinstance(block_sizes, qi.BlockSizes):
            return qi.int8_quant_matmul(x, w, i, block_sizes=block_sizes, interpret=backend.interpret())
        return qm.stacked_quant_matmul(x, w, i, block_sizes=block_sizes, interpret=backend.interpret())

    def run(x, w):
        layers = jax.tree.leaves(w)[0].shape[0]
        body = lambda h, i: (chain(h, product(h, w, i)), None)  # noqa: E731
        return jax.lax.scan(body, x, jnp.arange(layers))[0]

    return jax.jit(run)


def layer_ms(fmt: str, block_sizes, x, stacked, layers: int, repeats: int = 15) -> tuple[float, float]:
    """(the product kernel's ms per layer from a profiler trace, or the wall time where there is no GPU trace; the
    scan's wall ms per layer)."""
    prefix = ("stacked_gemv" if fmt == "bf16" else "int8_gemv" if isinstance(block_sizes, qi.BlockSizes)
              else "quant_matmul")
    return scan_kernel_ms(scan_fn(fmt, block_sizes), x, stacked, layers, prefix, repeats)


def scan_kernel_ms(fn, x, weights, layers: int, prefix: str, repeats: int) -> tuple[float, float]:
    """layer_ms for any layer scan fn(x, weights) of `layers` layers whose product kernel's name starts with
    `prefix`."""
    wall = median_ms(fn, x, weights, repeats=repeats) / layers
    kernel = kernel_ms(fn, x, weights, prefix=prefix, calls=2, warmups=0)
    return (wall if kernel is None else kernel), wall


def xla_separate_ms(fmt: str, stacked, x) -> float:
    """XLA's product on one unstacked layer, repeated over the layers' worth of separate copies."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    ws = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(layers)]

    def run(x, ws):
        for w in ws:
            x = chain(x, _xla_linear(x, w))
        return x

    return median_ms(jax.jit(run), x, ws) / layers


def candidates(fmt: str, m: int):
    if fmt == "bf16":
        grid = (itertools.product((8, 16, 32), (256, 512, 1024), (4, 8)) if m == 1
                else itertools.product((32, 64, 128), (64, 128, 256), (4,)))
        return [dense_gemv.BlockSizes(bn, bk, w, 3) for bn, bk, w in grid]
    block = GGML_QUANT_SIZES[T[fmt]][0]
    grid = (itertools.product((8, 16, 32), (256, 512, 1024), (4, 8)) if m == 1
            else itertools.product((16, 32, 64), (256, 512), (4,)))
    return [qm.BlockSizes(1 if m == 1 else 16, bn, max(1, v // block), w, 3) for bn, v, w in grid]


def sweep(formats, deadline: float, key) -> dict:
    out, k = SHAPES[0]
    best = {}
    for fmt in formats:
        stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
        for m in (1, 16):
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            for bs in candidates(fmt, m):
                if time.time() > deadline:
                    return best
                try:
                    ms = layer_ms(fmt, bs, x, stacked, layers, repeats=7)[0]
                except Exception as e:  # noqa: BLE001  (a tile over the shared-memory limit: skip it)
                    print(f"sweep {fmt} m={m} {bs}: failed {type(e).__name__}", flush=True)
                    continue
                print(f"sweep {fmt} m={m} {bs}: {nbytes / ms / 1e6:.0f} GB/s", flush=True)
                if (fmt, m) not in best or ms < best[fmt, m][0]:
                    best[fmt, m] = (ms, bs)
        del stacked
    return best


# The dense products of a Qwen3.5-27B decode step (out, in) and the rows x has there: 1 for the MLP and attention,
# 2 for the DeltaNet projections (ops.linear.split_linear stacks a float32 input's two bf16 parts).
DENSE_STACK_BYTES = 2 * 2**30  # a scan of 12 layers of 17408 x 5120: the call's fixed cost is a few percent
DENSE_DECODE_SHAPES = {1: [(17408, 5120), (5120, 17408), (12288, 5120), (1024, 5120), (5120, 6144)],
                       2: [(10240, 5120), (6144, 5120), (48, 5120), (5120, 6144)]}


def dense_candidates(m: int, out: int, k: int):
    """Tiles (with K splits for a minimum program count) to try for x [m, k] @ W[out, k].T."""
    grid = (itertools.product((16, 32), (256, 512), (4, 8)) if m == 1
            else itertools.product((16, 32), (128, 256), (4,)))
    for (bn, bk, warps), target in itertools.product(grid, (1, 528, 1056)):
        if out % bn or k % bk:
            continue
        yield dense_gemv.BlockSizes(bn, bk, warps, 3, dense_gemv.split_count(out // bn, k // bk, target))


def dense_sweep(deadline: float, key) -> list[dict]:
    """Every candidate on every decode shape; the fastest per shape first in its group of printed lines."""
    rows = []
    for m, shapes in DENSE_DECODE_SHAPES.items():
        for out, k in shapes:
            stacked, layers, nbytes = stacked_weight("bf16", out, k, key, DENSE_STACK_BYTES)
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            default = dense_gemv.BlockSizes.get_default(m, out, k)
            results = []
            for bs in dict.fromkeys([default, *dense_candidates(m, out, k)]):
                if time.time() > deadline:
                    break
                results.append((layer_ms("bf16", bs, x, stacked, layers, repeats=7)[0], bs))
            results.sort(key=lambda r: r[0])
            default_ms = next((ms for ms, bs in results if bs == default), float("nan"))
            for ms, bs in results[:3]:
                rows.append({"m": m, "out": out, "in": k, "gb_s": nbytes / ms / 1e6, "block_sizes": str(bs),
                             "default_gb_s": nbytes / default_ms / 1e6})
                print(json.dumps(rows[-1]), flush=True)
            del stacked
    return rows


ROWS_SWEEP_SHAPES = {"IQ4_XS": (17408, 5120), "Q4_K": (17408, 5120), "Q5_K": (5120, 17408), "Q6_K": (5120, 17408),
                     "Q8_0": (17408, 5120)}


def rows_sweep(formats, deadline: float, key) -> list[dict]:
    """Packed weights at 1..16 rows of x: the GEMV reduce (each weight decoded once, one multiply-add per row; full
    and halved K steps) against the tensor-core skinny dot (three K step sizes), float32 x as well at 1 and 2 rows (what
    split_linear sends). Sets KernelFormat.reduce_rows: the most rows where the reduce wins."""
    rows = []
    for fmt in formats:
        if fmt == "bf16":
            continue
        out, k = ROWS_SWEEP_SHAPES[fmt]
        stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
        block = GGML_QUANT_SIZES[T[fmt]][0]
        gemv = qm._stacked_block_sizes(T[fmt], 1, out)
        skinny = qm._stacked_block_sizes(T[fmt], 16, out)
        for m in (1, 2, 4, 8, 16):
            variants = []
            if m <= qm.REDUCE_MAX_ROWS:
                variants += [("reduce", dataclasses.replace(gemv, block_m=m)),
                             ("reduce, half K step", dataclasses.replace(gemv, block_m=m,
                                                                         blocks_k=max(1, gemv.blocks_k // 2)))]
            if m > 1:
                variants += [(f"skinny, {v} values", dataclasses.replace(skinny, blocks_k=max(1, v // block)))
                             for v in (256, 512, 1024)]
            for dtype in (jnp.bfloat16, jnp.float32) if m <= 2 else (jnp.bfloat16,):
                x = jax.random.normal(key, (m, k), dtype)
                for name, bs in variants:
                    if time.time() > deadline or (dtype == jnp.float32 and not name.startswith("reduce")):
                        continue
                    ms, wall = layer_ms(fmt, bs, x, stacked, layers, repeats=9)
                    rows.append({"format": fmt, "out": out, "in": k, "m": m, "x": jnp.dtype(dtype).name,
                                 "regime": name, "gb_s": nbytes / ms / 1e6, "scan_gb_s": nbytes / wall / 1e6,
                                 "block_sizes": str(bs)})
                    print(json.dumps(rows[-1]), flush=True)
        del stacked
    return rows


# block_n, values a K step, warps, stages
SKINNY_GRID = list(itertools.product((32, 64, 128), (256, 512), (4, 8), (1, 3)))


# (format, out, in, rows of x) for --skinny-check: the 27B's DeltaNet products at 32 rows (both bf16 parts of 16
# float32 rows in one launch), its MLP's at 32 rows (a decode step of 32 sequences), and the formats the
# --skinny-sweep grid left out
SKINNY_CHECKS = [("IQ4_XS", 16384, 5120, 32), ("IQ4_XS", 5120, 6144, 32), ("Q4_K", 16384, 5120, 32),
                 ("Q6_K", 5120, 6144, 32), ("IQ4_XS", 17408, 5120, 32), ("IQ4_XS", 5120, 17408, 32),
                 ("Q4_K", 17408, 5120, 32), ("Q5_K", 5120, 17408, 16), ("Q8_0", 17408, 5120, 16)]


def skinny_check(deadline: float, key) -> list[dict]:
    """The skinny dot's default tiles on SKINNY_CHECKS against one change each (3 stages, 32, 64 or 128 output
    rows, half and twice the K step, 8 warps)."""
    return _time_skinny_cases(SKINNY_CHECKS, lambda default: [
        dataclasses.replace(default, num_stages=3), *(dataclasses.replace(default, block_n=n) for n in (32, 64, 128)),
        dataclasses.replace(default, blocks_k=max(1, default.blocks_k // 2)),
        dataclasses.replace(default, blocks_k=2 * default.blocks_k), dataclasses.replace(default, num_warps=8)],
        deadline, key)


# (format, out, in, rows of x) for --skinny-splits: the 27B's decode products at 16 and 32 rows
SKINNY_SPLIT_CASES = [("IQ4_XS", 17408, 5120, 32), ("IQ4_XS", 5120, 17408, 32), ("IQ4_XS", 16384, 5120, 32),
                      ("IQ4_XS", 5120, 6144, 32), ("Q4_K", 17408, 5120, 32), ("IQ4_XS", 17408, 5120, 16),
                      ("IQ4_XS", 5120, 17408, 16), ("Q6_K", 5120, 17408, 16), ("Q6_K", 5120, 17408, 32),
                      ("Q6_K", 10240, 5120, 32), ("Q5_K", 5120, 17408, 32), ("Q8_0", 17408, 5120, 32),
                      ("Q6_K", 17408, 5120, 16), ("Q5_K", 5120, 17408, 16), ("Q8_0", 17408, 5120, 16)]


def skinny_splits(formats, deadline: float, key) -> list[dict]:
    """The skinny dot's default tiles on SKINNY_SPLIT_CASES of `formats` at one and two blocks a K step, each with K
    split 1, 2, 4 and 8 ways and the default split count (dense_gemv.split_count: K split until the format's
    min_programs), and at 1, 2 and 16 blocks a K step split by the rule before session 29 (until
    dense_gemv.MIN_PROGRAMS; 16 blocks: Q8_0's 512 values a step)."""
    cases = [case for case in SKINNY_SPLIT_CASES if case[0] in formats]
    return _time_skinny_cases(cases, lambda default: [
        *(dataclasses.replace(default, blocks_k=kb, splits=s) for kb in (1, 2) for s in (None, 1, 2, 4, 8)),
        *(dataclasses.replace(default, blocks_k=kb, splits=None, min_programs=qm.MIN_PROGRAMS) for kb in (1, 2, 16))],
        deadline, key)


def _time_skinny_cases(cases, changes, deadline: float, key) -> list[dict]:
    """Each (format, out, in, rows of x) case at its default skinny tiles and at changes(default) (repeats dropped),
    as _time_skinny."""
    rows = []
    for fmt, out, k, m in cases:
        stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
        default = qm._stacked_block_sizes(T[fmt], m, out)
        variants = list(dict.fromkeys([default, *changes(default)]))
        rows += _time_skinny(fmt, out, k, m, stacked, layers, nbytes, variants, deadline, key)
        del stacked
    return rows


def _time_skinny(fmt, out, k, m, stacked, layers, nbytes, variants, deadline, key) -> list[dict]:
    """Kernel time per layer of m rows of bf16 x times the stacked weight at each of the block sizes."""
    rows = []
    x = jax.random.normal(key, (m, k), jnp.bfloat16)
    for bs in variants:
        if time.time() > deadline:
            break
        try:
            ms, _ = layer_ms(fmt, bs, x, stacked, layers, repeats=5)
        except Exception as e:  # a tile the compiler refuses (shared memory, registers)
            print(f"{fmt} {bs}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue
        rows.append({"format": fmt, "out": out, "in": k, "m": m, "x": "bfloat16", "block_sizes": str(bs),
                     "default": bs == qm._stacked_block_sizes(T[fmt], m, out), "ms": ms, "gb_s": nbytes / ms / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def skinny_sweep(formats, deadline: float, key) -> list[dict]:
    """The fused kernel's tensor-core regime (5 to 16 rows of bf16 x) at other tiles than its default: the whole grid
    on IQ4_XS 17408 x 5120 at 16 rows, then the default and the three fastest there on every format and shape. The
    grid's K splits follow dense_gemv.MIN_PROGRAMS; --skinny-splits times the split counts."""
    stacked, layers, nbytes = stacked_weight("IQ4_XS", 17408, 5120, key)
    grid = [qm.BlockSizes(16, bn, max(1, v // 256), w, st) for bn, v, w, st in SKINNY_GRID]
    rows = _time_skinny("IQ4_XS", 17408, 5120, 16, stacked, layers, nbytes,
                        [qm._stacked_block_sizes(T.IQ4_XS, 16, 17408), *grid], deadline, key)
    del stacked
    by_name = {str(bs): bs for bs in grid}
    best = [by_name[r["block_sizes"]] for r in sorted((r for r in rows if not r["default"]), key=lambda r: r["ms"])[:3]]
    for fmt in formats:
        for out, k in ((17408, 5120), (5120, 17408)):
            if (fmt, out) == ("IQ4_XS", 17408):
                continue
            stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
            block = GGML_QUANT_SIZES[T[fmt]][0]
            variants = [qm._stacked_block_sizes(T[fmt], 16, out)] + [
                dataclasses.replace(bs, blocks_k=max(1, bs.blocks_k * 256 // block)) for bs in best]
            rows += _time_skinny(fmt, out, k, 16, stacked, layers, nbytes, variants, deadline, key)
            del stacked
    return rows


INT8_SHAPES = [(17408, 5120), (5120, 17408), (6144, 5120), (1024, 5120)]  # IQ4_XS decode products of the 27B
INT8_CASES = [(1, jnp.bfloat16), (1, jnp.float32), (2, jnp.float32), (4, jnp.bfloat16)]  # (rows, x dtype)


INT8_EXTRA = [qi.BlockSizes(16, 1, 8), qi.BlockSizes(8, 1, 4), qi.BlockSizes(16, 4, 16), qi.BlockSizes(32, 4, 16)]


def int8_candidates():
    return [qi.BlockSizes(bn, kb, warps) for bn, kb, warps in itertools.product((8, 16, 32), (2, 4, 8), (4, 8))]


def int8_sweep(deadline: float, key, first_sweep: bool = True, formats=("IQ4_XS",), defaults_only: bool = False
               ) -> list[dict]:
    """Packed formats at 1..4 rows: the int8 GEMV (on the first format's first shape and case every tile candidate,
    then the best three everywhere; with first_sweep off the default and INT8_EXTRA; with defaults_only the default
    tiles) against the float GEMV reduce's default tiles. Formats after the first run the default tiles only, on the
    MLP's two shapes."""
    rows, ranked = [], []
    for fmt_i, fmt in enumerate(formats):
        shapes = INT8_SHAPES if fmt_i == 0 else INT8_SHAPES[:2]
        for shape_i, (out, k) in enumerate(shapes):
            stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
            for case_i, (m, dtype) in enumerate(INT8_CASES):
                x = jax.random.normal(key, (m, k), dtype)
                first = fmt_i == shape_i == case_i == 0 and first_sweep and not defaults_only
                default = qi.BlockSizes.get_default(m, out, T[fmt], k // 256, qi.levels_for(dtype))
                variants = [("float reduce", qm._stacked_block_sizes(T[fmt], m, out))]
                tiles = (int8_candidates() if first else [default] if fmt_i or defaults_only
                         else dict.fromkeys([default, *ranked[:3], *INT8_EXTRA]))
                variants += [("int8", bs) for bs in tiles]
                for name, bs in variants:
                    if time.time() > deadline or (name == "int8" and out % bs.block_n):
                        continue
                    row = packed_row(fmt, bs, x, stacked, layers, nbytes, out, kernel=name)
                    if row is None:
                        continue
                    rows.append(row)
                    if first and name == "int8":
                        ranked.append(bs)
                if first:  # fastest first
                    ranked.sort(key=lambda bs: -next(r["gb_s"] for r in rows if r["block_sizes"] == str(bs)))
            del stacked
    return rows


# The int8 GEMV's streaming options (BlockSizes.prefetch / tiles) against the tiles of session 15 (16 rows, 4 blocks
# per K step, 8 warps, no prefetch), per decode product of the 27B: (out, in, rows, x dtype).
STREAM_CASES = [(17408, 5120, 1, jnp.bfloat16), (17408, 5120, 1, jnp.float32), (5120, 17408, 1, jnp.bfloat16),
                (10240, 5120, 1, jnp.float32), (6144, 5120, 1, jnp.float32), (12288, 5120, 1, jnp.bfloat16),
                (5120, 6144, 1, jnp.float32), (1024, 5120, 1, jnp.bfloat16), (17408, 5120, 4, jnp.bfloat16)]
STREAM_VARIANTS = [qi.BlockSizes(16, 4, 8, prefetch=False), qi.BlockSizes(16, 4, 8, prefetch=True),
                   qi.BlockSizes(16, 2, 8, prefetch=False), qi.BlockSizes(16, 2, 8, prefetch=True),
                   qi.BlockSizes(16, 2, 4, prefetch=True), qi.BlockSizes(8, 4, 8, prefetch=True),
                   qi.BlockSizes(8, 2, 4, prefetch=True),
                   qi.BlockSizes(32, 2, 8, prefetch=True), qi.BlockSizes(16, 4, 4, prefetch=True),
                   qi.BlockSizes(16, 2, 8, prefetch=True, tiles=2), qi.BlockSizes(16, 2, 8, prefetch=True, tiles=4),
                   qi.BlockSizes(16, 4, 8, prefetch=True, tiles=4), qi.BlockSizes(16, 2, 8, prefetch=False, tiles=4),
                   qi.BlockSizes(16, 1, 8, prefetch=True), qi.BlockSizes(16, 1, 4, prefetch=True)]
# Products of one input in a 27B decode step: (name, [out rows of each weight], x dtype, rows of x).
PRODUCT_GROUPS = [("MLP gate + up", [17408, 17408], jnp.bfloat16, 1),
                  ("DeltaNet qkv + z + b + a", [10240, 6144, 48, 48], jnp.float32, 1),
                  ("attention q + k + v", [12288, 1024, 1024], jnp.bfloat16, 1),
                  ("MLP gate + up, batch 4", [17408, 17408], jnp.bfloat16, 4)]


def packed_row(fmt: str, bs, x, stacked, layers: int, nbytes: int, out: int, **labels) -> dict | None:
    """One timed packed product x @ W[layer].T in the layer scan as a printed result row (None where its tiles
    fail to compile, e.g. over the shared-memory limit)."""
    try:
        ms, wall = layer_ms(fmt, bs, x, stacked, layers, repeats=7)
    except Exception as e:  # noqa: BLE001
        print(f"{fmt} {bs}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    (m, k) = x.shape
    row = {"format": fmt, "out": out, "in": k, "m": m, "x": jnp.dtype(x.dtype).name, **labels, "ms": ms,
           "gb_s": nbytes / ms / 1e6, "scan_gb_s": nbytes / wall / 1e6, "block_sizes": str(bs)}
    print(json.dumps(row), flush=True)
    return row


def stream_sweep(deadline: float, key) -> list[dict]:
    """Every streaming variant on the first case, then the old tiles and the best four on the rest (kernel time from
    a trace of the layer scan, as --int8-sweep)."""
    rows, ranked = [], []
    for case_i, (out, k, m, dtype) in enumerate(STREAM_CASES):
        stacked, layers, nbytes = stacked_weight("IQ4_XS", out, k, key)
        x = jax.random.normal(key, (m, k), dtype)
        tried = STREAM_VARIANTS if case_i == 0 else list(dict.fromkeys([STREAM_VARIANTS[0], *ranked[:4]]))
        for bs in tried:
            if time.time() > deadline or out % (bs.block_n * bs.tiles):
                continue
            row = packed_row("IQ4_XS", bs, x, stacked, layers, nbytes, out)
            if row is None:
                continue
            rows.append(row)
            if case_i == 0:
                ranked.append((row["ms"], bs))
        if case_i == 0:
            ranked = [bs for _, bs in sorted(ranked, key=lambda r: r[0])]
        del stacked
    return rows


# The int8 GEMV's 5,120-output products of a 27B decode step (MLP down, DeltaNet and attention output) against
# fewer rows per program and K splits: at 16 rows a program they are 320 programs, where an H200 holds ~396 at once
# (68 registers x 256 threads: three a multiprocessor), so a fifth of its slots stay empty for the whole product.
# (format, out, in, rows, x dtype); the K-quants' 4-row cases also time the float reduce (whether 4 rows go to int8).
SPLIT_CASES = [("IQ4_XS", 5120, 17408, 1, jnp.bfloat16), ("IQ4_XS", 5120, 6144, 1, jnp.float32),
               ("IQ4_XS", 5120, 6144, 1, jnp.bfloat16), ("IQ4_XS", 5120, 17408, 4, jnp.bfloat16),
               ("IQ4_XS", 5120, 6144, 4, jnp.bfloat16),
               ("Q5_K", 5120, 17408, 1, jnp.bfloat16), ("Q6_K", 5120, 17408, 1, jnp.bfloat16),
               ("Q4_K", 5120, 17408, 1, jnp.bfloat16), ("Q5_K", 5120, 17408, 4, jnp.bfloat16),
               ("Q6_K", 5120, 17408, 4, jnp.bfloat16), ("Q4_K", 5120, 17408, 4, jnp.bfloat16)]
SPLIT_VARIANTS = [qi.BlockSizes(16, 4, 8), qi.BlockSizes(16, 4, 8, prefetch=False), qi.BlockSizes(16, 2, 8, splits=2),
                  qi.BlockSizes(16, 2, 8, splits=2, prefetch=False), qi.BlockSizes(16, 2, 4, splits=2),
                  qi.BlockSizes(8, 2, 4, splits=2), qi.BlockSizes(16, 1, 8, splits=4),
                  # more programs of fewer K steps, or of four warps (more of them resident a multiprocessor)
                  qi.BlockSizes(16, 1, 8, splits=2), qi.BlockSizes(16, 1, 4, splits=4),
                  qi.BlockSizes(16, 1, 4, splits=2), qi.BlockSizes(16, 2, 8, splits=3),
                  qi.BlockSizes(16, 1, 8, splits=3), qi.BlockSizes(16, 1, 8, splits=6)]


def split_sweep(deadline: float, key) -> list[dict]:
    """Each SPLIT_VARIANT on each SPLIT_CASE that its K splits divide: the GEMV kernel's median launch and all GPU
    kernels per layer of the scan (x's quantization, the splits' sum and the chain's small ops included; in the
    decoder the sum fuses with the residual add that follows)."""
    rows = []
    for fmt, out, k, m, dtype in SPLIT_CASES:
        stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
        x = jax.random.normal(key, (m, k), dtype)
        default = qi.BlockSizes.get_default(m, out, T[fmt], k // 256, qi.levels_for(dtype))
        variants = list(dict.fromkeys([default, *SPLIT_VARIANTS]))
        if fmt != "IQ4_XS" and m > 2:
            variants.append(qm._stacked_block_sizes(T[fmt], m, out))
        for bs in variants:
            int8 = isinstance(bs, qi.BlockSizes)
            if time.time() > deadline or int8 and ((k // 256) % (bs.blocks_k * (bs.splits or 1)) or out % bs.block_n):
                continue
            row = packed_row(fmt, bs, x, stacked, layers, nbytes, out, kernel="int8" if int8 else "float reduce",
                             default=bs == default)
            if row is None:
                continue
            row["all_ms"] = (call_kernels_ms(scan_fn(fmt, bs), x, stacked) or float("nan")) / layers
            row["programs"] = out // bs.block_n * (bs.splits or 1) if int8 else None
            rows.append(row)
        del stacked
    return rows


# The int8 GEMV's planes loaded a K step ahead in registers: all of them (prefetch=True), none (False), or only the
# small ones ("small": scales and minima, a few bytes a thread; the qs/ql planes loaded in their step), against the
# default tiles, on a 27B decode step's products at 1 and 4 rows: (format, out, in, rows, x dtype); 34,816 rows stand
# for the MLP's gate + up launch, 16,384 for the DeltaNet's four projections, 14,336 for attention's q, k and v.
AHEAD_CASES = [("IQ4_XS", 34816, 5120, 1, jnp.bfloat16), ("IQ4_XS", 34816, 5120, 4, jnp.bfloat16),
               ("IQ4_XS", 5120, 17408, 4, jnp.bfloat16), ("IQ4_XS", 16384, 5120, 4, jnp.float32),
               ("IQ4_XS", 14336, 5120, 4, jnp.bfloat16), ("IQ4_XS", 5120, 6144, 4, jnp.float32),
               ("Q4_K", 34816, 5120, 1, jnp.bfloat16), ("Q4_K", 34816, 5120, 4, jnp.bfloat16),
               ("Q4_K", 16384, 5120, 1, jnp.float32), ("Q4_K", 5120, 17408, 1, jnp.bfloat16),
               ("Q4_K", 5120, 17408, 4, jnp.bfloat16), ("Q6_K", 5120, 17408, 1, jnp.bfloat16),
               ("Q6_K", 5120, 17408, 4, jnp.bfloat16), ("Q6_K", 34816, 5120, 4, jnp.bfloat16),
               ("Q5_K", 5120, 17408, 1, jnp.bfloat16), ("Q5_K", 5120, 17408, 4, jnp.bfloat16)]
AHEAD_VARIANTS = ("small", True, False)


def default_variants_sweep(cases, variants, label, deadline: float, key) -> list[dict]:
    """Each case (format, out, in, rows, x dtype) at each of variants(its default tiles) that covers its rows in
    whole tiles, once each: the GEMV kernel's median launch from a trace of the layer scan, each row labelled with
    label(block sizes)."""
    rows = []
    for fmt, out, k, m, dtype in cases:
        if time.time() > deadline:
            break
        stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
        x = jax.random.normal(key, (m, k), dtype)
        default = qi.BlockSizes.get_default(m, out, T[fmt], k // 256, qi.levels_for(dtype))
        for bs in dict.fromkeys(variants(default)):
            if time.time() > deadline or out % bs.block_n:
                continue
            row = packed_row(fmt, bs, x, stacked, layers, nbytes, out, **label(bs), default=bs == default)
            if row is not None:
                rows.append(row)
        del stacked
    return rows


def ahead_sweep(deadline: float, key) -> list[dict]:
    """Each AHEAD_CASE at the default tiles, then with each other AHEAD_VARIANT of their prefetch."""
    return default_variants_sweep(
        AHEAD_CASES, lambda d: [d, *(dataclasses.replace(d, prefetch=p) for p in AHEAD_VARIANTS)],
        lambda bs: {"ahead": str(bs.prefetch)}, deadline, key)


# A row tile's rows loaded as `parts` tensors (BlockSizes.parts: a thread holds words of several rows at the same
# K positions and loads their x words once), against the default tiles, on the 27B decode step's launches:
# (format, out, in, rows, x dtype) as AHEAD_CASES.
PARTS_CASES = [("IQ4_XS", 34816, 5120, 1, jnp.bfloat16), ("IQ4_XS", 16384, 5120, 1, jnp.float32),
               ("IQ4_XS", 14336, 5120, 1, jnp.bfloat16), ("IQ4_XS", 5120, 17408, 1, jnp.bfloat16),
               ("IQ4_XS", 5120, 6144, 1, jnp.float32), ("IQ4_XS", 5120, 6144, 1, jnp.bfloat16),
               ("IQ4_XS", 34816, 5120, 4, jnp.bfloat16), ("IQ4_XS", 5120, 17408, 4, jnp.bfloat16),
               ("Q4_K", 34816, 5120, 1, jnp.bfloat16), ("Q4_K", 5120, 17408, 1, jnp.bfloat16),
               ("Q6_K", 5120, 17408, 1, jnp.bfloat16)]


def parts_variants(default):
    """The default tiles, in 1, 2 and 4 parts (the default may already be in two: TWO_PARTS), and 32-row tiles in 2
    parts at 8 and 16 warps."""
    return [default, *(dataclasses.replace(default, parts=p) for p in (1, 2, 4)),
            dataclasses.replace(default, block_n=32, parts=2),
            dataclasses.replace(default, block_n=32, parts=2, num_warps=16)]


def parts_sweep(deadline: float, key) -> list[dict]:
    """Each PARTS_CASE with each of parts_variants (its default first)."""
    return default_variants_sweep(PARTS_CASES, parts_variants, lambda bs: {"parts": bs.parts}, deadline, key)


def stacked_group(outs: list[int], k: int, key):
    """(IQ4_XS weights of `outs` rows each, stacked over layers (>= STACK_BYTES in all), layers, bytes per layer)."""
    per_layer = sum(random_packed((n, k), T.IQ4_XS, key, jnp.bfloat16).nbytes for n in outs)
    layers = max(2, -(-STACK_BYTES // per_layer))
    ws = tuple(jax.tree.map(lambda *a: jnp.stack(a), *[
        random_packed((n, k), T.IQ4_XS, jax.random.fold_in(key, 100 * j + i), jnp.bfloat16)
        for i in range(layers)]) for j, n in enumerate(outs))
    return ws, layers, per_layer


def group_scan_fn(how: str, block_sizes, layers: int):
    """jit(x, ws) -> x after the products of one input per layer of the stacked weights ws, as "separate" launches
    (each quantizing x) or as "one launch" (int8_quant_matmul_many)."""
    def run(x, ws):
        def body(h, i):
            if how == "separate":
                ys = [qi.int8_quant_matmul(h, w, i, block_sizes=block_sizes, interpret=backend.interpret())
                      for w in ws]
            else:
                ys = qi.int8_quant_matmul_many(h, ws, i, block_sizes=block_sizes, interpret=backend.interpret())
            return chain(h, jnp.concatenate(ys, axis=-1)), None
        return jax.lax.scan(body, x, jnp.arange(layers))[0]

    return jax.jit(run)


# The decoder's own int8 GEMV launches (int8_quant_matmul_many; name, rows of each weight, in, x dtype, rows of x)
# at 1 row, then at 4: session 37 found two parts 1-2% faster on single-weight 4-row products and 2% slower end to
# end at batch 4, so variants are ranked on these too.
DECODER_LAUNCHES = [("MLP gate + up", [17408, 17408], 5120, jnp.bfloat16, 1),
                    ("DeltaNet qkv + z + b + a", [10240, 6144, 48, 48], 5120, jnp.float32, 1),
                    ("attention q + k + v", [12288, 1024, 1024], 5120, jnp.bfloat16, 1),
                    ("MLP down", [5120], 17408, jnp.bfloat16, 1),
                    ("DeltaNet out", [5120], 6144, jnp.float32, 1),
                    ("attention out", [5120], 6144, jnp.bfloat16, 1),
                    ("MLP gate + up", [17408, 17408], 5120, jnp.bfloat16, 4),
                    ("DeltaNet qkv + z + b + a", [10240, 6144, 48, 48], 5120, jnp.float32, 4),
                    ("attention q + k + v", [12288, 1024, 1024], 5120, jnp.bfloat16, 4),
                    ("MLP down", [5120], 17408, jnp.bfloat16, 4)]


def launch_sweep(variants, label, deadline: float, key, launches=DECODER_LAUNCHES) -> list[dict]:
    """Each of launches (DECODER_LAUNCHES: one launch, IQ4_XS) at each of variants(its default tiles): the int8 GEMV
    kernel's median launch from a trace of the layer scan (the scan's wall time per layer where there is no GPU),
    each row labelled with label(block sizes)."""
    rows = []
    for name, outs, k, dtype, m in launches:
        if time.time() > deadline:
            break
        ws, layers, per_layer = stacked_group(outs, k, key)
        x = jax.random.normal(key, (m, k), dtype)
        default = qi.BlockSizes.get_default(m, sum(outs), T.IQ4_XS, k // 256, qi.levels_for(dtype))
        for bs in dict.fromkeys(variants(default)):
            if time.time() > deadline:
                break
            fn = group_scan_fn("one launch", bs, layers)
            ms, _ = scan_kernel_ms(fn, x, ws, layers, "int8_gemv", repeats=7)
            rows.append({"group": name, "m": m, "x": jnp.dtype(dtype).name, **label(bs), "default": bs == default,
                         "ms": ms, "gb_s": per_layer / ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        del ws
    return rows


def group_parts_sweep(deadline: float, key) -> list[dict]:
    """Each DECODER_LAUNCH in one and in two parts."""
    return launch_sweep(lambda d: [dataclasses.replace(d, parts=p) for p in (1, 2)], lambda bs: {"parts": bs.parts},
                        deadline, key)


def ahead_parts_variants(default):
    """The default tiles; everything loaded a K step ahead (prefetch=True); that in two parts, and two parts alone.
    Why: read without a GPU (inspect_kernel.py, PyPI Triton 3.6), one-row gate + up loads a step ahead at 68
    registers in one part (three programs of 8 warps a multiprocessor instead of four: session 26 measured it
    slower) but at 64 in two, so the loads of the next step could overlap this step's decoding at the default's
    occupancy (loop 213 -> 238 instructions); the float32 DeltaNet four likewise 64 (242 -> 255). On an H100
    (session 41) loading ahead was slower on every launch, in one part or two; two parts alone won on q + k + v."""
    return [default, dataclasses.replace(default, prefetch=True), dataclasses.replace(default, parts=2, prefetch=True),
            dataclasses.replace(default, parts=2)]


def ahead_parts_sweep(deadline: float, key) -> list[dict]:
    """The decoder's one-row launches at each of ahead_parts_variants."""
    return launch_sweep(ahead_parts_variants, lambda bs: {"parts": bs.parts, "ahead": str(bs.prefetch)}, deadline,
                        key, launches=[launch for launch in DECODER_LAUNCHES if launch[-1] == 1])


def load_variants(default):
    """The default tiles with each way of loading the planes: the codes as [BN, KB, *view] tiles or as one run a row
    (BlockSizes.flat), the small planes whole or in pieces (BlockSizes.split_small); and where the default steps
    over 4 blocks, one run of 2 (read without a GPU, gate + up at 4 bf16 rows with the small planes ahead: 80 -> 53
    registers)."""
    halved = [dataclasses.replace(default, blocks_k=2, flat=True)] if default.blocks_k == 4 else []
    return [dataclasses.replace(default, flat=flat, split_small=split)
            for flat, split in itertools.product((False, True), repeat=2)] + halved


# The output head of llama.cpp's IQ4_XS and Q4_K_M plans (Q6_K, 248,320 x 5120: ~1 GB a decode step, the largest
# single product), as AHEAD_CASES.
HEAD_CASES = [("Q6_K", 248320, 5120, 1, jnp.bfloat16), ("Q6_K", 248320, 5120, 4, jnp.bfloat16)]


def load_sweep(deadline: float, key) -> list[dict]:
    """Each DECODER_LAUNCH, then each HEAD_CASE, at each of load_variants."""
    def label(bs):
        return {"flat": bs.flat, "split_small": bs.split_small, "blocks_k": bs.blocks_k}
    rows = launch_sweep(load_variants, label, deadline, key)
    return rows + [{"group": f"{r['format']} {r['out']} x {r['in']}", **r}
                   for r in default_variants_sweep(HEAD_CASES, load_variants, label, deadline, key)]


def group_sweep(deadline: float, key, block_sizes) -> list[dict]:
    """The products of one input as separate launches (each quantizing x) and as one int8_quant_matmul_many launch,
    in a scan over stacked layers: all GPU kernels per layer (quantization and the chain's small ops included) and
    the scan's wall time per layer."""
    rows = []
    for name, outs, dtype, m in PRODUCT_GROUPS:
        k = 5120
        ws, layers, per_layer = stacked_group(outs, k, key)
        x = jax.random.normal(key, (m, k), dtype)
        for how, bs in [("separate", None), ("separate", block_sizes), ("one launch", None),
                        ("one launch", block_sizes)]:
            if time.time() > deadline:
                break
            fn = group_scan_fn(how, bs, layers)
            wall = median_ms(fn, x, ws, repeats=9) / layers
            gpu = (call_kernels_ms(fn, x, ws) or float("nan")) / layers
            rows.append({"group": name, "how": how, "block_sizes": str(bs), "gpu_ms": gpu, "wall_ms": wall,
                         "gb_s": per_layer / gpu / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        del ws
    return rows


def read_ceiling_gb_s() -> float:
    """A 2 GiB bf16 array summed: bytes read once per call (the read-only rate a GEMV can approach)."""
    a = jnp.ones((1 << 30,), jnp.bfloat16)
    return a.nbytes / median_ms(jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32)), a) / 1e6


def copy_ceiling_gb_s() -> float:
    a = jnp.ones((1 << 28,), jnp.float32)
    return 2 * a.nbytes / median_ms(jax.jit(lambda v: v * 1.0001), a) / 1e6


def print_table(rows: list[dict], columns) -> None:
    """rows as a markdown table of columns [(header, row -> cell)]."""
    print("\n| " + " | ".join(h for h, _ in columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(cell(r)) for _, cell in columns) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--seconds", type=float, default=400)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--dense-sweep", action="store_true",
                    help="only sweep the dense kernel's tiles and K splits on the 27B decode shapes")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="only time the packed kernel's regimes (GEMV reduce, skinny dot) at 1..16 rows")
    ap.add_argument("--int8-sweep", action="store_true",
                    help="only time the int8 GEMV (IQ4_XS tile sweep; other --formats at the default tiles) "
                         "against the float GEMV reduce at 1..4 rows")
    ap.add_argument("--int8-quick", action="store_true", help="--int8-sweep with the default and a few tiles only")
    ap.add_argument("--default-tiles", action="store_true", help="--int8-sweep with the default tiles only")
    ap.add_argument("--stream-sweep", action="store_true",
                    help="only the int8 GEMV's streaming variants (prefetch, row tiles per program), then products "
                         "of one input in one launch against separate launches")
    ap.add_argument("--split-sweep", action="store_true",
                    help="only the int8 GEMV's 5,120-output products at fewer rows per program and K splits")
    ap.add_argument("--ahead-sweep", action="store_true",
                    help="only the int8 GEMV's default tiles with each choice of planes loaded a K step ahead")
    ap.add_argument("--parts-sweep", action="store_true",
                    help="only the int8 GEMV's default tiles against a row tile loaded in parts (BlockSizes.parts)")
    ap.add_argument("--group-parts-sweep", action="store_true",
                    help="only the decoder's int8 GEMV launches in one and two parts (BlockSizes.parts)")
    ap.add_argument("--ahead-parts-sweep", action="store_true",
                    help="only the decoder's one-row launches loading a step ahead, in one and two parts")
    ap.add_argument("--load-sweep", action="store_true",
                    help="only the decoder's int8 GEMV launches with their planes loaded each way (load_variants)")
    ap.add_argument("--skinny-sweep", action="store_true",
                    help="only the fused kernel's tensor-core regime (16 rows) at other tiles than its default")
    ap.add_argument("--skinny-check", action="store_true",
                    help="only the skinny dot's default tiles against one change each on SKINNY_CHECKS")
    ap.add_argument("--skinny-splits", action="store_true",
                    help="only the skinny dot's K split counts at 16 and 32 rows (SKINNY_SPLIT_CASES)")
    ap.add_argument("--group-tiles", help="block sizes for --stream-sweep's grouped products, e.g. 16,2,8,1,1 "
                                          "(block_n, blocks_k, warps, prefetch, tiles); default: the best of the sweep")
    ap.add_argument("--json")
    args = ap.parse_args()
    start = time.time()
    key = jax.random.key(0)
    ceiling = copy_ceiling_gb_s()
    read = read_ceiling_gb_s()
    print(f"copy ceiling {ceiling:.0f} GB/s, read {read:.0f} GB/s on {jax.devices()[0].device_kind}", flush=True)
    product = [("format", lambda r: r["format"]), ("out x in", lambda r: f"{r['out']}x{r['in']}"),
               ("rows", lambda r: r["m"]), ("x", lambda r: r["x"])]
    if args.skinny_sweep or args.skinny_check or args.skinny_splits:
        formats = [f for f in args.formats.split(",") if f != "bf16"]
        rows = (skinny_check(start + args.seconds, key) if args.skinny_check
                else skinny_splits(formats, start + args.seconds, key) if args.skinny_splits
                else skinny_sweep(formats, start + args.seconds, key))
        write_rows(args.json, rows)
        print_table(sorted(rows, key=lambda r: (r["format"], r["out"], r["ms"])),
                    [*product, ("block sizes", lambda r: r["block_sizes"] + (" (default)" if r["default"] else "")),
                     ("GB/s (kernel)", lambda r: f"{r['gb_s']:.0f}"), ("us", lambda r: f"{1e3 * r['ms']:.1f}")])
        return
    launch_sweeps = [  # (chosen, sweep, heading of its variant column, the variant of a row)
        (args.group_parts_sweep, group_parts_sweep, "parts", lambda r: f"{r['parts']} parts"),
        (args.ahead_parts_sweep, ahead_parts_sweep, "parts, loaded ahead",
         lambda r: f"{r['parts']} parts, ahead {r['ahead']}"),
        (args.load_sweep, load_sweep, "loads",
         lambda r: f"{'flat' if r['flat'] else 'tiles'}, {'pieces' if r['split_small'] else 'whole'}, "
                   f"{r['blocks_k']} blocks")]
    for chosen, launch_sweep_fn, heading, variant in launch_sweeps:
        if not chosen:
            continue
        rows = launch_sweep_fn(start + args.seconds, key)
        write_rows(args.json, rows)
        print_table(rows, [("launch", lambda r: r["group"]), ("rows", lambda r: r["m"]), ("x", lambda r: r["x"]),
                           (heading, lambda r: variant(r) + (" (default)" if r["default"] else "")),
                           ("GEMV GB/s (kernel)", lambda r: f"{r['gb_s']:.0f}"),
                           ("us", lambda r: f"{1e3 * r['ms']:.1f}")])
        return
    if args.parts_sweep or args.ahead_sweep:
        rows = (parts_sweep if args.parts_sweep else ahead_sweep)(start + args.seconds, key)
        write_rows(args.json, rows)
        variant = (("block sizes", lambda r: r["block_sizes"]) if args.parts_sweep
                   else ("loaded ahead (prefetch)", lambda r: r["ahead"]))
        print_table(rows, [*product, variant, ("GEMV GB/s (kernel)", lambda r: f"{r['gb_s']:.0f}"),
                           ("us", lambda r: f"{1e3 * r['ms']:.1f}")])
        return
    if args.split_sweep:
        rows = split_sweep(start + args.seconds, key)
        write_rows(args.json, rows)
        print_table(rows, [*product, ("block sizes", lambda r: r["block_sizes"] + " (default)" * r["default"]),
                           ("programs", lambda r: r["programs"]),
                           ("GEMV GB/s (kernel)", lambda r: f"{r['gb_s']:.0f}"),
                           ("all kernels us per layer", lambda r: f"{1e3 * r['all_ms']:.1f}")])
        return
    if args.stream_sweep:
        rows = stream_sweep(start + 0.7 * args.seconds, key)
        first = [r for r in rows if (r["out"], r["in"], r["m"]) == STREAM_CASES[0][:3]]
        best = max(first, key=lambda r: r["gb_s"])["block_sizes"] if first else None
        if args.group_tiles:
            block_n, blocks_k, warps, prefetch, tiles = (int(v) for v in args.group_tiles.split(","))
            bs = qi.BlockSizes(block_n, blocks_k, warps, prefetch=bool(prefetch), tiles=tiles)
        else:
            bs = next((v for v in STREAM_VARIANTS if str(v) == best), None)
        groups = group_sweep(start + args.seconds, key, bs)
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_gb_s": ceiling, "read_gb_s": read, "rows": rows,
                                                   "groups": groups}, indent=1))
        print("\n| out x in | rows | x | block sizes | GB/s (kernel) | in the scan, wall |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['out']}x{r['in']} | {r['m']} | {r['x']} | {r['block_sizes']} | {r['gb_s']:.0f} | "
                  f"{r['scan_gb_s']:.0f} |")
        print("\n| products | launches | block sizes | GPU ms per layer | wall ms per layer | GB/s (GPU) |\n"
              "|---|---|---|---|---|---|")
        for r in groups:
            print(f"| {r['group']} | {r['how']} | {r['block_sizes']} | {r['gpu_ms']:.4f} | {r['wall_ms']:.4f} | "
                  f"{r['gb_s']:.0f} |")
        return
    if args.rows_sweep or args.int8_sweep:
        if args.rows_sweep:
            rows, labels = rows_sweep(args.formats.split(","), start + args.seconds, key), ("format", "regime")
        else:
            formats = args.formats.split(",") if args.formats != ",".join(FORMATS) else ["IQ4_XS"]
            rows = int8_sweep(start + args.seconds, key, first_sweep=not args.int8_quick, formats=formats,
                              defaults_only=args.default_tiles)
            for r in rows:
                r["kernel"] = f"{r['format']} {r['kernel']}"
            labels = ("kernel", "block_sizes")
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_gb_s": ceiling, "read_gb_s": read, "rows": rows}, indent=1))
        print(f"\n| {labels[0]} | out x in | rows | x | {labels[1]} | GB/s (kernel) | in the scan, wall |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[labels[0]]} | {r['out']}x{r['in']} | {r['m']} | {r['x']} | {r[labels[1]]} | {r['gb_s']:.0f} | "
                  f"{r['scan_gb_s']:.0f} |")
        return
    if args.dense_sweep:
        rows = dense_sweep(start + args.seconds, key)
        if args.json:
            Path(args.json).write_text(json.dumps({"copy_gb_s": ceiling, "read_gb_s": read, "rows": rows}, indent=1))
        return
    formats = args.formats.split(",")
    best = sweep(formats, start + args.seconds / 2, key) if args.sweep else {}
    for (fmt, m), (ms, bs) in best.items():
        print(f"best {fmt} m={m}: {bs}", flush=True)
    rows = []
    for out, k in SHAPES:
        for fmt in formats:
            if time.time() > start + args.seconds:
                print(f"time limit: {fmt} {out}x{k} not run", flush=True)
                continue
            stacked, layers, nbytes = stacked_weight(fmt, out, k, key)
            for m in ROWS:
                x = jax.random.normal(key, (m, k), jnp.bfloat16)
                bs = best.get((fmt, 1 if m == 1 else 16), (None, None))[1]
                ms, wall = layer_ms(fmt, bs, x, stacked, layers)
                xla = xla_separate_ms(fmt, stacked, x) if m == 1 else None
                rows.append({"format": fmt, "out": out, "in": k, "m": m, "ms": ms, "gb_s": nbytes / ms / 1e6,
                             "scan_gb_s": nbytes / wall / 1e6,
                             "xla_separate_gb_s": nbytes / xla / 1e6 if xla else None, "block_sizes": str(bs)})
                print(json.dumps(rows[-1]), flush=True)
            del stacked
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gb_s": ceiling, "device": jax.devices()[0].device_kind,
                                               "best": {f"{f} m={m}": str(b) for (f, m), (_, b) in best.items()},
                                               "rows": rows}, indent=1))
    print(f"\n| weights | out x in | rows | in place GB/s (kernel) | % of copy ({ceiling:.0f} GB/s) "
          "| in the scan, wall | XLA, separate array, wall |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        xla = f"{r['xla_separate_gb_s']:.0f} GB/s" if r["xla_separate_gb_s"] else "-"
        print(f"| {r['format']} | {r['out']}x{r['in']} | {r['m']} | {r['gb_s']:.0f} | "
              f"{100 * r['gb_s'] / ceiling:.0f}% | {r['scan_gb_s']:.0f} | {xla} |")


if __name__ == "__main__":
    main()
