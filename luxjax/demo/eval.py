"""Accuracy of a served model on held-out demo questions, through the OpenAI-compatible HTTP API.

`python -m luxjax.demo.eval --url http://127.0.0.1:8080 -n 500 [--seed 20250] [--concurrency 4]`

Questions come from a seed the training never uses (training draws from seeds 1_000_003 * k + step); images are
sent as base64 PNG data URLs, temperature 0, a few tokens. Prints accuracy per question type and overall.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import random
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
from PIL import Image

from luxjax.demo.data import COLORS, QUESTION_TYPES, Scene, examples, is_correct

HELD_OUT_SEED = 20250


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(client: httpx.Client, url: str, question: str, images) -> str:
    content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    content.append({"type": "text", "text": question})
    body = {"model": "default", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 8}
    r = client.post(url.rstrip("/") + "/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"] or ""


def draw_plain(scene: Scene, rng: random.Random) -> Image.Image:
    """A second drawing routine, unlike the training renderer: numpy masks (no anti-aliasing, exact spec colours,
    equilateral triangles standing on their base), a light background and sometimes light noise."""
    y, x = np.mgrid[: scene.height, : scene.width] + 0.5
    image = np.empty((scene.height, scene.width, 3), np.float32)
    image[:] = [rng.randint(200, 255) for _ in range(3)]
    for s in scene.shapes:
        half = s.size / 2
        if s.kind == "circle":
            mask = (x - s.cx) ** 2 + (y - s.cy) ** 2 <= half**2
        elif s.kind == "square":
            mask = (abs(x - s.cx) <= half) & (abs(y - s.cy) <= half)
        else:
            top, bottom = s.cy + half - s.size * 3**0.5 / 2, s.cy + half
            mask = (y >= top) & (y <= bottom) & (abs(x - s.cx) <= (y - top) / 3**0.5)
        image[mask] = COLORS[s.color]
    if rng.random() < 0.5:
        image += np.random.default_rng(rng.getrandbits(32)).normal(0, 4, image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def evaluate(url: str, n: int, seed: int = HELD_OUT_SEED, concurrency: int = 4, timeout: float = 120.0,
             draw: str = "training") -> dict:
    """{"per_type": {type: [correct, total]}, "accuracy": float, "n": int, "mistakes": [...first few]}.
    `draw`: "training" (the training renderer) or "plain" (draw_plain, another routine for the same scenes)."""
    items = examples(seed, n)
    if draw == "plain":
        rng = random.Random(seed + 1)
        items = [(ex, [draw_plain(scene, rng) for scene in ex.scenes]) for ex, _ in items]
    with httpx.Client(timeout=timeout) as client, ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda item: ask(client, url, item[0].question, item[1]), items))
    per_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    mistakes = []
    for (ex, _), got in zip(items, answers):
        ok = is_correct(got, ex.answer)
        per_type[ex.kind][0] += ok
        per_type[ex.kind][1] += 1
        if not ok and len(mistakes) < 10:
            mistakes.append({"question": ex.question, "answer": ex.answer, "got": got})
    correct = sum(c for c, _ in per_type.values())
    return {"per_type": dict(per_type), "accuracy": correct / max(n, 1), "n": n, "mistakes": mistakes}


def table(result: dict) -> str:
    rows = ["| question type | correct | total | accuracy |", "|---|---|---|---|"]
    for kind in QUESTION_TYPES:
        c, t = result["per_type"].get(kind, [0, 0])
        rows.append(f"| {kind} | {c} | {t} | {100 * c / max(t, 1):.1f}% |")
    rows.append(f"| **all** | {round(result['accuracy'] * result['n'])} | {result['n']} | "
                f"{100 * result['accuracy']:.1f}% |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("-n", type=int, default=500)
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--draw", default="training", choices=["training", "plain"],
                   help="draw the images with the training renderer or with another routine (draw_plain)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    result = evaluate(args.url, args.n, args.seed, args.concurrency, draw=args.draw)
    print(table(result))
    for m in result["mistakes"][:5]:
        print("mistake:", m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
