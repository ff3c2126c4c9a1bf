"""The estimator: trace one training step on fake tensors, model the device, report the peak.

``api.estimate`` ties them together: ``targets`` checks and resolves the target (strategy, GPU,
CPU); ``tracing`` picks the tracer for it; ``trace`` records storage allocations (``StepTracer``,
``Recorder``), with ``autocast`` emulating CUDA's autocast on CPU, ``cuda_kernels`` (with its rules
in ``cuda_rules`` and ``cuda_attention``) allocating what CUDA's kernels allocate, ``cpu_kernels``
what the CPU's kernel paths allocate, and ``fake_corrections`` fixing fake kernels that under-report;
``fsdp2_trace`` traces rank 0 of an FSDP2 step; ``pricing`` turns a trace into an ``Estimate``
(``analysis`` scans the timeline, ``sharding`` applies ZeRO/DDP, ``cuda`` models the caching
allocator and workspaces, ``gpus`` is the catalog); ``eval_step`` estimates an evaluation step;
``op_memory`` measures one op for the tests and benchmarks.
"""

from memguard.estimator.api import estimate
from memguard.estimator.result import CATEGORIES, Estimate
from memguard.vocab import format_bytes

__all__ = ["estimate", "Estimate", "CATEGORIES", "format_bytes"]
