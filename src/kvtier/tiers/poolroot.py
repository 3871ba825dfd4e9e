"""A shared pool's root: made only on request, its one budget recorded in it, and where it lives
told at open.

A pool is a directory that already exists and carries the ``.kvtier`` marker. Only
``kvtier pool init PATH`` (``init_pool`` here) creates one. Opening a path that is missing or
unmarked is refused: the usual cause is a shared filesystem that is not mounted yet. Creating
the directory then would give every host a private "shared" pool on its root disk, with no hits
across instances and a filling disk.

The budget belongs to the pool, not to each instance: ``ROOT/.budget`` (``{"max_bytes": N}``),
written by ``kvtier pool init --max-bytes`` and ``kvtier pool budget``, and read by every
instance at open and again every ``BUDGET_REFRESH_S``. An instance's own ``pool_bytes`` can only
lower what that instance admits (``tiers/pool.py``). Like every pool file, ``.budget`` is
untrusted: it is read without following a symlink, up to a fixed size, and nonsense in it is
ignored with one warning.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import TierUnavailableError
from kvtier.fileio import TMP_SUFFIX, read_small
from kvtier.tiers.files import MARKER, ChunkFiles

log = logging.getLogger(__name__)
__all__ = ["BUDGET_FILE", "BUDGET_REFRESH_S", "Mount", "check_pool_root", "describe_at_open", "expect_local",
           "init_pool", "mount_of", "read_budget", "scratch_pool", "set_budget", "warn_once"]

BUDGET_FILE = ".budget"
BUDGET_READ_MAX = 4096  # a budget file is a few dozen bytes
BUDGET_REFRESH_S = 10.0
_warned: set[tuple[str, str]] = set()


def warn_once(root: str, what: str, message: str, *args: object) -> None:
    """``log.warning`` once per pool ``root`` and ``what`` in this process."""
    if (root, what) not in _warned:
        _warned.add((root, what))
        log.warning(message, *args)


def check_pool_root(path: str | os.PathLike[str]) -> None:
    """Raise TierUnavailableError, saying what to do, unless ``path`` is an existing directory
    with the ``.kvtier`` marker."""
    root = Path(path)
    hint = f"create it with `kvtier pool init {root} --max-bytes SIZE` (kvtier never creates a pool on its own)"
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise TierUnavailableError(f"pool {root} {what}: is its filesystem mounted? If this is a new pool, {hint}")
    if not (root / MARKER).is_file():
        raise TierUnavailableError(f"{root} is not a kvtier pool (no {MARKER} marker): is the shared filesystem "
                                   f"mounted there? If this is a new pool, {hint}")


def init_pool(path: str | os.PathLike[str], max_bytes: int | None, *, group_access: bool = False) -> Path:
    """Create (with missing parents) and mark the pool directory ``path``, and record its budget
    when ``max_bytes`` is given. An existing pool keeps its chunks; a non-empty directory that is
    not a pool is refused (ValueError), so that a typo never marks a directory of other files."""
    root = Path(path)
    # One listing decides: another init of the same pool may be writing the marker right now
    # (its temp file all the directory holds, then the marker), so only other files make the
    # directory "not a pool".
    names = {p.name for p in root.iterdir()} if root.is_dir() else set()
    if MARKER not in names and any(not name.endswith(TMP_SUFFIX) for name in names):
        raise ValueError(f"{root} is not empty and not a kvtier pool; give an empty or new directory")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"--max-bytes: must be > 0, got {max_bytes}")
    try:
        files = ChunkFiles(root, create=True, group_access=group_access)
    except TierUnavailableError as exc:
        raise ValueError(str(exc)) from None
    if max_bytes is not None:
        set_budget(root, max_bytes, files)
    return root


def set_budget(path: str | os.PathLike[str], max_bytes: int, files: ChunkFiles | None = None) -> None:
    """Record the pool's budget (every instance reads it within ``BUDGET_REFRESH_S``)."""
    check_pool_root(path)
    if max_bytes <= 0:
        raise ValueError(f"the pool budget must be > 0 bytes, got {max_bytes}")
    files = files or ChunkFiles(path, create=False, group_access=_group_shared(path))
    files.write_small(Path(path) / BUDGET_FILE, json.dumps({"max_bytes": max_bytes}).encode())


def _group_shared(path: str | os.PathLike[str]) -> bool:
    return bool(os.stat(path).st_mode & 0o070)


def read_budget(path: str | os.PathLike[str]) -> int | None:
    """The budget recorded in the pool, or None when there is none (or it is unreadable: warned
    about once per pool and process)."""
    where = os.path.join(path, BUDGET_FILE)
    try:
        data, _ = read_small(where, BUDGET_READ_MAX)
    except FileNotFoundError:
        return None
    except OSError as exc:
        warn_once(os.fspath(path), "budget-read", "kvtier pool %s: cannot read its budget (%s); "
                   "using this instance's pool_bytes", where, exc.strerror or exc)
        return None
    try:
        value = json.loads(data)["max_bytes"]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    except (ValueError, KeyError, TypeError):
        pass
    warn_once(os.fspath(path), "budget-bad", "kvtier pool %s: its budget file is not {\"max_bytes\": N}; "
               "ignored (rewrite it with `kvtier pool budget PATH SIZE`)", where)
    return None


@dataclass(frozen=True)
class Mount:
    """Where a path lives: its filesystem (from ``/proc/self/mountinfo``) and device."""

    path: str
    fstype: str
    source: str
    mount_point: str
    device: str
    on_root_device: bool
    """The path is on the same device as ``/``: a shared filesystem is probably not mounted."""


def mount_of(path: str | os.PathLike[str]) -> Mount:
    """The mount that holds ``path`` (``fstype`` "?" where mountinfo cannot tell)."""
    real = os.path.realpath(path)
    st_dev = os.stat(real).st_dev
    device = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    found: list[tuple[str, str, str]] = []  # (mount point, fstype, source) of mounts of this device
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 2 and fields[2] == device:
            found.append((fields[4].replace("\\040", " "), tail[0], tail[1]))
    holding = [m for m in found if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
    point, fstype, source = max(holding or found, key=lambda m: len(m[0]), default=("?", "?", "?"))
    return Mount(real, fstype, source, point, device, os.stat("/").st_dev == st_dev)


def scratch_pool(path: str | os.PathLike[str], max_bytes: int | None = None, *, group_access: bool = False) -> str:
    """``init_pool`` for a pool meant to be on the local disk (a benchmark's, a probe's, a test's):
    no root-device warning for it. Returns its ``fs://`` URL."""
    init_pool(path, max_bytes, group_access=group_access)
    expect_local(path)
    return f"fs://{os.path.abspath(path)}"


def expect_local(path: str | os.PathLike[str]) -> None:
    """Say that the pool at ``path`` is meant to be on the local disk (a probe's or a benchmark's
    scratch pool): ``describe_at_open`` then does not warn about the root device."""
    _warned.add((os.path.realpath(path), "root-device"))


def describe_at_open(path: str | os.PathLike[str]) -> Mount | None:
    """Log where the pool ``path`` lives; warn (once per pool and process) when it is on the
    root filesystem's device."""
    try:
        mount = mount_of(path)
    except OSError:
        return None
    log.info("kvtier pool %s: %s filesystem %s mounted at %s, device %s", mount.path, mount.fstype,
             mount.source, mount.mount_point, mount.device)
    if mount.on_root_device:
        warn_once(mount.path, "root-device", "kvtier pool %s is on the same device (%s) as / : if it should be "
                   "a shared filesystem, it is not mounted there, and this instance shares nothing", mount.path,
                   mount.device)
    return mount
