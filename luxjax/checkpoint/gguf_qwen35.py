"""Qwen3.5 decoder from a llama.cpp GGUF file, under Hugging Face names and orientation.

What llama.cpp's converter changed and how it is handled here (facts: shared/reference/qwen35.md):
- `+1` folded into every RMSNorm weight except the DeltaNet output norm (`ssm_norm`): subtracted again.
- `ssm_a = -exp(A_log)`: A_log = log(-ssm_a).
- conv1d squeezed to [channels, K]: restored to HF's [channels, 1, K].
- DeltaNet value heads reordered from grouped to tiled order (rows of attn_qkv's v part, attn_gate, ssm_alpha,
  ssm_beta, ssm_a, ssm_dt, v channels of ssm_conv1d, COLUMNS of ssm_out). Columns of a packed quantized matrix
  cannot be permuted, so every tensor is kept in tiled order and the config says so
  (`linear_value_head_order: "tiled"`); the model then maps value head i to key head i % k_heads.
The value transforms above only touch tensors llama.cpp stores as floats (norms, ssm_a, conv1d); a quantized one
is refused. Every other weight is handed to `materialize` as packed as it is in the file.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from luxjax.checkpoint.gguf_mmproj import load_qwen35_mmproj
from luxjax.checkpoint.gguf_reader import (
    LoadedCheckpoint,
    Materialize,
    Wanted,
    load_wanted,
    read_gguf,
    read_gguf_metadata,
    require_key,
)
from luxjax.checkpoint.quants import to_device_weight
from luxjax.errors import ModelFormatError

__all__ = ["LoadedCheckpoint", "load_qwen35_gguf", "load_qwen35_mmproj", "read_gguf_metadata"]

ARCH = "qwen35"
HF_PREFIX = "model.language_model."


def load_qwen35_gguf(
    path: str | os.PathLike, *, progress: bool = True, materialize: Materialize = to_device_weight
) -> LoadedCheckpoint:
    """Load a qwen35 GGUF decoder. MTP (nextn) blocks after the real layers are not loaded.

    `materialize` defaults to quants.to_device_weight (packed quantized weights); tests pass a dequantizer.
    """
    metadata, tensors, file_bytes = read_gguf(path)
    arch = metadata.get("general.architecture")
    if arch != ARCH:
        raise ModelFormatError(f"{os.fspath(path)}: general.architecture is {arch!r}, expected {ARCH!r}")
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{os.fspath(path)}: missing required tensors: token_embd.weight")
    vocab_size = tensors["token_embd.weight"].shape[0]
    text_config = text_config_from_metadata(metadata, vocab_size, "output.weight" not in tensors, path)
    loaded = load_wanted(
        tensors,
        decoder_plan(text_config),
        path=path,
        materialize=materialize,
        progress=progress,
    )
    return LoadedCheckpoint(loaded, metadata, file_bytes, text_config=text_config)


def text_config_from_metadata(
    md: dict[str, Any], vocab_size: int, tie_word_embeddings: bool, path: str | os.PathLike
) -> dict[str, Any]:
    """HF `text_config` keys (as in config.json) plus `linear_value_head_order`."""

    def key(name: str) -> Any:
        return require_key(md, f"{ARCH}.{name}", path)

    deepstack = md.get(f"{ARCH}.n_deepstack_layers", 0)
    if deepstack:
        raise ModelFormatError(f"{os.fspath(path)}: {ARCH}.n_deepstack_layers = {deepstack}; deepstack unsupported")
    num_layers = key("block_count") - md.get(f"{ARCH}.nextn_predict_layers", 0)
    head_dim = key("attention.key_length")
    if key("attention.value_length") != head_dim:
        raise ModelFormatError(
            f"{os.fspath(path)}: attention.key_length {head_dim} != attention.value_length "
            f"{key('attention.value_length')}"
        )
    v_heads, inner = key("ssm.time_step_rank"), key("ssm.inner_size")
    if inner % v_heads:
        raise ModelFormatError(
            f"{os.fspath(path)}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}"
        )
    return {
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": num_layers,
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads,
        "layer_types": _layer_types(md, num_layers, path),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": key("rope.freq_base"),
            "partial_rotary_factor": key("rope.dimension_count") / head_dim,
            "mrope_section": list(key("rope.dimension_sections")[:3]),
            "mrope_interleaved": True,
        },
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "max_position_embeddings": key("context_length"),
        "linear_value_head_order": "tiled",
    }


def _layer_types(md: dict[str, Any], num_layers: int, path: str | os.PathLike) -> list[str]:
    """attention.recurrent_layers (one bool per block) wins over full_attention_interval."""
    recurrent = md.get(f"{ARCH}.attention.recurrent_layers")
    if recurrent is not None:
        if len(recurrent) < num_layers:
            raise ModelFormatError(
                f"{os.fspath(path)}: attention.recurrent_layers has {len(recurrent)} entries for {num_layers} layers"
            )
        return ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]
    interval = require_key(md, f"{ARCH}.full_attention_interval", path)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def decoder_plan(cfg: dict[str, Any]) -> list[Wanted]:
    """Every tensor the model needs: HF name, GGUF name, expected numpy shape, value transform."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    plan = [
        Wanted(HF_PREFIX + "embed_tokens.weight", ("token_embd.weight",), (vocab, hidden)),
        Wanted(HF_PREFIX + "norm.weight", ("output_norm.weight",), (hidden,), unfold_norm),
    ]
    if not cfg["tie_word_embeddings"]:
        plan.append(Wanted("lm_head.weight", ("output.weight",), (vocab, hidden)))
    for i, kind in enumerate(cfg["layer_types"]):
        mixer = _attention_rows(cfg) if kind == "full_attention" else _deltanet_rows(cfg)
        plan += [
            Wanted(f"{HF_PREFIX}layers.{i}.{hf}", (f"blk.{i}.{gg}",), shape, transform)
            for hf, gg, shape, transform in _block_rows(cfg) + mixer
        ]
    return plan


