"""Small files written whole: reports, metrics snapshots. (Chunk files: ``tiers/files.py``.)"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write via a unique temp file in the same directory and ``os.replace``: a reader sees the
    old file or the new one, never half a file, and concurrent writers never share a temp name."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
