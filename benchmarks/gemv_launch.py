"""One launch of a decode GEMV kernel on random weights, for a hardware profiler to read its counters.

    ncu --clock-control none -c 1 -k regex:quant_matmul --section SpeedOfLight --section InstructionStats \
        python benchmarks/gemv_launch.py IQ4_XS --out 17408 --in 5120
    ncu ... --section SourceCounters --page source --print-source sass python benchmarks/gemv_launch.py Q4_K
    ncu ... python benchmarks/gemv_launch.py IQ4_XS --int8-levels 2   (the int8 GEMV, x in two int8 levels)

The kernel runs twice (compile, then the launch to profile); `-c 1` profiles the first. Formats: bf16 (the dense
stacked GEMV) or a ggml type with a fused kernel (the packed one); both read layer 0 of a one-layer stack in place,
as the decoder does. Without a GPU the kernel runs interpreted (a smoke test, nothing to profile).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from benchmarks.quant_plan import random_packed  # noqa: E402
from luxjax.ops import backend  # noqa: E402
from pallas_kernels import dense_gemv, quant_gemv_int8, quant_matmul  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("format", help="bf16 or a ggml type name (IQ4_XS, Q4_K, Q5_K, Q6_K, Q8_0)")
    ap.add_argument("--out", type=int, default=17408)
    ap.add_argument("--in", dest="k", type=int, default=5120)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (1..16)")
    ap.add_argument("--tiles", help="packed kernel's BLOCK_N,VALUES_PER_K_STEP,WARPS (default: the kernel's choice)")
    ap.add_argument("--int8-levels", type=int, help="IQ4_XS through the int8 GEMV, x in this many int8 levels")
    args = ap.parse_args()
    key_w, key_x = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (args.rows, args.k), jnp.bfloat16)
    layer = jnp.int32(0)
    if args.format == "bf16":
        stacked = jax.random.normal(key_w, (1, args.out, args.k), jnp.bfloat16)
        product = jax.jit(lambda x, w: dense_gemv.stacked_gemv(x, w, layer, interpret=backend.interpret()))
    else:
        one = random_packed((args.out, args.k), T[args.format], key_w, jnp.bfloat16)
        stacked = jax.tree.map(lambda a: a[None], one)
        block_sizes, block = None, GGML_QUANT_SIZES[T[args.format]][0]
        if args.tiles:
            default = quant_matmul.BlockSizes.get_default(T[args.format], args.rows)
            block_n, values, warps = map(int, args.tiles.split(","))
            block_sizes = quant_matmul.BlockSizes(default.block_m, block_n, max(1, values // block), warps,
                                                  default.num_stages)
        product = jax.jit(lambda x, w: quant_matmul.stacked_quant_matmul(x, w, layer, block_sizes=block_sizes,
                                                                             interpret=backend.interpret()))
        if args.int8_levels:
            int8_sizes = None
            if args.tiles:
                block_n, values, warps = map(int, args.tiles.split(","))
                int8_sizes = quant_gemv_int8.BlockSizes(block_n, max(1, values // block), warps)
            product = jax.jit(lambda x, w: quant_gemv_int8.int8_quant_matmul(
                x, w, layer, block_sizes=int8_sizes, levels=args.int8_levels, interpret=backend.interpret()))
    for _ in range(2):
        jax.block_until_ready(product(x, stacked))


if __name__ == "__main__":
    main()
