"""Fused dequantize-matmul (Pallas/Triton) vs the XLA dequantize-then-dot path on the Qwen3.5-27B shapes.

Decode GEMV (x rows 1, 4, 16): GB/s of packed weight + x + y bytes, against a measured device copy ceiling.
Prefill GEMM (M=1024): TFLOP/s against a measured bf16 matmul. Each timing is the median of >= 20 runs of one
jitted call that applies R weight copies in turn (rotating past the 60 MB L2, one dispatch for R kernels).
Prints a markdown table; writes JSON to $OUT (or the cwd). BENCH_SECONDS bounds the run (default 400).
Usage: python benchmarks/bench_quant_matmul.py [--sweep]  (--sweep: GEMV block sizes on the first shape)
"""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quant_plan import random_packed  # noqa: E402
from benchmarks.timing import median_ms  # noqa: E402
from luxjax.checkpoint.quants import QuantizedTensor  # noqa: E402
from luxjax.ops.linear import _xla_linear  # noqa: E402
from pallas_kernels.quant_matmul import BlockSizes, quant_matmul  # noqa: E402

TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS]
SHAPES = [(17408, 5120), (5120, 17408), (12288, 5120), (10240, 5120)]  # (out, in)
DECODE_ROWS = (1, 4, 16)
PREFILL_M, PREFILL_SHAPES = 1024, SHAPES[:2]
REPS = 25
ROTATE_BYTES = 256 * 2**20  # weights per timed call, well past the 60 MB L2


def random_weight(key, ggml_type, out, k) -> QuantizedTensor:
    return random_packed((out, k), ggml_type, key, jnp.float32)


def median_seconds(fn, *args) -> float:
    return median_ms(fn, *args, repeats=REPS, warmups=2) / 1e3


def rotating(impl, n_copies):
    """One jit applying impl to (x_i, w_i) for each copy i: kernels back to back, weights not cache-resident."""
    return jax.jit(lambda xs, ws: [impl(xs[i], ws[i]) for i in range(n_copies)])


def ceilings() -> dict:
    a = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    t = median_seconds(jax.jit(lambda v: v * 1.0001), a)
    b = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    tm = median_seconds(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(p.dtype)), b, b)
    return {"copy_GBps": 2 * a.nbytes / t / 1e9, "bf16_TFLOPs": 2 * 8192**3 / tm / 1e12}


# (block_m, block_n, values per K step, warps) per regime; block_m 1 is the reduce GEMV.
VARIANTS = {1: [(1, 8, 512, 4), (1, 16, 256, 4), (1, 8, 256, 2), (16, 64, 256, 4)],
            16: [(16, 32, 512, 4), (16, 64, 512, 4), (16, 128, 256, 8)],
            PREFILL_M: [(64, 128, 64, 4), (64, 64, 64, 4), (128, 128, 64, 8)]}


def sweep(key, deadline) -> dict:
    """Block sizes per type and regime on the first shape; returns the fastest of each, keyed (type, m)."""
    out, k = SHAPES[0]
    best = {}
    for ggml_type in TYPES:
        ws = [random_weight(jax.random.fold_in(key, i), ggml_type, out, k) for i in range(6)]
        block = GGML_QUANT_SIZES[ggml_type][0]
        for m, vs in VARIANTS.items():
            xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.bfloat16) for i in range(6)]
            for bm, bn, values, warps in vs:
                if time.time() > deadline:
                    return best
                bs = BlockSizes(bm, bn, max(1, values // block), warps, 3)
                try:
                    t = median_seconds(rotating(lambda x, w, bs=bs: quant_matmul(x, w, block_sizes=bs), 6), xs, ws) / 6
                except jax.errors.JaxRuntimeError as e:  # e.g. shared memory over the limit for this tile
                    print(f"sweep {ggml_type.name} m={m} {bs}: failed: {str(e).splitlines()[0]}", flush=True)
                    continue
                print(f"sweep {ggml_type.name} m={m} {bs}: {t * 1e6:.1f} us, {ws[0].nbytes / t / 1e9:.0f} GB/s, "
                      f"{2 * m * out * k / t / 1e12:.1f} TFLOP/s", flush=True)
                if (ggml_type, m) not in best or t < best[ggml_type, m][0]:
                    best[ggml_type, m] = (t, bs)
    return {key_: bs for key_, (_, bs) in best.items()}


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    start, budget = time.time(), float(os.environ.get("BENCH_SECONDS", "400"))
    deadline = start + budget
    ceil = ceilings()
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    rows, key = [], jax.random.key(1)
    best = sweep(key, start + budget / 2) if "--sweep" in sys.argv else {}
    for out, k in SHAPES:
        for ggml_type in TYPES:
            if time.time() > deadline:
                print(f"deadline reached: {ggml_type.name} {out}x{k} not run", flush=True)
                continue
            w0 = random_weight(key, ggml_type, out, k)
            copies = min(16, max(2, -(-ROTATE_BYTES // w0.nbytes)))
            ws = [w0] + [random_weight(jax.random.fold_in(key, i), ggml_type, out, k) for i in range(1, copies)]
            for m in DECODE_ROWS + ((PREFILL_M,) if (out, k) in PREFILL_SHAPES else ()):
                xs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (m, k), jnp.bfloat16) for i in range(copies)]
                res = {"type": ggml_type.name, "out": out, "in": k, "m": m}
                bs = best.get((ggml_type, 16 if 1 < m <= 16 else m))  # None: BlockSizes.get_default
                res["block_sizes"] = str(bs) if bs else "default"
                pallas = lambda x, w, bs=bs: quant_matmul(x, w, block_sizes=bs)
                for name, impl in (("pallas", pallas), ("xla", _xla_linear)):
                    t = median_seconds(rotating(impl, copies), xs, ws) / copies
                    res[f"{name}_us"] = t * 1e6
                    res[f"{name}_GBps"] = (w0.nbytes + 2 * m * (k + out)) / t / 1e9
                    res[f"{name}_TFLOPs"] = 2 * m * out * k / t / 1e12
                rows.append(res)
                print(json.dumps(res), flush=True)
                with open(os.path.join(out_dir, "bench_quant_matmul.json"), "w") as f:
                    json.dump({"ceilings": ceil, "device": str(jax.devices()[0]), "results": rows}, f, indent=1)
            del ws
    print("\n| type | out x in | M | Pallas us | XLA us | Pallas | XLA | Pallas % of ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["m"] >= PREFILL_M:
            a, b, pct = f"{r['pallas_TFLOPs']:.0f} TFLOP/s", f"{r['xla_TFLOPs']:.0f} TFLOP/s", \
                r["pallas_TFLOPs"] / ceil["bf16_TFLOPs"]
        else:
            a, b, pct = f"{r['pallas_GBps']:.0f} GB/s", f"{r['xla_GBps']:.0f} GB/s", r["pallas_GBps"] / ceil["copy_GBps"]
        print(f"| {r['type']} | {r['out']}x{r['in']} | {r['m']} | {r['pallas_us']:.1f} | {r['xla_us']:.1f} | "
              f"{a} | {b} | {100 * pct:.0f}% |")


if __name__ == "__main__":
    main()
