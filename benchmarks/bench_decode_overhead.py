"""Fixed cost of one decode step: a model of the Qwen3.5 layer pattern with many layers but tiny widths, so weight
and cache bytes are negligible and what is left is dispatch, kernel launches and the layer loop.

    python benchmarks/bench_decode_overhead.py [--layers 4,64] [--dtype bfloat16] [--steps 100]

On the H200 (2026-11-29): 2.0 ms per step with 4 layers, 2.3 ms with 64 (benchmarks/RESULTS.md), so a 40 ms step of
the 27B-shaped model is spent on its sizes, not on per-layer overhead.

The server's loop also samples each step's tokens and reads them to the host (decode, sample_tokens,
record_tokens, the outputs read back): timed with the next step issued after that read (the engine before session
46: the device idles while the host works) and before it (the engine's one step ahead). The sampling table times
sample_tokens alone at the Qwen3.5 vocabulary (248,320) for greedy, tempered and top-p rows.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def step_ms(layers: int, dtype: str, steps: int) -> tuple[float, float, float, float]:
    """(host milliseconds to issue a step, milliseconds per step including the device, milliseconds per step of the
    server's loop (tokens sampled, counted and read back each step) with the next step issued after the read and
    before it) for `layers` layers."""
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
    total = time.perf_counter() - t
    return (1e3 * issued / steps, 1e3 * total / steps, synced_step_ms(backend, steps, ahead=False),
            synced_step_ms(backend, steps, ahead=True))


def synced_step_ms(backend, steps: int, ahead: bool) -> float:
    """Milliseconds per step of the scheduler's decode loop for one greedy row (Engine._decode_step): the step,
    sample_tokens and record_tokens, and the sampled outputs read to the host; the next step issued after that read,
    or before it (`ahead`: the engine's way, its input tokens taken from the device)."""
    import jax.numpy as jnp

    from luxjax.engine.requests import SamplingParams
    from luxjax.engine.sampling import RowParams, sample_tokens
    from luxjax.engine.scheduler import record_tokens

    caches = backend.init_cache(1, 1280)
    counts, last = jnp.zeros((1, backend.vocab_size), jnp.int32), jnp.zeros((1,), jnp.int32)
    deltas, active = np.zeros(1, np.int32), np.ones(1, bool)
    began, in_flight = None, None
    for n in range(steps + 10):  # the first 10 compile and warm up
        if n == 10:
            began = time.perf_counter()
        if not ahead and in_flight is not None:
            [np.asarray(x) for x in in_flight]
        logits, caches = backend.decode(caches, last, np.full(1, 10 + n, np.int32), deltas, active)
        out = sample_tokens(logits, counts, RowParams.build([(SamplingParams(), 0, n)]))
        counts, last = record_tokens(counts, last, out[0], jnp.asarray(active))
        if ahead and in_flight is not None:
            [np.asarray(x) for x in in_flight]
        in_flight = out
    [np.asarray(x) for x in in_flight]
    return 1e3 * (time.perf_counter() - began) / steps


SAMPLING_CASES = {"greedy": {}, "temperature 0.8": {"temperature": 0.8},
                  "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95}}


def sampling_ms(batch: int, vocab: int, params: dict, steps: int) -> float:
    """Milliseconds per sample_tokens call on random logits [batch, vocab] with these SamplingParams for every
    row, its outputs read to the host each call."""
    import jax.numpy as jnp

    from luxjax.engine.requests import SamplingParams
    from luxjax.engine.sampling import RowParams, sample_tokens

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, vocab)).astype(np.float32))
    counts = jnp.zeros((batch, vocab), jnp.int32)
    began = None
    for n in range(steps + 5):
        if n == 5:
            began = time.perf_counter()
        out = sample_tokens(logits, counts, RowParams.build([(SamplingParams(**params), row, n)
                                                             for row in range(batch)]))
        [np.asarray(x) for x in out]
    return 1e3 * (time.perf_counter() - began) / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,64")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=248320, help="the sampling table's vocabulary")
    ap.add_argument("--batches", default="1,4", help="the sampling table's rows")
    args = ap.parse_args()
    print("| layers | host ms to issue a step | ms per step | server loop, ms per step: issued after the read "
          "| issued before it |\n|---|---|---|---|---|")
    for layers in (int(x) for x in args.layers.split(",")):
        issued, total, synced, ahead = step_ms(layers, args.dtype, args.steps)
        print(f"| {layers} | {issued:.2f} | {total:.2f} | {synced:.2f} | {ahead:.2f} |", flush=True)
    print(f"\n| rows | sample_tokens at {args.vocab:,} tokens | ms a call |\n|---|---|---|")
    for batch in (int(x) for x in args.batches.split(",")):
        for name, params in SAMPLING_CASES.items():
            print(f"| {batch} | {name} | {sampling_ms(batch, args.vocab, params, args.steps):.3f} |", flush=True)


if __name__ == "__main__":
    main()
