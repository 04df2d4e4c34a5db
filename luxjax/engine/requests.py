"""What a client asks the engine for, and what the engine sends back: plain data shared by the scheduler thread
and the HTTP event loop."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from luxjax.contract import Prompt
from luxjax.errors import RequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; the defaults are OpenAI's except temperature (0 = greedy, the engine's default)."""

    max_tokens: int | None = None  # None: whatever the context leaves
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class Delta:
    """Text made visible by one step (may be empty while a stop string is possibly starting)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Timings:
    queued_s: float  # submit -> admission
    image_encode_s: float
    time_to_first_token_s: float  # submit -> first token
    total_s: float
    inter_token_s: tuple[float, ...]  # gaps between consecutive tokens


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


@dataclass(frozen=True)
class Failed:
    error: RequestError


Event = Delta | Finished | Failed


@dataclass(eq=False)
class GenerationRequest:
    """One accepted request. The scheduler thread fills `events` through the owning event loop; the request ends
    with exactly one Finished or Failed event."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    max_tokens: int  # resolved against the context
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: bool = False

    def send(self, event: Event) -> None:
        """Thread-safe; at most one terminal event is delivered."""
        if self.done:
            return
        if isinstance(event, (Finished, Failed)):
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        self.cancelled.set()
