"""A benchmark result folder: written request by request as a run goes, read back whole.

A result folder holds ``requests.jsonl`` (one object per request, appended by :class:`Recorder`
as requests finish, so a crash keeps what was measured), ``configs.json`` (one object per engine
configuration tried, with its status) and ``env.json`` (versions, machine, model shape, suite
settings). :func:`load_run` reads it back as a :class:`Run`, with the resume profiles joined
(kvtier.bench.profiles). The suite and ``kvtier bench run`` write it; the report and the
planner's calibration read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench import profiles
from kvtier.jsonl import json_objects

Record = dict[str, Any]
# A row without these cannot be grouped or timed, so load_run rejects it rather than guess.
_REQUIRED = ("config", "instances", "workload", "concurrency", "measured", "start_s")


class Recorder:
    """Appends records to ``requests.jsonl`` as they arrive, so a crash keeps what was measured."""

    def __init__(self, out: Path) -> None:
        self.path = out / "requests.jsonl"
        self.path.touch()  # present even when every configuration fails, so the report still runs
        self.count = 0
        self.errors = 0

    def __call__(self, record: Record) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.count += 1
        self.errors += record.get("error") is not None


@dataclass
class Run:
    """One benchmark result folder as loaded by :func:`load_run`; read-only by convention."""

    path: Path
    records: list[Record]
    configs: list[Record] = field(default_factory=list)
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The folder name: the column heading of this run in :func:`compare`."""
        return self.path.name


def _load_json(path: Path, default: Any) -> Any:
    """Parsed JSON of ``path``, ``default`` if it does not exist; ValueError naming it if malformed."""
    if not path.exists():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read a result folder. ``requests.jsonl`` is required; ``configs.json``/``env.json`` are optional.

    Raises ValueError naming the file (and line) if ``requests.jsonl`` is missing, a line is not a
    JSON object, a row lacks a field needed for grouping, or ``configs.json`` is not a list of
    objects with a ``config`` name.
    Blank lines are skipped (a suite killed mid-write leaves at most a trailing partial line,
    which is reported rather than ignored, so a truncated run is noticed).
    """
    folder = Path(path)
    requests = folder / "requests.jsonl"
    if not requests.is_file():
        raise ValueError(f"{requests}: missing; is {folder} a benchmark result folder?")
    records: list[Record] = []
    with requests.open(encoding="utf-8") as fh:
        for lineno, row in json_objects(fh, requests):
            missing = [k for k in _REQUIRED if k not in row]
            if missing:
                raise ValueError(f"{requests}:{lineno}: missing field(s) {', '.join(missing)}")
            records.append(row)
    configs = _load_json(folder / "configs.json", [])
    if not isinstance(configs, list) or not all(isinstance(c, dict) and "config" in c for c in configs):
        raise ValueError(f"{folder / 'configs.json'}: expected a list of objects, each with a \"config\" name")
    env = _load_json(folder / "env.json", {})
    if not isinstance(env, dict):
        raise ValueError(f"{folder / 'env.json'}: expected a JSON object")
    records = profiles.join(records, profiles.load_profiles(folder))  # profile_* fields, where written
    return Run(path=folder, records=records, configs=configs, env=env)
