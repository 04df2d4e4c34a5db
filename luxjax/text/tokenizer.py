"""Text <-> token ids for one model, giving the ids and text that transformers gives for the same checkpoint.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend transformers itself uses) plus what transformers keeps
beside it: the named special tokens that chat templates see, the stop ids, and the chat template.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from luxjax.errors import ModelFormatError, RequestError
from luxjax.text.chat_template import render_chat

if TYPE_CHECKING:
    import gguf

GIL_FREE_ENCODE_CHARS = 1 << 16  # longer texts are encoded by encode_batch, which releases the GIL

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), in its order: the variables chat templates get.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Pre-tokenizer regexes as transformers (tokenizer.json) writes them. llama.cpp spells the contractions out as
# `'[sS]|...` instead of `(?i:...)`; the Hugging Face form is kept because transformers is the reference.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN35_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes, each splitting the pieces the previous one left.
LLAMA_CPP_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)""",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class PreTokenization:
    """How text is prepared and cut before byte-level BPE, for one llama.cpp pre-type / transformers class.

    `splits` empty means GPT-2's own regex inside the ByteLevel pre-tokenizer. `nfc` is transformers' Qwen classes'
    NFC normalizer (llama.cpp does not normalize; transformers is the reference). `ignore_merges` takes a piece whole
    when the vocabulary has it (Llama 3); `add_bos` is llama.cpp's default for `tokenizer.ggml.add_bos_token`.
    """

    splits: tuple[str, ...]
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False

    def normalizer(self) -> normalizers.Normalizer | None:
        return normalizers.NFC() if self.nfc else None

    def pre_tokenizer(self, add_prefix_space: bool = False) -> pre_tokenizers.PreTokenizer:
        if not self.splits:
            return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in self.splits]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])


