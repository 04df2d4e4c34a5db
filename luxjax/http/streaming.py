"""Server-sent events: engine events -> OpenAI stream chunks, sent by an ASGI response that notices a client
that goes away (and tells the engine, so the slot is freed within a step)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from luxjax.engine.requests import Delta, Event, Failed, Finished, GenerationRequest
from luxjax.http.responses import ResponseFormat, json_bytes

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def sse(obj: dict) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


async def stream_chunks(first: Event, generation: GenerationRequest, fmt: ResponseFormat, *, include_usage: bool,
                        return_token_ids: bool, on_end: Callable[[Event], None]) -> AsyncIterator[bytes]:
    """The SSE body: a role chunk (chat), one chunk per visible delta, the finish chunk, the optional usage
    chunk, then [DONE]. A failure after the first chunk is sent as an error object before [DONE]."""
    wants_logprobs = generation.params.logprobs
    if fmt.chat:
        yield sse(fmt.chunk("", role=True, include_usage=include_usage))
    event = first
    while True:
        if isinstance(event, Delta):
            if event.text or (wants_logprobs and event.logprobs):
                yield sse(fmt.chunk(event.text, logprobs=list(event.logprobs) if wants_logprobs else None,
                                    token_ids=list(event.token_ids) if return_token_ids else None,
                                    include_usage=include_usage))
        elif isinstance(event, Finished):
            yield sse(fmt.chunk(None if fmt.chat else "", finish_reason=event.finish_reason,
                                token_ids=[] if return_token_ids else None, include_usage=include_usage))
            if include_usage:
                yield sse(fmt.usage_chunk(event))
            yield DONE
            on_end(event)
            return
        elif isinstance(event, Failed):
            yield sse(event.error.to_openai())
            yield DONE
            on_end(event)
            return
        event = await generation.events.get()


class EventStreamResponse:
    """Streams `chunks`; when the client disconnects (http.disconnect, or a failed send) it stops reading them
    and calls `on_disconnect`."""

    def __init__(self, chunks: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.chunks = chunks
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(self._watch(receive))
        disconnected = False
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump in done:
                disconnected = pump.result()
            else:
                disconnected = True
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            await self.chunks.aclose()
            if disconnected:
                self.on_disconnect()

    async def _pump(self, send) -> bool:
        """Send every chunk; True when the client was gone before the end."""
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # uvicorn's ClientDisconnected
            return True
        return False

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
