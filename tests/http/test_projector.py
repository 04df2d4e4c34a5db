"""A GGUF decoder served with and without its projector: text output is byte-identical, and the model without one
refuses images with a message that says how to enable them."""
from __future__ import annotations

import httpx
import pytest

from http_helpers import FIXTURES, IMAGES, data_url, image_part, serve

GGUF = FIXTURES / "qwen35-tiny-a" / "tiny-qwen35-a-BF16.gguf"
MMPROJ = FIXTURES / "qwen35-tiny-a" / "mmproj-tiny-qwen35-a-F32.gguf"
TEXT = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
        "max_tokens": 10, "return_token_ids": True}


def answers(model) -> tuple[list[dict], dict, httpx.Response]:
    engine, thread = serve(model, max_concurrency=1, max_ctx=512)
    try:
        with thread, httpx.Client(base_url=thread.url, timeout=300) as c:
            bodies = [c.post("/v1/chat/completions", json={**TEXT, **extra}).json()
                      for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 7, "top_k": 40})]
            image = {"messages": [{"role": "user", "content": [image_part(data_url(IMAGES / "photo-desk.jpeg"))]}],
                     "max_tokens": 2}
            return bodies, c.get("/props").json(), c.post("/v1/chat/completions", json=image)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def both():
    import luxjax

    plain = luxjax.load(GGUF, dtype="float32", progress=False)
    with_projector = luxjax.load(GGUF, MMPROJ, dtype="float32", progress=False)
    return answers(plain), answers(with_projector)


def test_text_is_identical_with_and_without_projector(both):
    (plain, _, _), (vision, _, _) = both
    for a, b in zip(plain, vision):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert a["usage"] == b["usage"]


def test_images_need_the_projector(both):
    (_, props, refused), (_, vision_props, accepted) = both
    assert props["capabilities"]["image_input_supported"] is False
    assert vision_props["capabilities"]["image_input_supported"] is True
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "this model does not accept images; start the server with --mmproj"
    assert accepted.status_code == 200, accepted.text
