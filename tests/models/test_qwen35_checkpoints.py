"""Checkpoint variants: a text-only Qwen3.5 (Qwen3_5ForCausalLM, and a VL config whose files lack the vision tower)
loads without vision, matches transformers on text and refuses images with a 400; a vision tower with deepstack
layers (Qwen3-VL's, not Qwen3.5's) is refused at load."""
from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest
from PIL import Image

import luxjax
from luxjax.errors import ModelFormatError, RequestError
from qwen35_model_helpers import (FIXTURE, check_logits, compare_greedy, load_reference, luxjax_run, make_case,
                                  random_image, reference)

LOGITS_TOL = 1e-3


def png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_messages(image: Image.Image) -> list[list[dict]]:
    """The same question with the image as an in-process PIL part and as an OpenAI data-URL part."""
    return [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                      {"type": "image_url", "image_url": {"url": png_data_url(image)}}]}],
    ]


def assert_refuses_images(model, image: Image.Image, where: str):
    for messages in image_messages(image):
        for call in (lambda: model.render_prompt(messages), lambda: model.generate(messages, max_tokens=2)):
            with pytest.raises(RequestError) as info:
                call()
            assert info.value.status == 400, f"{where}: status {info.value.status}"
            assert "does not accept images" in info.value.message, f"{where}: {info.value.message!r}"
    with pytest.raises(RequestError) as info:
        model.image_inputs([image])
    assert info.value.status == 400 and "does not accept images" in info.value.message, where


@pytest.fixture(scope="module")
def text_only(checkpoint, luxjax_f32):
    directory, seed = checkpoint("text-only")
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and "vision_config" not in config
    return directory, seed, luxjax_f32(directory)


def test_text_only_checkpoint_matches_transformers(text_only):
    directory, seed, model = text_only
    assert not model.has_vision
    rng = np.random.default_rng(seed)
    case = make_case(rng, "text", 0)
    ref = reference(load_reference(directory), case)
    run = luxjax_run(model.backend, case)
    where = f"[text-only seed={seed}, {len(case.input_ids)} tokens]"
    measured = check_logits(run.logits, ref.logits, LOGITS_TOL, where, directory, case)
    steps, step_diff = compare_greedy(run.greedy, run.step_logits, ref.greedy, ref.step_logits, tol=LOGITS_TOL,
                                      where=where)
    print(f"{where}: {measured}; greedy {ref.greedy} equal over {steps} steps ({step_diff:.3g})")


def test_text_only_checkpoint_refuses_images(text_only):
    directory, seed, model = text_only
    text = [{"role": "user", "content": "Hello there"}]
    ids, image_inputs = model.render_prompt(text)  # text requests are served
    assert image_inputs is None and len(ids) > 3
    assert_refuses_images(model, random_image(np.random.default_rng(seed), 96, 64), "text-only")


def _link_checkpoint(source, target, config: dict, *, drop_visual: bool = False):
    """A copy of `source` with another config.json (and optionally without the model.visual.* tensors)."""
    target.mkdir()
    for path in source.iterdir():
        if path.name in ("config.json", "model.safetensors") and (path.name == "config.json" or drop_visual):
            continue
        os.symlink(path, target / path.name)
    (target / "config.json").write_text(json.dumps(config))
    if drop_visual:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(source / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, target / "model.safetensors")


def test_vl_config_without_vision_weights_is_text_only(checkpoint, tmp_path):
    directory, seed = checkpoint("ratio3-tied")
    config = json.loads((directory / "config.json").read_text())
    assert config["vision_config"]
    _link_checkpoint(directory, tmp_path / "no-visual", config, drop_visual=True)
    model = luxjax.load(tmp_path / "no-visual", dtype="float32", progress=False)
    assert not model.has_vision
    assert_refuses_images(model, random_image(np.random.default_rng(seed), 80, 120), "VL config without visual weights")


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_quantized_hf_checkpoint_is_refused_by_its_method(tmp_path, where):
    config = json.loads((FIXTURE / "hf" / "config.json").read_text())
    quantization = {"quant_method": "awq", "bits": 4, "group_size": 128}
    if where == "top":
        config["quantization_config"] = quantization
    else:
        config["text_config"]["quantization_config"] = quantization
    _link_checkpoint(FIXTURE / "hf", tmp_path / "awq", config)
    with pytest.raises(ModelFormatError, match="'awq'-quantized"):
        luxjax.load(tmp_path / "awq", dtype="float32", progress=False)


@pytest.mark.parametrize("source", ["fixture", "random"])
def test_deepstack_vision_tower_is_refused(checkpoint, tmp_path, source):
    directory = FIXTURE / "hf" if source == "fixture" else checkpoint("ratio3-tied")[0]
    config = json.loads((directory / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0]
    _link_checkpoint(directory, tmp_path / "deepstack", config)
    with pytest.raises(ModelFormatError, match="deepstack"):
        luxjax.load(tmp_path / "deepstack", dtype="float32", progress=False)
