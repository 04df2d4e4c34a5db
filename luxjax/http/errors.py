"""OpenAI-shaped errors for every failure the server answers: {"error": {message, type, param, code}}.

Client input never produces a 500: malformed bodies, unknown routes and wrong methods all get their 4xx here.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request

from luxjax.errors import RequestError
from luxjax.http.responses import JSONBody
from luxjax.vision.data_url import redact

log = logging.getLogger("luxjax.http")
RETRY_AFTER_SECONDS = 1
LARGE_BODY_BYTES = 1 << 20  # parsed in a worker thread, off the event loop


def error_response(error: RequestError) -> JSONBody:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
    body = error.to_openai()
    body["error"]["message"] = redact(body["error"]["message"])
    return JSONBody(body, status_code=error.status, headers=headers)


async def request_error_handler(request: Request, exc: RequestError) -> JSONBody:
    return error_response(exc)


async def http_exception_handler(request: Request, exc: HTTPException) -> JSONBody:
    if exc.status_code == 404:
        error = RequestError(f"unknown route: {request.method} {request.url.path}", status=404, code="not_found")
    elif exc.status_code == 405:
        error = RequestError(f"method {request.method} is not allowed for {request.url.path}", status=405,
                             code="method_not_allowed")
    else:
        error = RequestError(str(exc.detail), status=exc.status_code)
    response = error_response(error)
    response.headers.update(exc.headers or {})
    return response


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONBody:
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
    return error_response(RequestError("internal server error", status=500, type="server_error", code="internal_error"))


def body_too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is over the limit of {limit} bytes", status=413, code="body_too_large")


async def read_json_object(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (by Content-Length, and counted while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError("invalid Content-Length header")
        if int(declared) > limit:
            raise body_too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError("the client closed the connection while sending the body") from None
    raw = b"".join(chunks)
    try:
        body = json.loads(raw) if size < LARGE_BODY_BYTES else await asyncio.to_thread(json.loads, raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        position = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise RequestError(f"the body is not valid JSON{position}", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply", code="invalid_json") from None
    except ValueError:  # Python's int_max_str_digits: an integer literal of more than 4,300 digits
        raise RequestError("the body's JSON holds a number too long to read", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", code="invalid_json")
    return body


class ApiKeyMiddleware:
    """Refuses (401) every request without `Authorization: Bearer <key>` except the health check."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            error = RequestError("invalid or missing API key (send Authorization: Bearer <key>)", status=401,
                                 code="invalid_api_key")
            response = error_response(error)
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)
