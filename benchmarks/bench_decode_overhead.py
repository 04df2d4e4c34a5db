"""Fixed cost of one decode step: a model of the Qwen3.5 layer pattern with many layers but tiny widths, so weight
and cache bytes are negligible and what is left is dispatch, kernel launches and the layer loop.

    python benchmarks/bench_decode_overhead.py [--layers 4,64] [--dtype bfloat16] [--steps 100]

On the H200 (2026-11-29): 2.0 ms per step with 4 layers, 2.3 ms with 64 (benchmarks/RESULTS.md), so a 40 ms step of
the 27B-shaped model is spent on its sizes, not on per-layer overhead.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def step_ms(layers: int, dtype: str, steps: int) -> tuple[float, float]:
    """(host milliseconds to issue a step, milliseconds per step including the device) for `layers` layers."""
    from luxjax.demo.batches import processor
    from luxjax.demo.model_init import demo_config, init_params
    from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build

    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    cfg = demo_config(meta, layers=layers, vision_depth=1)
    cfg["text_config"].update(hidden_size=64, intermediate_size=64)
    cfg["vision_config"]["out_hidden_size"] = 64
    backend = build(ModelConfig.from_hf(cfg), init_params(cfg, 0), tok, processor(), dtype, origin="overhead")
    caches = backend.init_cache(1, 1280)
    tokens, cached, deltas = np.zeros(1, np.int32), np.full(1, 10, np.int32), np.zeros(1, np.int32)
    for _ in range(10):  # compile and warm up
        logits, caches = backend.decode(caches, tokens, cached, deltas)
    logits.block_until_ready()
    t = time.perf_counter()
    for _ in range(steps):
        logits, caches = backend.decode(caches, tokens, cached, deltas)
    issued = time.perf_counter() - t
    logits.block_until_ready()
    return 1e3 * issued / steps, 1e3 * (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    print("| layers | host ms to issue a step | ms per step |\n|---|---|---|")
    for layers in (int(x) for x in args.layers.split(",")):
        issued, total = step_ms(layers, args.dtype, args.steps)
        print(f"| {layers} | {issued:.2f} | {total:.2f} |", flush=True)


if __name__ == "__main__":
    main()
