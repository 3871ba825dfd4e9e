"""kvtier doctor: names the field that keeps a config from hitting a pool, and what else is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from _pool import new_pool
from kvtier import KVLayout, TieredStore
from kvtier.doctor import diagnose

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
PAGES = KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.uint8)  # an engine's pages as bytes
VLLM_FORMAT = "vllm-cpu-auto-AVX512-LBHNC-bs128-auto-bfloat16-FullAttentionSpec-page{page}"


def fill(pool: Path, layout: KVLayout = LAYOUT, chunk: int = 32, chunks: int = 3, **options: Any) -> None:
    with TieredStore.open(options.pop("model_id", "llama"), layout, chunk, host_bytes=0,
                          pool_url=new_pool(pool), **options) as store:
        tokens = list(range(100, 100 + chunks * chunk))
        store.put(tokens, torch.zeros(layout.shape(len(tokens)), dtype=layout.dtype))


def differing(pool: Path, **stated: Any) -> dict[str, list[Any]]:
    report = diagnose(pool, stated)
    assert not report.would_hit
    (ns,) = report.namespaces
    assert ns.chunks_seen == 3
    return ns.differs


def test_a_matching_config_would_hit_and_exits_zero(tmp_path: Path) -> None:
    fill(tmp_path)
    report = diagnose(tmp_path, {"model_id": "llama", "chunk_tokens": 32, "dtype": "bfloat16"})
    assert report.would_hit and report.complete_scan and report.sampled_files == 3
    assert [f.check for f in report.findings if f.status != "ok"] == []
    cli = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", str(tmp_path), "--model", "llama",
                          "--chunk-tokens", "32", "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["would_hit"] is True


@pytest.mark.parametrize("stated, field", [
    ({"model_id": "mistral"}, "model"),
    ({"model_id": "llama", "dtype": "float16"}, "dtype"),
    ({"model_id": "llama", "chunk_tokens": 64}, "chunk_tokens"),
    ({"model_id": "llama", "tenant_salt": "acme"}, "tenant"),
])
def test_each_field_that_differs_is_named(tmp_path: Path, stated: dict[str, Any], field: str) -> None:
    fill(tmp_path)
    assert list(differing(tmp_path, **stated)) == [field]


def test_tp_is_named_where_shards_are_per_rank_and_ignored_for_head_shards(tmp_path: Path) -> None:
    rank_shards, head_shards = tmp_path / "ranks", tmp_path / "heads"
    fill(rank_shards, PAGES, 256, model_id="/m/tiny", world_size=2, rank=0,
         kv_format=VLLM_FORMAT.format(page=32768) + "-tp2")
    fill(head_shards, PAGES, 256, model_id="/m/tiny", kv_format=VLLM_FORMAT.format(page=32768))
    assert differing(rank_shards, model="/m/tiny", tensor_parallel_size=1) == {"tensor_parallel_size": [2, 1]}
    report = diagnose(head_shards, {"model": "/m/tiny", "tensor_parallel_size": 8, "dtype": "bfloat16",
                                    "chunk_tokens": 256})
    assert report.would_hit
    assert report.namespaces[0].fields["tensor_parallel_size"] == "any (head shards)"
    assert differing(head_shards, model="/m/tiny", dtype="float16") == {"dtype": ["bfloat16", "float16"]}


def test_a_pool_written_by_two_models_names_the_closest_and_counts_each(tmp_path: Path) -> None:
    fill(tmp_path)
    fill(tmp_path, model_id="qwen", chunks=5)
    report = diagnose(tmp_path, {"model": "qwen", "chunk_tokens": 32})
    assert report.would_hit
    seen = {ns.fields["model"]: ns.chunks_seen for ns in report.namespaces}
    assert seen == {"llama": 3, "qwen": 5}


def test_nothing_seen_of_the_namespace_is_no_hit_and_findings_say_why(tmp_path: Path) -> None:
    fill(tmp_path)
    report = diagnose(tmp_path, {"model": "gpt"})
    (fail,) = [f for f in report.findings if f.status == "fail"]
    assert fail.check == "namespace" and "model (pool 'llama', config 'gpt')" in fail.detail


def test_retained_share_budget_and_a_sample_of_a_large_pool(tmp_path: Path) -> None:
    fill(tmp_path, chunks=40)
    files = sorted(tmp_path.rglob("*.kvt"))
    future = time.time() + 3600
    for f in files[:10]:
        os.utime(f, (future, future))
    size = files[0].stat().st_size
    report = diagnose(tmp_path, {"model": "llama"}, pool_bytes=20 * size, sample_files=1000)
    by_check = {f.check: f for f in report.findings}
    assert "25%" in by_check["retention"].detail
    assert by_check["budget"].status == "warn" and report.estimated_bytes == 40 * size
    small = diagnose(tmp_path, {"model": "llama"}, sample_files=5, seed=1)
    assert not small.complete_scan and 5 <= small.sampled_files < 40 and small.would_hit


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_chunks_another_user_wrote_owner_only_are_a_fail() -> None:
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="kvtier-doctor-", dir="/tmp"))  # pytest's tmp is root-only
    fill(tmp_path)
    tmp_path.chmod(0o755)
    for f in tmp_path.rglob("*"):
        os.chown(f, 4242, 4242)
        f.chmod(0o755 if f.is_dir() else 0o600)
    os.chown(tmp_path, 4242, 4242)
    code = ("import json, os, sys; from kvtier.doctor import diagnose; os.setgid(4343); os.setuid(4343); "
            f"r = diagnose({str(tmp_path)!r}, {{'model': 'llama'}}); "
            "print(json.dumps([r.would_hit, [f.check for f in r.findings if f.status == 'fail']]))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    finally:
        subprocess.run(["rm", "-rf", str(tmp_path)], check=True)
    assert out.returncode == 0, out.stderr
    would_hit, failed = json.loads(out.stdout)
    assert not would_hit and "permissions" in failed


def test_a_namespace_that_differs_only_in_the_weights_is_said_to(tmp_path: Path) -> None:
    """6f37bba never compared the weights: "would hit" for a pool of another checkpoint's KV."""
    from kvtier.identity import content_digest

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * 8192)
    pool = tmp_path / "pool"
    fill(pool, model_id=str(model), model_digest="engine-digest", weights_digest=content_digest(model))
    assert diagnose(pool, {"model": str(model), "chunk_tokens": 32}).would_hit
    (model / "model.safetensors").write_bytes(b"b" * 8192)  # new weights behind the same path
    report = diagnose(pool, {"model": str(model), "chunk_tokens": 32})
    (ns,) = report.namespaces
    assert not report.would_hit and list(ns.differs) == ["weights_digest"]
    (finding,) = [f for f in report.findings if f.check == "namespace"]
    assert "everything but the weights" in finding.detail
    cli = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "doctor", str(pool), "--model", str(model),
                          "--chunk-tokens", "32", "--json"], capture_output=True, text=True)
    assert cli.returncode == 1 and json.loads(cli.stdout)["would_hit"] is False
    by_digest = diagnose(pool, {"model": str(tmp_path / "elsewhere"), "model_digest": "other-digest"})
    assert set(by_digest.namespaces[0].differs) == {"model", "model_digest"}
