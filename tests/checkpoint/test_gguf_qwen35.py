"""llama.cpp GGUF decoder and mmproj against the Hugging Face checkpoint they were converted from (the oracle).

The loader keeps DeltaNet value heads in llama.cpp's tiled order; these tests undo that with a permutation written
here from the definition (shared/reference/qwen35.md), independently of the loader.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch  # noqa: F401  (safetensors' "pt" framework reads the bf16 weights)
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from safetensors import safe_open

from luxjax.checkpoint.gguf_qwen35 import (
    LoadedCheckpoint,
    load_qwen35_gguf,
    load_qwen35_mmproj,
    read_gguf_metadata,
)
from luxjax.checkpoint.quants import QuantizedTensor, dequantize
from luxjax.errors import ModelFormatError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"


def decoder(quant: str) -> Path:
    return FIXTURES / f"tiny-qwen35-a-{quant}.gguf"


def mmproj(quant: str) -> Path:
    return FIXTURES / f"mmproj-tiny-qwen35-a-{quant}.gguf"


# Relative RMS error of dequantized weights against HF, per file (a wrong orientation or permutation gives ~1.4).
DECODER_TOLERANCE = {"Q8_0": 0.01, "Q6_K": 0.03, "Q4_K_M": 0.1, "IQ4_XS": 0.1, "Q4_0": 0.1}
MMPROJ_TOLERANCE = {"F16": 1e-3, "Q8_0": 0.01}
# HF config keys with no meaning for inference (GGUF does not carry them).
UNUSED_TEXT_KEYS = {"initializer_range", "attention_dropout", "use_cache", "model_type"}
UNUSED_VISION_KEYS = {"initializer_range", "model_type"}
# Value transforms differ by float32 rounding from HF's bf16 A_log (measured max abs error 6e-8).
A_LOG_ATOL = 1e-7


def dequantizing(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...]) -> np.ndarray:
    return gguf.quants.dequantize(raw, ggml_type).reshape(shape).astype(np.float32)


@pytest.fixture(scope="module")
def hf_tensors() -> dict[str, np.ndarray]:
    with safe_open(FIXTURES / "hf" / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name).float().numpy() for name in f.keys()}


@pytest.fixture(scope="module")
def hf_config() -> dict:
    return json.loads((FIXTURES / "hf" / "config.json").read_text())


def tiled_index_of_grouped_heads(k_heads: int, v_heads: int) -> np.ndarray:
    """Grouped order lists value heads key-group-major (g0v0, g0v1, .., g1v0); tiled lists them
    repeat-major (g0v0, g1v0, .., g0v1). Entry n: where grouped head n sits in tiled order."""
    per_group = v_heads // k_heads
    return np.array([j * k_heads + g for g in range(k_heads) for j in range(per_group)])


def grouped_index_of_tiled_heads(k_heads: int, v_heads: int) -> np.ndarray:
    """Entry i: which grouped head sits at tiled position i (what the converter wrote there)."""
    per_group = v_heads // k_heads
    return np.array([(i % k_heads) * per_group + i // k_heads for i in range(v_heads)])


def to_grouped(name: str, x: np.ndarray, text: dict) -> np.ndarray:
    """Undo the converter's value-head reorder on one loaded DeltaNet tensor (HF layout, tiled heads)."""
    if ".linear_attn." not in name:
        return x
    heads = text["linear_num_value_heads"]
    order = tiled_index_of_grouped_heads(text["linear_num_key_heads"], heads)
    qk = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]

    def rows(m: np.ndarray) -> np.ndarray:  # value heads are row blocks
        return m.reshape(heads, -1, *m.shape[1:])[order].reshape(m.shape)

    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([x[:qk], rows(x[qk:])])
    if name.endswith(("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log")):
        return rows(x)
    if name.endswith("out_proj.weight"):
        return rows(x.T).T
    return x


def relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


# ---- decoder -------------------------------------------------------------------------------------------------


def test_bf16_decoder_reproduces_hf_exactly(hf_tensors, hf_config):
    ckpt = load_qwen35_gguf(decoder("BF16"), materialize=dequantizing, progress=False)
    expected = {name for name in hf_tensors if not name.startswith("model.visual.")}
    assert set(ckpt.tensors) == expected
    for name in sorted(expected):
        got = to_grouped(name, ckpt.tensors[name], ckpt.text_config)
        assert got.shape == hf_tensors[name].shape, name
        atol = A_LOG_ATOL if name.endswith("A_log") else 0.0
        np.testing.assert_allclose(got, hf_tensors[name], rtol=0, atol=atol, err_msg=name)


