"""Session-wide fixtures of the model tests: loaded models and written checkpoints are shared between modules, so
that each jitted shape compiles once per test session.

Random checkpoints take a fresh seed per session (printed, and named in failure messages); set
LUXJAX_TEST_SEED=<n> to replay one."""
from __future__ import annotations

import os

import pytest

from qwen35_model_helpers import FIXTURE_HF, SPECS, fresh_seed, write_checkpoint


@pytest.fixture(scope="session")
def session_seed() -> int:
    seed = int(os.environ["LUXJAX_TEST_SEED"]) if os.environ.get("LUXJAX_TEST_SEED") else fresh_seed()
    print(f"\nmodel tests: random checkpoints seeded from {seed} (replay with LUXJAX_TEST_SEED={seed})")
    return seed


@pytest.fixture(scope="session")
def fixture_model_f32():
    import luxjax

    return luxjax.load(FIXTURE_HF, dtype="float32", progress=False)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, session_seed):
    """checkpoint(name) -> (directory, seed): the spec `name` of SPECS written once per session by transformers."""
    written: dict[str, tuple] = {}

    def get(name: str):
        if name not in written:
            seed = (session_seed + 7919 * list(SPECS).index(name)) % (2**31)
            directory = write_checkpoint(SPECS[name], tmp_path_factory.mktemp(name), seed)
            written[name] = (directory, seed)
        return written[name]

    return get


@pytest.fixture(scope="session")
def luxjax_f32():
    """luxjax_f32(directory) -> Model, loaded once per session in float32."""
    import luxjax

    loaded: dict = {}

    def get(directory):
        if directory not in loaded:
            loaded[directory] = luxjax.load(directory, dtype="float32", progress=False)
        return loaded[directory]

    return get


MODULE_ORDER = ("test_qwen35_parity", "test_qwen35_chunked", "test_qwen35_checkpoints", "test_qwen35_bf16")


def pytest_collection_modifyitems(items):
    """float32 parity first (it compiles the shared shapes and is what everything else leans on), bf16 last. Only
    the slots of this directory's items are reordered (this hook sees the whole session's items)."""
    def module(item):
        return item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""

    slots = [i for i, item in enumerate(items) if module(item) in MODULE_ORDER]
    ordered = sorted((items[i] for i in slots), key=lambda item: MODULE_ORDER.index(module(item)))  # stable
    for i, item in zip(slots, ordered):
        items[i] = item
