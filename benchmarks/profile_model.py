"""Where the GPU time of a random-weight Qwen3.5 model goes: per-kernel totals from a jax.profiler trace of the
vision tower, a text prefill, the first token of an image prompt and decode steps (batch 1, or --decode-batch).

    python benchmarks/profile_model.py --config qwen35-27b --json profile.json

The model is built as in bench_model.py (transformers' random initialisation handed over through DLPack). Each phase
is compiled first, then traced for a few calls; the table lists the kernels with the most GPU time per call."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_model import build_torch_model, image_prompt_ids, random_image  # noqa: E402
from benchmarks.model_configs import CONFIGS  # noqa: E402
from benchmarks.quant_plan import SCHEMES, decoder_weights  # noqa: E402
from benchmarks.timing import gpu_idle_us, gpu_kernel_spans, gpu_kernel_times  # noqa: E402


SEQUENCE_LIMIT = 4000  # kernels of a phase's first call kept in order in the JSON report


def profile_phase(name: str, fn, calls: int) -> dict:
    """Compile and warm `fn` (which blocks until its device work is done), then trace `calls` calls."""
    fn()
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                fn()
        spans = gpu_kernel_spans(d)  # the trace read once: kernel totals and the idle gaps
    kernels = gpu_kernel_times(spans)
    idle_us, idle_gaps = gpu_idle_us(spans, calls)
    per_call = {k: (n / calls, us / calls) for k, (n, us) in kernels.items()}
    gpu_ms = sum(us for _, us in per_call.values()) / 1e3
    top = sorted(per_call.items(), key=lambda kv: -kv[1][1])
    print(f"\n## {name}: wall {1e3 * wall:.2f} ms per call, GPU kernels {gpu_ms:.2f} ms per call, GPU idle in gaps "
          f"> 20 us {idle_us / 1e3 / calls:.2f} ms per call ({idle_gaps / calls:.0f} gaps)")
    print("| kernel | launches | ms | share |\n|---|---|---|---|")
    for k, (n, us) in top[:25]:
        print(f"| {k[:90]} | {n:.0f} | {us / 1e3:.3f} | {100 * us / 1e3 / max(gpu_ms, 1e-9):.1f}% |")
    first_call = sorted(spans, key=lambda span: span[1])[: len(spans) // calls]
    return {"wall_ms": 1e3 * wall, "gpu_ms": gpu_ms, "gpu_idle_ms": idle_us / 1e3 / calls,
            "kernels": [{"name": k, "launches": n, "ms": us / 1e3} for k, (n, us) in top],
            # the first call's kernels in launch order (name, us): which small launches sit around which kernel
            "sequence": [(name, round(us, 2)) for name, _, us in first_call[:SEQUENCE_LIMIT]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", *SCHEMES])
    ap.add_argument("--prompt-tokens", type=int, default=1012)
    ap.add_argument("--image-tokens", type=int, default=975)
    ap.add_argument("--phases", default="vision,prefill,first_token,decode")
    ap.add_argument("--decode-batch", type=int, default=1, help="sequences decoded together in the decode phase")
    ap.add_argument("--json", help="write the per-phase tables here")
    args = ap.parse_args()
    phases = args.phases.split(",")
    cfg_dict = CONFIGS[args.config]

    from luxjax.models.qwen35 import model as qwen
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
    from luxjax.vision.types import ImageInputs

    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    torch_model = build_torch_model(cfg_dict, args.dtype, device)
    tensors = {name: jax.dlpack.from_dlpack(p.detach()) for name, p in torch_model.state_dict().items()}
    tensors = decoder_weights(tensors, args.weights, cfg_dict, jnp.dtype(args.dtype))
    processor = Qwen35ImageProcessor.from_preprocessor_config({
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    backend = build(ModelConfig.from_hf(cfg_dict), tensors, None, processor, args.dtype, origin=args.config)
    del tensors, torch_model

    report = {"config": args.config, "weights": args.weights, "device": jax.devices()[0].device_kind,
              "jax": jax.__version__}
    pixels, grid = random_image(cfg_dict, args.image_tokens)
    inputs = ImageInputs(pixels, grid, [int(grid[0].prod() // 4)])
    if "vision" in phases:
        to_device = lambda: jax.block_until_ready(backend.vision_arrays(inputs))  # noqa: E731
        to_device()
        t = time.perf_counter()
        on_device = to_device()
        report["vision_inputs_ms"] = 1e3 * (time.perf_counter() - t)
        print(f"\nvision inputs laid out and sent to the device: {report['vision_inputs_ms']:.2f} ms")
        report["vision_tower"] = profile_phase("vision tower (inputs on the device)", lambda: qwen.encode_images(
            backend.jit_graphdef, backend.state, **on_device).block_until_ready(), 3)
        report["encode_images"] = profile_phase("encode_images (host inputs)", lambda: backend.encode_images(
            inputs).block_until_ready(), 3)
    ids = np.random.default_rng(0).integers(0, cfg_dict["text_config"]["vocab_size"] - 1000,
                                            args.prompt_tokens).tolist()
    max_len = 2048
    state = {"caches": backend.init_cache(1, max_len)}
    if "prefill" in phases:
        prompt = backend.prompt_from_ids(ids, None)

        def prefill():
            logits, state["caches"] = backend.prefill(state["caches"], 0, prompt, None, 0, prompt.num_tokens)
            logits.block_until_ready()

        report["prefill"] = profile_phase(f"prefill ({args.prompt_tokens} tokens)", prefill, 2)
    if "first_token" in phases:
        image_prompt = backend.prompt_from_ids(
            image_prompt_ids(ids, backend.pad_id, inputs.num_tokens[0], args.prompt_tokens), inputs)

        def first_token():
            rows = backend.encode_images(inputs)
            logits, state["caches"] = backend.prefill(state["caches"], 0, image_prompt, rows, 0,
                                                      image_prompt.num_tokens)
            logits.block_until_ready()

        report["first_token"] = profile_phase("first token of the image prompt", first_token, 2)
    if "decode" in phases:
        batch = args.decode_batch
        state["caches"] = backend.init_cache(batch, max_len)
        tokens, cached = np.zeros(batch, np.int32), np.full(batch, args.prompt_tokens, np.int32)
        deltas = np.zeros(batch, np.int32)

        def ten_steps():
            for _ in range(10):
                logits, state["caches"] = backend.decode(state["caches"], tokens, cached, deltas)
            logits.block_until_ready()

        report[f"decode_10_steps_b{batch}"] = profile_phase(f"10 decode steps, batch {batch}", ten_steps, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
