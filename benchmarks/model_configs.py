"""Named HF-style configs for benchmarks: real Qwen3.5 shapes and small ones (random weights)."""
from __future__ import annotations

import copy

QWEN35_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
        "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    },
    "vision_config": {
        "model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 5120,
        "num_position_embeddings": 2304, "in_channels": 3, "hidden_act": "gelu_pytorch_tanh",
    },
}


def _shrunk(layers: int, hidden: int, ffn: int, vision_depth: int) -> dict:
    cfg = copy.deepcopy(QWEN35_27B)
    cfg["text_config"].update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn)
    cfg["vision_config"].update(depth=vision_depth, out_hidden_size=hidden)
    return cfg


CONFIGS = {
    "qwen35-27b": QWEN35_27B,
    "small": _shrunk(8, 1024, 3072, 4),
    "tiny": {
        **_shrunk(4, 256, 512, 2),
        "image_token_id": 4056, "video_token_id": 4057, "vision_start_token_id": 4053, "vision_end_token_id": 4054,
        "text_config": {**_shrunk(4, 256, 512, 2)["text_config"], "vocab_size": 4096, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
                        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64},
        "vision_config": {**_shrunk(4, 256, 512, 2)["vision_config"], "hidden_size": 128, "intermediate_size": 256,
                          "num_heads": 2, "num_position_embeddings": 256},
    },
}
# The 27B's 64 layers at the tiny widths: compile time (which grows with the scanned layer bodies, not the widths)
# measured without a GPU.
CONFIGS["deep-tiny"] = copy.deepcopy(CONFIGS["tiny"])
CONFIGS["deep-tiny"]["text_config"]["num_hidden_layers"] = 64
