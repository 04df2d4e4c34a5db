"""Session fixtures: the tiny fixture model (float32, loaded once) behind a real uvicorn server on a free
loopback port. Servers with other settings share the model (and, where shapes agree, its compiles)."""
from __future__ import annotations

import httpx
import pytest

from http_helpers import MODEL_DIR, serve


@pytest.fixture(scope="session")
def model():
    import luxjax.api

    return luxjax.api.load(MODEL_DIR, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def server(model):
    """The main server: 4 slots, context 1024."""
    engine, thread = serve(model, max_concurrency=4)
    with thread:
        yield thread
    engine.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


