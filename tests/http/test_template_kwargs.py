"""`chat_template_kwargs` (vLLM's and SGLang's extension, e.g. {"enable_thinking": false} for Qwen's templates): the
variables reach the model's chat template, as transformers' apply_chat_template renders them with the same kwargs;
what the server sets itself, or what is not an object of variable names, is a 400 naming the parameter."""
from __future__ import annotations

import secrets

import pytest
from http_helpers import MODEL_DIR

# The fixture checkpoint's template with a Qwen3-style thinking switch and a free variable `note` (the fixture's own
# template reads no variable).
THINKING_TEMPLATE = (
    "{%- if note is defined -%}{{- '<|im_start|>system\\n' + note + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture()
def thinking_template(model, monkeypatch):
    monkeypatch.setattr(model.backend.tokenizer, "chat_template", THINKING_TEMPLATE)


def reference_ids(reference, messages, **kwargs) -> list[int]:
    text = reference.apply_chat_template(messages, chat_template=THINKING_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True, **kwargs)
    return reference(text, add_special_tokens=False)["input_ids"]


def random_words(n: int) -> str:
    return " ".join(secrets.token_hex(3) for _ in range(n))


def test_template_kwargs_reach_the_template(http, reference, thinking_template):
    messages = [{"role": "user", "content": random_words(5)}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"note": random_words(3)},
                   {"enable_thinking": False, "note": random_words(4)}):
        body = {"messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {})}
        response = http.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["tokens"] == reference_ids(reference, messages, **kwargs), kwargs
    off = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    on = http.post("/tokenize", json={"messages": messages})
    assert off.json()["count"] > on.json()["count"]  # the switch changed the prompt


def test_chat_completion_renders_with_the_template_kwargs(http, reference, thinking_template):
    messages = [{"role": "user", "content": random_words(4)}]
    kwargs = {"enable_thinking": False, "note": random_words(2)}
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2,
                                                       "chat_template_kwargs": kwargs})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(reference_ids(reference, messages, **kwargs))


@pytest.mark.parametrize("kwargs, message", [
    ("enable_thinking", "must be an object"),
    ([{"enable_thinking": False}], "must be an object"),
    ({"messages": []}, "cannot set 'messages'"),
    ({"add_generation_prompt": False}, "cannot set 'add_generation_prompt'"),
    ({"eos_token": "x"}, "cannot set 'eos_token'"),  # the tokenizer's own variable
    ({"raise_exception": "x"}, "cannot set 'raise_exception'"),  # a function every template gets
    ({"not a name": 1}, "variable names"),
    ({f"v{i}": i for i in range(33)}, "at most 32"),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_bad_template_kwargs_are_400(http, route, kwargs, message):
    response = http.post(route, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                      "chat_template_kwargs": kwargs})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and message in error["message"], error


def test_notebook_api_takes_template_kwargs(model, reference, thinking_template):
    """luxjax.api.Model (the notebook path) renders with the same variables as the server and transformers."""
    messages = [{"role": "user", "content": random_words(4)}]
    kwargs = {"enable_thinking": False, "note": random_words(3)}
    ids, _ = model.render_prompt(messages, template_kwargs=kwargs)
    assert ids == reference_ids(reference, messages, **kwargs)
    assert model.prompt(messages).token_ids == reference_ids(reference, messages)
    generation = model.generate(messages, max_tokens=2, template_kwargs=kwargs)
    assert generation.prompt_tokens == len(ids)
