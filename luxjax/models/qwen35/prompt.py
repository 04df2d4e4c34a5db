"""Qwen3.5 prompts: chat template rendering, one `<|image_pad|>` per image expanded to that image's rows,
and the M-RoPE positions of the result."""
from __future__ import annotations

from typing import Sequence

from luxjax.contract import Prompt
from luxjax.errors import RequestError
from luxjax.models.qwen35.positions import mrope_positions
from luxjax.text.chat_template import render_chat, template_variables
from luxjax.vision.messages import ChatMessage, ImagePart
from luxjax.vision.spans import image_spans
from luxjax.vision.types import ImageInputs

IMAGE_MARKERS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")


def template_messages(parsed: Sequence[ChatMessage], original: Sequence[dict]) -> list[dict]:
    """Messages as the chat template expects them: string content stays a string; parts become
    {"type": "text", "text"} / {"type": "image"} (the pixels never reach the template)."""
    out = []
    for message, source in zip(parsed, original):
        item = {"role": message.role, **message.extra}
        if isinstance(source.get("content"), str) or source.get("content") is None:
            item["content"] = source.get("content") or ""
        else:
            item["content"] = [
                {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in message.parts
            ]
        out.append(item)
    return out


def expand_image_pads(ids: list[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """Each single pad id becomes counts[i] pad ids (the processor's expansion, done on ids)."""
    found = sum(1 for t in ids if t == pad_id)
    if found != len(counts):
        raise RequestError(
            f"the chat template placed {found} image placeholders for {len(counts)} images; "
            "every image must appear in the prompt"
        )
    out: list[int] = []
    images = iter(counts)
    for t in ids:
        out.extend([pad_id] * next(images) if t == pad_id else [t])
    return out


def build_prompt(tokenizer, template: str, parsed, original, image_inputs: ImageInputs | None, *, pad_id: int,
                 merge: int, add_generation_prompt: bool = True, template_kwargs=None,
                 max_tokens: int | None = None) -> Prompt:
    text = render_chat(template, template_messages(parsed, original), add_generation_prompt=add_generation_prompt,
                       **template_variables(tokenizer.template_variables(), template_kwargs or {}))
    ids = tokenizer.encode(text, max_tokens=max_tokens)
    counts = image_inputs.num_tokens if image_inputs is not None else []
    ids = expand_image_pads(ids, pad_id, counts)
    return prompt_from_ids(ids, image_inputs, pad_id=pad_id, merge=merge, text=text)


def prompt_from_ids(ids: list[int], image_inputs: ImageInputs | None, *, pad_id: int, merge: int, text: str = "") -> Prompt:
    counts = image_inputs.num_tokens if image_inputs is not None else []
    spans = image_spans(ids, pad_id, counts) if counts else []
    grids = [(int(h) // merge, int(w) // merge) for _, h, w in image_inputs.grid_thw] if counts else []
    positions, rope_delta = mrope_positions(len(ids), spans, grids)
    return Prompt(token_ids=list(ids), image_inputs=image_inputs, image_spans=spans, positions=positions,
                  rope_delta=rope_delta, text=text)
