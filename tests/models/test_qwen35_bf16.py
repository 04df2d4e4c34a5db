"""bfloat16 judged against a measured floor.

transformers run in bfloat16 on the same inputs sets how far a bf16 program lands from the float32 reference:
top-1 agreement over all prompt positions, mean cosine of the logits, RMS logit error. luxjax.load(dtype="bfloat16")
must do at least as well: cosine >= transformers' - 1e-3, RMS error <= 1.25x transformers', and top-1 >= transformers'
- (0.5 percentage points + two standard errors of the top-1 difference).

The RMS factor is not in the issue's criteria (top-1 and cosine are): measured over random checkpoints it ranged
0.87x-1.14x of transformers' (1.14x on seed 878166173; the cause of the seed-dependent excess is not found yet), so
1.25x flags a gross loss without failing at random.

transformers is run as `model.to(torch.bfloat16)`. (Loading it with dtype=torch.bfloat16 instead gives another
equally legitimate bf16 program, whose inv_freq buffers stay float32: its cosine and RMS error agree closely with
the first, its top-1 agreement differs by a point on the fixture, measured 0.912 vs 0.923 over the 441 positions:
the noise of that statistic.)

Why the standard-error term: the top-1 difference of two bf16 programs is decided by the few positions where their
argmaxes differ (near-ties of the float32 logits); with d the fraction of such positions among N, its standard error
is sqrt(d / N), about 1.3 points on the fixture. A flat 0.5-point bound fails at random: measured, a luxjax variant
with *smaller* RMS error than transformers (0.341 vs 0.367) scored top-1 0.905 against transformers' 0.912 / 0.923.
Cosine and RMS error carry the precision verdict; top-1 catches gross losses."""
from __future__ import annotations

import numpy as np
import pytest

import luxjax
from qwen35_model_helpers import (FIXTURE, SPECS, Case, image_processor, load_reference, make_case, mean_cosine,
                                  reference, rms_error, top1_agreement)

TOP1_SLACK = 0.005  # plus 2 standard errors, see above
COSINE_SLACK = 1e-3
RMS_FACTOR = 1.25  # see the module docstring
TORCH_BF16 = ("bfloat16",)  # helpers' load_reference also offers "bfloat16-load"


def measures(logits, ref) -> dict:
    return dict(top1=top1_agreement(logits, ref), cosine=mean_cosine(logits, ref), rms=rms_error(logits, ref))


def judge(label: str, cases: list[str], lux: list, torch_bf16: dict[str, list], ref: list):
    """Per-case numbers printed; the verdict pools all positions of all cases."""
    for i, name in enumerate(cases):
        line = ", ".join(f"{k} {v:.4f}" for k, v in measures(lux[i], ref[i]).items())
        floors = "; ".join(f"transformers {variant}: " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                                    measures(out[i], ref[i]).items())
                           for variant, out in torch_bf16.items())
        print(f"{label} {name} ({len(ref[i])} positions): luxjax {line}; {floors}")
    ref_all = np.concatenate(ref)
    ours = measures(np.concatenate(lux), ref_all)
    theirs = {variant: measures(np.concatenate(out), ref_all) for variant, out in torch_bf16.items()}
    floor = dict(top1=min(t["top1"] for t in theirs.values()), cosine=min(t["cosine"] for t in theirs.values()),
                 rms=max(t["rms"] for t in theirs.values()))
    summary = f"{label} pooled over {len(ref_all)} positions: luxjax {ours}; transformers {theirs}; floor {floor}"
    ours_top = np.argmax(np.concatenate(lux), -1)
    differ = max(float(np.mean(ours_top != np.argmax(np.concatenate(out), -1))) for out in torch_bf16.values())
    slack = TOP1_SLACK + 2 * np.sqrt(differ / len(ref_all))
    summary += f"; argmax differs from transformers bf16 at {differ:.4f} of positions, top-1 slack {slack:.4f}"
    print(summary)
    failures = []
    if ours["top1"] < floor["top1"] - slack:
        failures.append(f"top-1 {ours['top1']:.4f} < {floor['top1']:.4f} - {slack:.4f}")
    if ours["cosine"] < floor["cosine"] - COSINE_SLACK:
        failures.append(f"cosine {ours['cosine']:.6f} < {floor['cosine']:.6f} - {COSINE_SLACK}")
    if ours["rms"] > RMS_FACTOR * floor["rms"]:
        failures.append(f"RMS logit error {ours['rms']:.4f} > {RMS_FACTOR} x {floor['rms']:.4f}")
    assert not failures, "luxjax bf16 below transformers' bf16 floor: " + "; ".join(failures) + "\n" + summary


def test_fixture_bf16_against_transformers_floor():
    lux = luxjax.load(FIXTURE / "hf", dtype="bfloat16", progress=False)
    torch_models = {variant: load_reference(FIXTURE / "hf", variant) for variant in TORCH_BF16}
    names, ours, ref = ["text", "one_image", "two_images"], [], []
    theirs: dict[str, list] = {variant: [] for variant in TORCH_BF16}
    for name in names:
        data = np.load(FIXTURE / f"ref_{name}.npz")
        case = Case(name, data["input_ids"].tolist(), [], data["pixel_values"] if "pixel_values" in data else None,
                    data["image_grid_thw"] if "image_grid_thw" in data else None)
        logits = lux.forward_logits(case.input_ids, case.image_inputs())
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
        ours.append(logits)
        ref.append(data["logits"])
        for variant, model in torch_models.items():
            theirs[variant].append(reference(model, case, generate=False, image_features=False).logits)
    judge("fixture", names, ours, theirs, ref)


@pytest.mark.parametrize("name", ["ratio2-interval3"])
def test_random_checkpoint_bf16_against_transformers_floor(checkpoint, name):
    directory, seed = checkpoint(name)
    spec = SPECS[name]
    rng = np.random.default_rng(seed + 1)
    processor = image_processor(directory)
    cases = [make_case(rng, f"{n} images", n, processor, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
             for n in (1, 2, 3)]
    lux = luxjax.load(directory, dtype="bfloat16", progress=False)
    torch_f32 = load_reference(directory)
    torch_models = {variant: load_reference(directory, variant) for variant in TORCH_BF16}
    ours = [lux.forward_logits(case.input_ids, case.image_inputs()) for case in cases]
    ref = [reference(torch_f32, case, generate=False, image_features=False).logits for case in cases]
    theirs = {variant: [reference(model, case, generate=False, image_features=False).logits for case in cases]
              for variant, model in torch_models.items()}
    judge(f"[{name} seed={seed}]", [f"{c.label} ({len(c.input_ids)} tokens)" for c in cases], ours, theirs, ref)
