"""Packed prefill products decoded in pieces small enough to stay in the GPU's L2 cache, against one whole decode.

    python benchmarks/bench_prefill_chunks.py [--json out.json] [--scale N]

Why: a 1,012-row product of a packed weight decodes W to bf16 (Pallas, quant_dequantize) and runs the vendor GEMM on
it; the bf16 copy (2 bytes a weight) goes to device memory and is read back, ~18 ms of a 27B prefill. Decoded in
pieces of a few tens of MB, each piece could be written to and read back from L2 (H200: 60 MB) before the next
overwrites it. The pieces are split along W's rows (each product writes its own columns of y) or along K (products
summed in float32). Each case runs LAYERS different weights in one call (so no piece is in L2 from the call
before), pieces ordered by optimization barriers (piece c + 1 decoded only after product c). Dense bf16 products
cut the same way show what the smaller GEMMs cost by themselves. Times: GPU kernel time per layer from a profiler
trace (wall time on a CPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.quant_plan import random_packed  # noqa: E402
from benchmarks.timing import call_kernels_ms, median_ms, write_rows  # noqa: E402
from luxjax.checkpoint.quants import QuantizedTensor  # noqa: E402
from luxjax.ops import backend  # noqa: E402
from luxjax.ops.linear import vendor_matmul  # noqa: E402
from pallas_kernels import quant_dequantize as qd  # noqa: E402

LAYERS, ROWS = 4, 1012
# (out, in, axis): the 27B's MLP gate/up, DeltaNet qkv, z, attention q, and the MLP down projection
CASES = ((17408, 5120, "rows"), (10240, 5120, "rows"), (6144, 5120, "rows"), (12288, 5120, "rows"),
         (5120, 17408, "k"), (5120, 17408, "rows"), (5120, 6144, "k"))
PIECES = (1, 2, 4, 8, 16)


def time_ms(fn, *args) -> float:
    gpu = call_kernels_ms(fn, *args)
    return gpu if gpu is not None else median_ms(fn, *args, repeats=3)


def packed_pieces(w: QuantizedTensor, pieces: int, axis: str) -> list[QuantizedTensor]:
    """w cut into `pieces` equal parts along its rows or its blocks (K), each a packed tensor of its own."""
    n, k = w.shape
    out = []
    for p in range(pieces):
        if axis == "rows":
            sl, shape = (slice(p * n // pieces, (p + 1) * n // pieces),), (n // pieces, k)
        else:
            blocks = next(iter(w.planes.values())).shape[1]
            sl, shape = (slice(None), slice(p * blocks // pieces, (p + 1) * blocks // pieces)), (n, k // pieces)
        out.append(QuantizedTensor({name: a[sl] for name, a in w.planes.items()}, w.ggml_type, shape, w.dtype))
    return out


def dense_pieces(w: jax.Array, pieces: int, axis: str) -> list[jax.Array]:
    return jnp.split(w, pieces, axis=0 if axis == "rows" else 1)


def chained_product(x, layers, axis: str, decode):
    """Every layer's x @ W.T from its pieces, each piece decoded (decode(piece) -> dense) only after the product
    before it."""
    outs, token = [], jnp.zeros((), jnp.float32)
    k = x.shape[-1]
    for pieces in layers:
        ys, acc = [], None
        for p, piece in enumerate(pieces):
            piece, token = lax.optimization_barrier((piece, token))
            w = decode(piece)
            if axis == "rows":
                y = vendor_matmul(x, w, jnp.bfloat16)
                ys.append(y)
                token = y[0, 0].astype(jnp.float32)
            else:
                width = k // len(pieces)
                y = vendor_matmul(x[:, p * width:(p + 1) * width], w, jnp.float32)
                acc = y if acc is None else acc + y
                token = acc[0, 0]
        outs.append(jnp.concatenate(ys, axis=-1) if axis == "rows" else acc.astype(jnp.bfloat16))
    return outs


def measure(out: int, k: int, axis: str, scale: int) -> list[dict]:
    out, k = out // scale, max(256 * 16, k // scale // 256 * 256)
    packed = [random_packed((out, k), "IQ4_XS", jax.random.key(i), jnp.bfloat16) for i in range(LAYERS)]
    decode = lambda piece: qd.dequantize_in_kernel_order(  # noqa: E731
        piece, dtype=jnp.bfloat16, natural_order=True, interpret=backend.interpret())
    dense = [decode(w) for w in packed]
    x = jax.random.normal(jax.random.key(LAYERS), (ROWS, k), jnp.bfloat16)
    rows, reference = [], None
    for pieces in PIECES:
        if (out if axis == "rows" else k // 256) % pieces:
            continue
        p_layers = [packed_pieces(w, pieces, axis) for w in packed]
        d_layers = [dense_pieces(w, pieces, axis) for w in dense]
        run_packed = jax.jit(lambda x, ls: chained_product(x, ls, axis, decode))
        run_dense = jax.jit(lambda x, ls: chained_product(x, ls, axis, lambda w: w))
        got = run_packed(x, p_layers)[0].astype(jnp.float32)
        reference = got if reference is None else reference
        err = float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference)))
        piece_mb = out * k * 2 / pieces / 2**20
        rows.append({"out": out, "in": k, "axis": axis, "pieces": pieces, "piece_MB": piece_mb,
                     "packed_ms": time_ms(run_packed, x, p_layers) / LAYERS,
                     "dense_ms": time_ms(run_dense, x, d_layers) / LAYERS, "rel_diff_vs_whole": err})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=1, help="divide the shapes (a quick run on a CPU)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = [r for case in tqdm(CASES, desc="shapes") for r in measure(*case, args.scale)]
    timing = "GPU kernel time" if jax.default_backend() == "gpu" else "wall time, the kernel interpreted"
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; IQ4_XS, {ROWS} rows of bf16 x; ms per layer "
          f"({timing})")
    print("| out x in | split | pieces | piece MB | packed: decode + GEMM ms | dense GEMM ms | difference ms | "
          "rel. diff |\n" + "|---" * 8 + "|")
    for r in rows:
        print(f"| {r['out']} x {r['in']} | {r['axis']} | {r['pieces']} | {r['piece_MB']:.1f} | {r['packed_ms']:.3f} "
              f"| {r['dense_ms']:.3f} | {r['packed_ms'] - r['dense_ms']:.3f} | {r['rel_diff_vs_whole']:.1e} |")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
