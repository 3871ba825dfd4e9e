#!/usr/bin/env bash
# Build the venv that runs kvtier's SGLang HiCache backend tests (tests/hicache/) and
# benchmark (benchmarks/sglang_backend.py): sglang 0.5.23 with the torch it pins (2.14.1,
# a CUDA build that imports and runs on CPU) and kvtier installed editable.
#
# sglang is installed without its dependency tree: that tree pulls flashinfer, CUTLASS,
# DeepEP and other GPU kernels (well over 10 GB) that its storage path never imports. The
# packages below are what `sglang.srt.mem_cache` and `sglang.srt.managers.cache_controller`
# import, at sglang's own pins where it pins them. About 3 minutes and 6 GB.
# KVTIER_SGLANG_ENGINE=1 adds what sglang.Engine and sglang.launch_server import, for the opt-in
# engine test (tests/hicache/test_hicache_engine.py, KVTIER_TEST_SGLANG_ENGINE=1; about 40 s more).
#   bash scripts/sglang-venv.sh [VENV]      (default .venv-sglang)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-sglang}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
"$VENV/bin/pip" install -q --no-deps sglang==0.5.23
"$VENV/bin/pip" install -q torch==2.14.1 \
    apache-tvm-ffi==0.1.11 transformers==5.19.0 tokenizers==0.23.2 sentencepiece==0.2.1 \
    compressed-tensors==0.18.0 orjson psutil pybase64 requests packaging pillow starlette \
    fastapi msgspec pydantic pyzmq tqdm ipython aiohttp dill gguf triton numpy
"$VENV/bin/pip" install -q -e '.[test]' torch==2.14.1
if [ "${KVTIER_SGLANG_ENGINE:-0}" = 1 ]; then
    "$VENV/bin/pip" install -q torch==2.14.1 openai==2.8.0 xgrammar==0.2.7 uvloop uvicorn setproctitle \
        interegular partial_json_parser python-multipart zstandard einops jsonschema soundfile==0.13.1 \
        'python-dateutil<3'
    "$VENV/bin/python" -c "import sglang.srt.entrypoints.engine, sglang.srt.entrypoints.http_server"
fi
"$VENV/bin/python" -c "
import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.memory_pool_host
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
import kvtier.integrations.sglang"
echo "SGLang venv ready: $VENV/bin/python" >&2
