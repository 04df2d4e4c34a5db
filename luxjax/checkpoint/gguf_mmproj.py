"""Qwen3.5 vision tower + merger from a llama.cpp clip "mmproj" GGUF, under Hugging Face names (`model.visual.`).

Only `qwen3vl_merger` projectors without deepstack are accepted. The Conv3d patch embedding was split by the
converter into its two temporal slices (`v.patch_embd.weight` = t 0, `v.patch_embd.weight.1` = t 1); they are
stacked back into HF's [hidden, 3, 2, p, p]. That weight and the position table are decoded to float32 on load
even when quantized: they are small, the first must be reshaped and the second is resampled, not multiplied.
Every other weight is handed to `materialize` as packed as it is in the file.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from luxjax.checkpoint.gguf_reader import (
    LoadedCheckpoint,
    Materialize,
    Wanted,
    load_wanted,
    read_gguf,
    require_key,
)
from luxjax.checkpoint.quants import to_device_weight
from luxjax.errors import ModelFormatError

PROJECTOR_TYPE = "qwen3vl_merger"
HF_PREFIX = "model.visual."
# Released Qwen3.5 preprocessor_config.json limits, used when the converter wrote no
# clip.vision.image_min_pixels / image_max_pixels (llama.cpp's converter writes none for qwen3vl_merger).
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216


def load_qwen35_mmproj(
    path: str | os.PathLike, *, progress: bool = True, materialize: Materialize = to_device_weight
) -> LoadedCheckpoint:
    """Load a clip mmproj GGUF for Qwen3.5; `materialize` as in load_qwen35_gguf."""
    metadata, tensors, file_bytes = read_gguf(path)
    _check_projector(metadata, tensors, path)
    vision_config = vision_config_from_metadata(metadata, path)
    loaded = load_wanted(
        tensors,
        projector_plan(vision_config),
        path=path,
        materialize=materialize,
        progress=progress,
    )
    return LoadedCheckpoint(
        loaded,
        metadata,
        file_bytes,
        vision_config=vision_config,
        preprocessor_config=preprocessor_config_from_metadata(metadata, vision_config, path),
    )


def _check_projector(md: dict[str, Any], tensors: dict[str, Any], path: str | os.PathLike) -> None:
    where = os.fspath(path)
    arch = md.get("general.architecture")
    if arch != "clip":
        raise ModelFormatError(f"{where}: general.architecture is {arch!r}, expected 'clip' (an mmproj file)")
    if not md.get("clip.has_vision_encoder", False):
        raise ModelFormatError(f"{where}: projector has no vision encoder (clip.has_vision_encoder is not true)")
    # Files with several modalities name the vision projector under clip.vision.
    projector = md.get("clip.vision.projector_type", md.get("clip.projector_type"))
    if projector != PROJECTOR_TYPE:
        raise ModelFormatError(f"{where}: projector type is {projector!r}, expected {PROJECTOR_TYPE!r}")
    layers = [i for i, flag in enumerate(md.get("clip.vision.is_deepstack_layers", [])) if flag]
    deepstack_tensors = sorted(name for name in tensors if "deepstack" in name)
    found = [f"clip.vision.is_deepstack_layers true at layers {layers}"] if layers else []
    found += [f"tensors {', '.join(deepstack_tensors[:4])}"] if deepstack_tensors else []
    if found:
        raise ModelFormatError(f"{where}: deepstack projectors are not supported; found {'; '.join(found)}")


def vision_config_from_metadata(md: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """HF `vision_config` keys, plus `layer_norm_eps` (fixed to 1e-6 in transformers, written by the converter)."""

    def key(name: str) -> Any:
        return require_key(md, f"clip.vision.{name}", path)

    patch, image_size = key("patch_size"), key("image_size")
    if image_size % patch:
        raise ModelFormatError(
            f"{os.fspath(path)}: clip.vision.image_size {image_size} is not a multiple of patch_size {patch}"
        )
    return {
        "depth": key("block_count"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_heads": key("attention.head_count"),
        "patch_size": patch,
        "spatial_merge_size": key("spatial_merge_size"),
        "temporal_patch_size": 2,
        "out_hidden_size": key("projection_dim"),
        "num_position_embeddings": (image_size // patch) ** 2,
        "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": key("attention.layer_norm_epsilon"),
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }


def preprocessor_config_from_metadata(
    md: dict[str, Any], vision_config: dict[str, Any], path: str | os.PathLike
) -> dict[str, Any]:
    """HF preprocessor_config.json keys; pixel limits default to the released ones (see DEFAULT_MIN_PIXELS)."""
    return {
        "image_mean": list(require_key(md, "clip.vision.image_mean", path)),
        "image_std": list(require_key(md, "clip.vision.image_std", path)),
        "patch_size": vision_config["patch_size"],
        "merge_size": vision_config["spatial_merge_size"],
        "temporal_patch_size": vision_config["temporal_patch_size"],
        "size": {
            "shortest_edge": md.get("clip.vision.image_min_pixels", DEFAULT_MIN_PIXELS),
            "longest_edge": md.get("clip.vision.image_max_pixels", DEFAULT_MAX_PIXELS),
        },
    }


def projector_plan(cfg: dict[str, Any]) -> list[Wanted]:
    """Every tensor the vision tower and merger need: HF name, GGUF name(s), expected numpy shape, transform."""
    h, f, p = cfg["hidden_size"], cfg["intermediate_size"], cfg["patch_size"]
    merged = h * cfg["spatial_merge_size"] ** 2
    plan = [
        Wanted(
            HF_PREFIX + "patch_embed.proj.weight",
            ("v.patch_embd.weight", "v.patch_embd.weight.1"),
            (h, cfg["in_channels"], p, p),
            stack_temporal,
            float_only=False,
        ),
        Wanted(HF_PREFIX + "patch_embed.proj.bias", ("v.patch_embd.bias",), (h,)),
        Wanted(
            HF_PREFIX + "pos_embed.weight",
            ("v.position_embd.weight",),
            (cfg["num_position_embeddings"], h),
            decoded,
            float_only=False,
        ),
    ]
    for i in range(cfg["depth"]):
        plan += _linear_pair(f"blocks.{i}.norm1", f"v.blk.{i}.ln1", (h,))
        plan += _linear_pair(f"blocks.{i}.norm2", f"v.blk.{i}.ln2", (h,))
        plan += _linear_pair(f"blocks.{i}.attn.qkv", f"v.blk.{i}.attn_qkv", (3 * h, h))
        plan += _linear_pair(f"blocks.{i}.attn.proj", f"v.blk.{i}.attn_out", (h, h))
        plan += _linear_pair(f"blocks.{i}.mlp.linear_fc1", f"v.blk.{i}.ffn_up", (f, h))
        plan += _linear_pair(f"blocks.{i}.mlp.linear_fc2", f"v.blk.{i}.ffn_down", (h, f))
    plan += _linear_pair("merger.norm", "v.post_ln", (h,))
    plan += _linear_pair("merger.linear_fc1", "mm.0", (merged, merged))
    plan += _linear_pair("merger.linear_fc2", "mm.2", (cfg["out_hidden_size"], merged))
    return plan


def _linear_pair(hf: str, gguf: str, weight_shape: tuple[int, ...]) -> list[Wanted]:
    """weight + bias of a Linear or LayerNorm (bias length = first weight dim)."""
    return [
        Wanted(f"{HF_PREFIX}{hf}.weight", (f"{gguf}.weight",), weight_shape),
        Wanted(f"{HF_PREFIX}{hf}.bias", (f"{gguf}.bias",), weight_shape[:1]),
    ]


def stack_temporal(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Two [hidden, C, p, p] temporal slices -> Conv3d weight [hidden, C, 2, p, p]."""
    return np.stack([t0, t1], axis=2)


def decoded(values: np.ndarray) -> np.ndarray:
    """Identity on the decoded float32 values: the tensor is wanted dense whatever its file type."""
    return values
