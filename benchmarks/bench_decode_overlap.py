"""Packed prefill products with the weights' bf16 decode on a second GPU stream, against decode-then-GEMM in turn.

    python benchmarks/bench_decode_overlap.py [--layers 4] [--json out.json]

Why: a 1,012-row product of a packed weight decodes W to bf16 (Pallas, quant_dequantize) and then runs cuBLAS on it;
the decode is memory-bound (~3.4 TB/s), the GEMM compute-bound, and in turn they cost their sum (~19 ms of a 27B
IQ4_XS prefill). A layer's weights do not depend on its activations, so their decodes can run on another stream
(XLA's stream annotation, `compute_on("gpu_stream:1")`) while the GEMMs before them run. Each case is an MLP
layer of the 27B (gate and up 17408 x 5120, down 5120 x 17408), `--layers` different layers chained in one call,
unrolled, or in a lax.scan over the stacked layers. Wall time per layer (the overlap does not show in kernel sums).

Measured on an H200 (RESULTS.md, 2026-12-02 session 20): the decodes hid ~11% of their cost (unrolled: 1.103 ->
1.076 ms per layer, dense GEMMs alone 0.863): cuBLAS's GEMMs hold every multiprocessor, so the other stream's
kernels mostly wait for them. Not adopted.
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
from benchmarks.timing import median_ms, write_rows  # noqa: E402
from luxjax.checkpoint.quants import QuantizedTensor  # noqa: E402
from luxjax.ops import backend  # noqa: E402
from luxjax.ops.linear import vendor_matmul  # noqa: E402
from pallas_kernels import quant_dequantize as qd  # noqa: E402

ROWS, HIDDEN, MLP = 1012, 5120, 17408


def decode(w: QuantizedTensor) -> jax.Array:
    return qd.dequantize_in_kernel_order(w, dtype=jnp.bfloat16, natural_order=True, interpret=backend.interpret())


def on_stream(fn, stream: int):
    """fn as one call that XLA runs on GPU stream `stream`, its outputs waited for where they are used. JAX's
    compute_on annotates every op traced inside it, so a jitted helper inside fn becomes an annotated call within
    the annotated call, which XLA rejects at run time ("No ExecutionStreamId found"); here fn is traced outside
    the annotation and only the outer call carries it (JAX internals: compute_on's primitive, bound directly)."""
    from jax._src import compute_on as co

    def call(*args):
        flat, tree = jax.tree.flatten(args)
        jaxpr, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
        outs = co.compute_on_p.bind(*flat, jaxpr=jaxpr, compute_type=f"gpu_stream:{stream}",
                                    out_memory_spaces=tuple(a.memory_space for a in jaxpr.out_avals),
                                    compiler_options_json=None)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return call


def mlp(x, gate, up, down):
    g = vendor_matmul(x, gate, jnp.float32)
    u = vendor_matmul(x, up, jnp.float32)
    return x + vendor_matmul((jax.nn.silu(g) * u).astype(x.dtype), down)


def layer(x, weights, how: str):
    if how == "dense":
        return mlp(x, *weights)
    if how == "serial":
        return mlp(x, *(decode(w) for w in weights))
    decoded = on_stream(lambda ws: [decode(w) for w in ws], 1)(weights)
    return mlp(x, *decoded)


def unrolled(x, layers, how):
    for weights in layers:
        x = layer(x, weights, how)
    return x


def scanned(x, stacked, how):
    return lax.scan(lambda h, ws: (layer(h, ws, how), None), x, stacked)[0]


def stack(layers):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--scale", type=int, default=1, help="divide the shapes (a quick run on a CPU)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    hidden, mlp_dim = HIDDEN // args.scale // 256 * 256, MLP // args.scale // 256 * 256
    shapes = ((mlp_dim, hidden), (mlp_dim, hidden), (hidden, mlp_dim))
    packed = [[random_packed(s, "IQ4_XS", jax.random.key(3 * i + j), jnp.bfloat16) for j, s in enumerate(shapes)]
              for i in tqdm(range(args.layers), desc="weights")]
    dense = [[decode(w) for w in ws] for ws in packed]
    x = jax.random.normal(jax.random.key(99), (ROWS, hidden), jnp.bfloat16) * 0.1
    rows, reference = [], None
    for form, run, weights_of in (("unrolled", unrolled, lambda ws: ws), ("scan", scanned, stack)):
        for how in tqdm(("dense", "serial", "stream"), desc=form):
            fn = jax.jit(lambda x, ws, run=run, how=how: run(x, ws, how))
            ws = weights_of(dense if how == "dense" else packed)
            got = fn(x, ws).astype(jnp.float32)
            reference = got if reference is None else reference
            err = float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference)))
            rows.append({"form": form, "how": how, "ms_per_layer": median_ms(fn, x, ws, repeats=20) / args.layers,
                         "rel_diff": err})
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}; IQ4_XS MLP layers ({shapes}), {ROWS} rows of "
          f"bf16 x, {args.layers} layers per call; wall ms per layer")
    print("| form | weights | ms per layer | rel. diff |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['form']} | {r['how']} | {r['ms_per_layer']:.3f} | {r['rel_diff']:.1e} |")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
