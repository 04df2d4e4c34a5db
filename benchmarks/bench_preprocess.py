"""Images/second of the image input path for ~1 MP JPEG and PNG: decode + RGB + resize + rescale/normalize + patchify.

luxjax (decode_image + Qwen35ImageProcessor) against transformers' Qwen2VLImageProcessorPil on the same bytes,
both single-threaded, with the released Qwen3.5 pixel bounds unless --config names a preprocessor_config.json.

    python benchmarks/bench_preprocess.py [--iterations 30] [--config path/to/preprocessor_config.json]
"""
from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from PIL import Image
from tqdm import tqdm

from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.vision.data_url import EncodedImage
from luxjax.vision.decode import decode_image
from luxjax.vision.limits import ImageLimits

RELEASED_CONFIG = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
    "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
WIDTH, HEIGHT = 1184, 880  # 1.04 MP, not a multiple of 32 so the resize does real work


def photo_like(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    x, y = np.arange(width, dtype=np.float32), np.arange(height, dtype=np.float32)
    image = np.empty((height, width, 3), dtype=np.uint8)
    for c in range(3):
        smooth = 127 + 100 * np.outer(np.cos(y * rng.uniform(0.002, 0.02)), np.sin(x * rng.uniform(0.002, 0.02) + c))
        image[..., c] = np.clip(smooth + rng.normal(0, 6, size=(height, width)), 0, 255)
    return image


def encoded_samples() -> dict[str, bytes]:
    image = Image.fromarray(photo_like(np.random.default_rng(0), WIDTH, HEIGHT))
    samples = {}
    for fmt, args in [("JPEG", {"quality": 90}), ("PNG", {})]:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **args)
        samples[fmt] = buffer.getvalue()
    return samples


def images_per_second(runs: dict, iterations: int, description: str) -> dict[str, tuple[float, float]]:
    """(mean, median) images/second per contender. The contenders alternate every iteration so that load from
    elsewhere on the machine hits both alike; the median resists such load."""
    seconds = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm-up
    for _ in tqdm(range(iterations), desc=description, leave=False):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {name: (1 / np.mean(times), 1 / np.median(times)) for name, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--config", help="an HF preprocessor_config.json (default: released Qwen3.5 bounds)")
    args = parser.parse_args()
    config = json.load(open(args.config)) if args.config else RELEASED_CONFIG

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ours = Qwen35ImageProcessor.from_preprocessor_config(config)
    oracle = Qwen2VLImageProcessorPil.from_dict(json.loads(json.dumps(config)))
    limits = ImageLimits()

    rows = []
    for fmt, data in encoded_samples().items():
        encoded = EncodedImage(data, fmt, f"image/{fmt.lower()}")

        def run_ours():
            return ours([decode_image(encoded, "image 1", limits)]).pixel_values

        def run_transformers():
            return oracle([Image.open(io.BytesIO(data))])["pixel_values"]

        assert np.array_equal(run_ours(), run_transformers()), f"{fmt}: outputs differ"
        rates = images_per_second({"luxjax": run_ours, "transformers": run_transformers}, args.iterations, fmt)
        rows.append((fmt, len(data), run_ours().shape[0], rates["luxjax"], rates["transformers"]))

    print(f"\n{WIDTH}x{HEIGHT} image, {args.iterations} iterations, bit-identical outputs checked\n")
    print("| format | bytes | patches | luxjax img/s (mean / median) | transformers img/s (mean / median) | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for fmt, size, patches, (ours_mean, ours_median), (theirs_mean, theirs_median) in rows:
        print(f"| {fmt} | {size} | {patches} | {ours_mean:.1f} / {ours_median:.1f} | "
              f"{theirs_mean:.1f} / {theirs_median:.1f} | {ours_median / theirs_median:.2f}x |")


if __name__ == "__main__":
    main()
