"""Fixtures for the tokenizer/chat-template tests: transformers' tokenizer as the oracle, ours from HF and GGUF."""
from __future__ import annotations

import pytest
from text_samples import GGUF_PATH, HF_DIR


@pytest.fixture(scope="session")
def reference():
    """transformers' tokenizer for the fixture checkpoint (slow to import: once per session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(HF_DIR)


@pytest.fixture(scope="session")
def hf_tokenizer():
    from luxjax.text import Tokenizer

    return Tokenizer.from_hf_dir(HF_DIR)


@pytest.fixture(scope="session")
def gguf_metadata():
    import gguf

    from luxjax.text.gguf_tokenizer import gguf_tokenizer_metadata

    return gguf_tokenizer_metadata(gguf.GGUFReader(GGUF_PATH))


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_metadata):
    from luxjax.text import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(gguf_metadata)


@pytest.fixture(params=["hf", "gguf"])
def ours(request):
    """Each test taking `ours` runs for both loaders."""
    return request.getfixturevalue(f"{request.param}_tokenizer")
