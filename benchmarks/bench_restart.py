"""What a server start costs before its first answer, and what --cache-dir saves on the next start: each start is
timed from launch to "listening", then its first chat request with an image (compiles included) and a second one.

    python benchmarks/bench_restart.py --starts 2                       # the packaged model, a fresh cache folder
    python benchmarks/bench_restart.py --cache-dir /tmp/c -- model.gguf --mmproj mmproj.gguf

Arguments after `--` go to server.py."""
from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent


def image_request() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    return json.dumps({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe it"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def timed_request(port: int, body: bytes, attempts: int = 100) -> float:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    for _ in range(attempts):  # uvicorn may still be binding the port just after "listening"
        try:
            urllib.request.urlopen(request, timeout=600).read()
            return time.perf_counter() - start
        except urllib.error.URLError as e:
            if isinstance(e, urllib.error.HTTPError):
                raise
            time.sleep(0.1)
    raise RuntimeError("the server did not answer")


def one_start(server_args: list[str], port: int, body: bytes) -> tuple[float, float, float]:
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "server.py", "--port", str(port), *server_args], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:
            if "listening on" in line:
                break
        ready = time.perf_counter() - start
        # keep reading its output, so that a full pipe never blocks the server
        threading.Thread(target=server.stdout.read, daemon=True).start()
        first = timed_request(port, body)
        return ready, first, timed_request(port, body)
    finally:
        server.terminate()
        server.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--cache-dir", help="default: a fresh temporary folder")
    ap.add_argument("--no-cache", action="store_true", help="start without --cache-dir")
    ap.add_argument("--port", type=int, default=8391)
    args, server_args = ap.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    if not args.no_cache:
        server_args += ["--cache-dir", args.cache_dir or tempfile.mkdtemp(prefix="luxjax-cache-")]
    body = image_request()
    print("| start | ready s | first image request s | next request s |\n|---|---|---|---|")
    for n in range(args.starts):
        ready, first, second = one_start(server_args, args.port, body)
        print(f"| {n + 1} | {ready:.1f} | {first:.2f} | {second:.2f} |", flush=True)


if __name__ == "__main__":
    main()
