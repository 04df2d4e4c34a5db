"""render_chat gives transformers' apply_chat_template text; template failures are 400 RequestErrors."""
from __future__ import annotations

import copy
from datetime import datetime

import numpy as np
import pytest
from text_samples import FIXTURE_DIR

from luxjax.errors import RequestError
from luxjax.text import render_chat

IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
IMAGE = {"type": "image", "image": "https://example.com/cat.png"}

CONVERSATIONS = {
    "text_only": [{"role": "user", "content": "Describe the red circle."}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi <b>there</b> & 'you'"},
        {"role": "assistant", "content": "Hello.\n\n  Indented 😀"},
        {"role": "user", "content": "Again, in 中文?"},
    ],
    "one_image": [{"role": "user", "content": [IMAGE_URL, {"type": "text", "text": "What is shown?"}]}],
    "two_images": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                IMAGE_URL,
                {"type": "text", "text": "with"},
                IMAGE,
                {"type": "text", "text": "please."},
            ],
        }
    ],
    "three_images_multi_turn": [
        {"role": "system", "content": [{"type": "text", "text": "Look closely."}]},
        {"role": "user", "content": [IMAGE, IMAGE_URL, {"type": "text", "text": "Same?"}]},
        {"role": "assistant", "content": "No.", "tool_calls": None},
        {"role": "user", "content": [{"type": "text", "text": "And this?"}, IMAGE]},
    ],
}

# Exercises what transformers sets up: tojson (no HTML escaping, unicode kept, options), namespace, loop controls,
# trim/lstrip blocks, dict(), `{% generation %}`, reasoning aliasing, None keys dropped, tools, special-token variables.
FEATURES_TEMPLATE = """{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  {{ m | tojson }}
  {{ m | tojson(indent=2, sort_keys=True) }}
  {% if m.reasoning_content is defined %}R:{{ m.reasoning_content }}/{{ m.thinking }}{% endif %}
  {% if 'content' not in m %}no content{% endif %}
  {% if m.role == 'stop' %}{% break %}{% endif %}
{% endfor %}
{% generation %}count={{ ns.n }}{% endgeneration %}
{{ dict(a=1, b='x') | tojson(separators=(',', ':')) }}
{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}
{% if documents is none %}no documents{% endif %}
{% if add_generation_prompt %}<|im_start|>assistant{% endif %}
{{ enable_thinking | default('unset') }}"""

FEATURE_MESSAGES = [
    {"role": "user", "content": "<script>alert('x') & \"q\"</script> café ü", "name": None},
    {"role": "skip", "content": "hidden"},
    {"role": "assistant", "content": None, "reasoning": "think first"},
    {"role": "assistant", "content": "done", "thinking": "hmm"},
    {"role": "stop", "content": [{"type": "text", "text": "x"}]},
    {"role": "user", "content": "after break"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(reference, hf_tokenizer, gguf_tokenizer, name, add_generation_prompt, source):
    tokenizer = hf_tokenizer if source == "hf" else gguf_tokenizer
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(
        messages, chat_template=tokenizer.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert render_chat(tokenizer.chat_template, messages, add_generation_prompt) == expected


@pytest.mark.parametrize("case", ["one_image", "two_images"])
def test_fixture_prompts_are_the_rendered_chat_with_expanded_pads(hf_tokenizer, case):
    ref = np.load(FIXTURE_DIR / f"ref_{case}.npz")
    counts = [int(t) * int(h) * int(w) // 4 for t, h, w in ref["image_grid_thw"]]
    rendered = hf_tokenizer.apply_chat_template(CONVERSATIONS[case])
    pieces = rendered.split("<|image_pad|>")
    assert len(pieces) == len(counts) + 1
    expanded = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    assert expanded == str(ref["prompt"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_features_match_transformers(reference, hf_tokenizer, add_generation_prompt):
    expected = reference.apply_chat_template(
        FEATURE_MESSAGES,
        tools=TOOLS,
        chat_template=FEATURES_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=False,
    )
    ours = render_chat(
        FEATURES_TEMPLATE,
        FEATURE_MESSAGES,
        add_generation_prompt,
        tools=TOOLS,
        enable_thinking=False,
        **hf_tokenizer.special_tokens,
    )
    assert ours == expected
    assert '"<script>alert(\'x\') & \\"q\\"</script> café ü"' in ours


def test_strftime_now_matches_transformers(reference):
    template = "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}"
    messages = [{"role": "user", "content": "x"}]
    before = datetime.now().strftime("%Y-%m-%d")
    ours = render_chat(template, messages)
    assert ours == reference.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ours.split("|")[0] in (before, datetime.now().strftime("%Y-%m-%d"))


def test_raise_exception_is_a_request_error():
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}ok"
    )
    assert render_chat(template, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(RequestError) as info:
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert info.value.message == "Conversations must start with a user"
    assert info.value.status == 400


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content + '!' }}{% endfor %}",  # list content where a string is expected
        "{% for m in messages %}{{ m.content }",  # syntax error
        "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}",  # sandbox
        "{% set ns = namespace() %}{% set ns._x = 1 %}",  # transformers' namespace guard
    ],
)
def test_template_failures_are_request_errors(template):
    with pytest.raises(RequestError):
        render_chat(template, [{"role": "user", "content": [{"type": "text", "text": "x"}]}])


def test_no_template_is_a_request_error(hf_tokenizer):
    bare = copy.copy(hf_tokenizer)
    bare.chat_template = None
    with pytest.raises(RequestError):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_messages_are_not_modified(hf_tokenizer):
    messages = [{"role": "assistant", "content": "a", "reasoning": "r", "name": None}]
    render_chat(FEATURES_TEMPLATE, messages, **hf_tokenizer.special_tokens)
    assert messages == [{"role": "assistant", "content": "a", "reasoning": "r", "name": None}]


def test_non_json_objects_reach_the_template_as_placeholders():
    class Picture:
        def save(self, path):  # a method a template must never reach
            raise AssertionError("called")

    template = "{% for p in messages[0].content %}{{ p.image }}{% endfor %}"
    assert render_chat(template, [{"role": "user", "content": [{"type": "image", "image": Picture()}]}]) == "<Picture>"


def test_template_kwargs_cannot_shadow_what_the_renderer_gives_templates():
    """Every global compile_template adds or replaces is a name chat_template_kwargs may not set."""
    import jinja2.defaults

    from luxjax.text.chat_template import RENDERER_VARIABLES, compile_template, template_variables

    own = {name for name, value in compile_template("{{ 1 }}").globals.items()
           if jinja2.defaults.DEFAULT_NAMESPACE.get(name) is not value}
    assert own and own <= set(RENDERER_VARIABLES)
    for name in own:
        with pytest.raises(RequestError, match=f"cannot set '{name}'"):
            template_variables({}, {name: 1})
