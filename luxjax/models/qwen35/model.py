"""The Qwen3.5 vision-language model as one NNX module (text decoder + optional vision tower), and the pure
jitted functions the engine calls: encode images, prefill a chunk into one cache slot, decode one step."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.models.qwen35.config import ModelConfig
from luxjax.models.qwen35.decoder import TextDecoder
from luxjax.models.qwen35.vision_tower import VisionTower
from luxjax.ops import backend
from luxjax.vision.patch_codes import expand_on_device


class Qwen35Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, weights, dtype):
        self.text = TextDecoder(cfg.text, weights)
        self.vision = VisionTower(cfg.vision, weights, dtype) if cfg.vision is not None else None


class HashedGraphDef:
    """A GraphDef as the jitted functions' static argument, its hash taken once: jit hashes its static arguments on
    every call, and a GraphDef's own hash walks the whole module tree, paid by every decode step (tiny model on a
    2-core CPU: the hash 0.4-0.9 ms, a vision call 6.3 -> 3.4 ms with the wrapper). Equal to another wrapper of an
    equal GraphDef, so the cache still keys on the model's structure."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, HashedGraphDef) and self.graphdef == other.graphdef)


def _merge(graphdef, state) -> Qwen35Model:
    """The model from a GraphDef (or a HashedGraphDef) and its state."""
    return nnx.merge(graphdef.graphdef if isinstance(graphdef, HashedGraphDef) else graphdef, state)


def _slot_rows(tree, slot):
    """Select one batch row (axis 1: axis 0 stacks the layer repeats) of every cache array."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=1), tree)


def _put_slot_rows(tree, rows, slot):
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=1), tree, rows)


@partial(jax.jit, static_argnames=("graphdef", "repeat"), compiler_options=backend.LAYER_SCAN_GEMM_OPTIONS)
def encode_images(graphdef, state, patches, grid, table=None, *, repeat: int = 1):
    """The vision tower on the patches of a batch of images: float32 rows [N, patch_dim], or (given their table)
    the uint8 codes of PatchCodes [N, C, n], expanded here; grid int32 [M, 3], each image's (t, h, w) in patches
    (zero rows pad M). N and M are bucketed by the caller."""
    if table is not None:
        patches = expand_on_device(patches, table, repeat)
    return _merge(graphdef, state).vision.encode(patches, grid)


@partial(jax.jit, static_argnames=("graphdef", "all_logits", "dtype", "block_aligned"), donate_argnames=("caches",),
         compiler_options=backend.LAYER_SCAN_GEMM_OPTIONS)
def prefill(graphdef, state, caches, slot, ids, image_rows, image_index, positions, start, valid_len, *,
            dtype, all_logits: bool = False, block_aligned: bool = False):
    """One prompt chunk of one sequence into cache slot `slot`.

    ids, image_index int32 [T] (image_index: row of `image_rows` replacing the token's embedding, or -1);
    positions int32 [3, T]; start: tokens already in the slot (0 resets its DeltaNet state);
    valid_len: real tokens in this (padded) chunk. block_aligned: start is a multiple of deltanet.BLOCK (the
    caller knows start; a chunk from token 0 is), which spares the DeltaNet layers a block of work.
    Returns (logits: last valid token [V], or all [T, V]; caches)."""
    model = _merge(graphdef, state)
    T = ids.shape[0]
    x = model.text.embed(ids, dtype)
    if image_rows is not None:
        rows = image_rows[jnp.clip(image_index, 0)].astype(dtype)
        x = jnp.where((image_index >= 0)[:, None], rows, x)
    rows = _slot_rows(caches, slot)
    fresh = start == 0
    rows = jax.tree.map(lambda c: jnp.where(fresh, jnp.zeros_like(c), c), rows)
    valid = (jnp.arange(T) < valid_len)[None]
    h, rows = model.text(x[None], positions[:, None], start[None], valid, rows, chunked=True,
                         block_aligned=block_aligned,
                         weights_in_place="packed" if backend.cublas_reads_scanned_slices() else "all")
    caches = _put_slot_rows(caches, rows, slot)
    if all_logits:
        return model.text.logits(h[0]), caches
    last = jax.lax.dynamic_index_in_dim(h[0], valid_len - 1, axis=0, keepdims=False)
    return model.text.logits(last, as_layer_slice=True), caches


@partial(jax.jit, static_argnames=("graphdef", "dtype"), donate_argnames=("caches",))
def decode(graphdef, state, caches, ids, positions, start, active, *, dtype):
    """One token for each of the caches' first B slots (B <= the slots they hold; the others are neither read nor
    written): ids [B], positions int32 [3, B], start [B] (cached tokens), active [B] bool (idle slots and slots
    between prefill chunks keep their caches untouched). Returns logits [B, V]."""
    model = _merge(graphdef, state)
    x = model.text.embed(ids[:, None], dtype)
    h, caches = model.text(x, positions[:, :, None], start, active[:, None], caches, chunked=False,
                           weights_in_place="all", caches_in_place=True)
    return model.text.logits(h[:, 0]), caches
