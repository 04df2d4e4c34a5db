"""Training batches: every row is the chat template's own rendering of a conversation whose first turn is what the
server renders for a one-question request, whose labels are exactly the assistant answers, and whose every answer
is right for the row's images by the spec. And `python -m luxjax.demo.train` runs on the CPU."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from test_data import check_answer

import luxjax.demo.batches as batches
from luxjax.demo.model_init import demo_config, init_params
from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer
from luxjax.text.chat_template import render_chat

KINDS = [("shape", r"What shape is in the image\?"), ("color", r"What color is the \w+\?"),
         ("count_all", r"How many shapes are there\?"), ("count_shape", r"How many \w+s are there\?"),
         ("where", r"Where is the \w+ \w+\?"), ("which", r"Which image has a \w+ \w+, the first or the second\?")]
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def demo():
    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    cfg = demo_config(meta)
    return meta, tok, cfg


def kind_of(question: str) -> str:
    return next(kind for kind, pattern in KINDS if re.fullmatch(pattern, question))


def parse_conversation(text: str) -> list[dict]:
    """OpenAI-style messages from ChatML text (one image pad per image)."""
    messages = []
    for turn in text.split("<|im_start|>")[1:]:
        role, _, content = turn.partition("\n")
        content = content.removesuffix("\n").removesuffix("<|im_end|>")
        if VISION in content:
            pieces = re.split(f"({re.escape(VISION)})", content)
            content = [{"type": "image"} if p == VISION else {"type": "text", "text": p} for p in pieces if p]
        messages.append({"role": role, "content": content})
    return messages


def test_rows_are_template_conversations_with_right_answers(demo, monkeypatch):
    meta, tok, cfg = demo
    drawn = []
    real_render = batches.render
    monkeypatch.setattr(batches, "render", lambda scene, rng: drawn.append(scene) or real_render(scene, rng))
    maker = batches.BatchMaker(tok, cfg, meta["tokenizer.chat_template"], follow_ups=3,
                               mix=batches.parse_mix("uniform"))
    batch = maker(random.randrange(1 << 30), 24)
    pad, turns_seen = cfg["image_token_id"], 0
    for row in range(24):
        n = int(batch.valid[row].sum())
        assert not batch.valid[row, n:].any()
        ids = [int(t) for t in batch.ids[row, :n]]
        collapsed = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]  # one pad per image
        text = tok.decode(collapsed)
        messages = parse_conversation(text)
        assert render_chat(meta["tokenizer.chat_template"], messages, add_generation_prompt=False) == text + "\n"
        users, answers = messages[0::2], messages[1::2]
        assert [m["role"] for m in messages] == ["user", "assistant"] * len(answers) and 1 <= len(answers) <= 4
        assert all(isinstance(m["content"], str) for m in messages[1:])  # images only in the first turn
        labels = batch.labels[row]
        want = [t for a in answers for t in tok.encode(a["content"]) + [tok.eos_token_ids[0]]]
        assert [int(t) for t in labels[labels >= 0]] == want
        starts = np.flatnonzero(labels >= 0)
        assert all(labels[i] == ids[i + 1] for i in starts)  # each label is the next token
        images = sum(isinstance(p, dict) and p["type"] == "image" for p in users[0]["content"])
        scenes, drawn[:] = drawn[:images], drawn[images:]
        first = next(p["text"] for p in users[0]["content"] if p["type"] == "text")
        questions = [first] + [m["content"] for m in users[1:]]
        assert len(set(questions)) == len(questions)
        for question, answer in zip(questions, answers):
            check_answer(kind_of(question), question, answer["content"], scenes)
        turns_seen += len(answers)
    assert turns_seen > 24 * 1.5  # follow-up turns are really asked


def test_first_turn_is_the_server_prompt(demo):
    """The tokens up to the first answer equal the tokens the real load path renders for the same request."""
    from luxjax.api import Model
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build

    meta, tok, cfg = demo
    maker = batches.BatchMaker(tok, cfg, meta["tokenizer.chat_template"], follow_ups=0,
                               mix=batches.parse_mix("uniform"))
    model = Model(build(ModelConfig.from_hf(cfg), init_params(cfg, 0), tok, batches.processor(), "float32",
                        origin="memory"))
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(6):
        ex = batches.make_example(rng)
        images = [batches.render(s, rng) for s in ex.scenes]
        text_first = rng.random() < 0.5
        parts = [{"type": "image", "image": im} for im in images]
        question = {"type": "text", "text": ex.question}
        ids, _ = model.render_prompt([{"role": "user", "content": [question] + parts if text_first
                                       else parts + [question]}])
        counts = [len(batches.patch_bytes(maker.proc, im)[0]) // 4 for im in images]
        prompt = batches.expand_image_pads(tok.encode(maker._render(batches.messages_for(
            ex.question, len(images), text_first))), cfg["image_token_id"], counts)
        assert prompt == ids


def test_training_runs_on_cpu(tmp_path):
    """A few optimizer steps through the real entry point (in a subprocess, so a stalled runtime fails the test
    instead of hanging it)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "luxjax.demo.train", "--steps", "3", "--batch", "2", "--workers", "0",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    meta = json.loads((out / "tokenizer.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    initial = init_params(cfg, 0)
    with np.load(out / "params_text.npz") as trained:
        moved = [k for k in trained.files if not np.array_equal(trained[k], initial[k])]
    assert "lm_head.weight" in moved and len(moved) > len(initial) // 4
    assert meta["tokenizer.chat_template"]
