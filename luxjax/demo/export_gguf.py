"""Export the trained demo model as llama.cpp files: a `qwen35` GGUF decoder and a clip `mmproj` GGUF.

`python -m luxjax.demo.export_gguf [--src out/demo] [--dst luxjax/assets/default]`

This is the exact inverse of luxjax's loaders (luxjax/checkpoint/gguf_qwen35.py, gguf_mmproj.py), following
llama.cpp's converter: +1 folded into zero-centred norms (not ssm_norm), ssm_a = -exp(A_log), conv1d squeezed to
[C, K], DeltaNet value heads reordered grouped -> tiled, the Conv3d patch embedding split in its two temporal slices.
Tensors are numpy arrays in numpy order (matrices F16 by default, vectors F32, as llama.cpp's converter stores
them); the gguf writer stores them in ggml (reversed) dimension order. `load_exported` reads such a pair back
through the same loaders, as the HF-named float32 parameters training starts from (`train --resume`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from luxjax.demo.model_init import IMAGE_MEAN, IMAGE_STD, MAX_PIXELS, MIN_PIXELS

FILE_TYPES = {"F16": np.float16, "F32": np.float32}  # what matrices are stored as; vectors are always F32


def file_names(file_type: str) -> tuple[str, str]:
    return f"luxjax-demo-qwen35-{file_type}.gguf", f"mmproj-luxjax-demo-qwen35-{file_type}.gguf"


LM, VIS = "model.language_model.", "model.visual."


def tiled_order(v_heads: int, k_heads: int) -> np.ndarray:
    """perm with tiled[i] = grouped[perm[i]]: tiled head j*k_heads + g is grouped head g*r + j."""
    r = v_heads // k_heads
    return np.array([(i % k_heads) * r + i // k_heads for i in range(v_heads)])


def _heads(x: np.ndarray, perm: np.ndarray, axis: int = 0) -> np.ndarray:
    """Reorder `len(perm)` equal blocks of `x` along `axis`."""
    parts = np.split(x, len(perm), axis=axis)
    return np.concatenate([parts[i] for i in perm], axis=axis)


def decoder_tensors(params: dict, t: dict) -> dict[str, np.ndarray]:
    perm = tiled_order(t["linear_num_value_heads"], t["linear_num_key_heads"])
    qk = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"]
    f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    out = {
        "token_embd.weight": params[LM + "embed_tokens.weight"],
        "output_norm.weight": params[LM + "norm.weight"] + 1,
        "output.weight": params["lm_head.weight"],
    }
    for i, kind in enumerate(t["layer_types"]):
        p, b = f"{LM}layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = params[p + "input_layernorm.weight"] + 1
        out[b + "post_attention_norm.weight"] = params[p + "post_attention_layernorm.weight"] + 1
        for gg, hf in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            out[f"{b}{gg}.weight"] = params[f"{p}mlp.{hf}.weight"]
        if kind == "full_attention":
            a = p + "self_attn."
            for gg, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                out[f"{b}{gg}.weight"] = params[f"{a}{hf}.weight"]
            out[b + "attn_q_norm.weight"] = params[a + "q_norm.weight"] + 1
            out[b + "attn_k_norm.weight"] = params[a + "k_norm.weight"] + 1
            continue
        a = p + "linear_attn."
        qkv = params[a + "in_proj_qkv.weight"]
        conv = params[a + "conv1d.weight"][:, 0, :]
        out[b + "attn_qkv.weight"] = np.concatenate([qkv[:qk], _heads(qkv[qk:], perm)])
        out[b + "attn_gate.weight"] = _heads(params[a + "in_proj_z.weight"], perm)
        out[b + "ssm_alpha.weight"] = _heads(params[a + "in_proj_a.weight"], perm)
        out[b + "ssm_beta.weight"] = _heads(params[a + "in_proj_b.weight"], perm)
        out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], _heads(conv[qk:], perm)])
        out[b + "ssm_dt.bias"] = _heads(params[a + "dt_bias"], perm)
        out[b + "ssm_a"] = _heads(-np.exp(params[a + "A_log"].astype(np.float64)), perm)
        out[b + "ssm_norm.weight"] = params[a + "norm.weight"]
        out[b + "ssm_out.weight"] = _heads(params[a + "out_proj.weight"], perm, axis=1)
    return {k: f32(v) for k, v in out.items()}


def stored(tensors: dict[str, np.ndarray], file_type: str) -> dict[str, np.ndarray]:
    """Matrices (and higher) in the file type, vectors in F32."""
    return {k: v.astype(FILE_TYPES[file_type]) if v.ndim >= 2 else v for k, v in tensors.items()}


def write_decoder(path, params: dict, cfg: dict, tok_meta: dict, file_type: str = "F16") -> None:
    t = cfg["text_config"]
    rope = t["rope_parameters"]
    w = GGUFWriter(str(path), "qwen35")
    w.add_name("luxjax demo qwen35")
    a = "qwen35."
    _add_uint32s(w, a, {
        "block_count": t["num_hidden_layers"], "context_length": t["max_position_embeddings"],
        "embedding_length": t["hidden_size"], "feed_forward_length": t["intermediate_size"],
        "attention.head_count": t["num_attention_heads"], "attention.head_count_kv": t["num_key_value_heads"],
        "attention.key_length": t["head_dim"], "attention.value_length": t["head_dim"]})
    w.add_float32(a + "attention.layer_norm_rms_epsilon", t["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", rope["rope_theta"])
    w.add_uint32(a + "rope.dimension_count", int(t["head_dim"] * rope["partial_rotary_factor"]))
    w.add_array(a + "rope.dimension_sections", list(rope["mrope_section"]) + [0])
    _add_uint32s(w, a + "ssm.", {
        "conv_kernel": t["linear_conv_kernel_dim"], "state_size": t["linear_key_head_dim"],
        "group_count": t["linear_num_key_heads"], "time_step_rank": t["linear_num_value_heads"],
        "inner_size": t["linear_num_value_heads"] * t["linear_value_head_dim"]})
    interval = t["layer_types"].index("full_attention") + 1
    assert all((k == "full_attention") == ((i + 1) % interval == 0) for i, k in enumerate(t["layer_types"]))
    w.add_uint32(a + "full_attention_interval", interval)
    w.add_tokenizer_model(tok_meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok_meta["tokenizer.ggml.pre"])
    w.add_token_list(tok_meta["tokenizer.ggml.tokens"])
    w.add_token_types(tok_meta["tokenizer.ggml.token_type"])
    w.add_token_merges(tok_meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(tok_meta["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(tok_meta["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_meta["tokenizer.chat_template"])
    for name, value in stored(decoder_tensors(params, t), file_type).items():
        w.add_tensor(name, value)
    _finish(w)


def mmproj_tensors(params: dict, v: dict) -> dict[str, np.ndarray]:
    patch = params[VIS + "patch_embed.proj.weight"]  # [hidden, 3, 2, p, p]
    out = {
        "v.patch_embd.weight": patch[:, :, 0],
        "v.patch_embd.weight.1": patch[:, :, 1],
        "v.patch_embd.bias": params[VIS + "patch_embed.proj.bias"],
        "v.position_embd.weight": params[VIS + "pos_embed.weight"],
    }
    pairs = [("merger.norm", "v.post_ln"), ("merger.linear_fc1", "mm.0"), ("merger.linear_fc2", "mm.2")]
    for i in range(v["depth"]):
        pairs += [(f"blocks.{i}.{hf}", f"v.blk.{i}.{gg}") for hf, gg in (
            ("norm1", "ln1"), ("norm2", "ln2"), ("attn.qkv", "attn_qkv"), ("attn.proj", "attn_out"),
            ("mlp.linear_fc1", "ffn_up"), ("mlp.linear_fc2", "ffn_down"))]
    for hf, gg in pairs:
        out[gg + ".weight"] = params[f"{VIS}{hf}.weight"]
        out[gg + ".bias"] = params[f"{VIS}{hf}.bias"]
    return {k: np.ascontiguousarray(x, np.float32) for k, x in out.items()}


def write_mmproj(path, params: dict, cfg: dict, file_type: str = "F16") -> None:
    v = cfg["vision_config"]
    side = int(round(v["num_position_embeddings"] ** 0.5))
    w = GGUFWriter(str(path), "clip")
    w.add_name("luxjax demo qwen35 mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen3vl_merger")
    c = "clip.vision."
    _add_uint32s(w, c, {
        "image_size": side * v["patch_size"], "patch_size": v["patch_size"], "embedding_length": v["hidden_size"],
        "feed_forward_length": v["intermediate_size"], "block_count": v["depth"],
        "attention.head_count": v["num_heads"]})
    w.add_float32(c + "attention.layer_norm_epsilon", v["layer_norm_eps"])
    _add_uint32s(w, c, {"projection_dim": v["out_hidden_size"], "spatial_merge_size": v["spatial_merge_size"]})
    w.add_array(c + "image_mean", list(IMAGE_MEAN))
    w.add_array(c + "image_std", list(IMAGE_STD))
    w.add_array(c + "is_deepstack_layers", [False] * v["depth"])
    _add_uint32s(w, c, {"image_min_pixels": MIN_PIXELS, "image_max_pixels": MAX_PIXELS})
    w.add_bool("clip.use_gelu", True)
    for name, value in stored(mmproj_tensors(params, v), file_type).items():
        w.add_tensor(name, value)
    _finish(w)


def _add_uint32s(w: GGUFWriter, prefix: str, values: dict[str, int]) -> None:
    for key, value in values.items():
        w.add_uint32(prefix + key, value)


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


def export(params: dict, cfg: dict, tok_meta: dict, dst, file_type: str = "F16") -> tuple[Path, Path]:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    decoder, mmproj = (dst / name for name in file_names(file_type))
    write_decoder(decoder, params, cfg, tok_meta, file_type)
    write_mmproj(mmproj, params, cfg, file_type)
    return decoder, mmproj


def load_exported(folder) -> tuple[dict, dict, dict]:
    """(HF-named float32 params, config dict, GGUF tokenizer metadata) of an exported pair in `folder`, read by
    luxjax's own GGUF loaders; the config is demo_config's for the files' depths, checked tensor by tensor."""
    from luxjax.checkpoint.gguf_mmproj import load_qwen35_mmproj
    from luxjax.checkpoint.gguf_qwen35 import load_qwen35_gguf
    from luxjax.demo.model_init import demo_config, init_params

    folder = Path(folder)
    mmprojs = sorted(folder.glob("mmproj*.gguf"))
    decoders = sorted(set(folder.glob("*.gguf")) - set(mmprojs))
    if len(decoders) != 1 or len(mmprojs) != 1:
        raise ValueError(f"{folder}: expected one decoder GGUF and one mmproj*.gguf")
    text = load_qwen35_gguf(decoders[0], progress=False, materialize=_float32)
    vision = load_qwen35_mmproj(mmprojs[0], progress=False, materialize=_float32)
    meta = {k: v for k, v in text.metadata.items() if k.startswith("tokenizer.")}
    cfg = demo_config(meta, text.text_config["num_hidden_layers"], vision.vision_config["depth"])
    params = grouped_value_heads({**text.tensors, **vision.tensors}, cfg["text_config"])
    expected = {k: v.shape for k, v in init_params(cfg, 0).items()}
    got = {k: v.shape for k, v in params.items()}
    if got != expected:
        differ = sorted(set(got.items()) ^ set(expected.items()))
        raise ValueError(f"{folder}: tensors differ from the demo model's: {differ[:4]}")
    return params, cfg, meta


