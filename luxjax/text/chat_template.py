"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them.

Mirrors transformers/utils/chat_template_utils.py: the same sandboxed jinja2 environment (trim_blocks, lstrip_blocks,
loopcontrols, a `{% generation %}` tag), the same globals and `tojson` filter, and the same preparation of messages
(None-valued keys dropped, reasoning fields aliased, everything rebuilt from plain JSON types).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from luxjax.errors import RequestError

# Names a message's reasoning is passed under; the first is the one chat templates read (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables render_chat sets from its own arguments, and the functions compile_template gives every template
# (range: the sandbox's own).
RENDERER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt",
                      "raise_exception", "strftime_now", "dict", "namespace", "range")


def template_variables(fixed: Mapping[str, Any], requested: Mapping[str, Any]) -> dict[str, Any]:
    """The model's own template variables (special tokens, ...) and a request's `chat_template_kwargs` together;
    a requested name that the model or the renderer already sets is refused (400), not silently overridden."""
    for name in requested:
        if name in fixed or name in RENDERER_VARIABLES:
            raise RequestError(f'"chat_template_kwargs" cannot set {name!r}: the server sets it',
                               param="chat_template_kwargs", code="invalid_value")
    return {**fixed, **requested}


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render `messages` (OpenAI-style dicts, content a string or a list of parts) with `template`.

    `kwargs` become template variables (bos_token, eos_token, enable_thinking, ...). Any failure of the template on
    these inputs, `raise_exception(...)` included, is a RequestError carrying the template's message.
    """
    variables = {
        "messages": _prepare_messages(messages),
        "tools": _plain(list(tools)) if tools is not None else None,
        "documents": _plain(list(documents)) if documents is not None else None,
        "add_generation_prompt": add_generation_prompt,
        **_plain(kwargs),
    }
    try:
        return compile_template(template).render(**variables)
    except jinja2.TemplateError as e:
        raise RequestError(str(e)) from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise RequestError(f"chat template failed on these messages: {type(e).__name__}: {e}") from e


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per distinct template text."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """transformers' tojson: plain json.dumps, no HTML escaping, unicode kept."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore names, as transformers' TemplateNamespace does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it only to mask training labels)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """transformers' normalization: drop None-valued keys, rebuild as plain data, alias reasoning fields."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise RequestError(f"chat messages must be objects, got {type(message).__name__}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _plain(value: Any) -> Any:
    """Template data from plain JSON types only; any other object becomes an inert '<TypeName>' placeholder.

    Templates come from model files and are untrusted; objects with methods (decoded images, arrays) stay out of their
    reach. Templates only test whether media keys are present, so placeholders render the same.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