def test_text_config_matches_hf(hf_config):
    ckpt = load_qwen35_gguf(decoder("BF16"), materialize=dequantizing, progress=False)
    hf_text = hf_config["text_config"]
    for key in set(hf_text) - UNUSED_TEXT_KEYS:
        if key == "rms_norm_eps":
            assert ckpt.text_config[key] == pytest.approx(hf_text[key], rel=1e-7)
        else:
            assert ckpt.text_config[key] == hf_text[key], key
    assert ckpt.text_config["linear_value_head_order"] == "tiled"
    assert ckpt.file_bytes == decoder("BF16").stat().st_size
    assert ckpt.metadata["tokenizer.ggml.eos_token_id"] == 1009
    assert len(ckpt.metadata["tokenizer.ggml.tokens"]) == 1024


def test_value_heads_are_tiled_in_attn_qkv(hf_tensors, hf_config):
    """The key property: the GGUF's v rows are HF's v rows with heads permuted grouped -> tiled."""
    text = hf_config["text_config"]
    qk = 2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
    heads, v_dim = text["linear_num_value_heads"], text["linear_value_head_dim"]
    order = grouped_index_of_tiled_heads(text["linear_num_key_heads"], heads)
    assert sorted(order) != list(order), "fixture must have more value heads than key heads"
    tensors = {t.name: t for t in gguf.GGUFReader(decoder("BF16")).tensors}
    for i, kind in enumerate(text["layer_types"]):
        if kind != "linear_attention":
            continue
        t = tensors[f"blk.{i}.attn_qkv.weight"]
        gguf_v = dequantizing(t.data, t.tensor_type, tuple(reversed([int(d) for d in t.shape])))[qk:]
        hf_v = hf_tensors[f"model.language_model.layers.{i}.linear_attn.in_proj_qkv.weight"][qk:]
        permuted = hf_v.reshape(heads, v_dim, -1)[order].reshape(hf_v.shape)
        np.testing.assert_array_equal(gguf_v, permuted)
        assert not np.array_equal(gguf_v, hf_v)


@pytest.mark.parametrize("quant", sorted(DECODER_TOLERANCE))
def test_quantized_decoder_close_to_hf(quant, hf_tensors):
    ckpt = load_qwen35_gguf(decoder(quant), materialize=dequantizing, progress=False)
    assert set(ckpt.tensors) == {name for name in hf_tensors if not name.startswith("model.visual.")}
    for name, value in ckpt.tensors.items():
        got = to_grouped(name, value, ckpt.text_config)
        assert got.shape == hf_tensors[name].shape, name
        assert relative_rms(got, hf_tensors[name]) < DECODER_TOLERANCE[quant], name


@pytest.mark.parametrize(
    ("load", "path"), [(load_qwen35_gguf, decoder("Q4_K_M")), (load_qwen35_mmproj, mmproj("Q8_0"))]
)
def test_real_device_weights_stay_packed_and_decode_like_gguf(load, path):
    ckpt = load(path, progress=False)
    reference = load(path, materialize=dequantizing, progress=False)
    assert any(isinstance(t, QuantizedTensor) for t in ckpt.tensors.values())
    assert 0 < ckpt.device_bytes < 1.1 * ckpt.file_bytes
    for name, value in ckpt.tensors.items():
        np.testing.assert_array_equal(np.asarray(dequantize(value)), reference.tensors[name], err_msg=name)


def test_read_gguf_metadata_gives_python_values():
    md = read_gguf_metadata(decoder("Q4_0"))
    assert md["general.architecture"] == "qwen35"
    assert md["qwen35.attention.layer_norm_rms_epsilon"] == 1e-6  # shortest float32 decimal
    assert md["qwen35.rope.dimension_sections"] == [3, 3, 2, 0]
    assert md["qwen35.attention.recurrent_layers"][:4] == [True, True, True, False]
    assert isinstance(md["tokenizer.chat_template"], str)


# ---- mmproj --------------------------------------------------------------------------------------------------


def test_f32_mmproj_reproduces_hf_exactly(hf_tensors):
    ckpt = load_qwen35_mmproj(mmproj("F32"), materialize=dequantizing, progress=False)
    expected = {name for name in hf_tensors if name.startswith("model.visual.")}
    assert set(ckpt.tensors) == expected
    for name in sorted(expected):
        np.testing.assert_array_equal(ckpt.tensors[name], hf_tensors[name], err_msg=name)


