"""Whether DeepSpeed's CPU shm comm op is built where its loads look, for the tests that run real engines.

DeepSpeed's torch backend JIT-builds the op on first use (minutes on a small machine; ``bash
scripts/dev.sh setup`` builds it); a build killed half-way leaves a ``lock`` file that makes every
later build wait forever, and every load runs ``ninja`` from PATH again (another ninja version
rebuilds it all). The same check as scripts/build_deepspeed_op.py.
"""

from __future__ import annotations

import os
import subprocess
import sys


def shm_op_prebuilt() -> bool:
    """DeepSpeed's torch backend JIT-builds its shared-memory op on first use (minutes on a small
    machine; ``bash scripts/dev.sh setup`` builds it); a build killed half-way leaves a ``lock`` file
    that makes every later build wait forever. Run the real-initialize tests only where the op is
    built, unlocked and up to date for the ``ninja`` on PATH, which every load runs again (another
    ninja version rebuilds it all). The same check as in scripts/dev.sh setup."""
    try:
        import torch
        from torch.utils.cpp_extension import get_default_build_root
    except ImportError:
        return False
    # torch.utils.cpp_extension._get_build_directory: TORCH_EXTENSIONS_DIR/<name>, else
    # <default root>/py311_cpu/<name> (python and accelerator tags)
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        v = torch.version
        acc = f"rocm{v.hip.replace('.', '')}" if v.hip else f"cu{v.cuda.replace('.', '')}" if v.cuda else "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{acc}")
    build = os.path.join(root, "deepspeed_shm_comm")
    if not os.path.exists(os.path.join(build, "deepspeed_shm_comm.so")) or os.path.exists(os.path.join(build, "lock")):
        return False
    try:
        ninja = subprocess.run(["ninja", "-n", "-C", build], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "no work to do" in ninja.stdout
