"""Load generator for the luxjax server (loopback only): TTFT p50/p95, per-token latency and aggregate tokens/s at
several client concurrencies, for text and image chat requests. Prints a markdown table.

    python benchmarks/bench_server.py --model tests/fixtures/qwen35-tiny-a/hf --dtype float32 -c 1024
    python benchmarks/bench_server.py --url http://127.0.0.1:8080     # an already running server
    python benchmarks/bench_server.py --random-config qwen35-27b      # random weights of a real shape, in-process
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_IMAGE = ROOT / "tests" / "fixtures" / "images" / "photo-desk.jpeg"


@dataclass
class Sample:
    ttft_s: float
    per_token_s: float | None
    tokens: int


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="benchmark this running server instead of starting one (loopback only)")
    p.add_argument("--model", help="model for the server started here (default: the packaged model)")
    p.add_argument("--mmproj")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("-c", "--max-ctx", type=int, default=2048)
    p.add_argument("--slots", type=int, default=4, help="--max-concurrency of the server started here")
    p.add_argument("--concurrency", default="1,2,4,8", help="client concurrencies to measure")
    p.add_argument("--requests", type=int, default=8, help="requests per (kind, concurrency)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=600, help="seconds; stop starting new requests after it")
    p.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    p.add_argument("--kinds", default="text,image")
    p.add_argument("--random-config", help="serve a random-weight model of this benchmarks/model_configs.py shape "
                                           "in-process (tokenizer and chat template of the tiny fixture)")
    p.add_argument("--weights", default="bf16", choices=["bf16", "IQ4_XS", "Q4_K_M"],
                   help="--random-config's decoder weights: dense, or random packed blocks of a GGUF mix")
    return p.parse_args()


SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>",
                  "<|im_end|>", "<|endoftext|>")


def whole_vocabulary_tokenizer(vocab_size: int, fixture):
    """One word per id of the model's vocabulary (special tokens at the last ids) with the fixture's chat template:
    every id a random model samples becomes streamed text, so TTFT and per-token latency stay measurable."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from luxjax.text.tokenizer import Tokenizer

    first_special = vocab_size - len(SPECIAL_TOKENS)
    vocab = {f" w{i}": i for i in range(first_special)}
    vocab.update({token: first_special + k for k, token in enumerate(SPECIAL_TOKENS)})
    backend = HFTokenizer(WordLevel(vocab, unk_token=" w0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, eos_token_ids=[vocab["<|im_end|>"]],
                     chat_template=fixture.chat_template)


def start_random_server(args):
    """A server thread over a random-weight model: transformers initialises it on the device and luxjax takes the
    tensors through DLPack (see bench_model.py)."""
    import threading

    # the torch model's 54 GB (27B bf16) and XLA's preallocated pool do not both fit an 80 GB H100 (see
    # bench_model.release_torch_cache)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import uvicorn

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_model import build_torch_model, release_torch_cache
    from benchmarks.model_configs import CONFIGS
    from benchmarks.quant_plan import decoder_weights
    from luxjax.engine.scheduler import Engine
    from luxjax.http.app import create_app
    from luxjax.http.settings import Settings, engine_options
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build
    from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
    from luxjax.text.tokenizer import Tokenizer

    fixture = ROOT / "tests" / "fixtures" / "qwen35-tiny-a" / "hf"
    cfg_dict = CONFIGS[args.random_config]
    tokenizer = whole_vocabulary_tokenizer(cfg_dict["text_config"]["vocab_size"], Tokenizer.from_hf_dir(fixture))
    cfg_dict = {**cfg_dict, **{key: tokenizer.token_to_id(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}}
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    torch_model = build_torch_model(cfg_dict, args.dtype, device)
    tensors = {name: jax.dlpack.from_dlpack(p.detach()) for name, p in torch_model.state_dict().items()}
    tensors = decoder_weights(tensors, args.weights, cfg_dict, jax.numpy.dtype(args.dtype), progress=True)
    released_limits = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}
    processor = Qwen35ImageProcessor.from_preprocessor_config(
        json.loads((fixture / "preprocessor_config.json").read_text()) | released_limits)
    backend = build(ModelConfig.from_hf(cfg_dict), tensors, tokenizer, processor, args.dtype,
                    origin=args.random_config, max_context=args.max_ctx)
    del tensors, torch_model
    release_torch_cache(device)
    settings = Settings(model=args.random_config, dtype=args.dtype, max_ctx=args.max_ctx,
                        max_concurrency=args.slots, max_queue=256)
    engine = Engine(backend, **engine_options(settings)).start()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, settings), host="127.0.0.1", port=free_port(),
                                           log_level="warning", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.config.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, str(ROOT / "server.py"), "--port", str(port), "--dtype", args.dtype,
               "-c", str(args.max_ctx), "--max-concurrency", str(args.slots), "--max-queue", "256",
               "--log-level", "warning"]
    command += [args.model] if args.model else []
    command += ["--mmproj", args.mmproj] if args.mmproj else []
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not come up")


