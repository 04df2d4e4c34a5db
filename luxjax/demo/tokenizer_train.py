"""The demo model's own byte-level BPE tokenizer (Qwen3.5 pre-tokenizer, ChatML special tokens), trained with the
`tokenizers` library on the demo's question/answer text.

It is kept as GGUF `tokenizer.*` metadata (tokens, merges, token types, pre = "qwen35"), and the training code
tokenizes through luxjax's own GGUF tokenizer built from that metadata, so training and serving see the same ids.
"""
from __future__ import annotations

import json
import random

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from luxjax.demo.data import COLORS, QUADRANTS, SHAPES, make_example
from luxjax.text.tokenizer import PRE_TOKENIZATIONS

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
EOS, PAD = "<|im_end|>", "<|endoftext|>"
PRE = "qwen35"
# ChatML; an image part renders as <|vision_start|><|image_pad|><|vision_end|> (the server expands the pad).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # gguf.TokenType values (kept literal: gguf is not needed to train)


def corpus(seed: int = 1234, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    texts = ["user\n", "assistant\n", "system\n", "You are a helpful assistant.", "\n"] * 20
    texts += list(SHAPES) + [s + "s" for s in SHAPES] + list(COLORS) + list(QUADRANTS) + ["first", "second"]
    texts += [str(i) for i in range(10)] + ["zero one two three four five six seven eight nine ten"]
    for _ in range(n):
        ex = make_example(rng)
        texts += [ex.question, ex.answer]
    return texts


def train_tokenizer(vocab_size: int = 2048) -> dict:
    """Train and return the GGUF tokenizer metadata (tokenizer.ggml.* and tokenizer.chat_template)."""
    pre = PRE_TOKENIZATIONS[PRE]
    backend = BackendTokenizer(models.BPE())
    backend.normalizer = pre.normalizer()
    backend.pre_tokenizer = pre.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus(), trainer=trainer)
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "vocabulary ids must be dense"
    merges = json.loads(backend.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [TOKEN_CONTROL if t in SPECIAL_TOKENS else TOKEN_NORMAL for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab[EOS],
        "tokenizer.ggml.padding_token_id": vocab[PAD],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def tokenizer_from_metadata(meta: dict):
    """luxjax's Tokenizer exactly as the server builds it from the GGUF file."""
    from luxjax.text.gguf_tokenizer import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(meta)
