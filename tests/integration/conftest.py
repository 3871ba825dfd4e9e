"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama every engine test serves (config, random weights, a local tokenizer):
    built once per run; tests that need other weights build their own."""
    from kvtier.bench.model import make_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(path)
    return path
