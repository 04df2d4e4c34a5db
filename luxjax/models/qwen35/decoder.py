"""The Qwen3.5 text decoder: identical layers stacked per position of the repeating layer pattern
(e.g. DeltaNet x3 + attention) and run with one `lax.scan` over the repeats, so compile time does not grow
with depth. Caches are explicit arrays stacked the same way."""
from __future__ import annotations

import itertools
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.checkpoint.quants import QuantizedTensor
from luxjax.layers.basic import Embedding, KernelParam, Linear, MatrixParam, ZeroCenteredRMSNorm
from luxjax.layers.rope import interleaved_mrope_axes, inverse_frequencies, mrope_cos_sin
from luxjax.models.qwen35.attention import GatedAttention, empty_kv_cache
from luxjax.models.qwen35.config import FULL_ATTENTION, TextConfig
from luxjax.models.qwen35.deltanet import GatedDeltaNet, empty_deltanet_cache
from luxjax.ops.linear import LayerSlice, gated_linear, linear, linear_many

PREFIX = "model.language_model."


class MLP(nnx.Module):
    def __init__(self, w: Callable[[str], object]):
        self.gate_proj = Linear(w("gate_proj.weight"))
        self.up_proj = Linear(w("up_proj.weight"))
        self.down_proj = Linear(w("down_proj.weight"))

    def __call__(self, x):
        gate, up = linear_many(x, (self.gate_proj.weight.get_value(), self.up_proj.weight.get_value()))
        return gated_linear(gate, up, self.down_proj.weight.get_value())


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

    def __call__(self, x, cache, *, cos, sin, start, valid, chunked, dtype, block_aligned=False):
        """x: the float32 residual stream; attention and MLP compute in `dtype`, DeltaNet on float32 activations."""
        # the norms go to the projections unformed (luxjax.ops.deferred): the int8 GEMV's quantization forms them
        if self.is_attention:
            h, cache = self.mixer(self.input_layernorm.deferred(x, dtype), cos, sin, cache, start, valid)
        else:
            h, cache = self.mixer(self.input_layernorm.deferred(x, x.dtype), cache, start, valid, chunked=chunked,
                                  dtype=dtype, block_aligned=block_aligned)
        x = x + h.astype(jnp.float32)
        return x + self.mlp(self.post_attention_layernorm.deferred(x, dtype)).astype(jnp.float32), cache


class _Scoped:
    """A weight getter for the names under `prefix`."""

    def __init__(self, get: Callable[[str], object], prefix: str):
        self._get, self._prefix = get, prefix

    def __call__(self, name):
        return self._get(self._prefix + name)


def _is_packed_matrix(path, value) -> bool:
    return isinstance(value, MatrixParam) and isinstance(value.get_value(), QuantizedTensor)


# What Decoder's weights_in_place names: "all" for decode (the GEMV kernels read every layer's matrices in place, the
# DeltaNet's kernel its KernelParams); "packed" for a prefill compiled with backend.LAYER_SCAN_GEMM_OPTIONS (cuBLAS
# reads the scan's dense slices in place, the dequantize kernel the stacked packed ones); "none" for training
# (gradients through plain slices).
InPlace = Literal["none", "packed", "all"]
_IN_PLACE_FILTERS = {"none": None, "packed": _is_packed_matrix, "all": nnx.Any(MatrixParam, KernelParam)}


def _layer_slices(matrices, index):
    """Every stacked matrix of a layer state as a LayerSlice at `index` (packed tensors as a whole)."""
    return jax.tree.map(lambda w: LayerSlice(w, index), matrices, is_leaf=lambda a: isinstance(a, QuantizedTensor))


def _cache_at(stacked, index, in_place: bool, sequences: int):
    """One layer's cache from caches stacked over a scan's steps: its slices, or (in_place) LayerSlices of the
    stacks, which the layer reads or writes where they lie (decode: a step changes one row of most caches), for the
    first `sequences` of the slots the stacks hold where fewer are given (decode of the first B slots)."""
    if in_place:
        def at(c):
            return LayerSlice(c, index, sequences if sequences < c.shape[1] else None)

        return jax.tree.map(at, stacked)
    return jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, index, 0, keepdims=False), stacked)


