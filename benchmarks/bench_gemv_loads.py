"""Is the packed decode GEMV bound by its loads or by decoding? IQ4_XS 17408 x 5120, stacked over 8 layers and
read in place, one row of x: the real kernel against kernels with the same tiles that only load the qs plane
(as bytes, as uint32 words, and in the real kernel's strided pattern) and sum it.

    python benchmarks/bench_gemv_loads.py

GB/s: the real kernel's over all weight bytes, the load-only kernels' over the qs plane's bytes.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from benchmarks.quant_plan import random_packed  # noqa: E402
from benchmarks.timing import median_ms  # noqa: E402
from pallas_kernels.quant_matmul import stacked_quant_matmul  # noqa: E402

N, K, LAYERS = 17408, 5120, 8
BLOCKS = K // 256


def seconds_per_layer(fn, *args) -> float:
    return median_ms(fn, *args, repeats=10) / 1e3 / LAYERS


def _load_kernel(layer_ref, q_ref, o_ref, *, block_n, kb, width):
    rows = pl.ds(pl.program_id(0) * block_n, block_n)
    layer = layer_ref[0]

    def step(s, acc):
        sl = pl.ds(s * kb, kb)
        if q_ref.ndim == 6:  # [L, N, blocks, 4, 2, 16]: the real kernel's [4, 16] bytes of each half
            for half in range(2):
                acc = acc + q_ref[layer, rows, sl, :, half, :].astype(jnp.uint32).reshape(block_n, kb, 64)
            return acc
        return acc + q_ref[layer, rows, sl, :].astype(jnp.uint32)

    acc = lax.fori_loop(0, BLOCKS // kb, step, jnp.zeros((block_n, kb, width), jnp.uint32))
    o_ref[rows] = acc.sum(axis=(1, 2)).astype(jnp.float32)


def load_only(q, block_n: int, kb: int, warps: int):
    width = 64 if q.ndim == 6 else q.shape[-1]
    call = pl.pallas_call(functools.partial(_load_kernel, block_n=block_n, kb=kb, width=width),
                          out_shape=jax.ShapeDtypeStruct((N,), jnp.float32), grid=(N // block_n,),
                          compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=3))

    def run(q):
        body = lambda c, i: (c + call(jnp.reshape(i, (1,)).astype(jnp.int32), q)[0], None)  # noqa: E731
        return lax.scan(body, 0.0, jnp.arange(LAYERS))[0]

    return jax.jit(run)


def main():
    key = jax.random.key(0)
    layers = [random_packed((N, K), T.IQ4_XS, jax.random.fold_in(key, i), jnp.bfloat16) for i in range(LAYERS)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    words = stacked.planes["qs"].reshape(LAYERS, N, BLOCKS, 32)  # IQ4_XS codes are stored as uint32 words
    qs = lax.bitcast_convert_type(words, jnp.uint8).reshape(LAYERS, N, BLOCKS, 128)
    x = jax.random.normal(key, (1, K), jnp.bfloat16)
    real = jax.jit(lambda x, w: lax.scan(
        lambda h, i: (h + 1e-3 * stacked_quant_matmul(h, w, i)[:, :K], None), x, jnp.arange(LAYERS))[0])
    print(f"| kernel | tiles | GB/s |\n|---|---|---|\n| real | default | "
          f"{layers[0].nbytes / seconds_per_layer(real, x, stacked) / 1e9:.0f} |", flush=True)
    for block_n, kb, warps in [(8, 4, 8), (16, 4, 8), (32, 2, 8), (16, 2, 4)]:
        strided = qs.reshape(LAYERS, N, BLOCKS, 4, 2, 16)
        for name, q in (("bytes", qs), ("words", words), ("bytes, real pattern", strided)):
            t = seconds_per_layer(load_only(q, block_n, kb, warps), q)
            print(f"| loads only, qs as {name} | {block_n} rows, {kb} blocks, {warps} warps | "
                  f"{q[0].nbytes / t / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
