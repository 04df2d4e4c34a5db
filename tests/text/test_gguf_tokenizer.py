"""GGUF tokenizer metadata: pre-tokenizer names, token types, and what is refused."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import decoders
from text_samples import HF_DIR, random_text

from luxjax.errors import ModelFormatError
from luxjax.text import tokenizer_from_gguf_metadata
from luxjax.text.tokenizer import LLAMA3_SPLIT, PRE_TOKENIZATIONS, QWEN2_SPLIT, QWEN35_SPLIT


def altered(meta, **changes):
    """A copy of the fixture's metadata with `tokenizer.ggml.<key>` entries replaced (None removes one)."""
    meta = dict(meta)
    for key, value in changes.items():
        meta.pop(f"tokenizer.ggml.{key}", None)
        if value is not None:
            meta[f"tokenizer.ggml.{key}"] = value
    return meta


def test_unknown_pre_tokenizer_is_refused_by_name(gguf_metadata):
    with pytest.raises(ModelFormatError, match="'deepseek-v9'"):
        tokenizer_from_gguf_metadata(altered(gguf_metadata, pre="deepseek-v9"))


@pytest.mark.parametrize("model", ["llama", "bert", "t5", None])
def test_non_bpe_tokenizer_models_are_refused_by_name(gguf_metadata, model):
    with pytest.raises(ModelFormatError, match=repr(model)):
        tokenizer_from_gguf_metadata(altered(gguf_metadata, model=model))


def test_split_regexes_are_transformers(reference):
    from transformers.models.qwen2 import tokenization_qwen2
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    assert QWEN35_SPLIT == tokenization_qwen3_5.PRETOKENIZE_REGEX
    assert QWEN2_SPLIT == tokenization_qwen2.PRETOKENIZE_REGEX
    with open(HF_DIR / "tokenizer.json", encoding="utf-8") as f:
        split = json.load(f)["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == QWEN35_SPLIT
    assert LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}") == QWEN2_SPLIT


def fixture_vocab_reference(class_name):
    """A transformers tokenizer class built from the fixture's vocabulary and merges (no added tokens)."""
    import transformers

    with open(HF_DIR / "tokenizer.json", encoding="utf-8") as f:
        model = json.load(f)["model"]
    cls = getattr(transformers, class_name)
    return cls(vocab=dict(model["vocab"]), merges=[tuple(m) for m in model["merges"]])


@pytest.mark.parametrize("pre,class_name", [("qwen2", "Qwen2Tokenizer"), ("gpt2", "GPT2Tokenizer")])
def test_other_pre_tokenizers_match_their_transformers_class(gguf_metadata, seed, pre, class_name):
    ours = tokenizer_from_gguf_metadata(altered(gguf_metadata, pre=pre))
    reference = fixture_vocab_reference(class_name)
    rng = random.Random(seed)
    for _ in range(200):
        text = random_text(rng, with_special=False)
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), f"seed={seed} text={text!r}"


def test_pre_tokenizers_split_where_they_should():
    """qwen35 keeps combining marks with their letters, qwen2/qwen35 split digits singly, gpt2 keeps digit runs."""
    text = "x\u0334y 2024"  # U+0334 has no precomposed form, so NFC leaves it

    def pieces(pre):
        split = PRE_TOKENIZATIONS[pre].pre_tokenizer().pre_tokenize_str(text)
        return [decoders.ByteLevel().decode([piece]) for piece, _ in split]

    assert pieces("qwen35") == ["x\u0334y", " ", "2", "0", "2", "4"]
    assert pieces("qwen2") == ["x", "\u0334y", " ", "2", "0", "2", "4"]
    assert pieces("gpt2") == ["x", "\u0334", "y", " 2024"]
    assert pieces("llama-bpe") == ["x", "\u0334y", " ", "202", "4"]


def test_default_pre_tokenizer_round_trips(gguf_metadata, seed):
    ours = tokenizer_from_gguf_metadata(altered(gguf_metadata, pre=None))  # no key: llama.cpp's "default"
    rng = random.Random(seed)
    for _ in range(100):
        text = random_text(rng, with_special=False)
        assert ours.decode(ours.encode(text)) == text, f"seed={seed} text={text!r}"


def test_llama_bpe_adds_bos_and_takes_whole_vocabulary_pieces(gguf_metadata):
    tokens = list(gguf_metadata["tokenizer.ggml.tokens"])
    tokens[1016] = "Ġtheir"  # a vocabulary entry no merge path builds; ignore_merges takes it whole
    types = list(gguf_metadata["tokenizer.ggml.token_type"])
    types[1016] = 1
    ours = tokenizer_from_gguf_metadata(
        altered(gguf_metadata, pre="llama-bpe", bos_token_id=1011, tokens=tokens, token_type=types)
    )
    assert ours.encode(" their", add_special_tokens=True) == [1011, 1016]
    assert ours.encode(" their") == [1016]
    no_bos = tokenizer_from_gguf_metadata(altered(gguf_metadata, pre="llama-bpe", add_bos_token=False))
    assert no_bos.encode("hi", add_special_tokens=True) == no_bos.encode("hi")


def test_user_defined_tokens_are_matched_but_not_special(gguf_metadata):
    tokens = list(gguf_metadata["tokenizer.ggml.tokens"])
    types = list(gguf_metadata["tokenizer.ggml.token_type"])
    tokens[1017], types[1017] = "<tool_call>", 4
    ours = tokenizer_from_gguf_metadata(altered(gguf_metadata, tokens=tokens, token_type=types))
    ids = ours.encode("a<tool_call>b<|im_end|>")
    assert ids[1:3] == [1017, ours.encode("b")[0]] and ids[-1] == 1009
    assert ours.decode(ids, skip_special_tokens=True) == "a<tool_call>b"


def test_special_token_variables_from_metadata(gguf_tokenizer):
    assert gguf_tokenizer.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
