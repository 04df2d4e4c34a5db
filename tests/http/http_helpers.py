"""Helpers shared by the HTTP tests: a uvicorn server in a background thread, image parts, metrics."""
from __future__ import annotations

import base64
import io
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from PIL import Image

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL_DIR = FIXTURES / "qwen35-tiny-a" / "hf"
IMAGES = FIXTURES / "images"
MAX_CTX = 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(model, **settings_overrides):
    """(engine, ServerThread) for the model with these settings."""
    from luxjax.engine.scheduler import Engine
    from luxjax.http.app import create_app
    from luxjax.http.settings import Settings, engine_options

    settings = Settings(**{"model": str(MODEL_DIR), "dtype": "float32", "max_ctx": MAX_CTX, **settings_overrides})
    engine = Engine(model.backend, **engine_options(settings)).start()
    return engine, ServerThread(create_app(engine, settings))


def data_url(path: Path) -> str:
    mime = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}[path.suffix]
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def resized_data_url(path: Path, size: tuple[int, int], fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    Image.open(path).convert("RGB").resize(size).save(buffer, format=fmt)
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def metric(http_client: httpx.Client, name: str) -> float:
    text = http_client.get("/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))