def _put_cache_at(stacked, cache, index):
    """The stacked caches with layer `index` replaced: a field the layer returns as an array is written back as the
    layer's slice, one it returns as a LayerSlice is already its new stack. The caches ride in the scan's carry and
    are written in place in the (donated) buffers. As the scan's xs and ys XLA built new stacked buffers on every
    call (broadcasts, then copies out of the loop): H200 profile of an IQ4_XS 27B decode step, 13.8 -> 13.4-13.6
    ms of kernels. An array of fewer sequences than the stack holds (a decode step of the first B slots) goes to
    their rows."""
    def put(c, n):
        if isinstance(n, LayerSlice):
            return n.stacked
        return jax.lax.dynamic_update_slice(c, n[None].astype(c.dtype), (index,) + (0,) * n.ndim)

    return jax.tree.map(put, stacked, cache)


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


_SCAN_OVERHEAD = 0.5  # the compile cost of one more scan, in layer-pattern bodies (for choosing segments)
MAX_GROUP = 4  # most pattern repeats one scan step may hold


def scan_segments(weights, cfg: TextConfig, pattern, repeats: int) -> tuple[tuple[int, int, int], ...]:
    """(first, last, group) runs of pattern repeats [first, last), each one lax.scan whose step holds `group`
    consecutive repeats. A GGUF quantization mix stores some layers differently (Q4_K_M: Q6_K `ffn_down` on the
    first and last eighth of the layers and on every third in between), and layers stored differently cannot
    share a stacked array; but the mix repeats, so a scan step of `group` repeats restores stacking. Chosen to
    compile the fewest layer bodies (plus a little per scan): a uniform checkpoint gives one run of group 1;
    Q4_K_M's 64 layers three runs with 5 bodies in all, not 14 runs of one."""
    period = len(pattern)
    signatures = [tuple(weights.storage_signature(f"{PREFIX}layers.{r * period + j}.") for j in range(period))
                  for r in range(repeats)]

    def runs_from(first):
        """(last, group) of every run that may start at `first`: storage periodic with period `group`."""
        for group in range(1, min(MAX_GROUP, repeats - first) + 1):
            last = first + group
            while last + group <= repeats and signatures[last:last + group] == signatures[last - group:last]:
                last += group
            for end in range(first + group, last + 1, group):
                yield end, group

    best = [(0.0, ())] * (repeats + 1)  # best[r]: (cost, segments) covering repeats [r, repeats)
    for first in range(repeats - 1, -1, -1):
        best[first] = min(((group + _SCAN_OVERHEAD + best[end][0], ((first, end, group),) + best[end][1])
                           for end, group in runs_from(first)), key=lambda c: (c[0], len(c[1])))
    return best[0][1]


