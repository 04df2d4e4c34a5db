"""Single-sequence prefill + decode through the backend contract (the notebook path; the server's scheduler
batches many sequences through the same backend calls)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import jax.numpy as jnp

from luxjax.contract import Backend, Prompt
from luxjax.engine.requests import SamplingParams
from luxjax.engine.sampling import RowParams, sample_tokens
from luxjax.errors import RequestError
from luxjax.vision.spans import plan_prefill_chunks

PREFILL_CHUNK = 512  # prompt tokens per prefill step while other streams decode (each waits for the step)
# ... and while none does: most prompts in one step. A packed model decodes its weights to bf16 once per step
# (27B IQ4_XS on an H200: ~19 ms a step), and a larger step keeps the GEMMs busier.
SOLO_PREFILL_CHUNK = 2048
CACHE_ROUND = 256


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


def cache_length(prompt_tokens: int, max_tokens: int, max_context: int) -> int:
    needed = prompt_tokens + max_tokens
    if needed > max_context:
        raise RequestError(
            f"this request needs {needed} tokens ({prompt_tokens} prompt incl. images + {max_tokens} to generate), "
            f"the context is {max_context}", code="context_length_exceeded")
    return min(-(-needed // CACHE_ROUND) * CACHE_ROUND, max(max_context, CACHE_ROUND))


def prefill_prompt(backend: Backend, caches, slot: int, prompt: Prompt, *, chunk: int = SOLO_PREFILL_CHUNK,
                   all_logits: bool = False):
    """Encode the prompt's images, then prefill it chunk by chunk. Returns (logits, caches)."""
    rows = backend.encode_images(prompt.image_inputs) if prompt.image_spans else None
    pieces = []
    for begin, end in plan_prefill_chunks(prompt.num_tokens, prompt.image_spans, chunk, backend.keep_images_whole):
        logits, caches = backend.prefill(caches, slot, prompt, rows, begin, end, all_logits=all_logits)
        pieces.append(np.asarray(logits)[: end - begin] if all_logits else logits)
    return (np.concatenate(pieces) if all_logits else pieces[-1]), caches


def prompt_logits(backend: Backend, input_ids: list[int], image_inputs, *, chunk: int = PREFILL_CHUNK) -> np.ndarray:
    prompt = backend.prompt_from_ids(input_ids, image_inputs)
    caches = backend.init_cache(1, cache_length(len(input_ids), 0, backend.max_context))
    logits, _ = prefill_prompt(backend, caches, 0, prompt, chunk=chunk, all_logits=True)
    return logits.astype(np.float32)


def generate(backend: Backend, prompt: Prompt, *, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
             chunk: int = SOLO_PREFILL_CHUNK):
    caches = backend.init_cache(1, cache_length(prompt.num_tokens, max_tokens, backend.max_context))
    logits, caches = prefill_prompt(backend, caches, 0, prompt, chunk=chunk)
    params = SamplingParams(temperature=max(temperature, 0.0))
    seed = secrets.randbits(32) if seed is None else seed
    no_counts = jnp.zeros((1, backend.vocab_size), jnp.int32)
    eos = set(backend.tokenizer.eos_token_ids)
    tokens: list[int] = []
    finish = "length"
    cached = prompt.num_tokens
    for _ in range(max_tokens):
        picked = sample_tokens(jnp.reshape(logits, (1, -1)), no_counts, RowParams.build([(params, seed, len(tokens))]))
        token = int(picked[0][0])  # the server's sampler: same seed and temperature, same tokens
        if token in eos:
            finish = "stop"
            break
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
        logits, caches = backend.decode(caches, np.array([token]), np.array([cached]), np.array([prompt.rope_delta]))
        cached += 1
    return Generation(text=backend.tokenizer.decode(tokens), token_ids=tokens, finish_reason=finish,
                      prompt_tokens=prompt.num_tokens)
