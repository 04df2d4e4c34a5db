"""Training batches of fixed shapes (compiled once): prompts rendered with the chat template exactly as the server
renders them, each image pad expanded to the image's token count, M-RoPE positions, answer-only labels, and the
images as uint8 patches in the processor's layout (normalised on the device through the processor's own table)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from luxjax.demo.data import QUESTION_TYPES, follow_up_questions, make_example, render
from luxjax.demo.model_init import IMAGE_MEAN, IMAGE_STD, MAX_PIXELS, MIN_PIXELS
from luxjax.models.qwen35.config import VisionConfig
from luxjax.models.qwen35.positions import mrope_positions
from luxjax.models.qwen35.preprocess import Qwen35ImageProcessor
from luxjax.models.qwen35.prompt import expand_image_pads
from luxjax.models.qwen35.vision_tower import vision_layout
from luxjax.text.chat_template import render_chat

SEQ_LEN = 192  # tokens per sequence: two 64-token images plus the longest question fit
PATCHES = MAX_PIXELS // 256  # patches per image slot


def processor() -> Qwen35ImageProcessor:
    return Qwen35ImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, image_mean=IMAGE_MEAN,
                                image_std=IMAGE_STD)


def patch_bytes(proc: Qwen35ImageProcessor, image) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 [patches, 3, p*p] in the processor's row order (before normalisation and temporal repeat), grid_thw."""
    pixels = proc._resized_pixels(image)
    H, W, _ = pixels.shape
    return np.ascontiguousarray(proc._patch_codes(pixels)), (1, H // proc.patch_size, W // proc.patch_size)


def messages_for(question: str, n_images: int, text_first: bool) -> list[dict]:
    parts = [{"type": "image"}] * n_images
    parts = [{"type": "text", "text": question}] + parts if text_first else parts + [{"type": "text", "text": question}]
    return [{"role": "user", "content": parts}]


# First-turn question types in training: the hard ones (position, comparing two images, counting one kind) drawn
# more often than the uniform mix the evaluation uses.
TRAIN_MIX = {"shape": 0.05, "color": 0.05, "count_shape": 0.1, "count_all": 0.1, "where": 0.25, "which": 0.45}


# At most this many follow-up turns per sequence (as many as fit in SEQ_LEN): about 10 answers per sequence instead
# of 1, at the same cost of drawing images and nearly the same step time.
FOLLOW_UPS = 10


def parse_mix(text: str) -> dict[str, float]:
    """"uniform", "hard" (TRAIN_MIX) or "shape=1,which=2,...": weights of the first-turn question types."""
    if text == "uniform":
        return dict.fromkeys(QUESTION_TYPES, 1.0)
    if text == "hard":
        return dict(TRAIN_MIX)
    mix = {}
    for item in text.split(","):
        kind, _, weight = item.partition("=")
        if kind.strip() not in QUESTION_TYPES:
            raise ValueError(f"unknown question type {kind.strip()!r} in {text!r}; expected {QUESTION_TYPES}")
        mix[kind.strip()] = float(weight)
    return mix


def image_slots(batch_size: int) -> int:
    """Image slots per batch: one per sequence plus half as many for the two-image questions."""
    return batch_size + max(1, batch_size // 2)


@dataclass
class Batch:
    ids: np.ndarray  # int32 [B, T]
    labels: np.ndarray  # int32 [B, T]: next token at answer positions, else -1
    positions: np.ndarray  # int32 [3, B, T]
    valid: np.ndarray  # bool [B, T]
    image_index: np.ndarray  # int32 [B, T]: row of the flat merged image rows, or -1
    patches: np.ndarray  # uint8 [slots, PATCHES, 3, 256]
    taps: np.ndarray  # int32 [slots, PATCHES, 4]
    tap_weights: np.ndarray  # float32 [slots, PATCHES, 4]
    rope_ids: np.ndarray  # int32 [slots, PATCHES, 2]
    segments: np.ndarray  # int32 [slots, PATCHES]: 0 image, 1 padding (never all-masked: no NaN gradients)


class BatchMaker:
    """`follow_ups`: at most this many further questions about the same image(s), asked as later turns (the first
    turn is always exactly what the server renders for a one-question request). `mix`: weights of the first-turn
    question types (default TRAIN_MIX)."""

    def __init__(self, tokenizer, cfg: dict, template: str, follow_ups: int = FOLLOW_UPS, mix: dict | None = None):
        self.tok, self.template, self.follow_ups = tokenizer, template, follow_ups
        self.mix = dict(mix or TRAIN_MIX)
        self.vision = VisionConfig.from_hf(cfg["vision_config"])
        self.pad_id = cfg["image_token_id"]
        self.eos = tokenizer.eos_token_ids[0]
        self.proc = processor()

    def __call__(self, seed: int, batch_size: int) -> Batch:
        rng = random.Random(seed)
        B, T, S = batch_size, SEQ_LEN, image_slots(batch_size)
        ids = np.zeros((B, T), np.int32)
        labels = np.full((B, T), -1, np.int32)
        positions = np.zeros((3, B, T), np.int32)
        valid = np.zeros((B, T), bool)
        image_index = np.full((B, T), -1, np.int32)
        patches = np.zeros((S, PATCHES, 3, 256), np.uint8)
        taps = np.zeros((S, PATCHES, 4), np.int32)
        tap_w = np.zeros((S, PATCHES, 4), np.float32)
        rope = np.zeros((S, PATCHES, 2), np.int32)
        segments = np.ones((S, PATCHES), np.int32)
        used, kinds, weights = 0, list(self.mix), list(self.mix.values())
        for b in range(B):
            ex = make_example(rng, rng.choices(kinds, weights)[0])
            while used + len(ex.scenes) > S - (B - 1 - b):  # keep a slot for every later sequence
                ex = make_example(rng, "shape")
            counts, llm_grids, slots = [], [], []
            for scene in ex.scenes:
                slot, used = used, used + 1
                slots.append(slot)
                data, grid = patch_bytes(self.proc, render(scene, rng))
                n = len(data)
                patches[slot, :n] = data
                t, w_, r, seg = vision_layout(np.array([grid]), self.vision, PATCHES)
                taps[slot], tap_w[slot], rope[slot] = t, w_, r
                segments[slot] = np.where(seg >= 0, 0, 1)
                counts.append(n // 4)
                llm_grids.append((grid[1] // 2, grid[2] // 2))
            messages = messages_for(ex.question, len(ex.scenes), rng.random() < 0.3)
            prompt = expand_image_pads(self.tok.encode(self._render(messages)), self.pad_id, counts)
            full, targets = self._conversation(prompt, messages, ex, rng)
            n = len(full)
            ids[b, :n] = full
            valid[b, :n] = True
            for start, end in targets:
                labels[b, start - 1 : end - 1] = full[start:end]
            spans, row = [], 0
            for slot, c in zip(slots, counts):
                start = prompt.index(self.pad_id, row)
                spans.append((start, start + c))
                image_index[b, start : start + c] = slot * (PATCHES // 4) + np.arange(c)
                row = start + c
            pos, _ = mrope_positions(n, spans, llm_grids)
            positions[:, b, :n] = pos
        return Batch(ids, labels, positions, valid, image_index, patches, taps, tap_w, rope, segments)

    def _render(self, messages, generation_prompt: bool = True) -> str:
        return render_chat(self.template, messages, add_generation_prompt=generation_prompt,
                           **self.tok.template_variables())

    def _conversation(self, prompt: list[int], messages: list[dict], ex, rng) -> tuple[list[int], list[tuple]]:
        """Token ids of the first turn, its answer, and up to `follow_ups` further question/answer turns that fit
        in SEQ_LEN, with the [start, end) spans of every answer (answer tokens + end of turn) to train on."""
        full, targets = list(prompt), []
        others = follow_up_questions(ex)
        rng.shuffle(others)
        turns = [ex.answer] + [None] * min(len(others), rng.randint(0, self.follow_ups))
        for k, answer in enumerate(turns):
            if answer is None:  # a follow-up question: the template's text between the last answer and the next
                _, question, answer = others[k - 1]
                done = self._render(messages, generation_prompt=False)
                messages = messages + [{"role": "user", "content": question}]
                asked = self._render(messages)
                consumed = done[: done.rindex("<|im_end|>") + len("<|im_end|>")]
                assert asked.startswith(consumed), "the chat template must extend the conversation"
                turn = self.tok.encode(asked[len(consumed) :])
                if len(full) + len(turn) + len(self.tok.encode(answer)) + 1 > SEQ_LEN:
                    break
                full += turn
            reply = self.tok.encode(answer) + [self.eos]
            assert len(full) + len(reply) <= SEQ_LEN, (len(full), ex.question)
            targets.append((len(full), len(full) + len(reply)))
            full += reply
            messages = messages + [{"role": "assistant", "content": answer}]
        return full, targets
