"""Fixture paths, and random text that stresses byte-level BPE: scripts, emoji, combining marks, whitespace, digits."""
from __future__ import annotations

import random
from pathlib import Path

FIXTURE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"
HF_DIR = FIXTURE_DIR / "hf"
GGUF_PATH = FIXTURE_DIR / "tiny-qwen35-a-BF16.gguf"

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
_FIXED = (
    "'s", "'T", "'re", "'LL", "'ve", "'M", "'d", "ſ", "don't", "I'M",  # contractions, case-folded ones
    "👨‍👩‍👧", "👍🏽", "🇯🇵", "❤️", "🏳️‍🌈", "\u200d", "\ufe0f",  # ZWJ sequences, modifiers, flags
    "\u1100\u1161\u11a8", "क्षि", "Å", "Ω", "ﬁ", "e\u0301", "A\u030a", "\u0301",  # jamo, NFC-changing, stray mark
    "<|im_start", "|>", "<|", "\x00", "\x7f", "\ufffd",
)  # fmt: skip
_WHITESPACE = (" ", "  ", "\t", "\n", "\r\n", "\r", "\u3000", "\xa0", "\u2009", "\n\n\n", " \n ")
_DIGITS = "0123456789٣３①½٠߀"
_RANGES = (
    (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x0400, 0x04FF), (0x0370, 0x03FF), (0x0600, 0x06FF),
    (0x0E00, 0x0E7F), (0x1F300, 0x1F6FF), (0x1F900, 0x1F9FF), (0x00A0, 0x024F), (0x2000, 0x2BFF),
)  # fmt: skip


def _piece(rng: random.Random, with_special: bool) -> str:
    kind = rng.randrange(9 if with_special else 8)
    if kind == 0:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ") for _ in range(rng.randint(1, 10)))
    if kind == 1:
        return rng.choice(",.;:!?-_()[]{}<>/\\\"'`~@#$%^&*+=|")  * rng.randint(1, 3)
    if kind == 2:
        lo, hi = rng.choice(_RANGES)
        return "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))
    if kind == 3:
        return rng.choice("aeiouxyzαкñ") + "".join(chr(rng.randint(0x0300, 0x036F)) for _ in range(rng.randint(1, 3)))
    if kind == 4:
        return rng.choice(_WHITESPACE) * rng.randint(1, 4)
    if kind == 5:
        return "".join(rng.choice(_DIGITS) for _ in range(rng.randint(1, 7)))
    if kind == 6:
        return rng.choice(_FIXED)
    if kind == 7:
        return " " + "".join(rng.choice("the quick brown fox") for _ in range(rng.randint(1, 8)))
    return rng.choice(SPECIAL_TOKENS)


def random_text(rng: random.Random, with_special: bool = True) -> str:
    """One string of 1..40 random pieces (special-token strings included when `with_special`; otherwise drawn again
    until no special-token string appears, e.g. from the pieces "<|im_start" and "|>" side by side)."""
    while True:
        text = "".join(_piece(rng, with_special) for _ in range(rng.randint(1, 40)))
        if with_special or not any(token in text for token in SPECIAL_TOKENS):
            return text
