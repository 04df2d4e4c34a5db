"""The prepared-parameter cache (luxjax/checkpoint/param_cache.py): a second load of the same files restores the
model without reading tensors from the checkpoint and gives identical results; a changed file misses."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

import luxjax
from luxjax.checkpoint import gguf_mmproj, gguf_qwen35, gguf_reader, param_cache, quant_formats
from luxjax.models.qwen35 import load as qwen35_load

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen35-tiny-a"
# A packed decoder (QuantizedTensors must round-trip through orbax); the pair the parity tests also run, so that
# their compiled prefill is reused.
DECODER = "tiny-qwen35-a-Q4_0.gguf"
MMPROJ = "mmproj-tiny-qwen35-a-F32.gguf"
PACKED_MMPROJ = "mmproj-tiny-qwen35-a-Q8_0.gguf"


def copies(folder: Path, *names: str) -> tuple[Path, ...]:
    """Copies the test may modify."""
    return tuple(Path(shutil.copy(FIXTURES / name, folder / name)) for name in names)


@pytest.fixture
def files(tmp_path) -> tuple[Path, ...]:
    return copies(tmp_path, DECODER, MMPROJ)


def load(files, cache_dir) -> luxjax.Model:
    return luxjax.load(*files, dtype="float32", progress=False, cache_dir=cache_dir)


def forbid_tensor_reads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not read checkpoint tensors")

    for module, name in ((gguf_reader, "load_wanted"), (gguf_qwen35, "load_qwen35_gguf"),
                         (gguf_mmproj, "load_qwen35_mmproj"), (qwen35_load, "read_safetensors")):
        monkeypatch.setattr(module, name, refuse)


def assert_same_state(a: luxjax.Model, b: luxjax.Model) -> None:
    assert jax.tree.structure(a.backend.state) == jax.tree.structure(b.backend.state)
    for x, y in zip(jax.tree.leaves(a.backend.state), jax.tree.leaves(b.backend.state)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_second_load_hits_the_cache(files, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load(files, cache)  # a miss builds exactly as an uncached load does, then saves
    assert first.backend.load_report["cache"] == "miss"
    forbid_tensor_reads(monkeypatch)
    second = load(files, cache)
    print(f"\nGGUF cache: miss {first.backend.load_report['seconds']:.2f} s, "
          f"hit {second.backend.load_report['seconds']:.2f} s")
    assert second.backend.load_report["cache"] == "hit"
    assert second.backend.load_report["device_bytes"] == first.backend.load_report["device_bytes"]
    assert_same_state(first, second)
    with np.load(FIXTURES / "ref_text.npz") as ref:
        ids = ref["input_ids"].tolist()
    assert np.array_equal(second.forward_logits(ids), first.forward_logits(ids))


def test_packed_projector_round_trips(tmp_path, monkeypatch):
    files = copies(tmp_path, DECODER, PACKED_MMPROJ)
    first = load(files, tmp_path / "cache")
    forbid_tensor_reads(monkeypatch)
    second = load(files, tmp_path / "cache")
    assert second.backend.load_report["cache"] == "hit"
    assert_same_state(first, second)


def test_uncached_load_reports_no_cache(files, caplog):
    with caplog.at_level(logging.INFO, logger="luxjax.load"):
        report = luxjax.load(*files, dtype="float32", progress=False).backend.load_report
    assert report["cache"] is None
    assert any(DECODER in r.getMessage() and str(report["device_bytes"]) in r.getMessage() for r in caplog.records)


def test_modified_file_misses(files, tmp_path):
    cache = tmp_path / "cache"
    load(files, cache)
    decoder = files[0]
    stat = decoder.stat()
    rename_model(decoder)
    os.utime(decoder, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: only the bytes changed
    model = load(files, cache)
    assert model.backend.load_report["cache"] == "miss"


def rename_model(path: Path) -> None:
    """Overwrite general.name's value in place (same length), a metadata change the model still loads with."""
    data = bytearray(path.read_bytes())
    value = gguf_reader.read_gguf_metadata(path)["general.name"].encode()
    at = data.index(value)
    data[at:at + len(value)] = bytes(reversed(value))
    path.write_bytes(bytes(data))


def touch(path: Path) -> None:
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))


def flip_last_byte(path: Path) -> None:
    """Same size and mtime; only the bytes near the end differ."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("change", [touch, flip_last_byte])
def test_key_follows_the_files(files, change):
    before = param_cache.cache_key(files, "float32")
    assert param_cache.cache_key(files, "bfloat16") != before
    change(files[0])
    assert param_cache.cache_key(files, "float32") != before


def test_key_follows_the_packing(files, monkeypatch):
    """A changed plane layout (here IQ4_XS's four low-scale bytes viewed as one word) misses, whatever the
    installed version string says."""
    before = param_cache.cache_key(files, "float32")
    fmt = quant_formats.FORMATS[T.IQ4_XS]
    fields = tuple(dataclasses.replace(f, dtype=np.uint32) if f.name == "scales_l" else f for f in fmt.fields)
    assert fields != fmt.fields
    monkeypatch.setitem(quant_formats.FORMATS, T.IQ4_XS, dataclasses.replace(fmt, fields=fields))
    assert param_cache.cache_key(files, "float32") != before


def test_hf_directory_hits_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = luxjax.load(FIXTURES / "hf", dtype="float32", progress=False, cache_dir=cache)
    forbid_tensor_reads(monkeypatch)
    second = luxjax.load(FIXTURES / "hf", dtype="float32", progress=False, cache_dir=cache)
    print(f"\nHF cache: miss {first.backend.load_report['seconds']:.2f} s, "
          f"hit {second.backend.load_report['seconds']:.2f} s")
    assert (first.backend.load_report["cache"], second.backend.load_report["cache"]) == ("miss", "hit")
    assert_same_state(first, second)