class TextDecoder(nnx.Module):
    def __init__(self, cfg: TextConfig, weights: Callable[[str], object]):
        self.cfg = cfg
        self.pattern, self.repeats = cfg.layer_pattern()
        period = len(self.pattern)
        self.embed_tokens = Embedding(weights(PREFIX + "embed_tokens.weight"))
        self.segments = scan_segments(weights, cfg, self.pattern, self.repeats)
        # [segment][position in its scan step: group x pattern] -> layer module with parameters stacked over steps
        self.stacks = nnx.List()
        for first, last, group in self.segments:
            segment = nnx.List()
            for g, (j, layer_type) in itertools.product(range(group), enumerate(self.pattern)):
                layers = [
                    DecoderLayer(cfg, layer_type, _Scoped(weights, f"{PREFIX}layers.{(r + g) * period + j}."))
                    for r in range(first, last, group)
                ]
                graphdef, *_ = nnx.split(layers[0])
                segment.append(nnx.merge(graphdef, _stack([nnx.split(layer)[1] for layer in layers])))
                del layers
            self.stacks.append(segment)
        self.norm = ZeroCenteredRMSNorm(weights(PREFIX + "norm.weight"), cfg.rms_norm_eps)
        head = weights.get("lm_head.weight")
        self.lm_head = Linear(head) if head is not None else None

    def init_cache(self, batch: int, max_len: int, dtype) -> list:
        """Per scan segment, one cache per position in its scan step, stacked over the segment's steps."""
        caches = []
        for first, last, group in self.segments:
            segment, steps = [], (last - first) // group
            for layer_type in self.pattern * group:
                one = (
                    empty_kv_cache(self.cfg, batch, max_len, dtype)
                    if layer_type == FULL_ATTENTION
                    else empty_deltanet_cache(self.cfg, batch)
                )
                segment.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (steps,) + x.shape), one))
            caches.append(segment)
        return caches

    def embed(self, ids, dtype):
        return self.embed_tokens(ids, dtype)

    def __call__(self, x, positions, start, valid, caches, *, chunked: bool, weights_in_place: InPlace = "none",
                 caches_in_place: bool = False, block_aligned: bool = False):
        """x [B, T, hidden] input embeddings in the compute dtype; positions int32 [3, B, T]; start [B] cached tokens
        per sequence; valid [B, T] bool prefix mask. Returns (final-norm hidden [B, T, hidden], new caches).
        The residual stream stays float32 between layers (bf16 mode rounds only inside the blocks).
        weights_in_place: see _scan_segment (inference; training differentiates through the plain slices).
        caches_in_place: the layers get their caches as LayerSlices of the stacks (decode; see _cache_at).
        block_aligned: every start is a multiple of the DeltaNet block (see GatedDeltaNet.__call__)."""
        inv_freq = inverse_frequencies(self.cfg.rotary_dim, self.cfg.rope_theta)
        axes = interleaved_mrope_axes(self.cfg.rotary_dim, self.cfg.mrope_section)
        cos, sin = mrope_cos_sin(positions, inv_freq, axes)
        caches = list(caches)
        dtype = x.dtype
        x = x.astype(jnp.float32)
        for s, segment in enumerate(self.stacks):
            x, caches[s] = self._scan_segment(segment, x, caches[s], weights_in_place=weights_in_place,
                                              caches_in_place=caches_in_place, cos=cos, sin=sin, start=start,
                                              valid=valid, chunked=chunked, dtype=dtype, block_aligned=block_aligned)
        return self.norm(x).astype(dtype), caches

    @staticmethod
    def _scan_segment(segment, x, caches, *, weights_in_place: InPlace = "none", caches_in_place: bool = False,
                      **kw):
        """One lax.scan over the segment's steps (each its group of pattern repeats, layer by layer).
        weights_in_place: which matrices stay stacked, each layer getting LayerSlices of them (kernels read them in
        place) instead of the scan's slices: "all", "packed" (quantized ones only) or "none"."""
        if weights_in_place not in _IN_PLACE_FILTERS:
            raise ValueError(f"weights_in_place={weights_in_place!r}; expected one of {tuple(_IN_PLACE_FILTERS)}")
        in_place = _IN_PLACE_FILTERS[weights_in_place]
        filters = (in_place, ...) if in_place else (...,)
        split = [nnx.split(stack, *filters) for stack in segment]  # (graphdef, [stacked matrices,] scanned rest)
        graphdefs = [g for g, *_ in split]
        matrices = [parts[1] for parts in split] if in_place else None
        scanned = [parts[-1] for parts in split]

        def body(carry, xs):
            h, stacked_caches = carry
            index, layer_states = xs
            new_caches = []
            for j, (graphdef, state, stacked) in enumerate(zip(graphdefs, layer_states, stacked_caches)):
                states = (state,) if matrices is None else (_layer_slices(matrices[j], index), state)
                cache = _cache_at(stacked, index, caches_in_place, sequences=h.shape[0])
                h, cache = nnx.merge(graphdef, *states)(h, cache, **kw)
                new_caches.append(_put_cache_at(stacked, cache, index))
            return (h, new_caches), None

        repeats = jax.tree.leaves(caches)[0].shape[0]
        (x, caches), _ = jax.lax.scan(body, (x, caches), (jnp.arange(repeats), scanned))
        return x, caches

    def logits(self, h, *, as_layer_slice: bool = False):
        """float32 logits straight from the float32 accumulator (bf16-rounded logits would tie near the top);
        a tied head reuses the embedding table.

        as_layer_slice: a dense head goes to linear() as a one-layer stack, so a few rows take the in-place GEMV
        kernel. For prefill, compiled with backend.LAYER_SCAN_GEMM_OPTIONS: there XLA's one-row product widened
        the bf16 head to float32 before a float32 cuBLAS GEMV (H200 profile: 1.8 ms + 1.1 ms per prefill, against
        0.56 ms with the default options)."""
        head = (self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight).get_value()
        if as_layer_slice and isinstance(head, jax.Array):
            head = LayerSlice(head[None], jnp.zeros((), jnp.int32))
        return linear(h, head, out_dtype=jnp.float32)
