"""Training batches of fixed shapes (compiled once): prompts rendered with the chat template exactly as the server
renders them, each image pad expanded to the image's token count, M-RoPE positions, answer-only labels, and the
images as uint8 patches in the processor's layout (normalised on the device through the processor's own table)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from luxjax.demo.data import make_example, render
from luxjax.demo.model_init import IMAGE_MEAN, IMAGE_STD, MAX_PIXELS, MIN_PIXELS
from luxjax.models.qwen35.config import VisionConfig
from luxjax.models.qwen35.positions import mrope_positions
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.models.qwen35.prompt import expand_image_pads
from luxjax.models.qwen35.vision_tower import vision_layout
from luxjax.text.chat_template import render_chat

SEQ_LEN = 192  # tokens per sequence: two 64-token images plus the longest question fit
IMAGES_PER_SEQ = 2
PATCHES = MAX_PIXELS // 256  # patches per image slot


def processor() -> Qwen35ImageProcessor:
    return Qwen35ImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=IMAGE_MEAN,
                                image_std=IMAGE_STD)


def patch_bytes(proc: Qwen35ImageProcessor, image) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 [patches, 3, p*p] in the processor's row order (before normalisation and temporal repeat), grid_thw."""
    pixels = proc._resized_pixels(image)
    p, m = proc.patch_size, proc.merge_size
    H, W, C = pixels.shape
    blocks = pixels.reshape(H // (p * m), m, p, W // (p * m), m, p, C).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(blocks.reshape(-1, C, p * p)), (1, H // p, W // p)


def messages_for(question: str, n_images: int, text_first: bool) -> list[dict]:
    parts = [{"type": "image"}] * n_images
    parts = [{"type": "text", "text": question}] + parts if text_first else parts + [{"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


@dataclass
class Batch:
    ids: np.ndarray  # int32 [B, T]
    labels: np.ndarray  # int32 [B, T]: next token at answer positions, else -1
    positions: np.ndarray  # int32 [3, B, T]
    valid: np.ndarray  # bool [B, T]
    image_index: np.ndarray  # int32 [B, T]: row of the flat merged image rows, or -1
    patches: np.ndarray  # uint8 [B*2, PATCHES, 3, 256]
    taps: np.ndarray  # int32 [B*2, PATCHES, 4]
    tap_weights: np.ndarray  # float32 [B*2, PATCHES, 4]
    rope_ids: np.ndarray  # int32 [B*2, PATCHES, 2]
    segments: np.ndarray  # int32 [B*2, PATCHES]: 0 image, 1 padding (never all-masked: no NaN gradients)


class BatchMaker:
    def __init__(self, tokenizer, cfg: dict, template: str):
        self.tok, self.template = tokenizer, template
        self.vision = VisionConfig.from_hf(cfg["vision_config"])
        self.pad_id = cfg["image_token_id"]
        self.eos = tokenizer.eos_token_ids[0]
        self.proc = processor()

    def __call__(self, seed: int, batch_size: int) -> Batch:
        rng = random.Random(seed)
        B, T, S = batch_size, SEQ_LEN, IMAGES_PER_SEQ
        ids = np.zeros((B, T), np.int32)
        labels = np.full((B, T), -1, np.int32)
        positions = np.zeros((3, B, T), np.int32)
        valid = np.zeros((B, T), bool)
        image_index = np.full((B, T), -1, np.int32)
        patches = np.zeros((B * S, PATCHES, 3, 256), np.uint8)
        taps = np.zeros((B * S, PATCHES, 4), np.int32)
        tap_w = np.zeros((B * S, PATCHES, 4), np.float32)
        rope = np.zeros((B * S, PATCHES, 2), np.int32)
        segments = np.ones((B * S, PATCHES), np.int32)
        for b in range(B):
            ex = make_example(rng)
            counts, llm_grids = [], []
            for j, scene in enumerate(ex.scenes):
                slot = b * S + j
                data, grid = patch_bytes(self.proc, render(scene, rng))
                n = len(data)
                patches[slot, :n] = data
                t, w_, r, seg = vision_layout(np.array([grid]), self.vision, PATCHES)
                taps[slot], tap_w[slot], rope[slot] = t, w_, r
                segments[slot] = np.where(seg >= 0, 0, 1)
                counts.append(n // 4)
                llm_grids.append((grid[1] // 2, grid[2] // 2))
            text = render_chat(self.template, messages_for(ex.question, len(ex.scenes), rng.random() < 0.3),
                               add_generation_prompt=True, **self.tok.template_variables())
            prompt = expand_image_pads(self.tok.encode(text), self.pad_id, counts)
            full = prompt + self.tok.encode(ex.answer) + [self.eos]
            assert len(full) <= T, (len(full), ex.question)
            n = len(full)
            ids[b, :n] = full
            valid[b, :n] = True
            labels[b, len(prompt) - 1 : n - 1] = full[len(prompt) :]
            spans, row = [], 0
            for j, c in enumerate(counts):
                start = prompt.index(self.pad_id, row)
                spans.append((start, start + c))
                image_index[b, start : start + c] = (b * S + j) * (PATCHES // 4) + np.arange(c)
                row = start + c
            pos, _ = mrope_positions(n, spans, llm_grids)
            positions[:, b, :n] = pos
        return Batch(ids, labels, positions, valid, image_index, patches, taps, tap_w, rope, segments)
