"""Fixtures of the stand-in engine tests: the tiny model and vLLM's config for it, once per run.

``KVTIER_EXPECT_VLLM`` (set by ``tests/test_vllm_releases.py``) names the vLLM release this run
must import: a run that was meant for 0.34 and imported the installed 0.32 fails here instead of
passing for the wrong version.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("KVTIER_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")


def pytest_report_header() -> str:
    import vllm

    return f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}"


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import vllm

    expected = os.environ.get("KVTIER_EXPECT_VLLM")
    if expected and not vllm.__version__.startswith(expected):
        pytest.fail(f"expected vLLM {expected}, imported {vllm.__version__} from {vllm.__file__}")
    from _engine import base_config

    from kvtier.bench.model import make_model

    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    make_model(path)
    return base_config(path)
