#!/usr/bin/env bash
# Set up .venv in the repository root (CPU torch, pinned) and run a task in it.
#   bash scripts/dev.sh demo   plan GPT-2 124M for an A100-40GB, global batch 256 (no GPU, no download)
#   bash scripts/dev.sh test   the full test suite
#   bash scripts/dev.sh setup  only set up
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="torch==2.13.0"      # a CPU build; an unpinned torch would pull a multi-GB CUDA build
DEEPSPEED_PIN="deepspeed==0.19.8"
PY=.venv/bin/python

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv .venv
  fi
  "$PY" -m pip install -q --upgrade pip >/dev/null
  if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "$TORCH_PIN"
  fi
  "$PY" -m pip install -q -r requirements-dev.txt
  # DeepSpeed builds from source and imports torch while building: build it against the
  # installed torch (no isolated build environment, which would download another torch).
  if ! "$PY" -c "import deepspeed" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-build-isolation "$DEEPSPEED_PIN"
  fi
  "$PY" -m pip install -q --no-deps -e .
}

task="${1:-demo}"
case "$task" in
  setup) setup ;;
  demo)
    setup
    .venv/bin/memguard plan --hf gpt2 --seq-len 1024 --gpu A100-40GB --global-batch-size 256
    ;;
  test)
    setup
    set +e
    "$PY" -m pytest -q "${@:2}"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
      echo "pytest collected no tests: that is a failure" >&2
      exit 1
    fi
    exit "$rc"
    ;;
  *) echo "usage: bash scripts/dev.sh [demo|test|setup]" >&2; exit 2 ;;
esac
