"""Opt-in: real SGLang engines on CPU with HiCache and kvtier as its L3 storage backend.

``KVTIER_TEST_SGLANG_ENGINE=1`` enables it; the venv needs the engine's own packages
(``KVTIER_SGLANG_ENGINE=1 bash scripts/sglang-venv.sh``). SGLang 0.5.23 does not serve on CPU as
shipped: ``engine/`` holds the test-only stand-ins (a ``sgl_kernel`` whose CPU functions are
imported but never called here, no host-memory pinning, ``transfer_kv_direct`` in torch), on
``PYTHONPATH`` of the engine processes only. Three processes on a tiny random-weight Llama:
A serves two prompts and exits once its pages are in the pool; B, a new process on the same
pool, resumes every full page from it (SGLang reports them as storage hits); a third computes
the same prompts without HiCache. B's tokens are the recompute's and its logprobs within 1e-3
(they are equal here; KV scaled by 0.9 on load moved them by 8e-3 to 1.6e-2). About 2 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("KVTIER_TEST_SGLANG_ENGINE") != "1":
    pytest.skip("opt-in: KVTIER_TEST_SGLANG_ENGINE=1 (engines on CPU, about 2 minutes)", allow_module_level=True)

from kvtier.bench.model import make_model

pytestmark = pytest.mark.engine

ENGINE = Path(__file__).parent / "engine"
PAGE = 16


def serve(mode: str, model: Path, pool: Path) -> dict:
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ENGINE), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(ENGINE / "_engine.py"), mode, "--model", str(model), "--pool", str(pool)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, f"{mode}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_a_second_engine_resumes_the_first_engines_pages_from_kvtier(tmp_path: Path) -> None:
    model, pool = tmp_path / "tiny-llama", tmp_path / "pool"
    make_model(model)
    a = serve("write", model, pool)
    b = serve("read", model, pool)
    ref = serve("recompute", model, pool)
    full_pages = [(p["prompt_tokens"] - 1) // PAGE * PAGE for p in a["prompts"]]
    assert a["pages_in_pool"] >= sum(p["prompt_tokens"] // PAGE for p in a["prompts"])
    assert [p["cached"].get("storage", 0) for p in a["prompts"]] == [0, 0]
    assert [p["cached"]["storage"] for p in b["prompts"]] == full_pages  # every full page, from kvtier
    assert all(p["cached"]["storage_backend"] == "KVTierHiCacheStorage" for p in b["prompts"])
    for got, want in zip(b["prompts"], ref["prompts"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"], strict=True)) <= 1e-3
