"""A prompt prefilled in several chunks while another sequence decodes gives the same greedy tokens as alone:
decode steps in between must leave the half-prefilled slot untouched."""
from __future__ import annotations

import asyncio

import httpx

from http_helpers import serve

SHORT = {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 40, "temperature": 0,
         "return_token_ids": True}
LONG = {"messages": [{"role": "user", "content": "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 5}],
        "max_tokens": 8, "temperature": 0, "return_token_ids": True}


def test_chunked_prefill_interleaved_with_decode_matches_generate(model):
    expected = model.generate(LONG["messages"], max_tokens=8).token_ids
    engine, thread = serve(model, max_concurrency=2, max_ctx=256, prefill_chunk=32)

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            await c.post("/v1/chat/completions", json={**SHORT, "max_tokens": 2})  # compile outside the race
            short = asyncio.create_task(c.post("/v1/chat/completions", json=SHORT))
            while engine.active_slots == 0:
                await asyncio.sleep(0.01)
            long = await c.post("/v1/chat/completions", json=LONG)
            return long.json(), (await short).json()

    try:
        with thread:
            long, short = asyncio.run(scenario(thread.url))
    finally:
        engine.stop()
    assert "usage" in long, long
    assert long["usage"]["prompt_tokens"] > 4 * 32
    assert long["choices"][0]["token_ids"] == expected
    assert short["usage"]["completion_tokens"] >= 1