def test_vision_and_preprocessor_config_match_hf(hf_config):
    ckpt = load_qwen35_mmproj(mmproj("F32"), materialize=dequantizing, progress=False)
    hf_vision = hf_config["vision_config"]
    for key in set(hf_vision) - UNUSED_VISION_KEYS:
        assert ckpt.vision_config[key] == hf_vision[key], key
    assert ckpt.vision_config["layer_norm_eps"] == pytest.approx(1e-6, rel=1e-7)
    hf_pre = json.loads((FIXTURES / "hf" / "preprocessor_config.json").read_text())
    for key in ("image_mean", "image_std", "patch_size", "merge_size", "temporal_patch_size"):
        assert ckpt.preprocessor_config[key] == hf_pre[key], key
    # The converter writes no pixel limits for qwen3vl_merger (the HF fixture's 4096/131072 are lost):
    assert "clip.vision.image_min_pixels" not in ckpt.metadata
    assert ckpt.preprocessor_config["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}


@pytest.mark.parametrize("quant", sorted(MMPROJ_TOLERANCE))
def test_quantized_mmproj_close_to_hf(quant, hf_tensors):
    ckpt = load_qwen35_mmproj(mmproj(quant), materialize=dequantizing, progress=False)
    assert set(ckpt.tensors) == {name for name in hf_tensors if name.startswith("model.visual.")}
    for name, value in ckpt.tensors.items():
        assert value.shape == hf_tensors[name].shape, name
        assert relative_rms(value, hf_tensors[name]) < MMPROJ_TOLERANCE[quant], name


# ---- refusals and MTP ----------------------------------------------------------------------------------------


def copy_gguf(src: Path, dst: Path, *, arch=None, set_kv=None, drop=(), replace=None, add=None) -> Path:
    """Rewrite a fixture with changes: set_kv {key: (value, type, sub_type)}, tensors dropped, replaced
    ({name: (values, raw ggml type or None)}) or added."""
    reader = gguf.GGUFReader(src)
    set_kv, replace, add = set_kv or {}, replace or {}, add or {}
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in set_kv:
            continue
        sub_type = field.types[-1] if field.types[0] == V.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for key, (value, vtype, sub_type) in set_kv.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for t in reader.tensors:
        if t.name in replace:
            values, raw_dtype = replace[t.name]
            writer.add_tensor(t.name, values, raw_dtype=raw_dtype)
        elif t.name not in drop:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, value in add.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def q8_0(values: np.ndarray) -> tuple[np.ndarray, T]:
    return gguf.quants.quantize(values, T.Q8_0), T.Q8_0


DECODER_REFUSALS = {
    "architecture": (dict(arch="llama"), ["general.architecture", "'llama'"]),
    "missing": (dict(drop={"blk.3.attn_k.weight", "blk.0.ssm_a"}), ["blk.3.attn_k.weight", "blk.0.ssm_a"]),
    "shape": (
        dict(replace={"blk.0.attn_norm.weight": (np.zeros(255, np.float32), None)}),
        ["blk.0.attn_norm.weight", "[255]", "[256]"],
    ),
    "quantized_norm": (
        dict(replace={"blk.0.attn_norm.weight": q8_0(np.ones(256, np.float32))}),
        ["blk.0.attn_norm.weight", "Q8_0"],
    ),
    "deepstack": (dict(set_kv={"qwen35.n_deepstack_layers": (3, V.UINT32, None)}), ["n_deepstack_layers = 3"]),
}

MMPROJ_REFUSALS = {
    "projector_type": (
        dict(set_kv={"clip.projector_type": ("qwen2vl_merger", V.STRING, None)}),
        ["projector type", "'qwen2vl_merger'"],
    ),
    "deepstack_flag": (
        dict(set_kv={"clip.vision.is_deepstack_layers": ([False, True], V.ARRAY, V.BOOL)}),
        ["deepstack", "layers [1]"],
    ),
    "deepstack_tensor": (
        dict(add={"v.deepstack.0.norm.weight": np.ones(128, np.float32)}),
        ["deepstack", "v.deepstack.0.norm.weight"],
    ),
    "no_vision": (dict(set_kv={"clip.has_vision_encoder": (False, V.BOOL, None)}), ["no vision encoder"]),
    "missing": (dict(drop={"v.patch_embd.weight.1", "mm.2.bias"}), ["v.patch_embd.weight.1", "mm.2.bias"]),
    "shape": (
        dict(replace={"v.blk.1.attn_qkv.weight": (np.zeros((384, 127), np.float32), None)}),
        ["v.blk.1.attn_qkv.weight", "[384, 127]", "[384, 128]"],
    ),
}


@pytest.mark.parametrize("case", sorted(DECODER_REFUSALS))
def test_decoder_refusals_name_what_was_found(case, tmp_path):
    changes, fragments = DECODER_REFUSALS[case]
    path = copy_gguf(decoder("Q4_0"), tmp_path / f"{case}.gguf", **changes)
    with pytest.raises(ModelFormatError) as err:
        load_qwen35_gguf(path, materialize=dequantizing, progress=False)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("case", sorted(MMPROJ_REFUSALS))
def test_mmproj_refusals_name_what_was_found(case, tmp_path):
    changes, fragments = MMPROJ_REFUSALS[case]
    path = copy_gguf(mmproj("F32"), tmp_path / f"{case}.gguf", **changes)
    with pytest.raises(ModelFormatError) as err:
        load_qwen35_mmproj(path, materialize=dequantizing, progress=False)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_decoder_and_projector_are_not_interchangeable():
    with pytest.raises(ModelFormatError, match="'clip', expected 'qwen35'"):
        load_qwen35_gguf(mmproj("F32"), progress=False)
    with pytest.raises(ModelFormatError, match="'qwen35', expected 'clip'"):
        load_qwen35_mmproj(decoder("Q4_0"), progress=False)


def test_mtp_blocks_are_skipped(tmp_path):
    recurrent = [True, True, True, False] * 2 + [False]
    path = copy_gguf(
        decoder("Q4_0"),
        tmp_path / "mtp.gguf",
        set_kv={
            "qwen35.block_count": (9, V.UINT32, None),
            "qwen35.nextn_predict_layers": (1, V.UINT32, None),
            "qwen35.attention.recurrent_layers": (recurrent, V.ARRAY, V.BOOL),
        },
        add={"blk.8.nextn.eh_proj.weight": np.zeros((256, 512), np.float32)},
    )
    ckpt = load_qwen35_gguf(path, materialize=dequantizing, progress=False)
    assert isinstance(ckpt, LoadedCheckpoint)
    assert ckpt.text_config["num_hidden_layers"] == 8
    assert len(ckpt.text_config["layer_types"]) == 8
    assert not any(".layers.8." in name for name in ckpt.tensors)


def test_tied_embeddings_when_output_is_absent(tmp_path):
    path = copy_gguf(decoder("Q4_0"), tmp_path / "tied.gguf", drop={"output.weight"})
    ckpt = load_qwen35_gguf(path, materialize=dequantizing, progress=False)
    assert ckpt.text_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensors


def split_gguf(src: Path, directory: Path, parts: int) -> list[Path]:
    """The file cut as llama.cpp's gguf-split cuts it: PREFIX-0000i-of-0000N.gguf, the metadata in the first part,
    the tensors shared out in order, and split.no / split.count / split.tensors.count in every part."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tensors = list(reader.tensors)
    bounds = np.linspace(0, len(tensors), parts + 1).astype(int)
    paths = []
    for i in range(parts):
        path = directory / f"{src.stem}-{i + 1:05d}-of-{parts:05d}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        if i == 0:
            for key, field in reader.fields.items():
                if not key.startswith("GGUF.") and key != "general.architecture":
                    sub_type = field.types[-1] if field.types[0] == V.ARRAY else None
                    writer.add_key_value(key, field.contents(), field.types[0], sub_type)
        writer.add_key_value("split.no", i, V.UINT16)
        writer.add_key_value("split.count", parts, V.UINT16)
        writer.add_key_value("split.tensors.count", len(tensors), V.INT32)
        for t in tensors[bounds[i]:bounds[i + 1]]:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths


@pytest.mark.parametrize("load, source", [(load_qwen35_gguf, decoder("Q4_K_M")), (load_qwen35_mmproj, mmproj("Q8_0"))])
def test_split_files_load_like_the_whole_file(tmp_path, load, source):
    whole = load(source, materialize=dequantizing, progress=False)
    parts = split_gguf(source, tmp_path, 3)
    split = load(parts[0], materialize=dequantizing, progress=False)
    assert split.tensors.keys() == whole.tensors.keys()
    for name, value in whole.tensors.items():
        assert np.array_equal(split.tensors[name], value, equal_nan=True), name
    assert split.file_bytes == sum(p.stat().st_size for p in parts)
    assert (split.text_config, split.vision_config) == (whole.text_config, whole.vision_config)


def test_split_files_refusals(tmp_path):
    parts = split_gguf(decoder("Q4_0"), tmp_path, 3)
    with pytest.raises(ModelFormatError, match="part 2 of a GGUF split in 3: give the first part"):
        load_qwen35_gguf(parts[1], materialize=dequantizing, progress=False)
    renamed = parts[0].rename(tmp_path / "first.gguf")
    with pytest.raises(ModelFormatError, match="PREFIX-00001-of-00003.gguf"):
        load_qwen35_gguf(renamed, materialize=dequantizing, progress=False)
    renamed.rename(parts[0])
    parts[2].unlink()
    with pytest.raises(ModelFormatError, match=f"missing beside it: {parts[2].name}"):
        load_qwen35_gguf(parts[0], materialize=dequantizing, progress=False)
