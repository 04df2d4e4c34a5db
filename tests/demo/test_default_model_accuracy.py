"""The packaged default model answers held-out questions correctly through a real server (`python server.py` with
no model, as a user starts it), on the CPU: at least 90% of 100 questions (README reports 500)."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from luxjax.demo.data import examples
from luxjax.demo.eval import data_url, evaluate

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"server.py exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server.py was not healthy within {seconds} s")


def check_logprobs_of_an_answer(url: str, seed: int) -> None:
    """An answer that ends at the end-of-turn token: one logprobs entry per completion token, the stop token
    neither among them nor counted, streamed or not."""
    example, images = examples(seed + 1, 1)[0]
    content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    body = {"messages": [{"role": "user", "content": content + [{"type": "text", "text": example.question}]}],
            "max_tokens": 16, "logprobs": True, "return_token_ids": True}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", answer
    completion = answer["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["content"]) == completion == len(choice["token_ids"]), answer
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = [entry for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for entry in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in choice["logprobs"]["content"]], chunks


def test_default_model_answers_held_out_questions(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--port", str(port)], cwd=tmp_path,
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        wait_until_healthy(url, server, 300)
        seed = random.randrange(10**9, 2**40)  # training draws its data from seeds below 10**8
        result = evaluate(url, 100, seed=seed)
        check_logprobs_of_an_answer(url, seed)
    except AssertionError as e:
        log.flush()
        raise AssertionError(f"{e}; server log ends:\n{(tmp_path / 'server.log').read_text()[-2000:]}") from e
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    per_type = {kind: f"{c}/{t}" for kind, (c, t) in result["per_type"].items()}
    assert result["accuracy"] >= 0.90, (seed, result["accuracy"], per_type, result["mistakes"][:5])