def _block_rows(cfg: dict[str, Any]) -> list[tuple]:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    return [
        ("input_layernorm.weight", "attn_norm.weight", (h,), unfold_norm),
        ("post_attention_layernorm.weight", "post_attention_norm.weight", (h,), unfold_norm),
        ("mlp.gate_proj.weight", "ffn_gate.weight", (f, h), None),
        ("mlp.up_proj.weight", "ffn_up.weight", (f, h), None),
        ("mlp.down_proj.weight", "ffn_down.weight", (h, f), None),
    ]


def _attention_rows(cfg: dict[str, Any]) -> list[tuple]:
    """attn_q holds query and output gate interleaved per head ([q_h, gate_h] blocks), exactly as HF q_proj."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return [
        ("self_attn.q_proj.weight", "attn_q.weight", (2 * q, h), None),
        ("self_attn.k_proj.weight", "attn_k.weight", (kv, h), None),
        ("self_attn.v_proj.weight", "attn_v.weight", (kv, h), None),
        ("self_attn.o_proj.weight", "attn_output.weight", (h, q), None),
        ("self_attn.q_norm.weight", "attn_q_norm.weight", (d,), unfold_norm),
        ("self_attn.k_norm.weight", "attn_k_norm.weight", (d,), unfold_norm),
    ]


def _deltanet_rows(cfg: dict[str, Any]) -> list[tuple]:
    """Gated DeltaNet tensors, all in tiled value-head order (see module docstring)."""
    h, kernel = cfg["hidden_size"], cfg["linear_conv_kernel_dim"]
    v_heads, v_dim = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    qk = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    v = v_heads * v_dim
    return [
        ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", (2 * qk + v, h), None),
        ("linear_attn.in_proj_z.weight", "attn_gate.weight", (v, h), None),
        ("linear_attn.in_proj_a.weight", "ssm_alpha.weight", (v_heads, h), None),
        ("linear_attn.in_proj_b.weight", "ssm_beta.weight", (v_heads, h), None),
        ("linear_attn.conv1d.weight", "ssm_conv1d.weight", (2 * qk + v, kernel), unsqueeze_conv1d),
        ("linear_attn.dt_bias", "ssm_dt.bias", (v_heads,), None),
        ("linear_attn.A_log", "ssm_a", (v_heads,), a_log_from_ssm_a),
        ("linear_attn.norm.weight", "ssm_norm.weight", (v_dim,), None),
        ("linear_attn.out_proj.weight", "ssm_out.weight", (h, v), None),
    ]


def unfold_norm(w: np.ndarray) -> np.ndarray:
    """The converter stored 1 + w for zero-centred RMSNorms (llama.cpp multiplies by the weight directly)."""
    return w - np.float32(1.0)


def a_log_from_ssm_a(ssm_a: np.ndarray) -> np.ndarray:
    """The converter stored -exp(A_log); invert in float64 so only the final float32 rounding remains."""
    if np.any(ssm_a >= 0):
        raise ModelFormatError(f"ssm_a must be negative (it stores -exp(A_log)); found max {float(ssm_a.max())}")
    return np.log(-ssm_a.astype(np.float64)).astype(np.float32)


def unsqueeze_conv1d(w: np.ndarray) -> np.ndarray:
    """[channels, K] back to HF's depthwise Conv1d weight [channels, 1, K]."""
    return w[:, None, :]
