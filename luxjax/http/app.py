"""The OpenAI-compatible HTTP surface over an Engine: `create_app(engine, settings)` -> Starlette app."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from luxjax.contract import Prompt
from luxjax.engine.requests import Delta, Event, Failed, Finished, GenerationRequest
from luxjax.engine.scheduler import Engine
from luxjax.errors import RequestError
from luxjax.http.errors import (ApiKeyMiddleware, error_response, http_exception_handler, read_json_object,
                                request_error_handler, unexpected_error_handler)
from luxjax.http.metrics import Metrics
from luxjax.http.responses import JSONBody, ResponseFormat, TokenTexts
from luxjax.http.schemas import parse_chat_request, parse_completion_request, parse_template_kwargs
from luxjax.http.settings import Settings, cors_origins
from luxjax.http.streaming import EventStreamResponse, stream_chunks
from luxjax.vision.data_url import redact

log = logging.getLogger("luxjax.http")
DISCONNECT_POLL_S = 0.5
CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer


class ClientGone(Exception):
    pass


class Service:
    def __init__(self, engine: Engine, settings: Settings):
        self.engine = engine
        self.settings = settings
        self.backend = engine.backend
        self.metrics = Metrics(engine)
        self.tokens = TokenTexts(self.backend.tokenizer)

    # --- generation endpoints --------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        endpoint = request.url.path
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        started = time.perf_counter()
        try:
            body = await read_json_object(request, self.settings.max_body_bytes)
            parsed = parse_chat_request(body) if chat else parse_completion_request(body)
            self.engine.check_capacity()
            prompt = await self._prepare(parsed.messages if chat else parsed.prompt, chat=chat,
                                         template_kwargs=parsed.template_kwargs if chat else None)
            generation = self.engine.submit(request_id, prompt, parsed.options.params)
            first = await self._next_event(generation, request)
            if isinstance(first, Failed):
                raise first.error
        except RequestError as exc:
            self._record(endpoint, request_id, exc.status, started, error=exc)
            return error_response(exc)
        except ClientGone:
            self._record(endpoint, request_id, CLIENT_CLOSED, started)
            return Response(status_code=CLIENT_CLOSED)
        options = parsed.options
        fmt = ResponseFormat(request_id, options.model or self.settings.model_id, self.tokens,
                             options.params.top_logprobs, chat)
        has_images = bool(prompt.image_spans)
        if options.stream:
            def on_end(event: Event) -> None:
                status = event.error.status if isinstance(event, Failed) else 200
                self._record(endpoint, request_id, status, started, finished=event, has_images=has_images)

            def on_disconnect() -> None:
                self.engine.cancel(generation)
                self._record(endpoint, request_id, CLIENT_CLOSED, started)

            chunks = stream_chunks(first, generation, fmt, include_usage=options.include_usage,
                                   return_token_ids=options.return_token_ids, on_end=on_end)
            return EventStreamResponse(chunks, on_disconnect)
        return await self._collect(request, endpoint, request_id, started, generation, first, fmt, prompt, options)

    async def _collect(self, request, endpoint, request_id, started, generation, event, fmt, prompt, options):
        text, logprobs, token_ids = [], [], []
        try:
            while isinstance(event, Delta):
                text.append(event.text)
                logprobs.extend(event.logprobs)
                token_ids.extend(event.token_ids)
                event = await self._next_event(generation, request)
        except ClientGone:
            self._record(endpoint, request_id, CLIENT_CLOSED, started)
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(event, Failed):
            self._record(endpoint, request_id, event.error.status, started, error=event.error)
            return error_response(event.error)
        self._record(endpoint, request_id, 200, started, finished=event, has_images=bool(prompt.image_spans))
        body = fmt.completion("".join(text), event, logprobs if options.params.logprobs else None,
                              token_ids if options.return_token_ids else None,
                              prompt.token_ids if options.return_token_ids else None)
        return JSONBody(body)

    async def _prepare(self, source, *, chat: bool, template_kwargs: dict | None = None) -> Prompt:
        try:
            return await (self.engine.prepare_chat(source, template_kwargs) if chat
                          else self.engine.prepare_text(source))
        except RequestError:
            raise
        except Exception as exc:  # client input the prompt pipeline did not anticipate: still the client's
            log.warning("prompt preparation failed: %s: %s", type(exc).__name__, redact(str(exc))[:200])
            raise RequestError(f"the request could not be turned into a prompt ({type(exc).__name__})",
                               code="invalid_request") from None

    async def _next_event(self, generation: GenerationRequest, request: Request) -> Event:
        """The next engine event; cancels the generation when the client disconnects meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(generation.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    self.engine.cancel(generation)
                    raise ClientGone from None

    def _record(self, endpoint: str, request_id: str, status: int, started: float, *, error: RequestError | None = None,
                finished: Event | None = None, has_images: bool = False) -> None:
        """Metrics plus one log line per request (never the payload)."""
        self.metrics.count_request(endpoint, status)
        elapsed = time.perf_counter() - started
        if isinstance(finished, Finished):
            self.metrics.observe(finished, has_images)
            t = finished.timings
            log.info("%s %s status=%d prompt=%d completion=%d finish=%s queued=%.3fs image=%.3fs ttft=%.3fs "
                     "total=%.3fs", request_id, endpoint, status, finished.prompt_tokens, finished.completion_tokens,
                     finished.finish_reason, t.queued_s, t.image_encode_s, t.time_to_first_token_s, elapsed)
        else:
            reason = f" error={error.code or error.type}" if error is not None else ""
            log.info("%s %s status=%d%s total=%.3fs", request_id, endpoint, status, reason, elapsed)

    # --- other endpoints -------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        body = await read_json_object(request, self.settings.max_body_bytes)
        if "messages" in body:
            prompt = await self._prepare(body["messages"], chat=True, template_kwargs=parse_template_kwargs(body))
        elif isinstance(body.get("content"), str):
            prompt = await self._prepare(body["content"], chat=False)
        else:
            raise RequestError('send {"messages": [...]} or {"content": "..."}', param="content")
        return JSONBody({"tokens": prompt.token_ids, "count": prompt.num_tokens,
                         "image_tokens": prompt.num_image_tokens})

    def model_card(self) -> dict:
        capabilities = ["completion", "chat"] + (["multimodal"] if self.backend.supports_images else [])
        return {"id": self.settings.model_id, "object": "model", "created": 0, "owned_by": "luxjax",
                "capabilities": capabilities,
                "meta": {"n_ctx": self.engine.max_ctx, "n_vocab": self.backend.vocab_size,
                         "dtype": str(self.backend.dtype)}}

    async def models(self, request: Request) -> Response:
        return JSONBody({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card (the SDKs' models.retrieve); 404 for any other id."""
        if request.path_params["model_id"] != self.settings.model_id:
            raise RequestError(f"no model {request.path_params['model_id'][:100]!r} is served here", status=404,
                               param="model", code="model_not_found")
        return JSONBody(self.model_card())

    async def props(self, request: Request) -> Response:
        vision = bool(self.backend.supports_images)
        return JSONBody({
            "model_alias": self.settings.model_id,
            "model_path": self.settings.model,
            "mmproj_path": self.settings.mmproj,
            "n_ctx": self.engine.max_ctx,
            "max_concurrency": self.engine.max_concurrency,
            "max_queue": self.engine.max_queue,
            "capabilities": {"image_input_supported": vision, "chat": True, "completion": True},
            "modalities": {"vision": vision},
            "model": {"vocab_size": self.backend.vocab_size, "dtype": str(self.backend.dtype),
                      "max_context": self.backend.max_context},
        })

    async def health(self, request: Request) -> Response:
        return JSONBody({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)


def create_app(engine: Engine, settings: Settings) -> Starlette:
    service = Service(engine, settings)
    routes = [
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", service.model, methods=["GET"]),
        Route("/props", service.props, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/tokenize", service.tokenize, methods=["POST"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
    ]
    middleware, origins = [], cors_origins(settings)
    if origins:  # outermost: a browser's preflight (OPTIONS, no credentials) is answered here
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins,
                                     allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600))
    if settings.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=settings.api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={
        RequestError: request_error_handler, HTTPException: http_exception_handler,
        Exception: unexpected_error_handler})
    app.state.service = service
    return app
