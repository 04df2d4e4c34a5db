"""Whole-model parity of GGUF checkpoints loaded through `luxjax.load`.

- The BF16 decoder + F32 projector reproduce transformers' float32 logits and greedy tokens (tests/fixtures).
- Each quantized file gives the same logits as an F32 GGUF copy of itself, dequantized by gguf-py (the independent
  oracle): packed weights may change only the arithmetic, never the decoded values. The quantization error itself
  (KL against the BF16 model, top-1 agreement) is measured and printed as a table (run with -s).
- Device memory of packed files stays at file size, and the load report says so.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

import luxjax
from luxjax.checkpoint.quants import tensor_nbytes
from luxjax.engine.generate import generate
from luxjax.vision.types import ImageInputs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"
CASES = ("text", "one_image", "two_images")
DECODER_CASES = ("text", "one_image")
MMPROJ_CASES = ("one_image",)  # with the BF16 decoder the text case cannot differ
QUANT_DECODERS = ("Q8_0", "Q6_K", "Q4_K_M", "IQ4_XS", "Q4_0")
QUANT_MMPROJS = ("F16", "Q8_0")
# BF16 against transformers measured 5.8e-4 (two_images) on one CPU, 1.13e-3 on another (AMD EPYC, 2 cores: XLA:CPU's
# bf16 arithmetic differs by CPU)
LOGIT_ATOL = 1.5e-3
PACKED_ATOL = 1e-3  # packed against the F32 copy of its own dequantized weights: arithmetic only
MEMORY_SLACK = 1.1
GREEDY_TOKENS = 12


def decoder_path(quant: str) -> Path:
    return FIXTURES / f"tiny-qwen35-a-{quant}.gguf"


def mmproj_path(quant: str) -> Path:
    return FIXTURES / f"mmproj-tiny-qwen35-a-{quant}.gguf"


@functools.cache
def reference(case: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"ref_{case}.npz") as z:
        return dict(z)


def image_inputs(ref: dict[str, np.ndarray]) -> ImageInputs | None:
    if "pixel_values" not in ref:
        return None
    grid = ref["image_grid_thw"]
    return ImageInputs(ref["pixel_values"], grid, [int(t * h * w) // 4 for t, h, w in grid])


def load_model(decoder: Path, mmproj: Path) -> luxjax.Model:
    return luxjax.load(decoder, mmproj, dtype="float32", progress=False)


def case_logits(model: luxjax.Model, case: str) -> np.ndarray:
    ref = reference(case)
    return model.forward_logits(ref["input_ids"].tolist(), image_inputs(ref))


# --- the oracle copy -------------------------------------------------------------------------------------------

def write_f32_copy(src: Path, dst: Path) -> Path:
    """The same GGUF with every tensor decoded by gguf-py and stored as F32; all metadata copied."""
    reader = GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":  # written by GGUFWriter itself
            continue
        copy_field(writer, name, field)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def copy_field(writer: gguf.GGUFWriter, name: str, field) -> None:
    """field.types is [type] for scalars and strings, [ARRAY, element type] for flat arrays."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise NotImplementedError(f"{name}: nested arrays are not copied")
        writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[1])
    else:
        writer.add_key_value(name, field.contents(), vtype)


def test_f32_copy_keeps_metadata_and_values(tmp_path):
    src = decoder_path("Q4_K_M")
    copy = GGUFReader(write_f32_copy(src, tmp_path / "copy.gguf"))
    original = GGUFReader(src)
    assert {k: f.contents() for k, f in copy.fields.items() if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in original.fields.items() if not k.startswith("GGUF.")}
    by_name = {t.name: t for t in copy.tensors}
    for t in original.tensors:
        c = by_name[t.name]
        assert c.tensor_type == gguf.GGMLQuantizationType.F32 and list(c.shape) == list(t.shape)
        np.testing.assert_array_equal(
            np.asarray(c.data).reshape(-1), gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))


# --- shared models ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def summary():
    """Rows of the quantization table, printed once after the module's tests."""
    rows: list[str] = []
    yield rows
    if rows:
        header = f"{'file':<34} {'case':<10} {'KL(BF16||q)':>12} {'top-1':>7}"
        print("\n" + "\n".join([header, *rows]))


@pytest.fixture(scope="module")
def bf16_model():
    return load_model(decoder_path("BF16"), mmproj_path("F32"))


