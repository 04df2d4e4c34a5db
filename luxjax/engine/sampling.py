"""Token selection on device over a batch of logits with per-row parameters, and stop-string holdback on the host.

Order of the logits processors follows transformers' generate: penalties, temperature, top-k, top-p, min-p, each
filter acting on the distribution the previous one left. Temperature 0 is an exact argmax of the (penalised)
logits, so greedy output never depends on which other rows share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from luxjax.engine.requests import MAX_TOP_LOGPROBS, SamplingParams

NEG_INF = -jnp.inf
TOP_K_MAX = 2**31 - 1  # int32; any k at or past the vocabulary keeps every token, like 0


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as host arrays, one row per batch entry."""

    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B], 0 = off
    min_p: np.ndarray  # float32 [B]
    presence: np.ndarray  # float32 [B]
    frequency: np.ndarray  # float32 [B]
    seed: np.ndarray  # uint32 [B]
    step: np.ndarray  # int32 [B]: tokens generated so far (folded into the row's key)

    @classmethod
    def build(cls, rows: Sequence[tuple[SamplingParams, int, int] | None]) -> "RowParams":
        """rows: (params, seed, step) per batch row, or None for an idle row (greedy, ignored)."""
        default = (SamplingParams(), 0, 0)
        filled = [r or default for r in rows]
        return cls(
            temperature=np.array([p.temperature for p, _, _ in filled], np.float32),
            top_p=np.array([p.top_p for p, _, _ in filled], np.float32),
            top_k=np.array([min(p.top_k, TOP_K_MAX) for p, _, _ in filled], np.int32),
            min_p=np.array([p.min_p for p, _, _ in filled], np.float32),
            presence=np.array([p.presence_penalty for p, _, _ in filled], np.float32),
            frequency=np.array([p.frequency_penalty for p, _, _ in filled], np.float32),
            seed=np.array([s % 2**32 for _, s, _ in filled], np.uint32),
            step=np.array([n for _, _, n in filled], np.int32),
        )


def apply_penalties(logits, counts, presence, frequency):
    """OpenAI's definition: logit[j] -= count[j] * frequency + (count[j] > 0) * presence (counts of generated
    tokens). Zero penalties leave the logits bit-identical."""
    counts = counts.astype(logits.dtype)
    return logits - counts * frequency[:, None] - (counts > 0).astype(logits.dtype) * presence[:, None]


def filter_logits(logits, top_k, top_p, min_p):
    """Set to -inf every logit that top-k, then top-p, then min-p removes. logits [B, V]; all three per row.

    top-k keeps the k largest (0 = all); top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches top_p (a token is kept while the mass before it is < top_p); min-p keeps tokens whose probability is
    >= min_p times the largest. The most likely token always survives. Ties at the cut-off are kept together.
    """
    vocab = logits.shape[-1]
    ordered = -jnp.sort(-logits, axis=-1)  # descending
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, ordered, NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank == 0)
    probs = jax.nn.softmax(jnp.where(keep, ordered, NEG_INF), axis=-1)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    last_kept = jnp.sum(keep, axis=-1) - 1
    cutoff = jnp.take_along_axis(ordered, last_kept[:, None], axis=-1)
    return jnp.where(logits >= cutoff, logits, NEG_INF)


@partial(jax.jit, static_argnames=("top_logprobs",))
def sample_tokens(logits, counts, params: RowParams, *, top_logprobs: int = 0):
    """logits float [B, V], counts int32 [B, V] -> (tokens int32 [B], logprob [B], top ids [B, K], top logprobs
    [B, K]) with K = top_logprobs (0: empty). Logprobs are of the model's distribution before any processing."""
    logits = logits.astype(jnp.float32)
    penalised = apply_penalties(logits, counts, params.presence, params.frequency)
    greedy = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
    sampled = params.temperature > 0
    tokens = jax.lax.cond(jnp.any(sampled), lambda: jnp.where(sampled, _draw(penalised, params), greedy),
                          lambda: greedy)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    if top_logprobs:
        top_values, top_ids = jax.lax.top_k(logprobs, top_logprobs)
    else:
        top_values = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen, top_ids, top_values


def _draw(penalised, params: RowParams):
    """A token drawn per row from its filtered, tempered distribution. The filters sort the vocabulary, so they run
    only where some sampled row narrows its distribution; for the others they keep every finite logit anyway."""
    vocab = penalised.shape[-1]
    narrows = (params.temperature > 0) & (((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0)
                                          | (params.min_p > 0))
    filtered = jax.lax.cond(jnp.any(narrows), lambda: filter_logits(penalised, params.top_k, params.top_p,
                                                                   params.min_p), lambda: penalised)
    scaled = filtered / jnp.maximum(params.temperature, 1e-6)[:, None]
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(params.seed, params.step)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def top_logprobs_width(params: Sequence[SamplingParams | None]) -> int:
    """The static K for sample_tokens: MAX_TOP_LOGPROBS when any row wants logprobs (one compile), else 0."""
    return MAX_TOP_LOGPROBS if any(p is not None and p.logprobs for p in params) else 0


jax.tree_util.register_dataclass(
    RowParams, data_fields=["temperature", "top_p", "top_k", "min_p", "presence", "frequency", "seed", "step"],
    meta_fields=[])


class StopStringFilter:
    """Streams text while never emitting a stop string nor any text after it.

    Text that could be the beginning of a stop string is held back until the next piece proves it is not. The
    concatenation of everything emitted (plus `flush()` when no stop string was hit) is the generated text cut
    just before the stop string that completes first, however the text is split into pieces.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that is safe to emit now; sets `stopped` when a stop string appeared."""
        if self.stopped:
            return ""
        pending = self.held + text
        hits = [(i + len(s), i) for s, i in ((s, pending.find(s)) for s in self.stops) if i >= 0]
        if hits:  # the stop string that completes first (as if text arrived one character at a time)
            self.stopped = True
            self.held = ""
            return pending[: min(hits)[1]]
        keep = self._longest_stop_prefix_suffix(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
