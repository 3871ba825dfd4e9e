"""The worker's data path (``integrations/transfer.py``) through ``benchmarks/gpu_path.py`` on CPU tensors.

The benchmark saves and loads every chunk of five vLLM CUDA layouts through ``PageMover``
(from host DRAM, then from the disk tier alone) and exits 1 when any page differs; on a GPU it
runs the same code with streams, events and page-locked memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks" / "gpu_path.py"


def test_every_layouts_pages_round_trip_bit_exactly_through_the_workers_data_path(tmp_path: Path) -> None:
    out = tmp_path / "gpu_path.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--chunks", "3", "--layers", "2",
                           "--heads", "2", "--head-dim", "16", "--chunk-tokens", "64", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["all_bit_exact"] is True
    assert [r["layout"] for r in result["layouts"]] == ["flash-nhd", "flash-hnd", "flashinfer", "cross-layer",
                                                        "mla-fp8"]
    assert all(r["save_gbps"] > 0 and r["load_disk_gbps"] > 0 for r in result["layouts"])