@pytest.fixture(scope="module")
def bf16_logits(bf16_model):
    return {case: case_logits(bf16_model, case) for case in CASES}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """F32 copies, written once per source file."""
    folder = tmp_path_factory.mktemp("f32-copies")
    return functools.cache(lambda src: write_f32_copy(src, folder / src.name))


# --- BF16 against transformers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_bf16_logits_match_transformers(bf16_logits, case):
    diff = np.abs(bf16_logits[case] - reference(case)["logits"])
    assert diff.max() <= LOGIT_ATOL, f"{case}: max |diff| {diff.max():.2e} at position {diff.max(axis=1).argmax()}"


@pytest.mark.parametrize("case", CASES)
def test_bf16_greedy_matches_transformers(bf16_model, case):
    ref = reference(case)
    backend = bf16_model.backend
    prompt = backend.prompt_from_ids(ref["input_ids"].tolist(), image_inputs(ref))
    got = generate(backend, prompt, max_tokens=GREEDY_TOKENS).token_ids
    want = until_eos(ref["greedy"].tolist(), backend.tokenizer.eos_token_ids)
    assert got[: len(want)] == want[: len(got)] and len(got) >= len(want), (got, want)


def until_eos(tokens: list[int], eos_ids) -> list[int]:
    eos = set(eos_ids)
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


# --- quantized files against their F32 copies -----------------------------------------------------------------------

def kl_and_top1(reference_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """KL(reference || logits) averaged over positions, and how often both argmaxes agree."""
    p_log = log_softmax(reference_logits.astype(np.float64))
    q_log = log_softmax(logits.astype(np.float64))
    kl = float(np.mean(np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)))
    top1 = float(np.mean(reference_logits.argmax(-1) == logits.argmax(-1)))
    return kl, top1


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))


def check_against_copy(packed: Path, copy: Path, load: Callable[[Path], luxjax.Model], cases, bf16_logits,
                       summary) -> None:
    """packed and copy are the same file in two encodings; `load` completes either into a model."""
    models = [load(packed), load(copy)]
    for case in cases:
        got, oracle = (case_logits(m, case) for m in models)
        diff = np.abs(got - oracle).max()
        kl, top1 = kl_and_top1(bf16_logits[case], got)
        summary.append(f"{packed.name:<34} {case:<10} {kl:>12.3e} {top1:>7.3f}")
        print(f"{packed.name} {case}: max |packed - F32 copy| {diff:.2e}, KL(BF16||q) {kl:.3e}, top-1 {top1:.3f}")
        assert diff <= PACKED_ATOL, f"{packed.name} {case}: max |packed - F32 copy| {diff:.2e}"


@pytest.mark.parametrize("quant", QUANT_DECODERS)
def test_quantized_decoder_matches_its_f32_copy(quant, copies, bf16_logits, summary):
    packed = decoder_path(quant)
    load = functools.partial(load_model, mmproj=mmproj_path("F32"))
    check_against_copy(packed, copies(packed), load, DECODER_CASES, bf16_logits, summary)


@pytest.mark.parametrize("quant", QUANT_MMPROJS)
def test_quantized_mmproj_matches_its_f32_copy(quant, copies, bf16_logits, summary):
    packed = mmproj_path(quant)
    load = functools.partial(load_model, decoder_path("BF16"))
    check_against_copy(packed, copies(packed), load, MMPROJ_CASES, bf16_logits, summary)


# --- memory and the load report ---------------------------------------------------------------------------------

def file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


@pytest.mark.parametrize("quant", ("Q4_K_M", "IQ4_XS"))
def test_packed_decoder_stays_at_file_size(quant):
    path = decoder_path(quant)
    model = luxjax.load(path, dtype="float32", progress=False)
    resident = tensor_nbytes(model.backend.state)
    budget = file_tensor_bytes(path)
    print(f"{path.name}: device {resident} B / file tensors {budget} B = {resident / budget:.3f}")
    assert resident <= MEMORY_SLACK * budget


def test_load_report_is_consistent(bf16_model):
    report = bf16_model.backend.load_report
    assert report["device_bytes"] == tensor_nbytes(bf16_model.backend.state)
    assert report["file_bytes"] == os.path.getsize(decoder_path("BF16")) + os.path.getsize(mmproj_path("F32"))
    assert report["seconds"] > 0
