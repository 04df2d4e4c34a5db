"""--cache-dir also keeps XLA's compiled programs (luxjax.api.cache_compiled_programs): a second start of the server
on the same files loads the vision tower's, prefill's and decode's programs instead of compiling them, though the
first start built its weights from the GGUF files and the second restores them from the parameter cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import luxjax
from luxjax.models.qwen35 import model as qwen

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "qwen35-tiny-a"
DECODER, MMPROJ = FIXTURES / "tiny-qwen35-a-Q4_0.gguf", FIXTURES / "mmproj-tiny-qwen35-a-F32.gguf"
MODEL_PROGRAMS = ("jit_encode_images", "jit_prefill", "jit_decode")

# One server start: the CLI's settings and loader, then an answer about a random image (vision tower, prefill,
# decode); prints how the parameters were loaded.
START = """
import sys
import numpy as np
from PIL import Image
import server
settings = server.settings_from_args(server.parse_args(sys.argv[1:]))
model = server.load_model(settings)
pixels = np.random.default_rng().integers(0, 256, (48, 72, 3), dtype=np.uint8)
messages = [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(pixels)},
                                         {"type": "text", "text": "what is it?"}]}]
model.generate(messages, max_tokens=3)
print("parameters:", model.backend.load_report["cache"])
"""


def start_server(cache_dir: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", START, str(DECODER), "--mmproj", str(MMPROJ), "--dtype", "float32",
         "--cache-dir", str(cache_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def cached_programs(cache_dir: Path) -> set[str]:
    folder = cache_dir / "xla"
    return {p.name for p in folder.iterdir() if p.name.startswith(MODEL_PROGRAMS)} if folder.is_dir() else set()


def test_second_start_compiles_no_model_program(tmp_path):
    cache = tmp_path / "cache"
    assert "parameters: miss" in start_server(cache)
    first = cached_programs(cache)
    assert {name.split("-")[0] for name in first} == set(MODEL_PROGRAMS), f"programs cached: {sorted(first)}"
    assert "parameters: hit" in start_server(cache)
    # a program compiled again would be written under a new key
    assert cached_programs(cache) == first


def test_built_and_restored_weights_give_one_program(tmp_path):
    """The parameters as built from the files and as restored from the parameter cache lower decode to the same
    program (the restore commits them to their device; the built ones are committed where they lie)."""
    built = luxjax.load(DECODER, MMPROJ, dtype="float32", progress=False, cache_dir=tmp_path)
    restored = luxjax.load(DECODER, MMPROJ, dtype="float32", progress=False, cache_dir=tmp_path)
    assert (built.backend.load_report["cache"], restored.backend.load_report["cache"]) == ("miss", "hit")
    programs = []
    for backend in (built.backend, restored.backend):
        caches = backend.init_cache(2, 64)
        positions = np.zeros((3, 2), np.int32)
        programs.append(qwen.decode.lower(backend.jit_graphdef, backend.state, caches, np.zeros(2, np.int32),
                                          positions, np.zeros(2, np.int32), np.ones(2, bool),
                                          dtype=backend.dtype).as_text())
    assert programs[0] == programs[1]
