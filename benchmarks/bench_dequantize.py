"""The prefill path for packed weights: the Pallas dequantize kernel (pallas_kernels/quant_dequantize.py) against
XLA's decode, alone and before a 1,012-row bf16 product, on the Qwen3.5-27B shapes.

    python benchmarks/bench_dequantize.py [--sweep] [--json out.json]

Each weight is one layer of a three-layer stack, read in place by the kernel and sliced by XLA (as in a layer scan).
Times are GPU kernel time per call from a profiler trace (benchmarks/timing.call_kernels_ms): all kernels of the
call, whatever XLA named its fusions; on a CPU (no GPU trace, the kernel interpreted) wall-clock medians stand in. The kernel's rate counts
the packed bytes read and the dense bytes written, against the ~4.1 TB/s copy ceiling. --sweep times every tile of
SWEEP and reports the fastest; without it, the default tiles.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quant_plan import random_packed  # noqa: E402
from benchmarks.timing import call_kernels_ms, median_ms, write_rows  # noqa: E402
from luxjax.checkpoint.quants import dequantize  # noqa: E402
from luxjax.ops import backend  # noqa: E402
from pallas_kernels import quant_dequantize as qd  # noqa: E402

FORMATS = ("IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
SHAPES = ((17408, 5120), (5120, 17408))  # (out, in): the MLP's up/gate and down projections
LAYERS, ROWS = 3, 1012
# (rows, blocks, warps) of 256-value blocks; Q8_0's 32-value blocks take eight times the blocks
SWEEP = ((16, 1, 4), (16, 2, 4), (32, 2, 4), (16, 4, 4), (8, 4, 4), (32, 4, 8), (64, 1, 4), (32, 1, 4))


def time_ms(fn, *args) -> float:
    gpu = call_kernels_ms(fn, *args)
    return gpu if gpu is not None else median_ms(fn, *args, repeats=5)


def tiles(fmt: str, sweep: bool) -> list[qd.BlockSizes | None]:
    if not sweep:
        return [None]
    scale = 8 if fmt == "Q8_0" else 1
    return [qd.BlockSizes(rows, blocks * scale, warps) for rows, blocks, warps in SWEEP]


def measure(fmt: str, out: int, k: int, sweep: bool, scale: int) -> dict:
    out, k = out // scale, max(256, k // scale // 256 * 256)  # K stays whole 256-value blocks
    layers = [random_packed((out, k), fmt, jax.random.key(i), jnp.bfloat16) for i in range(LAYERS)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    layer = jnp.int32(1)
    packed_bytes = sum(p.nbytes for p in jax.tree.leaves(stacked)) / LAYERS
    take = lambda st, i: jax.tree.map(lambda a: a[i], st)  # noqa: E731
    row = {"format": fmt, "out": out, "in": k,
           "xla_decode_ms": time_ms(jax.jit(lambda st, i: dequantize(take(st, i), jnp.bfloat16)), stacked, layer)}
    best = None
    for bs in tiles(fmt, sweep):
        fn = jax.jit(lambda st, i, bs=bs: qd.dequantize_in_kernel_order(st, i, dtype=jnp.bfloat16, block_sizes=bs,
                                                                            interpret=backend.interpret()))
        ms = time_ms(fn, stacked, layer)
        row[f"kernel_ms {bs or 'default'}"] = ms
        if best is None or ms < best[1]:
            best = (bs or qd.BlockSizes.get_default(stacked.ggml_type), ms)
    row["kernel_tiles"], row["kernel_ms"] = str(best[0]), best[1]
    row["kernel_TBps"] = (packed_bytes + out * k * 2) / best[1] / 1e9
    natural = jax.jit(lambda st, i: qd.dequantize_in_kernel_order(st, i, dtype=jnp.bfloat16, natural_order=True,
                                                                  interpret=backend.interpret()))
    row["kernel_natural_order_ms"] = time_ms(natural, stacked, layer)
    x = jax.random.normal(jax.random.key(LAYERS), (ROWS, k), jnp.bfloat16)
    via_xla = jax.jit(lambda x, st, i: jnp.dot(x, dequantize(take(st, i), jnp.bfloat16).T,
                                               preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    via_kernel = jax.jit(lambda x, st, i: qd.dequantized_matmul(x, st, i, natural_order=False,
                                                                interpret=backend.interpret()))
    via_natural = jax.jit(lambda x, st, i: qd.dequantized_matmul(x, st, i, natural_order=True,
                                                                 interpret=backend.interpret()))
    row["product_xla_ms"] = time_ms(via_xla, x, stacked, layer)
    row["product_kernel_ms"] = time_ms(via_kernel, x, stacked, layer)
    row["product_natural_order_ms"] = time_ms(via_natural, x, stacked, layer)
    diff = via_xla(x, stacked, layer).astype(jnp.float32) - via_kernel(x, stacked, layer).astype(jnp.float32)
    row["products_max_abs_diff"] = float(jnp.max(jnp.abs(diff)))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="time every tile of SWEEP, report the fastest")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--scale", type=int, default=1, help="divide both dimensions (a quick run on a CPU)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cases = [(fmt, out, k) for fmt in args.formats.split(",") for out, k in SHAPES]
    rows = [measure(fmt, out, k, args.sweep, args.scale) for fmt, out, k in tqdm(cases, desc="dequantize")]
    timing = "GPU kernel time" if jax.default_backend() == "gpu" else "wall time, the kernel interpreted"
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; ms per call ({timing})")
    print("| weights | out x in | XLA decode ms | kernel ms (tiles) | kernel TB/s | kernel, natural order ms "
          "| product via XLA ms | product via kernel ms (x permuted) | natural order ms |\n" + "|---" * 9 + "|")
    for r in rows:
        print(f"| {r['format']} | {r['out']} x {r['in']} | {r['xla_decode_ms']:.3f} | {r['kernel_ms']:.3f} "
              f"{r['kernel_tiles']} | {r['kernel_TBps']:.2f} | {r['kernel_natural_order_ms']:.3f} | "
              f"{r['product_xla_ms']:.3f} | {r['product_kernel_ms']:.3f} | {r['product_natural_order_ms']:.3f} |")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
