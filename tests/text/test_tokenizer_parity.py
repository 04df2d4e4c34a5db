"""Our tokenizers (from the HF directory and from the GGUF) give transformers' ids and text."""
from __future__ import annotations

import random

import numpy as np
import pytest
from text_samples import FIXTURE_DIR, GGUF_PATH, SPECIAL_TOKENS, random_text

from luxjax.text import Tokenizer


@pytest.mark.parametrize("case", ["text", "one_image", "two_images"])
def test_fixture_prompts(ours, reference, case):
    ref = np.load(FIXTURE_DIR / f"ref_{case}.npz")
    prompt = str(ref["prompt"])
    assert ours.encode(prompt) == ref["input_ids"].tolist() == reference.encode(prompt, add_special_tokens=False)


def test_chat_formatted_text(ours, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Héllo <|im_end|> wörld 123\n\n  x"},
        {"role": "assistant", "content": "Hi!\t😀"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What's this?"}]},
    ]
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference.encode(text, add_special_tokens=False)
    assert ours.encode(text) == expected
    assert ours.encode(text, add_special_tokens=True) == reference.encode(text, add_special_tokens=True)
    assert expected.count(ours.token_to_id("<|im_start|>")) == 5


def test_random_text_encodes_like_transformers(ours, reference, seed):
    rng = random.Random(seed)
    for _ in range(300):
        text = random_text(rng)
        expected = reference.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, f"seed={seed} text={text!r}"
        for skip in (False, True):
            assert ours.decode(expected, skip_special_tokens=skip) == reference.decode(
                expected, skip_special_tokens=skip
            ), f"seed={seed} text={text!r} skip_special_tokens={skip}"


def test_random_ids_decode_like_transformers(ours, reference, seed):
    """Any ids, including cut multi-byte characters, special ids and ids past the vocabulary (1016..1023)."""
    rng = random.Random(seed)
    for _ in range(300):
        ids = [rng.randrange(1024) for _ in range(rng.randint(1, 30))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), (
                f"seed={seed} ids={ids} skip_special_tokens={skip}"
            )


def test_special_tokens_and_vocabulary(ours, reference):
    for token in SPECIAL_TOKENS:
        token_id = reference.convert_tokens_to_ids(token)
        assert ours.token_to_id(token) == token_id
        assert ours.id_to_token(token_id) == token
        assert token_id in ours.special_token_ids
    assert ours.special_token_ids == frozenset(reference.all_special_ids)
    assert ours.vocab_size == len(reference) == 1016
    assert ours.id_to_token(1016) is None
    assert ours.id_to_token(reference.convert_tokens_to_ids("Ġthe")) == "Ġthe"
    assert ours.pad_token_id == reference.pad_token_id == 1010
    assert ours.bos_token_id is None
    assert ours.eos_token_ids[0] == reference.eos_token_id == 1009


def test_special_token_variables_match_transformers(hf_tokenizer, reference):
    assert hf_tokenizer.special_tokens == hf_tokenizer.template_variables() == reference.special_tokens_map


def test_stop_ids(hf_tokenizer, gguf_tokenizer):
    assert hf_tokenizer.eos_token_ids == (1009,)  # generation_config.json
    assert gguf_tokenizer.eos_token_ids == (1009, 1010)  # metadata eos + llama.cpp's end-of-generation texts


def test_from_gguf_takes_a_reader_or_a_path(gguf_tokenizer):
    import gguf

    text = "Describe the red circle<|im_end|>"
    assert Tokenizer.from_gguf(gguf.GGUFReader(GGUF_PATH)).encode(text) == gguf_tokenizer.encode(text)
    assert Tokenizer.from_gguf(str(GGUF_PATH)).encode(text) == gguf_tokenizer.encode(text)


def test_chat_templates(hf_tokenizer, gguf_tokenizer):
    assert hf_tokenizer.chat_template == (FIXTURE_DIR / "hf" / "chat_template.jinja").read_text()
    assert gguf_tokenizer.chat_template == hf_tokenizer.chat_template


def test_decode_accepts_numpy_ids(ours):
    ids = ours.encode("hello world")
    assert ours.decode(np.asarray(ids, dtype=np.int64)) == "hello world"


def test_length_limit_refuses_only_text_that_cannot_fit(ours, reference, seed):
    """encode(text, max_tokens=m) refuses text by its (normalized) length before tokenizing it; transformers' count
    arbitrates: a refusal is right only when the text really makes more than m tokens, and text of the vocabulary's
    longest entries, or of decomposed characters NFC composes, is never refused while it fits."""
    from luxjax.errors import RequestError

    rng = random.Random(seed)
    vocab = reference.get_vocab()
    longest = max(len(token) for token in vocab)  # byte-level entries: a character per byte
    long_tokens = [reference.convert_tokens_to_string([t]) for t in vocab if len(t) >= longest - 4]
    kinds = {"random": lambda: random_text(rng), "long tokens": lambda: "".join(rng.choices(long_tokens, k=40)),
             "decomposed": lambda: "".join(rng.choice("aeouAEOU") + "\u0301" for _ in range(200)),
             "jamo": lambda: "\u1100\u1161\u11a8" * 150}
    refused = 0
    for name, make in kinds.items():
        for _ in range(10):
            text = make()
            expected = reference.encode(text, add_special_tokens=False)
            for limit in {len(expected), len(expected) + 1, rng.randint(1, len(expected)), len(text) // longest - 1}:
                if limit < 1:
                    continue
                try:
                    got = ours.encode(text, max_tokens=limit)
                except RequestError as exc:
                    assert exc.code == "context_length_exceeded" and len(expected) > limit, (
                        f"seed={seed} {name}: refused {len(text)} characters making {len(expected)} <= {limit} tokens")
                    refused += 1
                    continue
                assert got == expected, f"seed={seed} {name} text={text!r}"
    assert refused, f"seed={seed}: no text was refused"


def test_text_past_the_gil_free_length_encodes_like_transformers(ours, reference, seed):
    from luxjax.text.tokenizer import GIL_FREE_ENCODE_CHARS

    rng = random.Random(seed)
    pieces, size = [], 0
    while size <= GIL_FREE_ENCODE_CHARS:
        pieces.append(random_text(rng))
        size += len(pieces[-1])
    text = "".join(pieces)
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False), f"seed={seed}"
