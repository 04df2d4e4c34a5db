"""Continuous batching: one thread owns the device caches of `max_concurrency` slots and, each iteration, admits
queued requests into free slots, runs at most one prefill chunk, then issues one batched decode step for every
decoding slot and reads the step issued before it (one step ahead: Engine._decode_step). A prefill chunk is
`prefill_chunk` tokens while other streams decode (their next token waits for it), up to `solo_prefill_chunk` while
none does (most prompts in one step: a packed model decodes its weights once per step). Requests talk to it through
GenerationRequest objects (events flow back to their asyncio loop)."""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from luxjax.contract import Backend, Prompt
from luxjax.engine.generate import PREFILL_CHUNK, SOLO_PREFILL_CHUNK
from luxjax.engine.requests import (Delta, Failed, Finished, GenerationRequest, SamplingParams, Timings,
                                    TokenLogprob)
from luxjax.engine.sampling import RowParams, StopStringFilter, sample_tokens, top_logprobs_width
from luxjax.errors import RequestError
from luxjax.vision.spans import next_chunk_end

log = logging.getLogger("luxjax.engine")


@dataclass(frozen=True)
class StepInFlight:
    """A decode step issued but not read back yet: the sequence of each of its rows (None: idle) and its sampled
    outputs (sample_tokens'), on the device."""

    seqs: list
    outputs: tuple

    def holds(self, i: int, seq) -> bool:
        return i < len(self.seqs) and self.seqs[i] is seq


@dataclass(eq=False)
class SlotState:
    """A request admitted into a slot: its prefill progress, generated tokens and text stream."""

    request: GenerationRequest
    image_rows: object
    decoder: object
    stops: StopStringFilter
    admitted_at: float
    image_encode_s: float
    cached: int = 0  # tokens in the slot's cache (while prefilling: the prompt tokens prefilled so far)
    generated: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.request.prompt.num_tokens


def internal_error(what: str, exc: BaseException) -> RequestError:
    return RequestError(f"internal error during {what} ({type(exc).__name__}); the request was dropped",
                        status=500, type="server_error", code="internal_error")


def check_sampling_params(params: SamplingParams, seed: int) -> None:
    """Build the request's device row now, so parameters the scheduler thread could not use fail this request
    with a 400 instead of the batch it would join."""
    try:
        RowParams.build([(params, seed, 0)])
    except (OverflowError, ValueError, TypeError) as exc:
        raise RequestError(f"sampling parameters out of range: {exc}", code="invalid_value") from None


def busy_error(message: str) -> RequestError:
    return RequestError(message, status=503, type="server_error", code="server_busy")


@partial(jax.jit, donate_argnames=("counts", "last"))
def record_tokens(counts, last, tokens, active):
    """(counts [slots, V] with each active row's token [B] counted, last [slots] holding it), for the first B <=
    slots slots: the penalties' counts and the next decode step's input tokens stay on the device."""
    rows = jnp.arange(tokens.shape[0])
    return (counts.at[rows, tokens].add(active.astype(counts.dtype)),
            last.at[rows].set(jnp.where(active, tokens, last[rows])))


def decode_width(slots_in_use: int, slots: int) -> int:
    """The batch a decode step runs for the first `slots_in_use` slots: the next power of two, at most `slots`. A
    step's cost grows with its rows (27B IQ4_XS on an H100: 121 tokens/s at one row, 265 at four: 8.3 against 15.1
    ms a step), so a lone stream decodes at one row, not at every slot's; the few widths compile once each."""
    width = 1
    while width < slots_in_use:
        width *= 2
    return min(width, slots)


@partial(jax.jit, donate_argnames=("counts",))
def clear_row(counts, slot):
    return counts.at[slot].set(0)


