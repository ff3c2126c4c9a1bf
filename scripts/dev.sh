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

  # DeepSpeed's CPU shared-memory comm op, which its torch backend loads in deepspeed.initialize
  # (deepspeed/comm/torch.py build_shm_op). pip installs DeepSpeed without prebuilt ops, so the first
  # load JIT-builds it (ShareMemCommBuilder -> OpBuilder.jit_load -> torch.utils.cpp_extension.load,
  # ninja + g++, 2-3 min) into torch's extensions dir: $TORCH_EXTENSIONS_DIR/deepspeed_shm_comm, else
  # ~/.cache/torch_extensions/py<ver>_cpu/deepspeed_shm_comm. The engine tests in
  # tests/integrations/test_deepspeed.py skip unless it is built and up to date there
  # (_shm_op_prebuilt, the same check as here), so build it here, once.
  # The default location is kept (not one inside .venv) so that a plain `pytest` and the tests'
  # DeepSpeed subprocesses, which do not get dev.sh's environment, find the same build.
  # Every later load runs `ninja` from PATH again, and two ninja versions do not share a build log
  # (1.11 and 1.13 hash commands differently: all is rebuilt), so the caller's ninja comes first and
  # the venv's (a DeepSpeed dependency) is only the fallback.
  # cpp_extension.load guards the build with a torch.utils.file_baton.FileBaton, <build dir>/lock,
  # created O_CREAT|O_EXCL and held open by the building process until it removes it; a build killed
  # half-way leaves the file and every later load waits on it forever (FileBaton.wait). A lock that
  # no live process holds open is stale: it is removed before building.
  export PATH="$PATH:$PWD/.venv/bin"
  DS_ACCELERATOR=cpu "$PY" scripts/build_deepspeed_op.py
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
