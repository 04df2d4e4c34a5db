"""Slots and the queue: a client that goes away frees its slot within a step; a full queue answers 503; a decode
step runs only the slots in use, its tokens taken from the device."""
from __future__ import annotations

import asyncio
import time

import httpx

from http_helpers import metric, serve

LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200, "stream": True,
        "temperature": 0}


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot(server, http):
    assert wait_for(lambda: metric(http, "luxjax_active_slots") == 0)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in received)
            assert metric(http, "luxjax_active_slots") == 1
    assert wait_for(lambda: metric(http, "luxjax_active_slots") == 0, timeout=5.0)
    assert 'status="499"' in http.get("/metrics").text


def test_full_queue_answers_503_with_retry_after(model):
    engine, thread = serve(model, max_concurrency=1, max_queue=1, max_ctx=256)

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            async def hold(stream_ready: asyncio.Event):
                async with c.stream("POST", "/v1/chat/completions", json=LONG) as response:
                    stream_ready.set()
                    async for _ in response.aiter_lines():
                        pass

            running = asyncio.Event()
            first = asyncio.create_task(hold(running))
            await asyncio.wait_for(running.wait(), 120)
            queued = asyncio.create_task(c.post("/v1/chat/completions", json={**LONG, "stream": False}))
            deadline = time.monotonic() + 30
            while engine.queue_depth < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            refused = await c.post("/v1/chat/completions", json={**LONG, "stream": False})
            first.cancel()
            queued.cancel()
            await asyncio.gather(first, queued, return_exceptions=True)
            return refused

    try:
        with thread:
            refused = asyncio.run(scenario(thread.url))
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_error"
            with httpx.Client(base_url=thread.url) as c:
                assert wait_for(lambda: metric(c, "luxjax_active_slots") == 0 and metric(c, "luxjax_queue_depth") == 0)
                assert c.get("/health").json() == {"status": "ok"}
    finally:
        engine.stop()


def test_failed_image_encode_fails_only_that_request(model, server, http, monkeypatch):
    """An encoder failure reaches its own client as an error; a concurrent text request is unaffected."""
    from http_helpers import IMAGES, data_url, image_part

    backend = model.backend
    original = backend.encode_images

    def broken(image_inputs):
        raise RuntimeError("encoder exploded")

    monkeypatch.setattr(backend, "encode_images", broken)
    image_request = {"messages": [{"role": "user", "content": [image_part(data_url(IMAGES / "photo-desk.jpeg"))]}],
                     "max_tokens": 4, "temperature": 0}
    text_request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

    async def both():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(c.post("/v1/chat/completions", json=image_request),
                                        c.post("/v1/chat/completions", json=text_request))

    failed, fine = asyncio.run(both())
    monkeypatch.setattr(backend, "encode_images", original)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").json() == {"status": "ok"}


def test_decode_steps_run_only_the_slots_in_use(model, server, http, monkeypatch):
    """On the 4-slot server a lone stream decodes at one row (a step of every slot cost a 4-row step's time), two
    streams at once at two, and each step's rows are the slots up to the last one decoding (decode_width). Each
    step takes its tokens from the device (the engine issues it before reading the last one's) and a stream that
    ends at max_tokens issues no step past its last token. None of these steps compiles: every width compiled at
    the engine's start, with its tokens as the steps pass them."""
    import jax

    from luxjax.engine.scheduler import decode_width
    from luxjax.models.qwen35 import model as qwen

    backend, widths, on_device = model.backend, [], []
    real = backend.decode

    def counted(caches, token_ids, *args, **kwargs):
        widths.append(len(token_ids))
        on_device.append(isinstance(token_ids, jax.Array))
        return real(caches, token_ids, *args, **kwargs)

    assert wait_for(lambda: metric(http, "luxjax_active_slots") == 0)
    request = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 24, "temperature": 0}
    assert http.post("/v1/chat/completions", json={**request, "max_tokens": 1}).status_code == 200  # answered
    # after the engine's compile of every width at start, whose steps are not the stream's
    monkeypatch.setattr(backend, "decode", counted)
    compiled = qwen.decode._cache_size()
    alone = http.post("/v1/chat/completions", json=request)
    assert alone.status_code == 200
    tokens = alone.json()["usage"]["completion_tokens"]
    assert alone.json()["choices"][0]["finish_reason"] == "length"
    assert widths and set(widths) == {1} and len(widths) == tokens - 1, (widths, tokens)
    assert all(on_device)

    widths.clear()

    async def two():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json={**request, "seed": s}) for s in (1, 2)))

    answers = asyncio.run(two())
    assert all(a.status_code == 200 for a in answers)
    assert set(widths) <= {1, 2} and 2 in widths, widths
    assert qwen.decode._cache_size() == compiled
    for slots in range(1, 10):  # every width: the slots in use, rounded up to a power of two or all slots
        for in_use in range(1, slots + 1):
            width = decode_width(in_use, slots)
            assert in_use <= width <= slots and (width == slots or width & (width - 1) == 0 and width < 2 * in_use)
