"""The estimator: trace one training step on fake tensors, model the device, report the peak.

This package's face holds its public names; :mod:`memguard.estimator.api` is ``memguard.estimate``
and :mod:`memguard.estimator.gpus` the GPU catalog. Modules whose names start with ``_`` are
internal (they may change in any release). How an estimate is made, in the order it runs:

* ``api.estimate`` checks and resolves the target in ``_targets`` (strategy, GPU, CPU: the one
  resolution the planner uses too), then asks ``_tracing`` for the tracer and what it records
  (``TraceRequest``);
* ``_trace`` records storage allocations of one step on fake tensors (``StepTracer``, ``Recorder``),
  with ``_autocast`` emulating CUDA's autocast on CPU, ``_cuda_kernels`` (its rules in
  ``_cuda_rules`` and ``_cuda_attention``) allocating what CUDA's kernels allocate, ``_cpu_kernels``
  (``_onednn*``) what the host's CPU kernel paths allocate, and ``_fake_corrections`` fixing fake
  kernels that under-report; ``_fsdp2_trace`` traces rank 0 of an FSDP2 step (subclasses of the
  tracer and recorder);
* ``_layout`` is ``estimate(layout=...)``: ``Layout``, its checks and tensor-parallel plan, the
  per-rank estimate; ``_tp_trace`` traces rank 0 of a tensor-parallel (FSDP2/HSDP x TP) step;
* ``_pricing`` turns the trace into an :class:`Estimate` (``_result``; categories are
  :class:`Category`): ``_analysis`` scans the timeline, ``_sharding`` applies ZeRO/DDP, ``_fsdp2``
  FSDP2's layout, ``_cuda`` models the caching allocator and workspaces;
* ``_eval_step`` estimates an evaluation step; ``_twins`` builds the LoRA/QLoRA/8-bit-AdamW
  stand-ins the planner estimates fine-tuning with; ``_op_memory`` measures one op for the tests
  and benchmarks.
"""

from memguard.estimator._result import CATEGORIES, Category, Estimate
from memguard.estimator.api import estimate
from memguard.vocab import format_bytes

__all__ = ["estimate", "Estimate", "Category", "CATEGORIES", "format_bytes"]
