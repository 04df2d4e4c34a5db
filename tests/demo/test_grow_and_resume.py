"""Growing the demo model and resuming from exported files: a grown model computes exactly what the smaller one did
(its new blocks are identities until trained), the new blocks are really in the path, and exported GGUF files read
back as the parameters that were written (numpy's float16 rounding for matrices)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from luxjax.demo.data import make_example, render
from luxjax.demo.export_gguf import export, load_exported
from luxjax.demo.model_init import demo_config, grow_params, init_params, model_config
from luxjax.demo.tokenizer_train import SPECIAL_TOKENS, tokenizer_from_metadata, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    return meta, tok, {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def perturbed(params: dict, seed: int) -> dict:
    """Every tensor moved off its initial value, so no transform or layer is checked on constants alone."""
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in params.items()}


def logits_with_image(params: dict, cfg: dict, tok, seed: int) -> np.ndarray:
    from luxjax.api import Model
    from luxjax.demo.batches import processor
    from luxjax.demo.eval import data_url
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build

    model = Model(build(ModelConfig.from_hf(cfg), params, tok, processor(), "float32", origin="memory"))
    rng = random.Random(seed)
    ex = make_example(rng, "which")
    content = [{"type": "image_url", "image_url": {"url": data_url(render(s, rng))}} for s in ex.scenes]
    ids, images = model.render_prompt([{"role": "user", "content": content + [{"type": "text", "text": ex.question}]}])
    return model.forward_logits(ids, images)


def test_grown_model_computes_the_same_and_its_new_blocks_are_live(tokenizer):
    meta, tok, _ = tokenizer
    seed = int(np.random.default_rng().integers(1 << 30))
    small_cfg = demo_config(meta, layers=2, vision_depth=1)
    big_cfg = demo_config(meta, layers=4, vision_depth=2)
    small = perturbed(init_params(small_cfg, seed), seed + 1)
    big = grow_params(small, small_cfg, big_cfg, seed + 2)
    assert set(big) == set(init_params(big_cfg, 0)) and all(np.array_equal(big[k], v) for k, v in small.items())
    want = logits_with_image(small, small_cfg, tok, seed)
    got = logits_with_image(big, big_cfg, tok, seed)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for name in ("model.language_model.layers.3.self_attn.o_proj.weight",
                 "model.visual.blocks.1.mlp.linear_fc2.weight"):
        changed = dict(big)
        changed[name] = np.random.default_rng(seed).normal(0, 0.05, big[name].shape).astype(np.float32)
        moved = np.abs(logits_with_image(changed, big_cfg, tok, seed) - want).max()
        assert moved > 1e-3, f"{name} does not reach the logits"


def test_grow_refuses_other_shapes(tokenizer):
    meta, _, ids = tokenizer
    small_cfg = demo_config(meta, layers=4, vision_depth=2)
    small = init_params(small_cfg, 0)
    for big_cfg in (demo_config(meta, layers=2, vision_depth=2),
                    model_config(len(meta["tokenizer.ggml.tokens"]) + 1, ids, layers=6, vision_depth=2)):
        with pytest.raises(ValueError):
            grow_params(small, small_cfg, big_cfg, 0)


@pytest.mark.parametrize("file_type", ["F16", "F32"])
def test_exported_files_read_back_as_the_written_parameters(tokenizer, tmp_path, file_type):
    meta, _, _ = tokenizer
    seed = int(np.random.default_rng().integers(1 << 30))
    cfg = demo_config(meta, layers=4, vision_depth=2)
    params = perturbed(init_params(cfg, seed), seed + 1)
    export(params, cfg, meta, tmp_path, file_type)
    got, got_cfg, got_meta = load_exported(tmp_path)
    assert got_cfg == cfg and got_meta == meta and set(got) == set(params)
    store = np.float16 if file_type == "F16" else np.float32
    for name, value in params.items():
        if value.ndim >= 2:  # stored in the file type as they are
            np.testing.assert_array_equal(got[name], value.astype(store).astype(np.float32), err_msg=name)
        else:  # F32, some transformed (norms stored +1, A_log as -exp(A_log)): float32 rounding of the transform
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)