def request_body(kind: str, image_url: str, max_tokens: int, n: int) -> dict:
    text = f"Request {n}: describe what you see in a few sentences."
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}] \
        if kind == "image" else text
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, body: dict) -> Sample:
    started = time.perf_counter()
    token_times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    first = token_times[0] if token_times else time.perf_counter()
    per_token = (token_times[-1] - first) / (tokens - 1) if tokens > 1 and len(token_times) > 1 else None
    return Sample(first - started, per_token, tokens)


async def run_level(url: str, kind: str, concurrency: int, args, image_url: str, bar: tqdm, deadline: float):
    queue: asyncio.Queue[int] = asyncio.Queue()
    for n in range(args.requests):
        queue.put_nowait(n)
    samples: list[Sample] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            try:
                n = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            samples.append(await one_request(client, request_body(kind, image_url, args.max_tokens, n)))
            bar.update(1)

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        began = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - began
    return samples, wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def table_row(kind: str, concurrency: int, samples: list[Sample], wall: float) -> str:
    ttft = [s.ttft_s * 1000 for s in samples]
    per_token = [s.per_token_s * 1000 for s in samples if s.per_token_s is not None]
    tokens = sum(s.tokens for s in samples)
    mean_token = statistics.mean(per_token) if per_token else float("nan")
    return (f"| {kind} | {concurrency} | {len(samples)} | {percentile(ttft, 0.5):.0f} | {percentile(ttft, 0.95):.0f} "
            f"| {mean_token:.1f} | {tokens} | {tokens / wall:.1f} |")


async def benchmark(url: str, args) -> list[str]:
    image_url = f"data:image/jpeg;base64,{base64.b64encode(args.image.read_bytes()).decode()}"
    kinds = args.kinds.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # warm-up: compiles are not measured
        for kind in kinds:
            for n in range(2):
                await one_request(client, request_body(kind, image_url, args.max_tokens, n))
    rows = ["| kind | concurrency | requests | TTFT p50 (ms) | TTFT p95 (ms) | per-token (ms) | tokens | tokens/s |",
            "|---|---|---|---|---|---|---|---|"]
    deadline = time.monotonic() + args.time_limit
    with tqdm(total=len(kinds) * len(levels) * args.requests, desc="requests", unit="req") as bar:
        for kind in kinds:
            for concurrency in levels:
                samples, wall = await run_level(url, kind, concurrency, args, image_url, bar, deadline)
                if samples:
                    rows.append(table_row(kind, concurrency, samples, wall))
    return rows


def main() -> None:
    args = parse_args()
    process = server = None
    if args.random_config:
        server, url = start_random_server(args)
    elif args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("this load generator only targets loopback servers")
        url = args.url.rstrip("/")
    else:
        process, url = start_server(args)
    try:
        rows = asyncio.run(benchmark(url, args))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
        if server is not None:
            server.should_exit = True
    props = httpx.get(f"{url}/props", timeout=10).json() if args.url else None
    print()
    if props:
        print(f"server: {props.get('model_alias')} n_ctx={props.get('n_ctx')} slots={props.get('max_concurrency')}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
