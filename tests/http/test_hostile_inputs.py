"""Inputs that once got past validation and broke a response or the whole batch: each now gets its 4xx (or its
answer) and leaves the requests beside it untouched."""
from __future__ import annotations

import json
import threading

import pytest

from http_helpers import MAX_CTX

CHAT = "/v1/chat/completions"


def chat_body(content: str, **params) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6, **params}


def raw_post(http, path: str, body: str):
    """POST a JSON text as is (httpx's json= cannot encode lone surrogates)."""
    return http.post(path, content=body.encode("ascii"), headers={"content-type": "application/json"})


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(line) for line in lines[:-1]]


def test_huge_top_k_is_top_k_off_and_spares_the_batch(http, seed):
    """A top_k past int32 once overflowed in the scheduler thread and failed every request in flight with a 500.
    Any k at or past the vocabulary keeps every token: the answer is the top_k=0 one, and a request decoding beside
    it gets its own answer."""
    sampled = chat_body("count to five", temperature=0.9, seed=seed % 2**31, max_tokens=8)
    neighbour = chat_body("name three colours", max_tokens=40)
    alone = http.post(CHAT, json=neighbour).json()["choices"][0]["message"]["content"]
    off = http.post(CHAT, json=sampled).json()["choices"][0]["message"]["content"]
    results = {}

    def run(name, body):
        results[name] = http.post(CHAT, json=body)

    thread = threading.Thread(target=run, args=("neighbour", neighbour))
    thread.start()
    run("huge", {**sampled, "top_k": 2**40})
    thread.join()
    assert results["huge"].status_code == 200, results["huge"].text
    assert results["neighbour"].status_code == 200, results["neighbour"].text
    assert results["huge"].json()["choices"][0]["message"]["content"] == off, f"seed {seed}"
    assert results["neighbour"].json()["choices"][0]["message"]["content"] == alone


@pytest.mark.parametrize("prompt", ["", [""]])
def test_empty_completion_prompt_is_refused(http, prompt):
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "empty" in error["message"]
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}).status_code == 200


def test_lone_surrogates_are_echoed_escaped(http):
    """A model name or an unknown parameter name holding a lone surrogate (valid JSON, no UTF-8 form) once made
    the response fail to encode: a 500, or a stream cut after its headers."""
    body = '{"model": "tiny\\ud800", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3%s}'
    response = raw_post(http, CHAT, body % "")
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny\ud800"
    stream = raw_post(http, CHAT, body % ', "stream": true')
    assert stream.status_code == 200
    chunks = sse_events(stream.text)
    assert {c["model"] for c in chunks} == {"tiny\ud800"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    unknown = raw_post(http, CHAT, '{"messages": [{"role": "user", "content": "hi"}], "\\udc80x": 1}')
    assert unknown.status_code == 400, unknown.text
    assert unknown.json()["error"]["param"] == "\udc80x"


def test_integer_too_long_to_parse_is_invalid_json(http):
    digits = "9" * 5000  # past Python's int_max_str_digits (4,300)
    response = raw_post(http, CHAT, '{"messages": [{"role": "user", "content": "hi"}], "seed": %s}' % digits)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/tokenize"])
def test_text_that_cannot_fit_is_refused_before_tokenizing(http, model, path):
    """Refused by its length alone (a 40 MB prompt once took a minute to tokenize): more characters than the
    context's tokens can cover at the vocabulary's longest token."""
    longest = model.backend.tokenizer.max_token_chars
    text = "ab " * (MAX_CTX * longest // 3 + 100)
    body = {CHAT: chat_body(text), "/v1/completions": {"prompt": text}, "/tokenize": {"content": text}}[path]
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert len(response.text) < 1000


def test_models_retrieve(client, http):
    """The SDK's models.retrieve (GET /v1/models/{id}) gives the listed card; another id is a 404 error."""
    listed = http.get("/v1/models").json()["data"][0]
    card = client.models.retrieve(listed["id"])
    assert card.id == listed["id"] and card.owned_by == "luxjax"
    assert http.get(f"/v1/models/{listed['id']}").json() == listed
    missing = http.get("/v1/models/not-this-one")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_cors_only_for_the_origins_given(model):
    """--cors-origins: a browser page of a listed origin may call the API (its preflight answered without the API
    key, the answers carrying Access-Control-Allow-Origin); other origins, and every origin without the setting,
    get no CORS grant."""
    import httpx

    from http_helpers import serve

    page, other = "https://app.example", "https://evil.example"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    body = chat_body("hi", max_tokens=1)
    for origins in ("https://app.example, http://localhost:3000", None):
        engine, thread = serve(model, max_concurrency=1, max_ctx=256, api_key="k", cors_origins=origins)
        try:
            with thread, httpx.Client(base_url=thread.url, timeout=120) as c:
                granted = c.options(CHAT, headers={"Origin": page, **preflight})
                refused = c.options(CHAT, headers={"Origin": other, **preflight})
                answer = c.post(CHAT, json=body, headers={"Origin": page, "Authorization": "Bearer k"})
                assert answer.status_code == 200, answer.text
                assert "access-control-allow-origin" not in refused.headers
                if origins is None:
                    assert granted.status_code == 401 and "access-control-allow-origin" not in granted.headers
                    assert "access-control-allow-origin" not in answer.headers
                else:
                    assert granted.status_code == 200, granted.text
                    assert granted.headers["access-control-allow-origin"] == page
                    assert "POST" in granted.headers["access-control-allow-methods"]
                    assert answer.headers["access-control-allow-origin"] == page
                    keyless = c.post(CHAT, json=body, headers={"Origin": page})
                    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == page
        finally:
            engine.stop()
