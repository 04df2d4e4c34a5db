"""Greedy output through HTTP equals the notebook path and transformers' reference tokens; streaming and batching
change nothing."""
from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from http_helpers import FIXTURES, IMAGES, data_url, image_part, resized_data_url, text_part

MAX_TOKENS = 12


def fixture_messages(name: str) -> list[dict]:
    """The messages transformers' reference was made from (checked against the npz's rendered prompt)."""
    if name == "text":
        return [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Describe the red circle and the blue square in detail."}]
    if name == "one_image":
        return [{"role": "user", "content": [image_part(data_url(IMAGES / "photo-desk.jpeg")),
                                              text_part("What is shown?")]}]
    return [{"role": "user", "content": [
        text_part("Compare"), image_part(data_url(IMAGES / "photo-board.jpg")), text_part("with"),
        image_part(data_url(IMAGES / "chart-rgba.png")), text_part("please.")]}]


def three_image_messages() -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [
                image_part(resized_data_url(IMAGES / "photo-desk.jpeg", (200, 150))), text_part("first,"),
                image_part(resized_data_url(IMAGES / "chart-rgba.png", (96, 300), "JPEG")), text_part("second, and"),
                image_part(data_url(IMAGES / "photo-board.jpg")), text_part("third: what differs?")]}]


def chat(client, messages, **kw):
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    return client.chat.completions.create(model="tiny", messages=messages, extra_body={"return_token_ids": True}, **kw)


@pytest.mark.parametrize("name", ["text", "one_image", "two_images"])
def test_fixture_prompts_give_transformers_greedy_tokens(client, http, name):
    ref = np.load(FIXTURES / "qwen35-tiny-a" / f"ref_{name}.npz")
    messages = fixture_messages(name)
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == ref["input_ids"].tolist()
    response = chat(client, messages)
    choice = response.choices[0]
    assert choice.model_extra["token_ids"] == ref["greedy"].tolist()
    assert response.model_extra["prompt_token_ids"] == ref["input_ids"].tolist()
    assert response.usage.prompt_tokens == len(ref["input_ids"])
    assert response.usage.completion_tokens == len(ref["greedy"])
    assert response.usage.total_tokens == len(ref["input_ids"]) + len(ref["greedy"])
    assert choice.finish_reason == "length"


@pytest.mark.parametrize("frames", [1, 2], ids=["still", "animated"])
def test_gif_is_answered_as_its_first_frame(client, frames):
    """A GIF (a palette image of a fresh random size, an animation's second frame noise) gets the greedy answer of
    its first frame's pixels sent as a lossless PNG, PIL's decoding being the oracle."""
    rng = np.random.default_rng()
    size = (int(rng.integers(48, 160)), int(rng.integers(48, 160)))
    first = Image.open(IMAGES / "photo-desk.jpeg").convert("RGB").resize(size).quantize(int(rng.integers(16, 200)))
    noise = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).quantize(64)
    gif = io.BytesIO()
    first.save(gif, "GIF", save_all=frames > 1, append_images=[noise] if frames > 1 else [])
    png = io.BytesIO()
    Image.open(io.BytesIO(gif.getvalue())).convert("RGB").save(png, "PNG")
    answers = []
    for data, mime in ((gif.getvalue(), "image/gif"), (png.getvalue(), "image/png")):
        url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        response = chat(client, [{"role": "user", "content": [image_part(url), text_part("What is shown?")]}])
        answers.append((response.usage.prompt_tokens, response.choices[0].model_extra["token_ids"]))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello! What can you do?"}],
    three_image_messages(),
], ids=["no_image", "three_images"])
def test_greedy_equals_model_generate(client, model, messages):
    expected = model.generate(messages, max_tokens=MAX_TOKENS, temperature=0.0)
    response = chat(client, messages)
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == expected.prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_stream_joins_to_the_non_streamed_text(client):
    messages = fixture_messages("one_image")
    whole = chat(client, messages)
    stream = chat(client, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    streamed_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert streamed_ids == whole.choices[0].model_extra["token_ids"]


def test_completions_endpoint_matches_chat_on_the_same_text(client, http):
    messages = fixture_messages("text")
    rendered = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat_ids = chat(client, messages).choices[0].model_extra["token_ids"]
    ref = np.load(FIXTURES / "qwen35-tiny-a" / "ref_text.npz")
    completion = client.completions.create(model="tiny", prompt=str(ref["prompt"]), temperature=0,
                                           max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True})
    assert completion.model_extra["prompt_token_ids"] == rendered
    assert completion.choices[0].model_extra["token_ids"] == chat_ids
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_eight_concurrent_image_requests_equal_one_at_a_time(server):
    requests = [fixture_messages("one_image"), fixture_messages("two_images"), three_image_messages(),
                fixture_messages("text")] * 2
    body = lambda m: {"messages": m, "temperature": 0, "max_tokens": MAX_TOKENS, "return_token_ids": True}  # noqa

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            alone = [(await c.post("/v1/chat/completions", json=body(m))).json() for m in requests[:4]]
            together = await asyncio.gather(*[c.post("/v1/chat/completions", json=body(m)) for m in requests])
            return alone, [r.json() for r in together]

    alone, together = asyncio.run(run())
    texts = [r["choices"][0]["message"]["content"] for r in alone] * 2
    ids = [r["choices"][0]["token_ids"] for r in alone] * 2
    assert [r["choices"][0]["message"]["content"] for r in together] == texts
    assert [r["choices"][0]["token_ids"] for r in together] == ids