# By `tokenizer.ggml.pre` name (llama.cpp's names; aliases llama.cpp maps to the same pre-type).
PRE_TOKENIZATIONS: dict[str, PreTokenization] = {
    "qwen35": PreTokenization((QWEN35_SPLIT,), nfc=True),
    "qwen2": PreTokenization((QWEN2_SPLIT,), nfc=True),
    "llama-bpe": PreTokenization((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    "llama3": PreTokenization((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenization((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    "gpt2": PreTokenization(()),
    "default": PreTokenization(LLAMA_CPP_DEFAULT_SPLITS),
}

# transformers' AutoTokenizer ignores the hub's `tokenizer_class` for these model types and rebuilds the pipeline with
# its own class; every other class is taken as tokenizer.json writes it.
_FORCED_TRANSFORMERS_CLASS = {
    "qwen2": "Qwen2Tokenizer",
    "qwen3_5": "Qwen3_5Tokenizer",
    "qwen3_5_moe": "Qwen3_5Tokenizer",
    "qwen3_5_moe_text": "Qwen3_5Tokenizer",
    "qwen4_exp": "Qwen3_5Tokenizer",
}
_CLASS_PRE_TOKENIZATION = {"Qwen2Tokenizer": "qwen2", "Qwen3_5Tokenizer": "qwen35"}
# Those classes' constructor defaults, used where tokenizer_config.json does not name the token.
_QWEN_CLASS_SPECIAL_DEFAULTS = dict.fromkeys(("unk_token", "eos_token", "pad_token"), "<|endoftext|>")


class Tokenizer:
    """Encode/decode, special tokens, stop ids and chat template of one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
    ):
        self._backend = backend
        self.special_tokens: dict[str, str] = dict(special_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = 1 + max(backend.get_vocab(with_added_tokens=True).values())

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ generation_config.json / config.json for stop ids)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelFormatError(f"{path} has no tokenizer.json (only the fast-tokenizer format is supported)")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")

        special_defaults: Mapping[str, str] = {}
        pre_name = _CLASS_PRE_TOKENIZATION.get(_transformers_class(model_config.get("model_type"), config))
        if pre_name is not None:
            pre = PRE_TOKENIZATIONS[pre_name]
            backend.normalizer = pre.normalizer()
            backend.pre_tokenizer = pre.pre_tokenizer(add_prefix_space=bool(config.get("add_prefix_space")))
            backend.decoder = decoders.ByteLevel()
            special_defaults = _QWEN_CLASS_SPECIAL_DEFAULTS

        named = {k: config.get(k, special_defaults.get(k)) for k in NAMED_SPECIAL_TOKENS}
        named = {k: v for k, v in named.items() if v is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):
            extra = list(extra.values())
        backend.add_special_tokens([_added_token(t) for t in [*named.values(), *extra]])
        special_tokens = {k: _token_content(v) for k, v in named.items()}

        if "add_bos_token" in config or "add_eos_token" in config:
            backend.post_processor = bos_eos_post_processor(
                backend, special_tokens, bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            )

        eos_ids = _config_eos_ids(path, model_config)
        if "eos_token" in special_tokens and backend.token_to_id(special_tokens["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(special_tokens["eos_token"]))
        return cls(
            backend, special_tokens=special_tokens, eos_token_ids=eos_ids, chat_template=_hf_chat_template(path, config)
        )

    @classmethod
    def from_gguf(cls, reader_or_path: gguf.GGUFReader | str | Path) -> Tokenizer:
        """Build from a GGUF file's `tokenizer.*` metadata (a path or an open `gguf.GGUFReader`)."""
        from luxjax.text.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(reader_or_path)

    def encode(self, text: str, add_special_tokens: bool = False, *, max_tokens: int | None = None) -> list[int]:
        """Ids of `text`; special tokens written in the text (`<|im_start|>`) become their single ids.

        With `max_tokens`, text too long to make at most that many tokens is refused (400
        context_length_exceeded) before it is tokenized: a 40 MB prompt would otherwise take a minute."""
        if max_tokens is not None:
            self._check_can_fit(text, max_tokens)
        if len(text) < GIL_FREE_ENCODE_CHARS:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # encode_batch lets go of the GIL while it works: the HTTP event loop keeps answering meanwhile
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of normalized text one token can stand for: the longest vocabulary entry (a
        byte-level entry has a character per byte, a SentencePiece entry one per character or more)."""
        return max(len(token) for token in self._backend.get_vocab(with_added_tokens=True))

    def _check_can_fit(self, text: str, max_tokens: int) -> None:
        bound = max_tokens * self.max_token_chars
        if len(text) <= bound:
            return
        normalizer = self._backend.normalizer  # NFC may compose characters: count what the model sees
        if normalizer is not None and len(text := normalizer.normalize_str(text)) <= bound:
            return
        raise RequestError(
            f"the prompt is {len(text)} characters long: more than the {max_tokens} tokens of the context can hold "
            f"(a token covers at most {self.max_token_chars} characters)", code="context_length_exceeded")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def template_variables(self) -> dict[str, str]:
        """The special-token variables transformers gives chat templates (bos_token, eos_token, ...)."""
        return dict(self.special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The model's chat template rendered with its special-token variables, as transformers renders it."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template; use the completions endpoint with a raw prompt")
        variables = {**self.template_variables(), **kwargs}
        return render_chat(self.chat_template, messages, add_generation_prompt, tools, **variables)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streams text for ids fed one at a time, holding bytes back until they form whole UTF-8 characters.

    Each step decodes the ids since the last emitted boundary (with the previous chunk's ids as context) and emits the
    new suffix only when the decoded text does not end in U+FFFD, i.e. no character is cut. The joined stream plus
    `flush()` equals `decode` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the last emitted chunk's ids (context), then the ids not yet emitted
        self._context = 0

    def push(self, token_id: int) -> str:
        """Text completed by `token_id` ('' while a character is still incomplete)."""
        self._ids.append(int(token_id))
        prefix, text = self._pending()
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._ids = self._ids[self._context :]
        self._context = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held at the end of the stream (incomplete bytes come out as U+FFFD, as `decode` does)."""
        prefix, text = self._pending()
        self._ids, self._context = [], 0
        return text[len(prefix) :]

    def _pending(self) -> tuple[str, str]:
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        return decode(self._ids[: self._context], skip), decode(self._ids, skip)


def bos_eos_post_processor(
    backend: BackendTokenizer, special_tokens: Mapping[str, str], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """transformers' `update_post_processor`: BOS/EOS around the text when asked and when the token exists."""
    bos, eos = special_tokens.get("bos_token"), special_tokens.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


def _transformers_class(model_type: str | None, tokenizer_config: Mapping[str, Any]) -> str:
    if model_type in _FORCED_TRANSFORMERS_CLASS:
        return _FORCED_TRANSFORMERS_CLASS[model_type]
    return (tokenizer_config.get("tokenizer_class") or "").removesuffix("Fast")


def _token_content(token: str | Mapping[str, Any]) -> str:
    return token if isinstance(token, str) else token["content"]


def _added_token(token: str | Mapping[str, Any]) -> AddedToken:
    """A special token as transformers registers it (from a string, or tokenizer_config's AddedToken dict)."""
    if isinstance(token, str):
        return AddedToken(token, special=True, normalized=False)
    flags = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in token}
    return AddedToken(token["content"], special=True, **flags)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _id_list(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _config_eos_ids(path: Path, model_config: Mapping[str, Any]) -> list[int]:
    """Stop ids as generate() takes them: generation_config.json, else config.json (top level or text_config)."""
    generation = _read_json(path / "generation_config.json")
    if "eos_token_id" in generation:
        return _id_list(generation["eos_token_id"])
    eos = model_config.get("eos_token_id")
    return _id_list(eos if eos is not None else (model_config.get("text_config") or {}).get("eos_token_id"))


def _hf_chat_template(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config's (the 'default' of a named list), else chat_template.json's."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template