class Engine:
    def __init__(self, backend: Backend, *, max_concurrency: int = 4, max_queue: int = 64, max_ctx: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, solo_prefill_chunk: int = SOLO_PREFILL_CHUNK,
                 prompt_workers: int = 2):
        self.backend = backend
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.max_ctx = min(max_ctx or backend.max_context, backend.max_context)
        self.prefill_chunk = prefill_chunk
        self.solo_prefill_chunk = max(solo_prefill_chunk, prefill_chunk)
        self.eos_ids = frozenset(backend.tokenizer.eos_token_ids)
        self._prompt_pool = ThreadPoolExecutor(prompt_workers, thread_name_prefix="luxjax-prompt")
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._slots: list[SlotState | None] = [None] * max_concurrency
        self._caches = backend.init_cache(max_concurrency, self.max_ctx)
        self._clear_token_state()
        self._no_counts = self._zeros_beside_caches(1, backend.vocab_size)  # a prompt's first token: none generated
        self._in_flight: StepInFlight | None = None
        self._thread = threading.Thread(target=self._run, name="luxjax-scheduler", daemon=True)

    # --- event-loop side ------------------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_slots(self) -> int:
        return sum(s is not None for s in self._slots)

    def check_capacity(self) -> None:
        """Refuse early (before preparing the prompt) when the queue is already full."""
        if len(self._queue) >= self.max_queue + self.max_concurrency - self.active_slots:
            raise busy_error(f"the server is busy ({self.max_queue} requests waiting); retry later")

    async def prepare_chat(self, messages, template_kwargs: dict | None = None) -> Prompt:
        """Parse, decode and preprocess images and render the chat template (with a request's extra template
        variables), off the event loop."""
        render = partial(self.backend.render_prompt, messages, template_kwargs=template_kwargs or None,
                         max_tokens=self.max_ctx)
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, render)

    async def prepare_text(self, text: str) -> Prompt:
        encode = partial(self.backend.text_prompt, text, max_tokens=self.max_ctx)
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, encode)

    def resolve_max_tokens(self, prompt: Prompt, params: SamplingParams) -> int:
        """The number of tokens to generate at most; 400 context_length_exceeded when they cannot fit."""
        wanted = params.max_tokens if params.max_tokens is not None else max(self.max_ctx - prompt.num_tokens, 1)
        if prompt.num_tokens + wanted > self.max_ctx:
            raise RequestError(
                f"this request needs {prompt.num_tokens + wanted} tokens ({prompt.num_tokens} prompt tokens incl. "
                f"{prompt.num_image_tokens} image tokens + {wanted} to generate) but the context is {self.max_ctx}",
                code="context_length_exceeded", param="max_tokens" if params.max_tokens is not None else "messages")
        return wanted

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams) -> GenerationRequest:
        """Queue a request (call from the event loop that will read its events)."""
        if prompt.num_tokens == 0:
            raise RequestError("the prompt is empty: it must hold at least one token", param="prompt",
                               code="invalid_value")
        max_tokens = self.resolve_max_tokens(prompt, params)
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        check_sampling_params(params, seed)
        request = GenerationRequest(request_id, prompt, params, max_tokens, seed, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise busy_error("the server is shutting down")
            free = self.max_concurrency - self.active_slots
            if len(self._queue) >= self.max_queue + free:
                raise busy_error(f"the server is busy ({self.max_queue} requests waiting); retry later")
            self._queue.append(request)
        self._wake.set()
        return request

    def cancel(self, request: GenerationRequest) -> None:
        request.cancel()
        self._wake.set()

    # --- scheduler thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        self._compile_decode_widths()
        while True:
            with self._lock:
                if self._stopping:
                    break
                idle = not self._queue and self.active_slots == 0
                if idle:
                    self._wake.clear()
                    self._in_flight = None  # its sequences all ended: nothing in it to read
            if idle:
                self._wake.wait(1.0)
                continue
            try:
                self._drop_cancelled()
                self._admit()
                self._prefill_one_chunk()
                self._decode_step()
            except Exception as exc:  # a bug in the loop itself: fail what is in flight, keep serving
                log.exception("scheduler iteration failed")
                self._fail_all(internal_error("scheduling", exc))
        self._fail_all(busy_error("the server is shutting down"))

    def _compile_decode_widths(self) -> None:
        """The decode step, its sampling and token counts compiled at every width a step may take (decode_width)
        before the first request, with no row active (the caches stay as they are): compiled on first use, a second
        stream joining would stall every stream for the new width's compile (seconds for a 27B model; ~1 s for the
        tiny fixture on a CPU, measured). Requests queue meanwhile; a failure here is logged and leaves the compiles
        to first use."""
        widths = sorted({decode_width(n, self.max_concurrency) for n in range(1, self.max_concurrency + 1)})
        began = time.perf_counter()
        try:
            for width in widths:
                zeros = np.zeros(width, np.int32)
                idle = np.zeros(width, bool)
                # the tokens as _issue_step passes them (a device array, not host zeros: another compile)
                logits, self._caches = self.backend.decode(self._caches, self._last_tokens[:width], zeros, zeros,
                                                           idle)
                self._sample(logits, [None] * width, idle)  # counts nothing
            jax.block_until_ready(self._counts)
        except Exception:  # noqa: BLE001 - the steps compile again on first use; a real fault shows there
            log.exception("compiling the decode step ahead failed")
            self._recover_caches()
            return
        log.info("decode step compiled for %s rows in %.1f s", widths, time.perf_counter() - began)

    def _drop_cancelled(self) -> None:
        with self._lock:
            kept = [r for r in self._queue if not r.cancelled.is_set()]
            dropped = [r for r in self._queue if r.cancelled.is_set()]
            self._queue = collections.deque(kept)
        for request in dropped:
            request.send(Finished("cancelled", request.prompt.num_tokens, 0, self._timings_unadmitted(request)))
        for i, seq in enumerate(self._slots):
            if seq is not None and seq.request.cancelled.is_set():
                self._finish(i, "cancelled")

    def _admit(self) -> None:
        for i in range(self.max_concurrency):
            if self._slots[i] is not None:
                continue
            with self._lock:
                if not self._queue:
                    return
                request = self._queue.popleft()
            try:
                self._slots[i] = self._start_sequence(request)
                self._counts = clear_row(self._counts, i)
            except Exception as exc:
                log.warning("request %s: image encoding failed: %s", request.request_id, exc)
                request.send(Failed(exc if isinstance(exc, RequestError) else internal_error("image encoding", exc)))
                self._recover_caches()

    def _start_sequence(self, request: GenerationRequest) -> SlotState:
        prompt = request.prompt
        began = time.perf_counter()
        rows = None
        if prompt.image_spans:
            rows = self.backend.encode_images(prompt.image_inputs)
            jax.block_until_ready(rows)
        return SlotState(request, rows, self.backend.tokenizer.incremental_decoder(),
                        StopStringFilter(request.params.stop), admitted_at=began,
                        image_encode_s=time.perf_counter() - began)

    def _prefill_one_chunk(self) -> None:
        waiting = [(s.admitted_at, i) for i, s in enumerate(self._slots) if s is not None and s.prefilling]
        if not waiting:
            return
        _, i = min(waiting)
        seq = self._slots[i]
        prompt = seq.request.prompt
        others_decoding = any(s is not None and not s.prefilling for s in self._slots)
        begin = seq.cached
        end = next_chunk_end(begin, prompt.num_tokens, prompt.image_spans,
                             self.prefill_chunk if others_decoding else self.solo_prefill_chunk,
                             self.backend.keep_images_whole)
        params = seq.request.params
        try:
            logits, self._caches = self.backend.prefill(self._caches, i, prompt, seq.image_rows, begin, end)
            seq.cached = end
            if seq.prefilling:
                return
            row = RowParams.build([(params, seq.request.seed, 0)])
            token, logprob, top_ids, top_values = sample_tokens(
                jnp.reshape(logits, (1, -1)), self._no_counts, row, top_logprobs=top_logprobs_width([params]))
        except Exception as exc:
            log.exception("request %s: prefill failed", seq.request.request_id)
            self._slots[i] = None
            seq.request.send(Failed(exc if isinstance(exc, RequestError) else internal_error("prefill", exc)))
            self._recover_caches()
            return
        seq.image_rows = None
        self._counts, self._last_tokens = record_tokens(self._counts, self._last_tokens,
                                                        jnp.full((self.max_concurrency,), token[0]),
                                                        jnp.arange(self.max_concurrency) == i)
        self._accept(i, *_host_row(token, logprob, top_ids, top_values, 0))

    def _decode_step(self) -> None:
        """Issue the next decode step, then read the step issued before it (one step ahead): the host's work
        between steps (reading the tokens, streaming their text, issuing the step) overlaps the device's step, where
        it used to leave the device idle (27B IQ4_XS on an H100, session 46: 13.8 ms a token for a lone stream
        through the server, 8.1 ms a step in bench_model). The next step takes its tokens from the device; a row
        whose sequence ends in the step read (eos, a stop string, cancelled) has run one step more, its result
        dropped. Rows that reached max_tokens with the step in flight are not issued."""
        in_flight, self._in_flight = self._in_flight, None
        issued = [(i, s) for i, s in enumerate(self._slots) if s is not None and not s.prefilling
                  and self._tokens_issued(i, s, in_flight) < s.request.max_tokens]
        try:
            if issued:
                self._in_flight = self._issue_step(issued, in_flight)
            host = None if in_flight is None else [np.asarray(x) for x in in_flight.outputs]
        except Exception as exc:
            log.exception("decode step failed")
            self._in_flight = None
            in_flight_rows = [] if in_flight is None else list(enumerate(in_flight.seqs))
            for i, seq in issued + in_flight_rows:
                if seq is not None and self._slots[i] is seq:
                    seq.request.send(Failed(internal_error("decoding", exc)))
                    self._slots[i] = None
            self._recover_caches()
            return
        if in_flight is not None:
            for i, seq in enumerate(in_flight.seqs):
                if seq is not None and self._slots[i] is seq:  # else it ended (or was failed) since
                    self._accept(i, *_host_row(*host, i))

    @staticmethod
    def _tokens_issued(i: int, seq: SlotState, in_flight: StepInFlight | None) -> int:
        """The tokens of seq generated so far, with the one of the step in flight."""
        return len(seq.generated) + (in_flight is not None and in_flight.holds(i, seq))

    def _issue_step(self, issued: list[tuple[int, SlotState]], in_flight: StepInFlight | None) -> StepInFlight:
        """Issue a decode step for the `issued` (slot, sequence) rows and the sampling of its tokens, unread."""
        B = decode_width(issued[-1][0] + 1, self.max_concurrency)  # slots from B on are neither read nor written
        cached, deltas = np.zeros(B, np.int32), np.zeros(B, np.int32)
        for i, seq in enumerate(self._slots[:B]):
            if seq is not None:
                cached[i] = seq.cached
        rows: list = [None] * B
        seqs: list = [None] * B
        for i, seq in issued:
            deltas[i], seqs[i] = seq.request.prompt.rope_delta, seq
            rows[i] = (seq.request.params, seq.request.seed, self._tokens_issued(i, seq, in_flight))
        active = np.array([seq is not None for seq in seqs])
        # only issued rows advance: idle slots and sequences between prefill chunks keep their caches
        logits, self._caches = self.backend.decode(self._caches, self._last_tokens[:B], cached, deltas, active)
        outputs = self._sample(logits, rows, active)
        for _, seq in issued:
            seq.cached += 1
        return StepInFlight(seqs, outputs)

    def _sample(self, logits, rows: list, active: np.ndarray):
        """sample_tokens for a decode step's rows ((params, seed, step) or None per row, the first len(rows) slots),
        its tokens counted for the active rows. One call for the step and its compile ahead, so that both trace the
        same functions with the same arguments (a static argument passed or left to its default compiles twice)."""
        out = sample_tokens(logits, self._counts[: len(rows)], RowParams.build(rows),
                            top_logprobs=top_logprobs_width([r[0] if r else None for r in rows]))
        self._counts, self._last_tokens = record_tokens(self._counts, self._last_tokens, out[0],
                                                        jnp.asarray(active))
        return out

    def _accept(self, i: int, token: int, logprob: TokenLogprob | None) -> None:
        """Record one sampled token of slot i: stream its text, and finish on eos, a stop string or max_tokens."""
        seq = self._slots[i]
        now = time.perf_counter()
        if seq.last_token_at is not None:
            seq.gaps.append(now - seq.last_token_at)
        seq.first_token_at = seq.first_token_at or now
        seq.last_token_at = now
        logprobs = (logprob,) if logprob is not None and seq.request.params.logprobs else ()
        if token in self.eos_ids:  # not a completion token: no text, no logprobs entry, not counted
            tail = seq.stops.push(seq.decoder.flush())
            tail += seq.stops.flush()
            if tail:
                seq.request.send(Delta(tail, (), ()))
            self._finish(i, "stop")
            return
        seq.generated.append(token)
        text = seq.stops.push(seq.decoder.push(token))
        finish = "stop" if seq.stops.stopped else None
        if finish is None and len(seq.generated) >= seq.request.max_tokens:
            text += seq.stops.push(seq.decoder.flush())
            text += seq.stops.flush()
            finish = "stop" if seq.stops.stopped else "length"
        seq.request.send(Delta(text, (token,), logprobs))
        if finish:
            self._finish(i, finish)

    def _finish(self, i: int, reason: str) -> None:
        seq = self._slots[i]
        self._slots[i] = None
        request = seq.request
        now = time.perf_counter()
        timings = Timings(
            queued_s=seq.admitted_at - request.submitted_at, image_encode_s=seq.image_encode_s,
            time_to_first_token_s=(seq.first_token_at or now) - request.submitted_at,
            total_s=now - request.submitted_at, inter_token_s=tuple(seq.gaps))
        request.send(Finished(reason, request.prompt.num_tokens, len(seq.generated), timings))

    @staticmethod
    def _timings_unadmitted(request: GenerationRequest) -> Timings:
        waited = time.perf_counter() - request.submitted_at
        return Timings(waited, 0.0, waited, waited, ())

    def _recover_caches(self) -> None:
        """After a failed device call the donated caches may be gone: rebuild them and fail the other sequences."""
        if not any(x.is_deleted() for x in jax.tree.leaves((self._caches, self._counts, self._last_tokens))):
            return
        log.error("device caches were lost; failing the sequences in flight")
        self._fail_slots(internal_error("a failed device call", RuntimeError("caches lost")))
        self._caches = self.backend.init_cache(self.max_concurrency, self.max_ctx)
        self._clear_token_state()

    def _clear_token_state(self) -> None:
        """Each slot's generated-token counts [slots, V] (the penalties') and last sampled token [slots], zero."""
        self._counts = self._zeros_beside_caches(self.max_concurrency, self.backend.vocab_size)
        self._last_tokens = self._zeros_beside_caches(self.max_concurrency)

    def _zeros_beside_caches(self, *shape: int) -> jax.Array:
        """int32 zeros committed where the caches lie, as the jitted steps' outputs that replace them (or take their
        place in a call) are: an uncommitted array (jnp.zeros') is another key of a jit's cache, so the compile
        ahead of the first step (with these) would not serve the later steps (with those)."""
        return jax.device_put(np.zeros(shape, np.int32), jax.tree.leaves(self._caches)[0].sharding)

    def _fail_slots(self, error: RequestError) -> None:
        self._in_flight = None
        for i, seq in enumerate(self._slots):
            if seq is not None:
                seq.request.send(Failed(error))
                self._slots[i] = None

    def _fail_all(self, error: RequestError) -> None:
        self._fail_slots(error)
        with self._lock:
            pending, self._queue = list(self._queue), collections.deque()
        for request in pending:
            request.send(Failed(error))


def _host_row(tokens, logprobs, top_ids, top_values, row: int) -> tuple[int, TokenLogprob]:
    tokens, logprobs, top_ids, top_values = (np.asarray(x) for x in (tokens, logprobs, top_ids, top_values))
    top = tuple((int(t), float(v)) for t, v in zip(top_ids[row], top_values[row]))
    return int(tokens[row]), TokenLogprob(int(tokens[row]), float(logprobs[row]), top)
