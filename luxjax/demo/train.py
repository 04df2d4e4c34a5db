"""Train the packaged demo model: `python -m luxjax.demo.train [--steps N] [--batch B] [--out DIR]`.

Trains the demo tokenizer, then a small Qwen3.5 (DeltaNet/attention decoder + vision tower + merger) built by the
real model code (luxjax/models/qwen35) from a dict of Hugging Face-named arrays, which is what is optimised.
Batches come from worker processes (spawned before JAX starts) so rendering never starves the accelerator.
Writes DIR/params_text.npz, DIR/params_vision.npz, DIR/config.json, DIR/tokenizer.json (GGUF tokenizer metadata).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from luxjax.demo.batches import FOLLOW_UPS, BatchMaker, parse_mix
from luxjax.demo.model_init import DECODER_LAYERS, VISION_DEPTH, demo_config, grow_params, init_params
from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer

_MAKER = None


def _init_worker(meta: dict, cfg: dict, follow_ups: int, mix: dict):
    global _MAKER
    _MAKER = BatchMaker(tokenizer_from_metadata(meta), cfg, meta["tokenizer.chat_template"], follow_ups, mix)


def _make_batch(args):
    return _MAKER(*args)


def build_model(params, cfg: dict, dtype):
    from luxjax.checkpoint.weights import WeightSource
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.model import Qwen35Model

    return Qwen35Model(ModelConfig.from_hf(cfg), WeightSource(params, dtype, origin="demo"), dtype)


def make_loss(cfg: dict):
    import jax
    import jax.numpy as jnp
    import optax

    from luxjax.demo.batches import processor
    from luxjax.vision.patch_codes import expand

    proc = processor()
    lut = jnp.asarray(proc._lookup)  # [3, 256] the processor's exact normalised values
    f32 = jnp.float32

    def loss_fn(params, b):
        model = build_model(params, cfg, f32)
        S, P, C, n = b["patches"].shape
        codes = b["patches"].reshape(S * P, C, n).astype(jnp.int32)
        pixels = expand(codes, lut, proc.temporal_patch_size).reshape(S, P, -1)  # the processor's float rows
        rows = jax.vmap(model.vision)(pixels, b["taps"], b["tap_weights"], b["rope_ids"], b["segments"])
        rows = rows.reshape(-1, rows.shape[-1])
        ids, index = b["ids"], b["image_index"]
        x = model.text.embed(ids, f32)
        x = jnp.where((index >= 0)[..., None], rows[jnp.clip(index, 0)], x)
        B, T = ids.shape
        h, _ = model.text(x, b["positions"], jnp.zeros(B, jnp.int32), b["valid"],
                          model.text.init_cache(B, T, f32), chunked=True)
        logits = model.text.logits(h)
        labels = b["labels"]
        mask = labels >= 0
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.clip(labels, 0))
        loss = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)
        acc = jnp.sum((jnp.argmax(logits, -1) == labels) * mask) / jnp.maximum(jnp.sum(mask), 1)
        return loss, acc

    return loss_fn


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="0: in-process")
    p.add_argument("--time-limit", type=float, default=0,
                   help="stop after this many seconds of training, counted from the compiled first step (0 = none)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--follow-ups", type=int, default=FOLLOW_UPS,
                   help="at most this many extra question turns per sequence")
    p.add_argument("--question-mix", type=parse_mix, default="hard",
                   help='first-turn question types: "hard" (the default weights), "uniform" or "which=2,where=1,..."')
    p.add_argument("--layers", type=int, default=DECODER_LAYERS, help="decoder layers (even: DeltaNet, attention, ...)")
    p.add_argument("--vision-depth", type=int, default=VISION_DEPTH, help="vision tower blocks")
    p.add_argument("--resume", help="start from the parameters in this folder (fresh optimizer state): one written "
                   "by this script or an exported GGUF pair (e.g. luxjax/assets/default); a model with fewer layers "
                   "grows to the current shape, its new blocks starting as identities")
    p.add_argument("--out", default="out/demo")
    args = p.parse_args(argv)
    started = time.time()
    meta = train_tokenizer()
    cfg = demo_config(meta, args.layers, args.vision_depth)
    params = init_params(cfg, args.seed)
    if args.resume:
        params = resumed_params(args.resume, cfg, meta, args.seed)
    first_job = 1_000_003 * (args.seed + 1) + (10_000_019 if args.resume else 0)  # a resumed run sees new data
    jobs = ((first_job + step, args.batch) for step in range(args.steps))
    if args.workers > 0:
        pool = mp.get_context("spawn").Pool(args.workers, _init_worker, (meta, cfg, args.follow_ups, args.question_mix))
        batches = pool.imap(_make_batch, jobs, chunksize=1)
    else:
        pool, _ = None, _init_worker(meta, cfg, args.follow_ups, args.question_mix)
        batches = map(_make_batch, jobs)

    import jax
    import optax
    from tqdm import tqdm

    warmup = min(100 if args.resume else 300, args.steps // 10)
    decay_mask = jax.tree.map(lambda a: a.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=args.lr, b2=0.98, weight_decay=0.01, mask=decay_mask))
    params = jax.device_put(params)
    opt_state = opt.init(params)
    grad_fn = jax.value_and_grad(make_loss(cfg), has_aux=True)

    @jax.jit
    def step(params, opt_state, batch, lr):
        (loss, acc), grads = grad_fn(params, batch)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    print(f"devices {jax.devices()}; vocab {cfg['text_config']['vocab_size']}; "
          f"{sum(a.size for a in params.values()) / 1e6:.2f}M parameters", flush=True)
    t0, ema, done, waited, compile_seconds = time.time(), None, 0, 0.0, 0.0
    bar = tqdm(total=args.steps, desc="train", mininterval=5)
    for i in range(args.steps):
        asked = time.time()
        b = next(batches)
        waited += time.time() - asked
        elapsed = time.time() - t0
        lr = learning_rate(args.lr, i, warmup, max(i / args.steps, elapsed / args.time_limit if args.time_limit else 0))
        params, opt_state, loss, acc = step(params, opt_state, vars(b), np.float32(lr))
        if i == 0:  # the clock of --time-limit starts once the step is compiled
            jax.block_until_ready(loss)
            compile_seconds, t0 = time.time() - t0, time.time()
        done = i + 1
        if i % 25 == 0 or done == args.steps:
            loss, acc = float(loss), float(acc)
            ema = loss if ema is None else 0.8 * ema + 0.2 * loss
            bar.set_postfix(loss=f"{loss:.4f}", ema=f"{ema:.4f}", acc=f"{acc:.3f}", lr=f"{lr:.1e}")
        bar.update(1)
        if args.save_every and done % args.save_every == 0:
            save(args.out, params, cfg, meta)
        if args.time_limit and time.time() - t0 > args.time_limit:
            break
    bar.close()
    if pool is not None:
        pool.terminate()
    final_loss = float(loss)
    out = save(args.out, params, cfg, meta)
    summary = {"steps": done, "batch": args.batch, "train_seconds": round(time.time() - t0, 1),
               "total_seconds": round(time.time() - started, 1), "final_loss": final_loss,
               "final_loss_ema": ema, "seconds_waiting_for_data": round(waited, 1),
               "compile_seconds": round(compile_seconds, 1), "device": str(jax.devices()[0])}
    (out / "summary.json").write_text(json.dumps(summary))
    print("SUMMARY", json.dumps(summary), flush=True)


def learning_rate(peak: float, step: int, warmup: int, progress: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 3% of `peak` as `progress` goes 0 -> 1 (the larger of
    the step fraction and the time fraction, so a run cut by --time-limit still ends annealed)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def save(folder, params, cfg: dict, meta: dict) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.asarray(v, np.float32) for k, v in params.items()}
    np.savez(out / "params_text.npz", **{k: v for k, v in arrays.items() if not k.startswith("model.visual.")})
    np.savez(out / "params_vision.npz", **{k: v for k, v in arrays.items() if k.startswith("model.visual.")})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(meta))
    return out


def resumed_params(folder, cfg: dict, meta: dict, seed: int) -> dict:
    """Parameters saved in `folder` (by main() or as exported GGUF files) for the model of `cfg`."""
    saved, saved_cfg, saved_meta = load_trained(folder)
    if saved_meta != meta:
        raise SystemExit(f"--resume {folder}: saved with another tokenizer")
    if saved_cfg == cfg:
        return saved
    try:
        return grow_params(saved, saved_cfg, cfg, seed)
    except ValueError as e:
        raise SystemExit(f"--resume {folder}: saved with another model shape ({e})") from e


def load_trained(folder) -> tuple[dict, dict, dict]:
    """(HF-named float32 params, config dict, GGUF tokenizer metadata) written by main(), or read from the exported
    GGUF files in `folder`."""
    folder = Path(folder)
    if not (folder / "params_text.npz").exists():
        from luxjax.demo.export_gguf import load_exported

        return load_exported(folder)
    params = {}
    for name in ("params_text.npz", "params_vision.npz"):
        with np.load(folder / name) as z:
            params.update({k: z[k] for k in z.files})
    return params, json.loads((folder / "config.json").read_text()), json.loads((folder / "tokenizer.json").read_text())


if __name__ == "__main__":
    main()
