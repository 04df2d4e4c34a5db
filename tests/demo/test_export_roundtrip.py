"""GGUF export round trip: export -> luxjax.load -> logits equal the in-memory model's (float32, with an image)."""
import random

import numpy as np

import luxjax
from luxjax.demo.data import make_example, render
from luxjax.demo.export_gguf import export, tiled_order
from luxjax.demo.model_init import demo_config, init_params
from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer


def test_tiled_order():
    # 2 key heads, 4 value heads: grouped (g0v0, g0v1, g1v0, g1v1) -> tiled (g0v0, g1v0, g0v1, g1v1)
    assert tiled_order(4, 2).tolist() == [0, 2, 1, 3]


def test_export_load_logits_match(tmp_path):
    from luxjax.api import Model
    from luxjax.demo.batches import processor
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build

    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    cfg = demo_config(meta)
    params = init_params(cfg, seed=1)
    rng = np.random.default_rng(2)
    for name, value in params.items():  # move every weight off its initial value so each transform is exercised
        params[name] = (value + rng.normal(0, 0.05, value.shape)).astype(np.float32)
    decoder, mmproj = export(params, cfg, meta, tmp_path)  # matrices stored as F16: numpy's rounding is the oracle
    stored = {k: v.astype(np.float16).astype(np.float32) if v.ndim >= 2 else v for k, v in params.items()}
    loaded = luxjax.load(decoder, mmproj=mmproj, dtype="float32", progress=False)
    memory = Model(build(ModelConfig.from_hf(cfg), stored, tok, processor(), "float32", origin="memory"))

    pyrng = random.Random(3)
    ex = make_example(pyrng, "where")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(render(ex.scenes[0], pyrng))}},
        {"type": "text", "text": ex.question}]}]
    ids, images = loaded.render_prompt(messages)
    ids_memory, images_memory = memory.render_prompt(messages)
    assert ids == ids_memory and np.array_equal(images.pixel_values, images_memory.pixel_values)
    got, want = loaded.forward_logits(ids, images), memory.forward_logits(ids, images_memory)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _data_url(image):
    from luxjax.demo.eval import data_url

    return data_url(image)
