"""bfloat16 judged against a measured floor: transformers run in bfloat16 on the same inputs sets how far a bf16
program lands from the float32 reference (top-1 agreement over all prompt positions, mean cosine of the logits);
luxjax.load(dtype="bfloat16") must do at least as well, within 0.5 percentage points and 1e-3 cosine."""
from __future__ import annotations

import numpy as np
import pytest

import luxjax
from qwen35_model_helpers import (FIXTURE, Case, image_processor, load_reference, make_case, mean_cosine,
                                  reference, top1_agreement)

TOP1_SLACK = 0.005
COSINE_SLACK = 1e-3


def judge(label: str, rows: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]):
    """rows: (case, luxjax bf16 logits, transformers bf16 logits, transformers float32 logits); pooled over cases."""
    for name, lux, tbf, ref in rows:
        print(f"{label} {name} ({len(ref)} positions): top-1 luxjax {top1_agreement(lux, ref):.4f} transformers "
              f"{top1_agreement(tbf, ref):.4f}; cosine luxjax {mean_cosine(lux, ref):.6f} transformers "
              f"{mean_cosine(tbf, ref):.6f}")
    lux = np.concatenate([r[1] for r in rows])
    tbf = np.concatenate([r[2] for r in rows])
    ref = np.concatenate([r[3] for r in rows])
    measured = dict(top1_luxjax=top1_agreement(lux, ref), top1_transformers=top1_agreement(tbf, ref),
                    cosine_luxjax=mean_cosine(lux, ref), cosine_transformers=mean_cosine(tbf, ref))
    print(f"{label} pooled over {len(ref)} positions: " + ", ".join(f"{k} {v:.6f}" for k, v in measured.items()))
    assert measured["top1_luxjax"] >= measured["top1_transformers"] - TOP1_SLACK, f"{label}: {measured}"
    assert measured["cosine_luxjax"] >= measured["cosine_transformers"] - COSINE_SLACK, f"{label}: {measured}"


def test_fixture_bf16_against_transformers_floor():
    lux = luxjax.load(FIXTURE / "hf", dtype="bfloat16", progress=False)
    torch_bf16 = load_reference(FIXTURE / "hf", "bfloat16")
    rows = []
    for name in ("text", "one_image", "two_images"):
        data = np.load(FIXTURE / f"ref_{name}.npz")
        case = Case(name, data["input_ids"].tolist(), [], data["pixel_values"] if "pixel_values" in data else None,
                    data["image_grid_thw"] if "image_grid_thw" in data else None)
        logits = lux.forward_logits(case.input_ids, case.image_inputs())
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
        rows.append((name, logits, reference(torch_bf16, case, generate=False).logits, data["logits"]))
    judge("fixture", rows)


@pytest.mark.parametrize("name", ["ratio2-interval3"])
def test_random_checkpoint_bf16_against_transformers_floor(checkpoint, name):
    directory, seed = checkpoint(name)
    from qwen35_model_helpers import SPECS

    spec = SPECS[name]
    rng = np.random.default_rng(seed + 1)
    processor = image_processor(directory)
    cases = [make_case(rng, f"{n} images", n, processor, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
             for n in (1, 2, 3)]
    lux = luxjax.load(directory, dtype="bfloat16", progress=False)
    torch_f32, torch_bf16 = load_reference(directory), load_reference(directory, "bfloat16")
    rows = [(f"{case.label} ({len(case.input_ids)} tokens)", lux.forward_logits(case.input_ids, case.image_inputs()),
             reference(torch_bf16, case, generate=False).logits, reference(torch_f32, case, generate=False).logits)
            for case in cases]
    judge(f"[{name} seed={seed}]", rows)
