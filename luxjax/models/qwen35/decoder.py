"""The Qwen3.5 text decoder: identical layers stacked per position of the repeating layer pattern
(e.g. DeltaNet x3 + attention) and run with one `lax.scan` over the repeats, so compile time does not grow
with depth. Caches are explicit arrays stacked the same way."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.layers.basic import Embedding, Linear, ZeroCenteredRMSNorm
from luxjax.layers.rope import interleaved_mrope_axes, inverse_frequencies, mrope_cos_sin
from luxjax.models.qwen35.attention import GatedAttention, empty_kv_cache
from luxjax.models.qwen35.config import FULL_ATTENTION, TextConfig
from luxjax.models.qwen35.deltanet import GatedDeltaNet, empty_deltanet_cache
from luxjax.ops.linear import linear

PREFIX = "model.language_model."


class MLP(nnx.Module):
    def __init__(self, w: dict):
        self.gate_proj = Linear(w["gate_proj.weight"])
        self.up_proj = Linear(w["up_proj.weight"])
        self.down_proj = Linear(w["down_proj.weight"])

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """h += mixer(norm1(h)); h += mlp(norm2(h)). The mixer is gated attention or Gated DeltaNet."""

    def __init__(self, cfg: TextConfig, layer_type: str, w: Callable[[str], object]):
        self.is_attention = layer_type == FULL_ATTENTION
        mixer_prefix = "self_attn." if self.is_attention else "linear_attn."
        mixer_w = _Scoped(w, mixer_prefix)
        self.mixer = GatedAttention(cfg, mixer_w) if self.is_attention else GatedDeltaNet(cfg, mixer_w)
        self.input_layernorm = ZeroCenteredRMSNorm(w("input_layernorm.weight"), cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(w("post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.mlp = MLP(_Scoped(w, "mlp."))

    def __call__(self, x, cache, *, cos, sin, start, valid, chunked):
        h = self.input_layernorm(x)
        if self.is_attention:
            h, cache = self.mixer(h, cos, sin, cache, start)
        else:
            h, cache = self.mixer(h, cache, valid, chunked=chunked)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class _Scoped(dict):
    """Read-only view of a weight getter under a name prefix (used as a mapping by the layer constructors)."""

    def __init__(self, get: Callable[[str], object], prefix: str):
        super().__init__()
        self._get, self._prefix = get, prefix

    def __getitem__(self, name):
        return self._get(self._prefix + name)

    def __call__(self, name):
        return self._get(self._prefix + name)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


class TextDecoder(nnx.Module):
    def __init__(self, cfg: TextConfig, weights: Callable[[str], object]):
        self.cfg = cfg
        self.pattern, self.repeats = cfg.layer_pattern()
        period = len(self.pattern)
        self.embed_tokens = Embedding(weights(PREFIX + "embed_tokens.weight"))
        self.stacks = nnx.List()
        for j, layer_type in enumerate(self.pattern):
            layers = [
                DecoderLayer(cfg, layer_type, _Scoped(weights, f"{PREFIX}layers.{r * period + j}."))
                for r in range(self.repeats)
            ]
            graphdef, *_ = nnx.split(layers[0])
            states = [nnx.split(layer)[1] for layer in layers]
            self.stacks.append(nnx.merge(graphdef, _stack(states)))
            del layers
        self.norm = ZeroCenteredRMSNorm(weights(PREFIX + "norm.weight"), cfg.rms_norm_eps)
        head = weights.get("lm_head.weight") if hasattr(weights, "get") else None
        self.lm_head = Linear(head) if head is not None else None

    def init_cache(self, batch: int, max_len: int, dtype) -> list:
        """One cache per pattern position, each stacked over the repeats."""
        caches = []
        for layer_type in self.pattern:
            one = (
                empty_kv_cache(self.cfg, batch, max_len, dtype)
                if layer_type == FULL_ATTENTION
                else empty_deltanet_cache(self.cfg, batch, dtype)
            )
            caches.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (self.repeats,) + x.shape), one))
        return caches

    def embed(self, ids, dtype):
        return self.embed_tokens(ids, dtype)

    def __call__(self, x, positions, start, valid, caches, *, chunked: bool):
        """x [B, T, hidden] input embeddings; positions int32 [3, B, T]; start [B] cached tokens per sequence;
        valid [B, T] bool prefix mask. Returns (final-norm hidden [B, T, hidden], new caches)."""
        inv_freq = inverse_frequencies(self.cfg.rotary_dim, self.cfg.rope_theta)
        axes = interleaved_mrope_axes(self.cfg.rotary_dim, self.cfg.mrope_section)
        cos, sin = mrope_cos_sin(positions, inv_freq, axes)
        split = [nnx.split(stack) for stack in self.stacks]
        graphdefs = [g for g, _ in split]
        states = [s for _, s in split]

        def body(h, xs):
            layer_states, layer_caches = xs
            new_caches = []
            for graphdef, state, cache in zip(graphdefs, layer_states, layer_caches):
                layer = nnx.merge(graphdef, state)
                h, cache = layer(h, cache, cos=cos, sin=sin, start=start, valid=valid, chunked=chunked)
                new_caches.append(cache)
            return h, new_caches

        x, caches = jax.lax.scan(body, x, (states, caches))
        return self.norm(x), caches

    def logits(self, h):
        """float32 logits; a tied head reuses the embedding table."""
        if self.lm_head is None:
            return linear(h, self.embed_tokens.weight.get_value()).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)
