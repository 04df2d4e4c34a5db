"""The packaged demo model: procedural shape questions (data), its tokenizer, training, GGUF export and HTTP eval."""
