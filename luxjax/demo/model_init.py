"""Shape of the packaged demo model (an HF-style Qwen3.5 config dict) and its random initialisation as a dict of
Hugging Face-named float32 arrays: the same names the real checkpoints use, so the real model code builds it."""
from __future__ import annotations

import numpy as np

# Images are kept small: 4096..65536 pixels -> at most 64 merged tokens (256 patches) per image.
MIN_PIXELS, MAX_PIXELS = 4096, 65536
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)


DECODER_LAYERS, VISION_DEPTH = 8, 4


def model_config(vocab_size: int, ids: dict[str, int], layers: int = DECODER_LAYERS,
                 vision_depth: int = VISION_DEPTH) -> dict:
    """HF config.json dict. `ids`: token ids of <|image_pad|>, <|vision_start|>, <|vision_end|>, <|im_end|>,
    <|endoftext|> in the demo tokenizer. `layers` (even): DeltaNet and attention layers alternate, so half of them
    read the images by attention."""
    if layers < 2 or layers % 2:
        raise ValueError(f"layers must be a positive even number, got {layers}")
    layers = ["linear_attention", "full_attention"] * (layers // 2)
    text = {
        "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": len(layers), "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4, "layer_types": layers, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    }  # fmt: skip
    vision = {
        "depth": vision_depth, "hidden_size": 192, "intermediate_size": 384, "num_heads": 3, "out_hidden_size": 256,
        "num_position_embeddings": 256, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "in_channels": 3, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }  # fmt: skip
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }  # fmt: skip


def demo_config(meta: dict, layers: int = DECODER_LAYERS, vision_depth: int = VISION_DEPTH) -> dict:
    """model_config for the demo tokenizer given as its GGUF metadata (vocabulary size and special-token ids)."""
    from luxjax.demo.tokenizer_train import SPECIAL_TOKENS, tokenizer_from_metadata

    tok = tokenizer_from_metadata(meta)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return model_config(len(meta["tokenizer.ggml.tokens"]), ids, layers, vision_depth)


def init_params(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Matrices ~ N(0, 0.02); zero-centred RMSNorm weights 0 (scale 1); DeltaNet output norm 1; LayerNorms 1/0;
    A_log ~ log U(1, 16); dt_bias 1."""
    rng = np.random.default_rng(seed)
    t, v = cfg["text_config"], cfg["vision_config"]
    out: dict[str, np.ndarray] = {}

    def mat(name, *shape):
        out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def const(name, value, *shape):
        out[name] = np.full(shape, value, np.float32)

    h, f, V = t["hidden_size"], t["intermediate_size"], t["vocab_size"]
    lm = "model.language_model."
    mat(lm + "embed_tokens.weight", V, h)
    mat("lm_head.weight", V, h)
    const(lm + "norm.weight", 0.0, h)
    kd = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    vh = t["linear_num_value_heads"]
    vd = vh * t["linear_value_head_dim"]
    hd, heads, kv = t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"]
    for i, kind in enumerate(t["layer_types"]):
        p = f"{lm}layers.{i}."
        const(p + "input_layernorm.weight", 0.0, h)
        const(p + "post_attention_layernorm.weight", 0.0, h)
        mat(p + "mlp.gate_proj.weight", f, h)
        mat(p + "mlp.up_proj.weight", f, h)
        mat(p + "mlp.down_proj.weight", h, f)
        if kind == "full_attention":
            mat(p + "self_attn.q_proj.weight", 2 * heads * hd, h)
            mat(p + "self_attn.k_proj.weight", kv * hd, h)
            mat(p + "self_attn.v_proj.weight", kv * hd, h)
            mat(p + "self_attn.o_proj.weight", h, heads * hd)
            const(p + "self_attn.q_norm.weight", 0.0, hd)
            const(p + "self_attn.k_norm.weight", 0.0, hd)
        else:
            a = p + "linear_attn."
            mat(a + "in_proj_qkv.weight", 2 * kd + vd, h)
            mat(a + "in_proj_z.weight", vd, h)
            mat(a + "in_proj_a.weight", vh, h)
            mat(a + "in_proj_b.weight", vh, h)
            out[a + "conv1d.weight"] = (rng.standard_normal((2 * kd + vd, 1, t["linear_conv_kernel_dim"])) * 0.3
                                        ).astype(np.float32)
            const(a + "dt_bias", 1.0, vh)
            out[a + "A_log"] = np.log(rng.uniform(1, 16, vh)).astype(np.float32)
            const(a + "norm.weight", 1.0, t["linear_value_head_dim"])
            mat(a + "out_proj.weight", h, vd)
    vz, vf, p = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = vz * v["spatial_merge_size"] ** 2
    vis = "model.visual."
    mat(vis + "patch_embed.proj.weight", vz, v["in_channels"], v["temporal_patch_size"], p, p)
    const(vis + "patch_embed.proj.bias", 0.0, vz)
    mat(vis + "pos_embed.weight", v["num_position_embeddings"], vz)
    for i in range(v["depth"]):
        b = f"{vis}blocks.{i}."
        for norm in ("norm1", "norm2"):
            const(b + norm + ".weight", 1.0, vz)
            const(b + norm + ".bias", 0.0, vz)
        for name, shape in (("attn.qkv", (3 * vz, vz)), ("attn.proj", (vz, vz)), ("mlp.linear_fc1", (vf, vz)),
                            ("mlp.linear_fc2", (vz, vf))):
            mat(b + name + ".weight", *shape)
            const(b + name + ".bias", 0.0, shape[0])
    const(vis + "merger.norm.weight", 1.0, vz)
    const(vis + "merger.norm.bias", 0.0, vz)
    mat(vis + "merger.linear_fc1.weight", merged, merged)
    const(vis + "merger.linear_fc1.bias", 0.0, merged)
    mat(vis + "merger.linear_fc2.weight", t["hidden_size"], merged)
    const(vis + "merger.linear_fc2.bias", 0.0, t["hidden_size"])
    return out


# Output projections of a block: zero makes the block an exact identity on its residual stream.
_DECODER_OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")
_VISION_OUTPUTS = ("attn.proj.weight", "attn.proj.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


def grow_params(params: dict, small: dict, big: dict, seed: int) -> dict[str, np.ndarray]:
    """Parameters of config `big` that compute exactly what `params` (of config `small`) compute: `big` may only add
    decoder layers after the last one and vision blocks after the last one; the new blocks are freshly initialised
    with their output projections zeroed, so they start as identities and training grows them from there."""
    st, bt, sv, bv = small["text_config"], big["text_config"], small["vision_config"], big["vision_config"]
    n, d = len(st["layer_types"]), sv["depth"]
    same = (bt["layer_types"][:n] == st["layer_types"] and bv["depth"] >= d
            and _without(bt, "layer_types", "num_hidden_layers") == _without(st, "layer_types", "num_hidden_layers")
            and _without(bv, "depth") == _without(sv, "depth")
            and _without(big, "text_config", "vision_config") == _without(small, "text_config", "vision_config"))
    if not same:
        raise ValueError("the larger config must equal the smaller one except for appended layers and blocks")
    out = init_params(big, seed)
    for name, value in params.items():
        if out[name].shape != value.shape:
            raise ValueError(f"{name}: shape {value.shape}, the config says {out[name].shape}")
        out[name] = value
    new = [f"model.language_model.layers.{i}.{o}" for i in range(n, len(bt["layer_types"])) for o in _DECODER_OUTPUTS]
    new += [f"model.visual.blocks.{i}.{o}" for i in range(d, bv["depth"]) for o in _VISION_OUTPUTS]
    for name in new:
        if name in out:
            out[name] = np.zeros_like(out[name])
    return out


def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}
