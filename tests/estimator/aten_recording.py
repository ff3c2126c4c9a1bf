"""What the tests of the ATen-level CUDA finders share: targets, and a recorder run over a function.

Imported by the tests (this folder is on ``sys.path`` under pytest).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memguard.estimator._cuda_kernels import CudaTarget
from memguard.estimator._trace import Recorder, Trace, load_rules

load_rules()

H100 = CudaTarget(capability=(9, 0), sm_count=132)  # H100 SXM: 132 SMs, 2048 threads an SM
UNKNOWN = CudaTarget(capability=(9, 0))  # no SM count: the largest split
AMD = CudaTarget(capability=(9, 4), vendor="amd", sm_count=304)


def record_unmodelled(target: CudaTarget | None, fn: Callable[[], object], deterministic: bool | None = None) -> list:
    """Run ``fn`` on fake tensors under a recorder that reports the ATen-level finders for ``target``
    (None: the CPU target); what they named. ``deterministic``: run under
    ``torch.use_deterministic_algorithms(deterministic)`` (then off again); None leaves the setting as it is."""
    rec = Recorder(Trace(), None, None)
    rec.unmodelled_target = target
    if deterministic is not None:
        torch.use_deterministic_algorithms(deterministic)
    try:
        with FakeTensorMode():
            with rec:
                fn()
    finally:
        if deterministic is not None:
            torch.use_deterministic_algorithms(False)
    return rec.unmodelled
