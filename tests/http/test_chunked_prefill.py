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


class PrefillRecorder:
    """The backend, its prefill calls recorded as (tokens in the chunk, tokens left before it, whether another
    stream was decoding at the time)."""

    def __init__(self, backend, engine):
        self._backend, self._engine, self.steps = backend, engine, []

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def prefill(self, caches, slot, prompt, rows, begin, end, **kwargs):
        decoding = any(s is not None and not s.prefilling for i, s in enumerate(self._engine._slots) if i != slot)
        self.steps.append((end - begin, prompt.num_tokens - begin, decoding))
        return self._backend.prefill(caches, slot, prompt, rows, begin, end, **kwargs)


def test_prefill_step_size_follows_the_decoding_streams(model):
    """Alone, a prompt is prefilled in solo_prefill_chunk steps; while another stream decodes, in prefill_chunk
    steps (its next token waits for each); the greedy tokens are the same either way."""
    expected = model.generate(LONG["messages"], max_tokens=8).token_ids
    engine, thread = serve(model, max_concurrency=2, max_ctx=256, prefill_chunk=16, solo_prefill_chunk=48)
    recorder = engine.backend = PrefillRecorder(model.backend, engine)

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            alone = (await c.post("/v1/chat/completions", json=LONG)).json()
            solo_steps = list(recorder.steps)
            engine.eos_ids = frozenset()  # the short stream decodes its 200 tokens, whatever it samples
            short = asyncio.create_task(c.post("/v1/chat/completions", json={**SHORT, "max_tokens": 200}))
            while not any(s is not None and not s.prefilling for s in engine._slots):
                await asyncio.sleep(0.01)
            recorder.steps.clear()
            beside = (await c.post("/v1/chat/completions", json=LONG)).json()
            await short
            return alone, beside, solo_steps, list(recorder.steps)

    try:
        with thread:
            alone, beside, solo_steps, mixed_steps = asyncio.run(scenario(thread.url))
    finally:
        engine.stop()
    assert alone["choices"][0]["token_ids"] == expected
    assert beside["choices"][0]["token_ids"][: len(expected)] == expected  # past an end-of-sequence token now
    assert len(solo_steps) >= 3 and not any(decoding for *_, decoding in solo_steps), solo_steps
    for steps in (solo_steps, mixed_steps):
        for size, left, decoding in steps:
            assert size == min(16 if decoding else 48, left), steps
    assert any(decoding for *_, decoding in mixed_steps), mixed_steps
