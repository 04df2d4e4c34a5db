"""The benchmarks' random quantized decoders: the type plan reproduces llama.cpp's own quantized fixtures tensor by
tensor, random blocks decode (by gguf's dequantizer) to small finite weights, and a model built from them runs
with the same logits as one built from gguf's dequantization of the same blocks."""
from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.quant_plan import ggml_type_for, hf_role, quantize_at_random, random_packed  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"


@pytest.mark.parametrize("scheme", ["IQ4_XS", "Q4_K_M"])
def test_plan_matches_llama_cpp_quantizer(scheme):
    reader = GGUFReader(FIXTURES / f"tiny-qwen35-a-{scheme}.gguf")
    n_layers = int(reader.fields["qwen35.block_count"].parts[-1][0])
    checked = 0
    for tensor in reader.tensors:
        if len(tensor.shape) != 2 or tensor.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor.name)
        role, layer = (m.group(2), int(m.group(1))) if m else (tensor.name.removesuffix(".weight"), None)
        assert ggml_type_for(scheme, role, layer, n_layers) == tensor.tensor_type.name, tensor.name
        checked += 1
    assert checked > 5 * n_layers


def _raw_bytes(q) -> np.ndarray:
    planes = [np.asarray(p).view(np.uint8).reshape(*p.shape[:2], -1) for p in q.planes.values()]
    return np.concatenate(planes, axis=-1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("ggml_type", ["IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_random_blocks_decode_small_and_finite(ggml_type):
    from gguf.constants import GGMLQuantizationType

    import jax

    q = random_packed((24, 512), ggml_type, jax.random.key(random.randrange(1 << 30)), np.float32)
    assert q.ggml_type.name == ggml_type
    values = gguf_dequantize(_raw_bytes(q), GGMLQuantizationType[ggml_type])
    assert values.shape == (24, 512) and np.isfinite(values).all()
    assert 1e-4 < values.std() and np.abs(values).max() <= 0.06


@pytest.mark.parametrize("kernels", ["xla", "pallas, packed weights in place"])
def test_random_quantized_model_matches_its_dequantized_twin(kernels, monkeypatch):
    """Also with the Pallas kernels (interpreted here) and the prefill layout CUDA uses: dense matrices sliced by the
    layer scan, packed ones kept stacked and decoded in place by the dequantize kernel."""
    from gguf.constants import GGMLQuantizationType

    import jax

    from luxjax.ops import backend
    from pallas_kernels import quant_dequantize

    in_place_layers = []
    if kernels != "xla":
        jax.clear_caches()  # the jitted prefill traced on the XLA path would otherwise be reused
        monkeypatch.setattr(backend, "use_pallas", lambda: True)
        monkeypatch.setattr(backend, "interpret", lambda: True)
        monkeypatch.setattr(backend, "cublas_reads_scanned_slices", lambda: True)
        real = quant_dequantize.dequantized_matmul
        monkeypatch.setattr(quant_dequantize, "dequantized_matmul", lambda x, w, layer, **kw: (
            in_place_layers.append((layer is not None, w.shape)) or real(x, w, layer, **kw)))

    import luxjax.checkpoint.quants as quants
    from luxjax.api import Model
    from luxjax.demo.batches import processor
    from luxjax.demo.model_init import demo_config, init_params
    from luxjax.demo.tokenizer_train import tokenizer_from_metadata, train_tokenizer
    from luxjax.models.qwen35.config import ModelConfig
    from luxjax.models.qwen35.load import build

    meta = train_tokenizer()
    tok = tokenizer_from_metadata(meta)
    cfg = demo_config(meta)
    dense = init_params(cfg, seed=random.randrange(1 << 30))
    n_layers = cfg["text_config"]["num_hidden_layers"]
    packed = quantize_at_random(dense, "Q4_K_M", n_layers, np.float32, seed=random.randrange(1 << 30))
    replaced = [n for n in dense if hf_role(n)]
    assert replaced and all(isinstance(packed[n], quants.QuantizedTensor) for n in replaced)
    assert packed["lm_head.weight"].ggml_type.name == "Q6_K"
    twin = dict(packed)
    for n in replaced:
        q = packed[n]
        twin[n] = gguf_dequantize(_raw_bytes(q), GGMLQuantizationType[q.ggml_type.name]).reshape(q.shape)
    ids = np.random.default_rng(0).integers(0, cfg["text_config"]["vocab_size"], 40).tolist()
    logits = [Model(build(ModelConfig.from_hf(cfg), weights, tok, processor(), "float32", origin=name))
              .forward_logits(ids) for name, weights in (("packed", packed), ("twin", twin))]
    assert np.isfinite(logits[0]).all() and np.abs(logits[0]).max() > 0
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4 * np.abs(logits[1]).max())
    if kernels != "xla":
        head = packed["lm_head.weight"].shape  # all logits: the head is no layer of a scan
        assert in_place_layers and all(kept or shape == head for kept, shape in in_place_layers), (
            f"packed prefill products should be decoded in place: {in_place_layers}")
        jax.clear_caches()
