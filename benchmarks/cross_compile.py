"""Every Pallas kernel a model's jitted functions launch, lowered for a GPU platform and compiled by PyPI's Triton
for that GPU, on a machine without one: does each kernel compile for AMD (gfx942, MI300) and NVIDIA (sm_90)?

    python benchmarks/cross_compile.py --platform rocm --triton /tmp/tv/bin/python [--config small] [--weights IQ4_XS]
    python benchmarks/cross_compile.py --platform cuda --triton /tmp/tv/bin/python --json out.json

The model (a named config of benchmarks/model_configs.py, random weights; packed blocks with --weights) is built on
the CPU and driven through its backend as the engine drives it (a prefill step, decode steps at batch 1, 4, 16 and
32, the vision tower, a prompt with an image), with the Pallas kernels chosen as on a GPU of that platform
(ops.backend.gpu_platform reports it). Each jitted call is lowered for the platform instead of run (its outputs
are zeros of their shapes), every Triton module Pallas produces is kept with its warps and stages, and PyPI's Triton
(`python -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.6.0`, not a project dependency) compiles each one.
XLA compiles the same IR with its own Triton (another version), so this shows what lowers and compiles, not speed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_model import build_torch_model, image_prompt_ids, random_image  # noqa: E402
from benchmarks.inspect_kernel import KernelCapture  # noqa: E402
from benchmarks.model_configs import CONFIGS  # noqa: E402
from benchmarks.quant_plan import SCHEMES, decoder_weights  # noqa: E402

TARGETS = {"rocm": ("hip", "gfx942", 64), "cuda": ("cuda", 90, 32)}
# Shared memory (LDS) one program may use: gfx942's 64 KiB, sm_90's 227 KiB; a kernel asking more fails at launch.
SHARED_LIMITS = {"rocm": 64 * 1024, "cuda": 227 * 1024}

# Run by the Triton Python: compile one IR file for the target, print one JSON line of what it found.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
path, backend, arch, warp, warps, stages = sys.argv[1:7]
arch = int(arch) if arch.isdigit() else arch
k = triton.compile(path, target=GPUTarget(backend, arch, int(warp)),
                   options={"num_warps": int(warps), "num_stages": int(stages)})
print(json.dumps({"shared_bytes": k.metadata.shared, "binary": "hsaco" if "hsaco" in k.asm else "cubin"}))
"""


def lowered_instead(fn, platform: str):
    """fn (a jitted function) lowered for `platform` when called, its outputs zeros of their shapes."""
    def call(*args, **kwargs):
        fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
        return jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args, **kwargs))

    return call


