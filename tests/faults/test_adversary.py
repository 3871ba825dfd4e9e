"""Hostile pool metadata and hostile clients (docs/reliability.md, "Never wrong, never stuck"):
the ``hostile metadata`` and ``hostile clients`` fault scenarios at the ci scale. Seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import SCALES
from .harness.adversary import METADATA, hostile_clients, hostile_metadata


@pytest.fixture(scope="module")
def metadata_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    return {row.fault: row for row in hostile_metadata(SCALES["ci"], tmp_path_factory.mktemp("metadata"))}


@pytest.mark.parametrize("kind", [name for name, _, _ in METADATA])
def test_hostile_pool_metadata_never_blocks_and_never_serves_wrong_kv(metadata_rows, kind: str) -> None:
    row = metadata_rows[kind]
    row.check()  # nothing wrong, nothing stuck, every read served


def test_hostile_clients_cost_nothing_but_a_refusal(tmp_path: Path) -> None:
    rows = hostile_clients(SCALES["ci"], tmp_path)
    assert len(rows) == 3
    for row in rows:
        row.check()
