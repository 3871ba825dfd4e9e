#!/usr/bin/env bash
# Runs every storage benchmark of docs/benchmarks.md back to back and writes JSON to OUT.
# Usage: benchmarks/run_all.sh [OUT_DIR] [SCRATCH_DIR]   (run on a quiet machine)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/bench}
SCRATCH=${2:-/var/tmp}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" benchmarks/read_path.py "$SCRATCH" --runs 3 --repeats 3 --total 1GiB --out "$OUT/read_path.json"
"$PY" benchmarks/read_path.py "$SCRATCH" --runs 3 --repeats 3 --total 256MiB --layout tiny \
    --out "$OUT/read_path_tiny.json"
"$PY" benchmarks/lookup.py --tokens 131072 --iters 200 > "$OUT/lookup.json"
"$PY" benchmarks/gpu_path.py --out "$OUT/gpu_path.json"   # the worker's copy path (CUDA if present)
if command -v redis-server >/dev/null; then
    PORT=$(( 20000 + RANDOM % 20000 ))
    RDIR=$(mktemp -d)
    redis-server --port "$PORT" --dir "$RDIR" --save '' --appendonly no --daemonize yes \
        --pidfile "$RDIR/redis.pid" --maxmemory 3gb --maxmemory-policy allkeys-lru >/dev/null
    trap 'kill "$(cat "$RDIR/redis.pid")" 2>/dev/null; rm -rf "$RDIR"' EXIT
    sleep 0.5
    "$PY" -m kvtier.cli.main probe "redis://127.0.0.1:$PORT" --total 1GiB --json > "$OUT/probe_redis.json"
    "$PY" -m kvtier.cli.main probe "$SCRATCH" --total 1GiB --json > "$OUT/probe_fs.json"
fi
echo "results in $OUT"