def drive_model(backend, cfg_dict, prompt_tokens: int, image_tokens: int):
    """The engine's calls on the backend: a prompt's prefill, decode steps at batch 1, 4, 16 and 32 (the most
    sequences the packed decode kernels take in a step), the vision tower, a prompt with an image prefilled in the
    server's steps."""
    from luxjax.engine.generate import prefill_prompt
    from luxjax.vision.types import ImageInputs

    vocab = cfg_dict["text_config"]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab - 1000, prompt_tokens).tolist()
    caches = backend.init_cache(1, 2 * prompt_tokens)
    _, caches = backend.prefill(caches, 0, backend.prompt_from_ids(ids, None), None, 0, prompt_tokens)
    for batch in (1, 4, 16, 32):
        caches = backend.init_cache(batch, 2 * prompt_tokens)
        backend.decode(caches, np.zeros(batch, np.int32), np.full(batch, prompt_tokens, np.int32),
                       np.zeros(batch, np.int32))
    pixels, grid = random_image(cfg_dict, image_tokens)
    inputs = ImageInputs(pixels, grid, [int(grid[0].prod() // 4)])
    backend.encode_images(inputs)
    prompt = backend.prompt_from_ids(image_prompt_ids(ids, backend.pad_id, inputs.num_tokens[0], prompt_tokens),
                                     inputs)
    prefill_prompt(backend, backend.init_cache(1, 2 * prompt_tokens), 0, prompt)


def build_backend(config: str, weights: str):
    """The config's model with random weights (transformers' initialisation on the CPU; packed blocks of llama.cpp's
    type plan for `weights` other than bf16), as bench_model.py builds it, and its HF config dict."""
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor

    cfg_dict = CONFIGS[config]
    torch_model = build_torch_model(cfg_dict, "bfloat16", "cpu")
    tensors = {name: jax.dlpack.from_dlpack(p.detach()) for name, p in torch_model.state_dict().items()}
    tensors = decoder_weights(tensors, weights, cfg_dict, jax.numpy.dtype("bfloat16"))
    processor = Qwen35ImageProcessor.from_preprocessor_config({
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    return build(ModelConfig.from_hf(cfg_dict), tensors, None, processor, "bfloat16", origin=config), cfg_dict


def compile_kernel(kernel: dict, platform: str, triton_python: str) -> dict:
    """One captured kernel compiled by the Triton Python for the platform's target: ok where it compiled within the
    target's shared memory, else the error."""
    backend_name, arch, warp = TARGETS[platform]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.ttir"
        path.write_text(kernel["ir"])
        found = subprocess.run([triton_python, "-c", _COMPILE, str(path), backend_name, str(arch), str(warp),
                                str(kernel["num_warps"]), str(kernel["num_stages"])], capture_output=True, text=True)
    if found.returncode:
        return {"ok": False, "error": found.stderr.strip().splitlines()[-1][:300] if found.stderr else "?"}
    result = json.loads(found.stdout.strip().splitlines()[-1])
    if result["shared_bytes"] > SHARED_LIMITS[platform]:
        return {"ok": False, "error": f"{result['shared_bytes']} bytes of shared memory, over {platform}'s "
                                      f"{SHARED_LIMITS[platform]}", **result}
    return {"ok": True, **result}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="rocm", choices=sorted(TARGETS))
    ap.add_argument("--config", default="small", choices=sorted(CONFIGS))
    ap.add_argument("--weights", default="IQ4_XS", choices=["bf16", *SCHEMES])
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--image-tokens", type=int, default=120)
    ap.add_argument("--triton", default=sys.executable, help="a Python that has PyPI's triton")
    ap.add_argument("--json")
    ap.add_argument("--keep", help="also write each kernel's Triton IR into this folder")
    args = ap.parse_args()

    from luxjax.models.qwen35 import model as qwen
    from luxjax.ops import backend as ops_backend

    backend, cfg_dict = build_backend(args.config, args.weights)
    ops_backend.use_pallas = lambda: True
    ops_backend.interpret = lambda: False
    ops_backend.gpu_platform = lambda: args.platform
    for name in ("prefill", "decode", "encode_images"):
        setattr(qwen, name, lowered_instead(getattr(qwen, name), args.platform))
    with KernelCapture() as captured:
        drive_model(backend, cfg_dict, args.prompt_tokens, args.image_tokens)
    rows = []
    for digest, kernel in captured.kernels.items():
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            (Path(args.keep) / f"{kernel['name']}-{digest}.ttir").write_text(kernel["ir"])
        result = compile_kernel(kernel, args.platform, args.triton)
        rows.append({"kernel": kernel["name"], "ir": digest, "num_warps": kernel["num_warps"],
                     "num_stages": kernel["num_stages"], **result})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"platform": args.platform, "config": args.config,
                                               "weights": args.weights, "rows": rows}, indent=1))
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows)} kernels lowered for {args.platform} ({args.config}, {args.weights}); "
          f"{len(rows) - len(failed)} compiled for {TARGETS[args.platform][1]} within its shared memory, "
          f"{len(failed)} failed")
    for r in failed:
        print(f"  {r['kernel']}: {r['error']}")


if __name__ == "__main__":
    main()
