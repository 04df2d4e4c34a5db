"""Tokenizers and chat templates: text <-> ids as transformers produces them, from HF directories or GGUF files."""
from luxjax.text.chat_template import render_chat
from luxjax.text.gguf_tokenizer import tokenizer_from_gguf_metadata
from luxjax.text.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "Tokenizer", "render_chat", "tokenizer_from_gguf_metadata"]
