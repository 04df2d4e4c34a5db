"""Frozen configs for the Qwen3.5 / Qwen3.8 dense vision-language model, read from HF `config.json` dicts.

The GGUF loader produces the same dicts (see luxjax/checkpoint/gguf_qwen35.py), so one parser serves both.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from luxjax.errors import ModelFormatError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


def rope_parameters(d: dict, *, partial_rotary_factor: float | None = None) -> dict:
    """The rope settings of a config dict as transformers gathers them (convert_rope_params_to_dict): a legacy
    `rope_scaling` dict, else `rope_parameters`, completed by the top-level `rope_theta` and `partial_rotary_factor`
    (else the defaults: DEFAULT_ROPE_THETA, and the model's `partial_rotary_factor`)."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    rope.setdefault("rope_theta", d.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = d.get("partial_rotary_factor", partial_rotary_factor)
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    attention_bias: bool = False  # biases on the full-attention layers' q/k/v/o projections
    # "grouped": HF order (key head g serves value heads g*r..g*r+r-1);
    # "tiled": llama.cpp order (value head i uses key head i % k_heads), kept for packed GGUF weights.
    linear_value_head_order: str = "grouped"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    def layer_pattern(self) -> tuple[tuple[str, ...], int]:
        """Smallest repeating unit of `layer_types` and its repeat count (the scan length)."""
        n = len(self.layer_types)
        for period in range(1, n + 1):
            if n % period == 0 and self.layer_types == self.layer_types[:period] * (n // period):
                return self.layer_types[:period], n // period
        raise AssertionError("unreachable")

    @classmethod
    def from_hf(cls, d: dict) -> "TextConfig":
        rope = rope_parameters(d, partial_rotary_factor=0.25)  # Qwen3_5TextConfig's default, kept for old configs
        n = d["num_hidden_layers"]
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
        layer_types = tuple(layer_types[:n])
        unknown = set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}
        if unknown:
            raise ModelFormatError(f"unknown layer types {sorted(unknown)} in text config")
        if rope["rope_type"] not in ("default", "mrope"):  # "mrope": Qwen2-VL's legacy name of the same rope
            raise ModelFormatError(f"rope_type {rope['rope_type']!r} is not supported (only 'default')")
        if not rope.get("mrope_interleaved", True):
            raise ModelFormatError("non-interleaved M-RoPE is not supported by the qwen35 model")
        heads = d["num_attention_heads"]
        cfg = cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=n,
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            linear_num_key_heads=d["linear_num_key_heads"],
            linear_num_value_heads=d["linear_num_value_heads"],
            linear_key_head_dim=d["linear_key_head_dim"],
            linear_value_head_dim=d["linear_value_head_dim"],
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
            layer_types=layer_types,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            partial_rotary_factor=rope["partial_rotary_factor"],
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10)))[:3],
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            max_position_embeddings=d.get("max_position_embeddings", 262144),
            attention_bias=bool(d.get("attention_bias", False)),
            linear_value_head_order=d.get("linear_value_head_order", "grouped"),
        )
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ModelFormatError(
                f"linear value heads ({cfg.linear_num_value_heads}) must be a multiple of key heads "
                f"({cfg.linear_num_key_heads})"
            )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelFormatError(f"{heads=} must be a multiple of num_key_value_heads={cfg.num_key_value_heads}")
        return cfg


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 1e4
    layer_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned position-embedding grid: transformers' int(num_position_embeddings ** 0.5), which
        leaves the rows past the largest square unused when the count is not a square."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_hf(cls, d: dict) -> "VisionConfig":
        if d.get("deepstack_visual_indexes"):
            raise ModelFormatError(
                f"vision tower with deepstack layers {d['deepstack_visual_indexes']} is not a Qwen3.5 tower"
            )
        if d.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu"):
            raise ModelFormatError(f"vision hidden_act {d['hidden_act']!r} is not supported")
        return cls(
            depth=d["depth"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_heads=d["num_heads"],
            out_hidden_size=d["out_hidden_size"],
            num_position_embeddings=d["num_position_embeddings"],
            patch_size=d.get("patch_size", 16),
            spatial_merge_size=d.get("spatial_merge_size", 2),
            temporal_patch_size=d.get("temporal_patch_size", 2),
            in_channels=d.get("in_channels", 3),
            hidden_act=d.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=rope_parameters(d)["rope_theta"],
            layer_norm_eps=d.get("layer_norm_eps", 1e-6),
        )


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        text = TextConfig.from_hf(d.get("text_config", d))
        vision = VisionConfig.from_hf(d["vision_config"]) if d.get("vision_config") else None
        return cls(
            text=text,
            vision=vision,
            image_token_id=d.get("image_token_id"),
            vision_start_token_id=d.get("vision_start_token_id"),
            vision_end_token_id=d.get("vision_end_token_id"),
        )

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
