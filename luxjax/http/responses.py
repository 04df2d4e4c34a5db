"""The OpenAI object shapes: chat.completion(.chunk) and text_completion, with logprobs and usage."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache

from starlette.responses import JSONResponse

from luxjax.engine.requests import Finished, TokenLogprob


def json_bytes(obj) -> bytes:
    """Compact UTF-8 JSON. A string that has no UTF-8 form (a lone surrogate a client sent as "\\ud800", echoed
    back as the model name or in an error message) is written \\u-escaped instead of failing the response."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class JSONBody(JSONResponse):
    """Starlette's JSONResponse rendered by json_bytes."""

    def render(self, content) -> bytes:
        return json_bytes(content)


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens}


class TokenTexts:
    """Text of single tokens for logprobs (cached: the same ids come back all the time)."""

    def __init__(self, tokenizer):
        self.text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))


@dataclass
class ResponseFormat:
    """Builds one endpoint's response objects for one request."""

    request_id: str
    model: str
    tokens: TokenTexts
    top_logprobs: int
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    # --- logprobs --------------------------------------------------------------------------------------------
    def logprobs(self, entries: list[TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        texts = [self.tokens.text(e.token_id) for e in entries]
        return {
            "tokens": texts,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.tokens.text(t): v for t, v in e.top[: self.top_logprobs]} for e in entries],
        }

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        def one(token_id: int, logprob: float) -> dict:
            text = self.tokens.text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**one(entry.token_id, entry.logprob),
                "top_logprobs": [one(t, v) for t, v in entry.top[: self.top_logprobs]]}

    # --- whole responses ---------------------------------------------------------------------------------
    def completion(self, text: str, finished: Finished, logprobs: list[TokenLogprob] | None,
                   token_ids: list[int] | None, prompt_ids: list[int] | None) -> dict:
        choice: dict = {"index": 0, "finish_reason": finished.finish_reason,
                        "logprobs": None if logprobs is None else self.logprobs(logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {"id": self.request_id, "object": self.object_name, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(finished)}
        if prompt_ids is not None:
            body["prompt_token_ids"] = prompt_ids
        return body

    # --- stream chunks ---------------------------------------------------------------------------------
    def chunk(self, text: str | None, *, role: bool = False, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None, token_ids: list[int] | None = None,
              include_usage: bool = False) -> dict:
        choice: dict = {"index": 0, "logprobs": None if logprobs is None else self.logprobs(logprobs),
                        "finish_reason": finish_reason}
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if token_ids is not None:
            choice["token_ids"] = token_ids
        body = {"id": self.request_id, "object": f"{self.object_name}.chunk" if self.chat else self.object_name,
                "created": self.created, "model": self.model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, finished: Finished) -> dict:
        return {"id": self.request_id, "object": f"{self.object_name}.chunk" if self.chat else self.object_name,
                "created": self.created, "model": self.model, "choices": [], "usage": usage(finished)}
