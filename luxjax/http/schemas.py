"""Request bodies of /v1/chat/completions and /v1/completions -> validated dataclasses.

Every problem is a 400 RequestError naming the parameter. Unknown parameters are refused rather than silently
ignored, except a few OpenAI fields that do not change the output (user, metadata, ...) and any parameter sent as
null (clients that serialize every field they know send null for "not set").
"""
from __future__ import annotations

from dataclasses import dataclass

from luxjax.engine.requests import MAX_TOP_LOGPROBS, SamplingParams
from luxjax.errors import RequestError

MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_TEMPLATE_KWARGS = 32
SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty", "stop", "n", "logit_bias"}
IGNORED_KEYS = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                "prompt_cache_key"}
COMMON_KEYS = SAMPLING_KEYS | IGNORED_KEYS | {"stream", "stream_options", "return_token_ids"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                           "tools", "tool_choice", "chat_template_kwargs", "modalities"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}


@dataclass(frozen=True)
class GenerationOptions:
    """What both endpoints share besides their input."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool  # vLLM's extension: the prompt's and the completion's token ids in the response
    model: str | None


@dataclass(frozen=True)
class ChatCompletionRequest:
    messages: list
    options: GenerationOptions
    template_kwargs: dict  # chat_template_kwargs (vLLM's and SGLang's extension): extra chat template variables


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    options: GenerationOptions


def invalid(param: str, message: str) -> RequestError:
    return RequestError(message, param=param, code="invalid_value")


def parse_chat_request(body: dict) -> ChatCompletionRequest:
    _refuse_unknown(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", '"messages" must be a non-empty list of messages')
    if body.get("tools"):
        raise invalid("tools", "tool calling is not supported by this server")
    if body.get("tool_choice") not in (None, "none"):
        raise invalid("tool_choice", "tool calling is not supported by this server")
    if body.get("modalities") not in (None, ["text"]):
        raise invalid("modalities", 'only modalities ["text"] is supported')
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid("response_format", 'only response_format {"type": "text"} is supported')
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise invalid("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens = _integer(body, "max_completion_tokens", None, 1) or _integer(body, "max_tokens", None, 1)
    logprobs = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    return ChatCompletionRequest(messages, _options(body, max_tokens, logprobs, top_logprobs),
                                 parse_template_kwargs(body))


def parse_template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`: variables for the chat template (e.g. {"enable_thinking": false} for Qwen's), an
    object of at most MAX_TEMPLATE_KWARGS identifier keys; {} when absent. Names the renderer sets itself are
    refused where it renders (chat_template.template_variables)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", '"chat_template_kwargs" must be an object of template variables')
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise invalid("chat_template_kwargs", f'"chat_template_kwargs" may hold at most {MAX_TEMPLATE_KWARGS} variables')
    for key in kwargs:
        if not key.isidentifier():
            raise invalid("chat_template_kwargs",
                          f'"chat_template_kwargs" keys must be template variable names; got {key[:60]!r}')
    return dict(kwargs)


def parse_completion_request(body: dict) -> CompletionRequest:
    _refuse_unknown(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", '"prompt" must be a string (or a list holding one string)')
    if _boolean(body, "echo", False):
        raise invalid("echo", "echo is not supported")
    if body.get("suffix") is not None:
        raise invalid("suffix", "suffix is not supported")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "best_of must be 1")
    max_tokens = _integer(body, "max_tokens", 16, 1)  # OpenAI's default for completions
    top_logprobs = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt, _options(body, max_tokens, top_logprobs is not None, top_logprobs or 0))


def _options(body: dict, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> GenerationOptions:
    if _integer(body, "n", 1, 1) != 1:
        raise invalid("n", "only n=1 is supported")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "logit_bias is not supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", '"model" must be a string')
    stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options", '"stream_options" must be an object')
        if not stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        include_usage = _boolean(stream_options, "include_usage", False, param="stream_options.include_usage")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_top_k(body),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_integer(body, "seed", None, -(2**63), 2**64 - 1),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return GenerationOptions(params, stream, include_usage, _boolean(body, "return_token_ids", False), model)


def _refuse_unknown(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if key not in known and value is not None:
            raise RequestError(f"unknown parameter {str(key)[:60]!r}", param=str(key)[:60], code="unknown_parameter")


def _top_k(body: dict) -> int:
    value = _integer(body, "top_k", 0, -1)
    return max(value, 0)  # -1 (vLLM) and 0 both mean off


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", '"stop" must be a non-empty string or a list of non-empty strings')
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
    return tuple(stops)


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise invalid(name, f'"{name}" must be a number')
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f'"{name}" must be in {bracket}{low:g}, {high:g}], got {value}')
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f'"{name}" must be an integer')
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise invalid(name, f'"{name}" must be {limit}, got {value}')
    return value


def _boolean(body: dict, name: str, default: bool, *, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(param or name, f'"{param or name}" must be true or false')
    return value
