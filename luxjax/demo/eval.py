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
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx

from luxjax.demo.data import QUESTION_TYPES, examples, is_correct

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


def evaluate(url: str, n: int, seed: int = HELD_OUT_SEED, concurrency: int = 4, timeout: float = 120.0) -> dict:
    """{"per_type": {type: [correct, total]}, "accuracy": float, "n": int, "mistakes": [...first few]}."""
    items = examples(seed, n)
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
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    result = evaluate(args.url, args.n, args.seed, args.concurrency)
    print(table(result))
    for m in result["mistakes"][:5]:
        print("mistake:", m)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
