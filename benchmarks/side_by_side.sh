#!/usr/bin/env bash
# benchmarks/run_all.sh at two commits, interleaved (A B A B ...), each from its own git worktree
# with one Python (PYTHONPATH points at that worktree's src/), so a refactor's figures can be
# read against the commit before it on the same machine within minutes of each other.
# Usage: benchmarks/side_by_side.sh BEFORE_REF [AFTER_REF=HEAD] [OUT=results/side] [ROUNDS=2]
# Writes OUT/{before,after}-N/*.json and OUT/{before,after}-N.log; compare with
# benchmarks/side_by_side.py OUT. About 2.7 minutes per run_all on 2 cores (run on a quiet machine).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: benchmarks/side_by_side.sh BEFORE_REF [AFTER_REF] [OUT] [ROUNDS]}
AFTER=${2:-HEAD}
OUT=$(realpath -m "${3:-results/side}")
ROUNDS=${4:-2}
PY=$(realpath -s "${PYTHON:-.venv/bin/python}")  # -s: a venv's python is a symlink; resolved, it leaves the venv
TREES=$(mktemp -d)
trap 'git worktree remove --force "$TREES/before" 2>/dev/null; git worktree remove --force "$TREES/after" 2>/dev/null; rm -rf "$TREES"' EXIT
git worktree add -q --detach "$TREES/before" "$BEFORE"
git worktree add -q --detach "$TREES/after" "$AFTER"
mkdir -p "$OUT"
echo "before: $(git rev-parse --short "$BEFORE")  after: $(git rev-parse --short "$AFTER")" | tee "$OUT/commits.txt"
for r in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        echo "round $r/$ROUNDS: $side ($(date +%T))"
        start=$(date +%s)
        (cd "$TREES/$side" && PYTHONPATH="$TREES/$side/src" PYTHON="$PY" \
            bash benchmarks/run_all.sh "$OUT/$side-$r" "${SCRATCH:-/var/tmp}") > "$OUT/$side-$r.log" 2>&1
        echo "  done in $(( $(date +%s) - start )) s"
    done
done
"$PY" benchmarks/side_by_side.py "$OUT"
