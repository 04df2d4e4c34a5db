"""What a matmul costs inside a scan over stacked layer weights, against the same weights held as separate arrays.

    python benchmarks/bench_layer_scan.py [--layers 8] [--rows 1,16,1024] [--json out.json] [--hlo-dir DIR]

Every variant runs `layers` matmuls y = x @ W_l.T (W_l [17408, 5120], the 27B MLP shape) in one jitted call, each
layer's input taken from the previous output so nothing is skipped. Variants:
- scan: `lax.scan` over the stacked weights (how the decoder runs), XLA dot on the scan's slice;
- separate: a Python loop over per-layer arrays (no slicing);
- scan_in_place: the scan with the stacked weights left whole and the layer read in place by a Pallas kernel
  (luxjax.ops.linear's LayerSlice path: the decode GEMVs up to 16 rows, pallas_kernels/dense_gemm.py beyond, bf16
  only), when the kernels are importable;
- the same three for random IQ4_XS blocks through the fused dequantize-matmul.
Achieved bandwidth = weight bytes / time per layer (TFLOP/s too for more than 16 rows). --hlo-dir writes the
optimised HLO of the scan variants.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.timing import median_ms  # noqa: E402


def chain(x, y):
    """Next layer's input from this layer's output (keeps every matmul live)."""
    return (x + y[:, : x.shape[1]].astype(x.dtype)) * 0.5


def variants(stacked, separate, linear_fn, layer_slice):
    def scan(x, w):
        return jax.lax.scan(lambda h, wl: (chain(h, linear_fn(h, wl)), None), x, w)[0]

    def scan_in_place(x, w):
        body = lambda h, i: (chain(h, linear_fn(h, layer_slice(w, i))), None)  # noqa: E731
        return jax.lax.scan(body, x, jnp.arange(jax.tree.leaves(w)[0].shape[0]))[0]

    def loop(x, ws):
        for wl in ws:
            x = chain(x, linear_fn(x, wl))
        return x

    return {"scan": (jax.jit(scan), stacked), "separate": (jax.jit(loop), separate),
            "scan_in_place": (jax.jit(scan_in_place), stacked)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", default="1,16,1024")
    ap.add_argument("--json")
    ap.add_argument("--hlo-dir")
    ap.add_argument("--shape", default="17408,5120", help="out,in of each layer's weight")
    args = ap.parse_args()
    N, K = (int(v) for v in args.shape.split(","))
    from gguf.constants import GGMLQuantizationType as T

    from benchmarks.quant_plan import random_packed
    from luxjax.ops.linear import LayerSlice, linear

    key = jax.random.key(0)
    dense = [jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.bfloat16) * 0.02 for i in range(args.layers)]
    packed = [random_packed((N, K), T.IQ4_XS, jax.random.fold_in(key, 100 + i), jnp.bfloat16)
              for i in range(args.layers)]
    stack = lambda ws: jax.tree.map(lambda *a: jnp.stack(a), *ws)  # noqa: E731
    sets = {"bf16": (stack(dense), dense, 2 * N * K), "IQ4_XS": (stack(packed), packed, packed[0].nbytes)}
    results = []
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| weights | rows | variant | ms per layer | GB/s |\n|---|---|---|---|---|")
    for fmt, (stacked, separate, nbytes) in sets.items():
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(key, (m, K), jnp.bfloat16)
            for name, (fn, w) in variants(stacked, separate, linear, LayerSlice).items():
                if name == "scan_in_place" and m > 16 and fmt != "bf16":  # packed prefill slices (XLA path)
                    continue
                try:
                    ms = median_ms(fn, x, w) / args.layers
                except Exception as e:  # noqa: BLE001  (report the variant as failed and go on)
                    print(f"| {fmt} | {m} | {name} | failed: {type(e).__name__}: {str(e)[:200]} | |")
                    continue
                tflops = 2 * m * N * K / ms / 1e9
                results.append({"weights": fmt, "rows": m, "variant": name, "ms_per_layer": ms,
                                "gb_s": nbytes / ms / 1e6, "tflop_s": tflops})
                print(f"| {fmt} | {m} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} |"
                      + (f" {tflops:.0f} TFLOP/s" if m > 16 else ""), flush=True)
                if args.hlo_dir and name.startswith("scan") and m <= 16:
                    Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                    text = fn.lower(x, w).compile().as_text()
                    Path(args.hlo_dir, f"{fmt}_{m}_{name}.txt").write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": args.layers,
                                               "device": jax.devices()[0].device_kind, "results": results}, indent=2))


if __name__ == "__main__":
    main()