def test_logprobs_and_stop_strings(client):
    messages = fixture_messages("text")
    full = chat(client, messages).choices[0].message.content
    stop = full[3:5]
    cut = chat(client, messages, stop=[stop]).choices[0]
    assert cut.message.content == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, messages, stop=[stop], stream=True)
                       if c.choices)
    assert streamed == cut.message.content
    with_logprobs = chat(client, messages, logprobs=True, top_logprobs=3).choices[0]
    content = with_logprobs.logprobs.content
    assert len(content) == MAX_TOKENS
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy picks the most likely token
        assert entry.logprob <= 0


def test_the_stream_after_one_cut_by_a_stop_string_is_unaffected(client, model):
    """The engine issues a decode step before reading the one before it, so a stream that a stop string ends has run
    a step more in its slot; the next stream admitted there (the lowest free slot) answers as the notebook path."""
    cut_short, after = fixture_messages("text"), [{"role": "user", "content": "Name three colours, please."}]
    full = chat(client, cut_short).choices[0].message.content
    cut = chat(client, cut_short, stop=[full[2:4]]).choices[0]
    assert cut.finish_reason == "stop"
    served = chat(client, after).choices[0].model_extra["token_ids"]
    assert served == model.generate(after, max_tokens=MAX_TOKENS).token_ids


def test_seeded_sampling_is_reproducible(client, model):
    messages = fixture_messages("text")
    kw = dict(temperature=1.0, top_p=0.95, seed=1234)
    first = chat(client, messages, **kw).choices[0].model_extra["token_ids"]
    again = chat(client, messages, **kw).choices[0].model_extra["token_ids"]
    assert first == again
    served = chat(client, messages, temperature=0.8, seed=99).choices[0].model_extra["token_ids"]
    assert served == model.generate(messages, max_tokens=MAX_TOKENS, temperature=0.8, seed=99).token_ids


def test_models_props_health_tokenize(http):
    models = http.get("/v1/models").json()
    assert models["data"][0]["owned_by"] == "luxjax" and "multimodal" in models["data"][0]["capabilities"]
    props = http.get("/props").json()
    assert props["capabilities"]["image_input_supported"] is True and props["n_ctx"] == 1024
    assert http.get("/health").json() == {"status": "ok"}
    one = http.post("/tokenize", json={"messages": fixture_messages("one_image")}).json()
    assert one["count"] == len(one["tokens"]) == 129 and 0 < one["image_tokens"] < 129
    assert http.post("/tokenize", json={"content": "hello"}).json()["count"] >= 1
    assert "luxjax_time_to_first_token_seconds_bucket" in http.get("/metrics").text
