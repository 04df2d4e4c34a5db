"""Checkpoints whose config.json or processor files take forms the released ones do not, each read as transformers
reads it, against transformers' logits on the same files:
- attention biases (attention_bias: true) on the q/k/v/o projections;
- the rope settings outside rope_parameters (a legacy rope_scaling dict, top-level rope_theta and
  partial_rotary_factor), no "architectures" (model_type only), and a vision position table of a non-square size
  (80 rows: transformers uses the 8x8 grid of int(sqrt(80)));
- a spatial merge of 3 (9 patches per image token), with the image processor settings only in transformers 5's
  processor_config.json ("image_processor"), beside a stale preprocessor_config.json it must not read."""
from __future__ import annotations

import json

import numpy as np
import pytest

import luxjax
from luxjax.errors import ModelFormatError
from qwen35_model_helpers import (FULL, LIN, Spec, check_logits, load_reference, luxjax_run, make_case, reference,
                                  rope, text_config, vision_config, write_checkpoint)

LOGITS_TOL = 1e-3


def variant_seed(session_seed: int, name: str) -> int:
    return (session_seed + sum(map(ord, name)) * 104729) % (2**31)


def compare_with_transformers(directory, case, where: str) -> str:
    model = luxjax.load(directory, dtype="float32", progress=False)
    ref = reference(load_reference(directory), case, generate=False, image_features=False)
    run = luxjax_run(model.backend, case, steps=1)
    return check_logits(run.logits, ref.logits, LOGITS_TOL, where, directory, case)


def edit_json(path, edit) -> dict:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))
    return data


def test_attention_biases(tmp_path, session_seed):
    seed = variant_seed(session_seed, "bias")
    spec = Spec("bias", text_config(hidden_size=64, num_hidden_layers=3, layer_types=[LIN, FULL, FULL],
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, attention_bias=True,
                                    rope_parameters=rope(0.5, (3, 3, 2))), None)
    directory = write_checkpoint(spec, tmp_path / "bias", seed)
    case = make_case(np.random.default_rng(seed), "text", 0)
    where = f"[attention_bias seed={seed}]"
    print(where, compare_with_transformers(directory, case, where))


def test_legacy_rope_keys_no_architectures_non_square_positions(tmp_path, session_seed):
    seed = variant_seed(session_seed, "legacy")
    spec = Spec("legacy", text_config(hidden_size=64, num_hidden_layers=4, layer_types=[LIN, FULL, LIN, FULL],
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      rope_parameters=rope(0.5, (6, 1, 1), 100.0)),
                vision_config(depth=1, num_position_embeddings=80), min_pixels=32 * 32 * 40, max_pixels=32 * 32 * 60)
    directory = write_checkpoint(spec, tmp_path / "legacy", seed)

    def legacy(config):
        text = config["text_config"]
        del text["rope_parameters"]
        # a small theta and sections unlike the default's (11, 11, 10) where they matter: frequencies 1-5 of 8
        text.update(rope_theta=100.0, partial_rotary_factor=0.5,
                    rope_scaling={"mrope_section": [6, 1, 1], "mrope_interleaved": True})
        del config["architectures"]

    config = edit_json(directory / "config.json", legacy)
    assert "rope_parameters" not in config["text_config"] and "architectures" not in config
    from transformers import Qwen3_5Config

    read_back = Qwen3_5Config.from_pretrained(directory).text_config.rope_parameters
    assert (read_back["rope_theta"], read_back["partial_rotary_factor"], read_back["mrope_section"]) == (
        100.0, 0.5, [6, 1, 1]), read_back  # transformers folds them into rope_parameters
    from qwen35_model_helpers import image_processor

    case = make_case(np.random.default_rng(seed), "image", 1, image_processor(directory),
                     min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    where = f"[legacy rope keys, no architectures, 80 positions; seed={seed}]"
    print(where, compare_with_transformers(directory, case, where))


def test_merge_three_with_nested_processor_config(tmp_path, session_seed):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    seed = variant_seed(session_seed, "merge3")
    spec = Spec("merge3", text_config(hidden_size=64, num_hidden_layers=2, layer_types=[LIN, FULL],
                                      rope_parameters=rope(0.25, (2, 1, 1))),
                vision_config(depth=1, spatial_merge_size=3, num_position_embeddings=144),
                min_pixels=48 * 48 * 15, max_pixels=48 * 48 * 28)
    directory = write_checkpoint(spec, tmp_path / "merge3", seed)
    settings = json.loads((directory / "preprocessor_config.json").read_text())
    (directory / "processor_config.json").write_text(json.dumps({"image_processor": {**settings, "merge_size": 3}}))
    edit_json(directory / "preprocessor_config.json",  # stale: transformers 5 reads the nested settings first
              lambda stale: stale.update(merge_size=2, size={"shortest_edge": 1024, "longest_edge": 4096}))
    processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    assert processor.merge_size == 3, "transformers did not take processor_config.json's image_processor"
    case = make_case(np.random.default_rng(seed), "image", 1, processor, min_pixels=spec.min_pixels,
                     max_pixels=spec.max_pixels)
    assert case.merge == 3
    model = luxjax.load(directory, dtype="float32", progress=False)
    ours = model.image_inputs(case.images)
    np.testing.assert_array_equal(ours.grid_thw, case.grid_thw)
    assert ours.num_tokens == case.num_tokens_per_image
    assert np.array_equal(np.asarray(ours.pixel_values, np.float32), case.pixel_values), f"seed={seed}"
    where = f"[spatial merge 3, nested processor config; seed={seed}]"
    print(where, compare_with_transformers(directory, case, where))


@pytest.mark.parametrize("drop", ["both", "nested_only_without_image_processor"])
def test_vision_checkpoint_without_processor_settings_is_refused(tmp_path, session_seed, drop):
    seed = variant_seed(session_seed, "refuse")
    spec = Spec("refuse", text_config(num_hidden_layers=1, layer_types=[FULL], rope_parameters=rope(0.25, (2, 1, 1))),
                vision_config())
    directory = write_checkpoint(spec, tmp_path / "refuse", seed)
    (directory / "preprocessor_config.json").unlink()
    if drop != "both":
        (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    with pytest.raises(ModelFormatError, match="processor_config.json"):
        luxjax.load(directory, dtype="float32", progress=False)
