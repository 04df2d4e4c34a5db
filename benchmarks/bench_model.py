"""Prefill and decode speed of a random-weight Qwen3.5 model of a real config, luxjax next to transformers on the
same weights and device.

    python benchmarks/bench_model.py --config qwen35-27b --dtype bfloat16 --json out.json
    python benchmarks/bench_model.py --config qwen35-27b --weights IQ4_XS --json out.json

Both run in one process: transformers' model is initialised at random on the device, measured, and its tensors are
handed to luxjax through DLPack (same values). With --weights IQ4_XS or Q4_K_M, luxjax's decoder weights are then
replaced by random packed blocks of llama.cpp's type plan for that scheme (benchmarks/quant_plan.py), while
transformers stays in bf16 (the peer the issue compares against). The decode bound is decoder weight bytes (as
stored on the device) / 4.1 TB/s per step."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.model_configs import CONFIGS  # noqa: E402
from benchmarks.quant_plan import SCHEMES, decoder_weights  # noqa: E402

HBM_BYTES_PER_S = 4.1e12


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of `fn()` (which must block until its device work is done) after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def build_torch_model(cfg_dict: dict, dtype: str, device: str):
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3_5Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def release_torch_cache(device: str) -> int | None:
    """Hand the memory of transformers' dropped weights back to the device and return the bytes free after.
    PyTorch's caching allocator keeps them otherwise: the 27B's 54 GB of bf16 weights stay held while luxjax runs,
    which an 80 GB H100 cannot spare: XLA then failed to compile the prefill there ("BlasLt is unavailable",
    session 36); with the cache emptied the same run completed on an H100 (54.7 GB free, session 38)."""
    import gc

    gc.collect()
    if device != "cuda":
        return None
    import torch

    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def image_prompt_ids(ids: list[int], pad_id: int, image_tokens: int, prompt_tokens: int) -> list[int]:
    """`prompt_tokens` ids: half the text, the image's pad run, the other half."""
    text = max(prompt_tokens - image_tokens, 2)
    return ids[: text // 2] + [pad_id] * image_tokens + ids[text // 2 : text]


def measure_transformers(model, prompt_tokens, decode_steps, batches, image_grid, device):
    import torch

    results = {}
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, vocab - 1000, (1, prompt_tokens), device=device)

    def sync(x=None):
        torch.cuda.synchronize() if device == "cuda" else None
        return x

    with torch.inference_mode():
        results["prefill_s"] = timed(lambda: sync(model(input_ids=ids, use_cache=True)), repeats=2)
        for b in batches:
            batch = ids.repeat(b, 1)
            gen = dict(do_sample=False, use_cache=True, pad_token_id=0)
            t1 = timed(lambda: sync(model.generate(batch, max_new_tokens=1, min_new_tokens=1, **gen)), repeats=1)
            tn = timed(lambda: sync(model.generate(batch, max_new_tokens=decode_steps + 1,
                                                   min_new_tokens=decode_steps + 1, **gen)), repeats=1)
            # too few steps to time apart from the first token reads as nan, not as a huge rate
            results[f"decode_b{b}_tok_s"] = b * decode_steps / (tn - t1) if tn > t1 else float("nan")
        pixels, grid = image_grid
        pv = torch.from_numpy(np.asarray(pixels)).to(device=device, dtype=model.dtype)  # on the device, untimed
        g = torch.from_numpy(grid).to(device)
        results["vision_s"] = timed(lambda: sync(model.model.visual(pv, grid_thw=g)), repeats=3)
        image_ids = image_prompt_ids(ids[0].tolist(), model.config.image_token_id, int(grid[0].prod() // 4),
                                     prompt_tokens)
        image_ids = torch.tensor([image_ids], device=device)
        types = (image_ids == model.config.image_token_id).long()  # 1 marks image tokens (M-RoPE)
        results["ttft_image_s"] = timed(lambda: sync(model(input_ids=image_ids, pixel_values=pv, image_grid_thw=g,
                                                           mm_token_type_ids=types, use_cache=True)), repeats=2)
    return results


def random_image(cfg_dict, image_tokens: int):
    """A random-pixel image's preprocessed form (PatchCodes, as luxjax's processor hands it to the backend: uint8
    pixels in patch order and the rescale + normalize table) whose merged grid is near-square with `image_tokens`
    tokens, and its grid."""
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
    from luxjax.vision.patch_codes import PatchCodes

    rows = int(np.sqrt(image_tokens))
    while image_tokens % rows:
        rows -= 1
    cols = image_tokens // rows
    v = cfg_dict["vision_config"]
    codes = np.random.default_rng(0).integers(0, 256, (4 * image_tokens, 3, v["patch_size"] ** 2), dtype=np.uint8)
    table = Qwen35ImageProcessor(patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"])._lookup
    return PatchCodes(codes, table, v["temporal_patch_size"]), np.array([[1, 2 * rows, 2 * cols]], dtype=np.int64)


def measure_luxjax(backend, prompt_tokens, decode_steps, batches, image_grid, vocab):
    from luxjax.engine.generate import PREFILL_CHUNK, SOLO_PREFILL_CHUNK, prefill_prompt
    from luxjax.models.qwen35 import model as qwen
    from luxjax.vision.types import ImageInputs

    results = {}
    ids = np.random.default_rng(0).integers(0, vocab - 1000, prompt_tokens).tolist()
    prompt = backend.prompt_from_ids(ids, None)
    max_len = -(-(prompt_tokens + decode_steps + 64) // 256) * 256
    state = {"caches": backend.init_cache(1, max_len)}

    def prefill():
        logits, state["caches"] = backend.prefill(state["caches"], 0, prompt, None, 0, prompt_tokens)
        logits.block_until_ready()

    t = time.perf_counter()
    prefill()
    results["prefill_compile_s"] = time.perf_counter() - t
    results["prefill_s"] = timed(prefill)
    for b in batches:
        state["caches"] = backend.init_cache(b, max_len)
        tokens = np.zeros(b, np.int32)
        cached = np.full(b, prompt_tokens, np.int32)
        deltas = np.zeros(b, np.int32)

        def step():
            logits, state["caches"] = backend.decode(state["caches"], tokens, cached, deltas)
            return logits

        t = time.perf_counter()
        step().block_until_ready()
        results[f"decode_b{b}_compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for _ in tqdm(range(decode_steps), desc=f"luxjax decode b={b}", leave=False):
            logits = step()
        logits.block_until_ready()
        results[f"decode_b{b}_tok_s"] = b * decode_steps / (time.perf_counter() - t)
    if backend.supports_images:
        pixels, grid = image_grid
        inputs = ImageInputs(pixels, grid, [int(grid[0].prod() // 4)])
        t = time.perf_counter()
        backend.encode_images(inputs).block_until_ready()
        results["vision_compile_s"] = time.perf_counter() - t
        results["vision_s"] = timed(lambda: backend.encode_images(inputs).block_until_ready())
        # the same call's two parts: the inputs to the device (padding, one transfer), then the tower on them
        results["vision_inputs_s"] = timed(lambda: jax.block_until_ready(backend.vision_arrays(inputs)))
        arrays = backend.vision_arrays(inputs)
        results["vision_device_inputs_s"] = timed(lambda: qwen.encode_images(
            backend.jit_graphdef, backend.state, **arrays).block_until_ready())
        image_prompt = backend.prompt_from_ids(
            image_prompt_ids(ids, backend.pad_id, inputs.num_tokens[0], prompt_tokens), inputs)
        state["caches"] = backend.init_cache(1, max_len)

        def first_token(chunk: int):
            """The server's path (the engine's prefill steps, sampling aside): encode the image, prefill the
            prompt in steps of `chunk` tokens with its rows."""
            logits, state["caches"] = prefill_prompt(backend, state["caches"], 0, image_prompt, chunk=chunk)
            logits.block_until_ready()

        results["ttft_image_s"] = timed(lambda: first_token(SOLO_PREFILL_CHUNK))  # no other stream decoding
        results["ttft_image_busy_s"] = timed(lambda: first_token(PREFILL_CHUNK))  # steps beside decoding streams
        results["busy_prefill_chunk"] = PREFILL_CHUNK
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=1012)
    ap.add_argument("--decode-steps", type=int, default=256, help="decode steps timed per batch size")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--weights", default="bf16", choices=["bf16", *SCHEMES],
                    help="luxjax's decoder weights: the transformers model's (bf16) or random packed blocks")
    ap.add_argument("--image-tokens", type=int, default=975)
    ap.add_argument("--no-peer", action="store_true", help="skip transformers")
    ap.add_argument("--compile-cache", help="keep XLA's compiled programs in this directory (the server's "
                                             "--cache-dir does): a second run with it loads them")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.compile_cache:
        from luxjax.api import cache_compiled_programs

        cache_compiled_programs(args.compile_cache)
    batches = [int(b) for b in args.batches.split(",")]
    cfg_dict = CONFIGS[args.config]
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    image = random_image(cfg_dict, args.image_tokens)

    t = time.perf_counter()
    torch_model = build_torch_model(cfg_dict, args.dtype, device)
    init_s = time.perf_counter() - t
    peer = {} if args.no_peer else measure_transformers(torch_model, args.prompt_tokens, args.decode_steps, batches,
                                                         image, device)

    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor

    tensors = {name: jax.dlpack.from_dlpack(p.detach()) for name, p in torch_model.state_dict().items()}
    tensors = decoder_weights(tensors, args.weights, cfg_dict, jax.numpy.dtype(args.dtype), progress=True)
    weight_bytes = sum(int(t.nbytes) for n, t in tensors.items() if not n.startswith("model.visual."))
    processor = Qwen35ImageProcessor.from_preprocessor_config({
        "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2,
        "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    t = time.perf_counter()
    backend = build(ModelConfig.from_hf(cfg_dict), tensors, None, processor, args.dtype, origin=args.config)
    build_s = time.perf_counter() - t
    del tensors, torch_model
    free_bytes = release_torch_cache(device)
    ours = measure_luxjax(backend, args.prompt_tokens, args.decode_steps, batches, image,
                          cfg_dict["text_config"]["vocab_size"])

    bound = HBM_BYTES_PER_S / weight_bytes
    report = {"config": args.config, "dtype": args.dtype, "weights": args.weights,
              "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps,
              "image_tokens": args.image_tokens, "weight_bytes": weight_bytes, "decode_bound_tok_s": bound,
              "torch_init_s": init_s, "luxjax_build_s": build_s,
              "device_free_bytes_before_luxjax": free_bytes, "luxjax": ours, "transformers": peer}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    rows = [("prefill tokens/s", args.prompt_tokens / ours["prefill_s"],
             args.prompt_tokens / peer["prefill_s"] if peer else None)]
    rows += [(f"decode tokens/s, batch {b}", ours[f"decode_b{b}_tok_s"], peer.get(f"decode_b{b}_tok_s"))
             for b in batches]
    if "vision_s" in ours:
        rows.append((f"vision tower ms ({args.image_tokens} tokens)", 1e3 * ours["vision_s"],
                     1e3 * peer["vision_s"] if peer else None))
        rows.append(("vision tower ms, inputs already on the device", 1e3 * ours["vision_device_inputs_s"], None))
        rows.append(("vision inputs to the device ms", 1e3 * ours["vision_inputs_s"], None))
        rows.append((f"first token ms ({args.prompt_tokens}-token prompt with the image)",
                     1e3 * ours["ttft_image_s"], 1e3 * peer["ttft_image_s"] if peer else None))
        rows.append((f"first token ms, prompt in {ours['busy_prefill_chunk']}-token steps (beside decoding streams)",
                     1e3 * ours["ttft_image_busy_s"], None))
    compiles = ", ".join(f"{k.removesuffix('_compile_s')} {v:.1f}s" for k, v in ours.items() if k.endswith("compile_s"))
    print(f"\n{args.config} {args.weights} weights, {args.dtype} compute on {report['device']}; "
          f"decode bound (batch 1) {bound:.1f} tokens/s; compiles: {compiles}")
    print("| metric | luxjax | transformers | ratio |\n|---|---|---|---|")
    for name, a, b in rows:
        ratio = f"{a / b:.2f}" if b else "-"
        if name.startswith(("vision", "first token")):  # times: the peer's over ours
            ratio = f"{b / a:.2f}" if b else "-"
        print(f"| {name} | {a:.1f} | {b:.1f} | {ratio} |" if b else f"| {name} | {a:.1f} | - | - |")


if __name__ == "__main__":
    main()
