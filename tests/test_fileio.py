"""kvtier.fileio.write_atomic: the one helper for files replaced whole."""

from __future__ import annotations

import os
import stat

import pytest

from kvtier.fileio import TMP_SUFFIX, write_atomic


def test_replaces_the_whole_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "summary.json"
    target.write_bytes(b"old contents, longer than the new")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_buffers_are_written_in_order(tmp_path):
    target = tmp_path / "chunk"
    write_atomic(target, [b"head", memoryview(b"-payload-"), b"", b"pad"])
    assert target.read_bytes() == b"head-payload-pad"


def test_exact_mode_ignores_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "loose", b"x", mode=0o660)
        write_atomic(tmp_path / "exact", b"x", mode=0o660, exact_mode=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "loose").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "exact").stat().st_mode) == 0o660


def test_a_failed_write_raises_and_removes_its_temp(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "missing-dir" / "f", b"x")

    def full(fd, views):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(tmp_path / "f", b"x")
    assert not any(p.name.endswith(TMP_SUFFIX) for p in tmp_path.iterdir())
    assert not (tmp_path / "f").exists()
