"""The misconfiguration rows of the fault matrix (``faults/harness/misconfig.py``): every
mistake refused before anything is served, or warned at open, with nothing created where a
mount belongs."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.harness import SCALES
from faults.harness.misconfig import misconfiguration_matrix


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list:
    return misconfiguration_matrix(SCALES["ci"], Path(tmp_path_factory.mktemp("misconfig")))


def test_every_misconfiguration_is_refused_or_warned(rows) -> None:
    assert len(rows) == 16
    for row in rows:
        row.check()


def test_refusals_name_the_setting_on_one_line_and_never_start_vllm(rows) -> None:
    serve = [r for r in rows if r.fault.startswith("kvtier serve")]
    assert len(serve) == 10
    for row in serve:
        assert row.extra["rc"] == 2 and "Traceback" not in str(row.extra["stderr"]), row.notes
