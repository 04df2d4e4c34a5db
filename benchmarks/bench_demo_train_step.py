"""Where a training step of the packaged demo model spends its time: the vision tower, the decoder, and the whole
step (forward + backward + AdamW), each jitted alone on one real batch.

    LUXJAX_KERNELS=xla python benchmarks/bench_demo_train_step.py [--batch 64] [--repeats 20] [--json out.json]

On the H200 a whole step of this 4.9M-parameter model took about 47 ms at batch 64 (benchmarks/RESULTS.md), far
above what its FLOPs need; this splits that time so the cause can be found.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from luxjax.demo.batches import BatchMaker, processor  # noqa: E402
from luxjax.demo.model_init import demo_config, init_params  # noqa: E402
from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer  # noqa: E402
from luxjax.demo.train import build_model, make_loss  # noqa: E402


def median_ms(fn, args, repeats: int) -> tuple[float, float]:
    """(compile + first run seconds, median milliseconds of the next `repeats` runs)."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    cfg = demo_config(meta)
    params = jax.device_put(init_params(cfg, 0))
    batch = jax.device_put(vars(BatchMaker(tok, cfg, meta["tokenizer.chat_template"])(1, args.batch)))
    f32 = jnp.float32
    lut = jnp.asarray(processor()._lookup)

    def vision_rows(params, b):
        model = build_model(params, cfg, f32)
        S, P = b["patches"].shape[:2]
        pixels = lut[jnp.arange(3)[None, None, :, None], b["patches"].astype(jnp.int32)]
        pixels = jnp.broadcast_to(pixels[:, :, :, None], (S, P, 3, 2, 256)).reshape(S, P, -1)
        return jax.vmap(model.vision)(pixels, b["taps"], b["tap_weights"], b["rope_ids"], b["segments"])

    def text_logits(params, b):
        model = build_model(params, cfg, f32)
        B, T = b["ids"].shape
        h, _ = model.text(model.text.embed(b["ids"], f32), b["positions"], jnp.zeros(B, jnp.int32), b["valid"],
                          model.text.init_cache(B, T, f32), chunked=True)
        return model.text.logits(h)

    loss = make_loss(cfg)
    opt = optax.adamw(1e-4)
    opt_state = opt.init(params)

    def step(params, opt_state, b):
        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, b)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    parts = {
        "vision forward": (jax.jit(vision_rows), (params, batch)),
        "vision forward+backward": (jax.jit(jax.grad(lambda p, b: jnp.sum(vision_rows(p, b) ** 2))), (params, batch)),
        "decoder forward": (jax.jit(text_logits), (params, batch)),
        "decoder forward+backward": (jax.jit(jax.grad(lambda p, b: jnp.sum(text_logits(p, b) ** 2))),
                                     (params, batch)),
        "loss forward": (jax.jit(loss), (params, batch)),
        "whole step": (jax.jit(step), (params, opt_state, batch)),
    }
    report = {"device": str(jax.devices()[0]), "jax": jax.__version__, "batch": args.batch,
              "image_slots": int(batch["patches"].shape[0]), "seq_len": int(batch["ids"].shape[1]), "parts": {}}
    print(f"| part (batch {args.batch}, {report['device']}) | first call s | median ms |\n|---|---|---|")
    for name, (fn, fn_args) in parts.items():
        first, ms = median_ms(fn, fn_args, args.repeats)
        report["parts"][name] = {"first_call_s": first, "median_ms": ms}
        print(f"| {name} | {first:.1f} | {ms:.2f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
