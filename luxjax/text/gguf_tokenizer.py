"""A `Tokenizer` from a GGUF file's `tokenizer.*` metadata, built to give transformers' ids for the same model.

The metadata carries the vocabulary, merges, token types and the pre-tokenizer's llama.cpp name; from them this builds
the byte-level BPE `tokenizers.Tokenizer` that the checkpoint's tokenizer.json describes. `tokenizer_from_gguf_metadata`
takes a plain dict so that tests can feed altered metadata without writing files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import gguf
from tokenizers import AddedToken, decoders
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from luxjax.errors import ModelFormatError
from luxjax.text.tokenizer import NAMED_SPECIAL_TOKENS, PRE_TOKENIZATIONS, Tokenizer, bos_eos_post_processor

_NORMAL, _CONTROL = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
_USER_DEFINED, _UNUSED = int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.UNUSED)

# GGUF id keys of transformers' named special tokens (llama.cpp spells "seperator").
_NAMED_ID_KEYS = dict(
    zip(
        NAMED_SPECIAL_TOKENS,
        ("bos", "eos", "unknown", "seperator", "padding", "cls", "mask"),
    )
)

# llama.cpp's end-of-generation tokens found by text (llama-vocab.cpp, special_eog_ids): GGUFs carry no generation
# config, so this is how llama.cpp stops on e.g. both <|im_end|> and <|endoftext|> for Qwen.
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    )
)  # fmt: skip


def tokenizer_from_gguf(reader_or_path: gguf.GGUFReader | str | Path) -> Tokenizer:
    reader = reader_or_path if isinstance(reader_or_path, gguf.GGUFReader) else gguf.GGUFReader(reader_or_path)
    return tokenizer_from_gguf_metadata(gguf_tokenizer_metadata(reader))


def gguf_tokenizer_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The `tokenizer.*` fields as Python values (strings, ints, bools, lists)."""
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFormatError(
            f"GGUF tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) tokenizers are supported"
        )
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZATIONS:
        raise ModelFormatError(
            f"GGUF tokenizer.ggml.pre is {pre_name!r}, a pre-tokenizer luxjax does not know; "
            f"supported: {', '.join(sorted(PRE_TOKENIZATIONS))}"
        )
    pre = PRE_TOKENIZATIONS[pre_name]
    tokens: list[str] = list(_required(meta, "tokenizer.ggml.tokens"))
    types: list[int] = [int(t) for t in meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]

    backend = _byte_level_bpe(tokens, types, _required(meta, "tokenizer.ggml.merges"), pre.ignore_merges)
    backend.normalizer = pre.normalizer()
    backend.pre_tokenizer = pre.pre_tokenizer()
    # Added tokens: they are in the BPE vocabulary too, so each keeps its GGUF id.
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )

    special_tokens = {
        name: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
        for name, key in _NAMED_ID_KEYS.items()
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None
    }
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens.values()])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        backend.post_processor = bos_eos_post_processor(backend, special_tokens, add_bos, add_eos)

    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        eos_token_ids=_eog_ids(meta, tokens, types),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _required(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"GGUF metadata has no {key}")
    return meta[key]


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], ignore_merges: bool) -> BackendTokenizer:
    """BPE over GPT-2's byte alphabet; UNUSED tokens (padding rows like `[PAD1016]`) are left out, as transformers
    has no token at those ids (they decode to nothing)."""
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k != _UNUSED}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _eog_ids(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> list[int]:
    """Stop ids: eos/eot/eom from the metadata, then tokens llama.cpp treats as end-of-generation by their text."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ids += [i for i, (t, k) in enumerate(zip(tokens, types)) if t in _EOG_TEXTS and k != _UNUSED]
    return [int(i) for i in ids if i is not None]
