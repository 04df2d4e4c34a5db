"""Every bad input gets its status and an OpenAI-shaped error through HTTP; the server stays healthy."""
from __future__ import annotations

import base64

import httpx
import pytest

from http_helpers import IMAGES, data_url, image_part, serve, text_part

PNG = (IMAGES / "chart-rgba.png").read_bytes()
JPEG = (IMAGES / "photo-desk.jpeg").read_bytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def chat_body(messages, **params) -> dict:
    return {"model": "tiny", "messages": messages, "max_tokens": 4, **params}


def tiny_png_url() -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    return f"data:image/png;base64,{b64(buffer.getvalue())}"


IMAGE_CASES = {
    "remote_url": (user(image_part("https://example.com/cat.png")), 400, "does not fetch remote images"),
    "file_url": (user(image_part("file:///etc/passwd")), 400, "does not read local files"),
    "bad_base64": (user(image_part("data:image/png;base64,iVBORw0KG!!!!")), 400, "base64 payload is invalid"),
    "mismatched_mime": (user(image_part(f"data:image/jpeg;base64,{b64(PNG)}")), 400,
                        "declares image/jpeg but the bytes are image/png"),
    "unsupported_mime": (user(image_part("data:image/tiff;base64," + b64(b"II*\0...."))), 400,
                         "unsupported image type"),
    "corrupt_gif": (user(image_part(f"data:image/gif;base64,{b64(b'GIF89a....')}")), 400, "cannot be read"),
    "truncated_image": (user(image_part(f"data:image/jpeg;base64,{b64(JPEG[: len(JPEG) // 3])}")), 400, "image 1"),
    "too_many_images": (user(*[image_part(tiny_png_url()) for _ in range(17)]), 400, "at most 16 images"),
    "image_in_system": ([{"role": "system", "content": [image_part(tiny_png_url())]},
                         {"role": "user", "content": "hi"}], 400, "only accepted in user messages"),
    "marker_text": (user(text_part("look: <|image_pad|>")), 400, "reserved marker"),
    "image_url_string": (user({"type": "image_url", "image_url": data_url(IMAGES / "photo-desk.jpeg")}), 400,
                         "must be an object"),
    "unknown_part": (user({"type": "audio", "audio": "x"}), 400, "unknown content part type"),
    "bad_role": ([{"role": "wizard", "content": "hi"}], 400, "unknown role"),
    "oversized_image": (user(image_part("data:image/png;base64," + "A" * (23 * 1024 * 1024))), 413,
                        "over the limit"),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_bad_messages(http, case):
    messages, status, message = IMAGE_CASES[case]
    response = http.post("/v1/chat/completions", json=chat_body(messages))
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert len(response.text) < 2000  # no payload echoed


PARAM_CASES = {
    "n": ({"n": 2}, "n"),
    "negative_temperature": ({"temperature": -0.5}, "temperature"),
    "temperature_type": ({"temperature": "hot"}, "temperature"),
    "top_p_zero": ({"top_p": 0}, "top_p"),
    "top_p_above_one": ({"top_p": 1.5}, "top_p"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens_float": ({"max_tokens": 2.5}, "max_tokens"),
    "unknown": ({"frobnicate": True}, "frobnicate"),
    "five_stops": ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    "empty_stop": ({"stop": [""]}, "stop"),
    "top_logprobs_alone": ({"top_logprobs": 2}, "top_logprobs"),
    "stream_type": ({"stream": "yes"}, "stream"),
    "min_p": ({"min_p": 2}, "min_p"),
    "penalty": ({"presence_penalty": 3}, "presence_penalty"),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    "audio_out": ({"modalities": ["text", "audio"]}, "modalities"),
}


@pytest.mark.parametrize("case", sorted(PARAM_CASES))
def test_bad_parameters(http, case):
    params, param = PARAM_CASES[case]
    response = http.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}], **params))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"messages": "hi"}', "non-empty list"),
    (b'{"messages": []}', "non-empty list"),
    (b'{"messages": [{"role": "user"}]}', "content"),
])
def test_malformed_bodies(http, body, message):
    response = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_nulls_and_metadata_parameters_change_nothing(http):
    """Unknown parameters sent as null (clients that serialize every field) and OpenAI's metadata-only fields are
    accepted and leave the answer as it was; the same unknown parameter with a value is still refused."""
    messages = [{"role": "user", "content": "name a colour"}]
    plain = http.post("/v1/chat/completions", json=chat_body(messages, max_tokens=4))
    extra = {"audio": None, "prediction": None, "modalities": ["text"], "frobnicate": None,
             "safety_identifier": base64.b16encode(bytes(range(6))).decode(), "prompt_cache_key": "k1"}
    padded = http.post("/v1/chat/completions", json=chat_body(messages, max_tokens=4, **extra))
    assert plain.status_code == padded.status_code == 200, padded.text
    assert padded.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    refused = http.post("/v1/chat/completions", json=chat_body(messages, max_tokens=4, frobnicate=0))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frobnicate"


def test_completions_validation(http):
    assert http.post("/v1/completions", json={"prompt": 5}).json()["error"]["param"] == "prompt"
    assert http.post("/v1/completions", json={"prompt": "x", "echo": True}).status_code == 400
    response = http.post("/v1/completions", json={"prompt": "a <|vision_start|> b"})
    assert response.status_code == 400 and "reserved image marker" in response.json()["error"]["message"]


def test_unknown_route_and_wrong_method(http):
    response = http.post("/v1/nothing", json={})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    response = http.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_over_long_prompt_gives_the_counts(http):
    response = http.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "word " * 1100}]))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "context is 1024" in error["message"]
    response = http.post("/v1/chat/completions", json=chat_body([{"role": "user", "content": "hi"}], max_tokens=1020))
    assert response.status_code == 400
    assert "1020 to generate" in response.json()["error"]["message"]


def test_api_key_and_body_limit(model):
    engine, thread = serve(model, max_concurrency=1, max_ctx=256, api_key="sekrit", max_body_bytes=64 * 1024)
    try:
        with thread, httpx.Client(base_url=thread.url, timeout=60) as c:
            body = chat_body([{"role": "user", "content": "hi"}], max_tokens=1)
            assert c.post("/v1/chat/completions", json=body).status_code == 401
            wrong = c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models").status_code == 401
            assert c.get("/health").status_code == 200
            auth = {"Authorization": "Bearer sekrit"}
            assert c.get("/v1/models", headers=auth).status_code == 200
            assert c.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
            big = chat_body([{"role": "user", "content": "x" * 100_000}])
            response = c.post("/v1/chat/completions", json=big, headers=auth)
            assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"

            def chunked():  # no Content-Length: counted while reading
                for _ in range(10):
                    yield b" " * 10_000

            response = c.post("/v1/chat/completions", content=chunked(), headers=auth)
            assert response.status_code == 413
    finally:
        engine.stop()


def test_health_after_everything(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert "luxjax_requests_total" in http.get("/metrics").text