def grouped_value_heads(params: dict, t: dict) -> dict:
    """The loader keeps DeltaNet value heads in llama.cpp's tiled order; training works in HF's grouped order."""
    back = np.argsort(tiled_order(t["linear_num_value_heads"], t["linear_num_key_heads"]))
    qk = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"]
    out = dict(params)
    for i, kind in enumerate(t["layer_types"]):
        if kind == "full_attention":
            continue
        a = f"{LM}layers.{i}.linear_attn."
        for name in ("in_proj_qkv.weight", "conv1d.weight"):
            x = params[a + name]
            out[a + name] = np.concatenate([x[:qk], _heads(x[qk:], back)])
        for name in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log"):
            out[a + name] = _heads(params[a + name], back)
        out[a + "out_proj.weight"] = _heads(params[a + "out_proj.weight"], back, axis=1)
    return out


def _float32(raw: np.ndarray, ggml_type, shape: tuple[int, ...]) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(raw, ggml_type).reshape(shape).astype(np.float32)


def main(argv=None):
    from luxjax.demo.train import load_trained

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", default="out/demo", help="folder written by python -m luxjax.demo.train")
    p.add_argument("--dst", default=str(Path(__file__).parents[1] / "assets" / "default"))
    p.add_argument("--type", default="F16", choices=sorted(FILE_TYPES), help="storage type of the matrices")
    args = p.parse_args(argv)
    for path in export(*load_trained(args.src), args.dst, args.type):
        print(f"{path} {path.stat().st_size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
