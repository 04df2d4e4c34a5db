"""Qwen3.5 / Qwen3.8 implementation of the backend contract (luxjax/contract.py)."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from luxjax.contract import Prompt
from luxjax.errors import RequestError
from luxjax.models.qwen35 import deltanet, model as qwen
from luxjax.models.qwen35.config import ModelConfig
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.models.qwen35.prompt import IMAGE_MARKERS, build_prompt, prompt_from_ids
from luxjax.models.qwen35.vision_tower import frame_grid
from luxjax.ops.attention import MAX_PACKED_SEGMENTS
from luxjax.vision.limits import ImageLimits
from luxjax.vision.messages import parse_messages
from luxjax.vision.patch_codes import PatchCodes
from luxjax.vision.types import ImageInputs

# Padded sizes (bucket): powers of two up to these, quarter steps of an octave above them: prompt chunks (512:
# chunks of 513-2,048 tokens pad to 640, 768, ..., 2,048) and image patch counts (2,048: 2,560, 3,072, ...).
TOKEN_QUARTERS_ABOVE = 512
PATCH_QUARTERS_ABOVE = 2048


def bucket(n: int, minimum: int = 16, quarters_above: int | None = None) -> int:
    """The padded size for n: the next power of two >= n (and >= minimum), a few static shapes instead of one
    compile per length; from `quarters_above` on, the next quarter step (5/4, 6/4, 7/4 or 2 times a power of two
    >= quarters_above), so a size just past a power of two pads by a quarter at most instead of doubling (a
    1,100-token prompt ran as 2,048 tokens)."""
    size = minimum
    while size < n:
        size *= 2
    half = size // 2
    if quarters_above is not None and half >= quarters_above:
        return next(half + q * half // 4 for q in range(1, 5) if half + q * half // 4 >= n)
    return size


class Qwen35Backend:
    image_markers = IMAGE_MARKERS
    keep_images_whole = False  # positions are precomputed for the whole prompt, so an image may straddle chunks

    def __init__(self, cfg: ModelConfig, model: qwen.Qwen35Model, tokenizer, processor: Qwen35ImageProcessor | None,
                 dtype, *, max_context: int | None = None, limits: ImageLimits = ImageLimits()):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.graphdef, state = nnx.split(model)
        # committed where they lie (no copy), as a restored parameter cache gives them: a jitted function's program
        # then does not depend on how the weights were loaded, and XLA's persistent compilation cache finds the
        # programs of a built model's run when the next start restores its parameters
        self.state = jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)
        self._sharding = jax.tree.leaves(self.state)[0].sharding  # where device inputs are committed
        self.jit_graphdef = qwen.HashedGraphDef(self.graphdef)  # what the jitted functions take (hashed once)
        self.tokenizer = tokenizer
        self.processor = processor
        self.limits = limits
        self.supports_images = cfg.vision is not None and processor is not None
        self.max_context = max_context or cfg.text.max_position_embeddings
        self.vocab_size = cfg.text.vocab_size
        self.pad_id = cfg.image_token_id
        self.merge = cfg.vision.spatial_merge_size if cfg.vision else 2

    # --- prompts -------------------------------------------------------------------------------------------
    def refuse_images(self):
        raise RequestError("this model does not accept images; start the server with --mmproj",
                           code="images_not_supported", param="messages")

    def image_inputs(self, images) -> ImageInputs:
        if not self.supports_images:
            self.refuse_images()
        return self.processor(images)

    def num_image_tokens(self, width: int, height: int) -> int:
        return self.processor.num_tokens(width, height)

    def render_prompt(self, messages, *, add_generation_prompt: bool = True, template_kwargs=None,
                      max_tokens: int | None = None) -> Prompt:
        parsed = parse_messages(messages, self.limits, self.image_markers)
        images = [p.image for m in parsed for p in m.images]
        image_inputs = self.image_inputs(images) if images else None
        if image_inputs is not None:
            image_inputs = ImageInputs(image_inputs.pixel_values, image_inputs.grid_thw, image_inputs.num_tokens,
                                       [p.hash for m in parsed for p in m.images])
        template = self.tokenizer.chat_template
        if not template:
            raise RequestError("this model has no chat template; use /v1/completions")
        return build_prompt(self.tokenizer, template, parsed, messages, image_inputs, pad_id=self.pad_id,
                            merge=self.merge, add_generation_prompt=add_generation_prompt,
                            template_kwargs=template_kwargs, max_tokens=max_tokens)

    def text_prompt(self, text: str, *, max_tokens: int | None = None) -> Prompt:
        for marker in self.image_markers:
            if marker in text:
                raise RequestError(f"prompt contains the reserved image marker {marker!r}", param="prompt")
        ids = self.tokenizer.encode(text, max_tokens=max_tokens)
        return prompt_from_ids(ids, None, pad_id=self.pad_id, merge=self.merge, text=text)

    def prompt_from_ids(self, token_ids, image_inputs) -> Prompt:
        """A prompt whose pads are already expanded (e.g. transformers' processor output)."""
        return prompt_from_ids(list(token_ids), image_inputs, pad_id=self.pad_id, merge=self.merge)

    # --- device work -----------------------------------------------------------------------------------------
    def encode_images(self, image_inputs: ImageInputs) -> jax.Array:
        """Merger output for all images [sum(num_tokens), hidden], images padded to a bucketed patch count."""
        rows = qwen.encode_images(self.jit_graphdef, self.state, **self.vision_arrays(image_inputs))
        return rows[: len(image_inputs.pixel_values) // self.merge**2]

    def vision_arrays(self, image_inputs: ImageInputs) -> dict:
        """qwen.encode_images' inputs beside graphdef and state, on the device: the patches padded to a bucketed
        count (PatchCodes travel as their uint8 codes and table and are expanded there) and the grid, a row per frame
        padded to a bucketed count, sent in one transfer; the tower lays the patches out from the grid itself."""
        pixels = image_inputs.pixel_values
        unit = self.merge**2  # the merger takes the patches merge**2 at a time: pad to whole units (merge 3: 9)
        padded = -(-bucket(len(pixels), 64, quarters_above=PATCH_QUARTERS_ABOVE) // unit) * unit
        frames = int(np.asarray(image_inputs.grid_thw)[:, 0].sum())
        # the rows padded to cuDNN's packed-segment count at least: the tower compiles per patch bucket only
        grid = frame_grid(image_inputs.grid_thw, bucket(frames, MAX_PACKED_SEGMENTS))
        if isinstance(pixels, PatchCodes):
            codes, table, grid = jax.device_put((pixels.padded_codes(padded), pixels.table, grid),
                                                self._weights_sharding())
            return {"patches": codes, "grid": grid, "table": table, "repeat": pixels.repeat}
        rows = np.zeros((padded, pixels.shape[1]), np.float32)
        rows[: len(pixels)] = pixels
        rows, grid = jax.device_put((rows, grid), self._weights_sharding())
        return {"patches": rows, "grid": grid}

    def init_cache(self, slots: int, max_len: int):
        """Zeroed caches, committed to the weights' device: uncommitted inputs would make the first jitted call
        compile a second variant once it gets back committed outputs."""
        return jax.device_put(self._decoder().init_cache(slots, max_len, self.dtype), self._weights_sharding())

    def _weights_sharding(self):
        """Where the weights live: device inputs are committed there (looked up once: walking the state's leaves
        took ~0.1 ms a call, on every image's way to the tower)."""
        return self._sharding

    def _decoder(self):
        return nnx.merge(self.graphdef, self.state).text

    def prefill(self, caches, slot: int, prompt: Prompt, image_rows, begin: int, end: int, *, all_logits=False,
                block_aligned: bool | None = None):
        """Prompt tokens [begin, end) of the sequence in `slot` (begin tokens already cached). block_aligned: see
        model.prefill; None (the engine's way) sets it where begin is a multiple of the DeltaNet block."""
        n = end - begin
        size = bucket(n, quarters_above=TOKEN_QUARTERS_ABOVE)
        ids = np.zeros(size, np.int32)
        ids[:n] = prompt.token_ids[begin:end]
        positions = np.zeros((3, size), np.int32)
        positions[:, :n] = prompt.positions[:, begin:end]
        image_index = np.full(size, -1, np.int32)
        row = 0
        for s, e in prompt.image_spans:
            lo, hi = max(s, begin), min(e, end)
            if lo < hi:
                image_index[lo - begin : hi - begin] = row + (lo - s) + np.arange(hi - lo)
            row += e - s
        # host arrays go to the jitted call as they are: it transfers them together, faster than one by one
        return qwen.prefill(self.jit_graphdef, self.state, caches, np.int32(slot), ids,
                            image_rows if prompt.image_spans else None, image_index, positions, np.int32(begin),
                            np.int32(n), dtype=self.dtype, all_logits=all_logits,
                            block_aligned=begin % deltanet.BLOCK == 0 if block_aligned is None else block_aligned)

    def decode(self, caches, token_ids, cached, rope_deltas, active=None):
        pos = np.asarray(cached, np.int32) + np.asarray(rope_deltas, np.int32)
        positions = np.broadcast_to(pos, (3, len(pos))).astype(np.int32)
        active = np.ones(len(pos), bool) if active is None else np.asarray(active, bool)
        ids = token_ids if isinstance(token_ids, jax.Array) else np.asarray(token_ids, np.int32)  # not read back
        return qwen.decode(self.jit_graphdef, self.state, caches, ids, positions, np.asarray(cached, np.int32), active,
                           dtype=self.dtype)
