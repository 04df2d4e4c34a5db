"""The Qwen3.5-27B vision tower alone (random weights; a small text decoder beside it, since the tower is the same
whatever the decoder), one image of --image-tokens tokens: milliseconds per call from inputs already on the device
(wall median and GPU kernels from a trace), from the host, and the inputs' way to the device. Builds in seconds
where bench_model.py builds the whole 27B model.

    python benchmarks/bench_vision_tower.py [--image-tokens 975] [--json out.json]

Without a GPU the tower runs on the CPU (no GPU kernel time)."""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from benchmarks.bench_model import build_torch_model, random_image  # noqa: E402
from benchmarks.model_configs import QWEN35_27B  # noqa: E402
from benchmarks.timing import call_kernels_ms, median_ms  # noqa: E402

SMALL_TEXT = {"num_hidden_layers": 4, "hidden_size": 1024, "intermediate_size": 3072, "vocab_size": 4096}


def tower_config() -> dict:
    """The 27B's vision config beside a small text decoder (its output width the decoder's)."""
    cfg = copy.deepcopy(QWEN35_27B)
    cfg["text_config"].update(SMALL_TEXT)
    cfg["vision_config"]["out_hidden_size"] = SMALL_TEXT["hidden_size"]
    cfg.update(image_token_id=4056, video_token_id=4057, vision_start_token_id=4053, vision_end_token_id=4054)
    return cfg


def build_backend(cfg: dict):
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor

    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    torch_model = build_torch_model(cfg, "bfloat16", device)
    tensors = {name: jax.dlpack.from_dlpack(p.detach()) for name, p in torch_model.state_dict().items()}
    processor = Qwen35ImageProcessor.from_preprocessor_config({
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    return build(ModelConfig.from_hf(cfg), tensors, None, processor, "bfloat16", origin="27b-vision")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image-tokens", type=int, default=975)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    from luxjax.models.qwen35 import model as qwen
    from luxjax.vision.types import ImageInputs

    cfg = tower_config()
    backend = build_backend(cfg)
    pixels, grid = random_image(cfg, args.image_tokens)
    inputs = ImageInputs(pixels, grid, [int(grid[0].prod() // 4)])
    arrays = backend.vision_arrays(inputs)

    def tower():
        return qwen.encode_images(backend.jit_graphdef, backend.state, **arrays)

    t = time.perf_counter()
    jax.block_until_ready(tower())
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "image_tokens": args.image_tokens,
              "compile_s": time.perf_counter() - t, "device_inputs_ms": median_ms(tower, repeats=args.repeats),
              "gpu_ms": call_kernels_ms(tower),
              "host_inputs_ms": median_ms(lambda: backend.encode_images(inputs), repeats=args.repeats),
              "inputs_ms": median_ms(lambda: backend.vision_arrays(inputs), repeats=args.repeats)}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    gpu = f"{report['gpu_ms']:.2f}" if report["gpu_ms"] is not None else "-"
    print(f"\nvision tower (27B), one {args.image_tokens}-token image on {report['device']} (compile "
          f"{report['compile_s']:.1f} s)\n| from device inputs, wall ms | GPU kernels ms | from the host, wall ms "
          f"| inputs to the device ms |\n|---|---|---|---|\n| {report['device_inputs_ms']:.2f} | {gpu} | "
          f"{report['host_inputs_ms']:.2f} | {report['inputs_ms']:.2f} |")


if __name__ == "__main__":
    main()
