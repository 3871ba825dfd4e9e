"""What ``TieredStore.retain`` costs the caller (the model runner's thread of every rank) once the
retention table is full: median and max of ``Retention.retain`` for a batch of keys into a table
of ``MAX_KEYS`` unexpired keys.

    python benchmarks/retention_table.py [--calls 300] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

from kvtier.retention import MAX_KEYS, Retention


@dataclass(frozen=True)
class _Id:
    key: bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="retain() calls timed (default 300)")
    parser.add_argument("--batch", type=int, default=16, help="keys per call (default 16: a 4k-token session)")
    args = parser.parse_args()
    retention = Retention()
    until = time.time() + 3600
    retention.retain([_Id(os.urandom(32)) for _ in range(MAX_KEYS)], until, [])  # type: ignore[misc]
    times = []
    for _ in range(args.calls):
        batch = [_Id(os.urandom(32)) for _ in range(args.batch)]
        t = time.perf_counter()
        retention.retain(batch, until, [])  # type: ignore[arg-type]
        times.append(time.perf_counter() - t)
    retention.flush()
    retention.close()
    print(f"retain() of {args.batch} keys into a full table ({MAX_KEYS} keys), {args.calls} calls: "
          f"median {statistics.median(times) * 1e6:.1f} us, p99 {sorted(times)[int(0.99 * len(times))] * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
