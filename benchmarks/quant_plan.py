"""Random GGUF-quantized decoders for speed benchmarks: llama.cpp's type plan (which ggml type each decoder tensor
gets under IQ4_XS or Q4_K_M) and random packed blocks of those types, so a 27B-shaped IQ4_XS model can be timed
without a 15 GB checkpoint.

The plan reproduces what llama.cpp's quantizer wrote into tests/fixtures (tiny-qwen35-a-IQ4_XS / -Q4_K_M, 8 layers;
tests/checkpoint/test_quant_plan.py checks it tensor by tensor): the output head in Q6_K; under Q4_K_M the value
projections (attn_v, and the DeltaNet's fused attn_qkv, counted together by layer) and ffn_down in Q6_K on
llama.cpp's "more bits" layers, else Q4_K; under IQ4_XS ffn_down in Q5_K on the first eighth of the layers, all else
IQ4_XS. Norms, conv, gates' biases and the vision tower stay dense.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from luxjax.checkpoint.quant_formats import FORMATS
from luxjax.checkpoint.quants import QuantizedTensor

SCHEMES = ("IQ4_XS", "Q4_K_M")
# HF parameter name (inside a decoder layer) -> llama.cpp tensor role
HF_ROLES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta", "linear_attn.out_proj": "ssm_out",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
# Largest |value| a block can decode to per unit of its f16 scale (d): random scales are set so weights stay < 0.05.
_RANGE_PER_SCALE = {"IQ4_XS": 32 * 127, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "Q8_0": 127}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get the larger type: the first and last eighth, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def ggml_type_for(scheme: str, role: str, layer: int | None, n_layers: int) -> str:
    """The ggml type name of a 2-D tensor `role` ("output", "token_embd", or a per-layer role) under `scheme`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
    if role == "output":
        return "Q6_K"
    if scheme == "Q4_K_M":
        if role in ("attn_v", "attn_qkv", "ffn_down") and use_more_bits(layer, n_layers):
            return "Q6_K"
        return "Q4_K"
    if role == "ffn_down" and layer < n_layers // 8:
        return "Q5_K"
    return "IQ4_XS"


def hf_role(name: str) -> tuple[str, int | None] | None:
    """(llama.cpp role, layer) of an HF text-decoder weight name, or None for tensors kept dense."""
    if name == "lm_head.weight":
        return "output", None
    if name.endswith("embed_tokens.weight") and "visual" not in name:
        return "token_embd", None
    m = re.search(r"language_model\.layers\.(\d+)\.(.+)\.weight$", name)
    if m and m.group(2) in HF_ROLES:
        return HF_ROLES[m.group(2)], int(m.group(1))
    return None


def random_packed(shape, ggml_type, key, dtype) -> QuantizedTensor:
    """A QuantizedTensor of random blocks made on the device: random quant bits, small positive f16 scales (so
    every weight decodes finite and below 0.05)."""
    qtype = GGMLQuantizationType[ggml_type] if isinstance(ggml_type, str) else GGMLQuantizationType(ggml_type)
    block, _ = GGML_QUANT_SIZES[qtype]
    rows, blocks = math.prod(shape[:-1]), shape[-1] // block
    scale = 0.05 / _RANGE_PER_SCALE.get(qtype.name, 100)
    planes = {}
    for field in FORMATS[qtype].fields:
        key, sub = jax.random.split(key)
        dt = np.dtype(field.dtype)
        plane = (rows, blocks, field.nbytes // dt.itemsize)
        if field.name in ("d", "dmin", "m"):
            values = jax.random.uniform(sub, plane, jnp.float32, 0.5 * scale, scale).astype(jnp.float16)
            planes[field.name] = jax.lax.bitcast_convert_type(values, jnp.uint16)
        else:
            bits = jax.random.bits(sub, plane, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[dt.itemsize])
            planes[field.name] = jax.lax.bitcast_convert_type(bits, dt)
    return QuantizedTensor(planes, qtype, tuple(int(d) for d in shape), jnp.dtype(dtype))


def quantize_at_random(tensors: dict, scheme: str, n_layers: int, dtype, seed: int = 0, progress=None) -> dict:
    """`tensors` with every planned decoder weight replaced by random packed blocks of its planned type."""
    key = jax.random.key(seed)
    out = dict(tensors)
    names = [n for n in tensors if hf_role(n)]
    for i, name in enumerate(progress(names) if progress else names):
        role, layer = hf_role(name)
        qtype = ggml_type_for(scheme, role, layer, n_layers)
        out[name] = random_packed(tuple(tensors[name].shape), qtype, jax.random.fold_in(key, i), dtype)
    return out


def decoder_weights(tensors: dict, weights: str, cfg_dict: dict, dtype, *, progress: bool = False) -> dict:
    """A random model's tensors as a benchmark's --weights asks: as they are for "bf16", else with the decoder's
    weights as random packed blocks of that scheme's mix (quantize_at_random; a progress bar where asked)."""
    if weights == "bf16":
        return tensors
    bar = (lambda names: tqdm(names, desc=f"random {weights} blocks")) if progress else None
    return quantize_at_random(tensors, weights, cfg_dict["text_config"]["num_hidden_layers"], dtype, progress=bar)
