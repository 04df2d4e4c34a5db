"""Streaming decode: the joined stream equals a full decode, and no character is ever cut mid-stream."""
from __future__ import annotations

import random

import pytest
from text_samples import random_text


def stream(tokenizer, ids, skip_special_tokens=False):
    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip_special_tokens)
    chunks = [decoder.push(i) for i in ids]
    return chunks, decoder.flush()


@pytest.mark.parametrize("skip", [False, True])
def test_random_ids_join_to_full_decode(ours, reference, seed, skip):
    """Ids drawn mostly from single-byte tokens, so multi-byte characters are split and some stay invalid."""
    rng = random.Random(seed)
    byte_ids = [ours.token_to_id(t) for t in ("ä", "¸", "Ń", "ð", "Ł", "ĺ", "ģ", "Ģ", "Ġ", "Ċ", "ã", "ģ", "Ĥ")]
    for _ in range(200):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(1024)
            for _ in range(rng.randint(1, 40))
        ]
        chunks, rest = stream(ours, ids, skip)
        full = ours.decode(ids, skip_special_tokens=skip)
        assert "".join(chunks) + rest == full == reference.decode(ids, skip_special_tokens=skip), (
            f"seed={seed} ids={ids}"
        )


def test_valid_text_never_shows_replacement_mid_stream(ours, seed):
    rng = random.Random(seed)
    for _ in range(200):
        text = random_text(rng).replace("\ufffd", "")
        ids = ours.encode(text)
        chunks, rest = stream(ours, ids)
        assert not any("\ufffd" in c for c in chunks), f"seed={seed} text={text!r} chunks={chunks}"
        assert "".join(chunks) + rest == ours.decode(ids), f"seed={seed} text={text!r}"
        assert rest == "", f"seed={seed} text={text!r}"


def test_character_split_over_byte_tokens(ours):
    ids = ours.encode("a😀")
    assert len(ids) == 5  # 'a' and the emoji's four bytes, one token each in this tiny vocabulary
    chunks, rest = stream(ours, ids)
    assert chunks == ["a", "", "", "", "😀"] and rest == ""


def test_flush_emits_an_unfinished_character_as_decode_does(ours):
    ids = ours.encode("ok 中")[:-1]  # drop the last byte of 中
    chunks, rest = stream(ours, ids)
    assert "".join(chunks) == "ok "
    assert rest == ours.decode(ids)[len("ok ") :] == "\ufffd"


def test_special_tokens_stream(ours):
    ids = ours.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert "".join(stream(ours, ids)[0]) == "<|im_start|>assistant\nhi<|im_end|>"
    assert "".join(stream(ours, ids, skip_special_tokens=True)[0]) == "assistant\nhi"
