"""Fixtures for the image pipeline tests: the transformers oracle (imported once per session: it is slow)."""
from __future__ import annotations

import copy

import pytest


@pytest.fixture(scope="session")
def oracle_class():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


@pytest.fixture(scope="session")
def make_oracle(oracle_class):
    def make(config: dict):
        return oracle_class.from_dict(copy.deepcopy(config))  # its constructor edits nested dicts in place

    return make
