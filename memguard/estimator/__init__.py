"""The estimator: trace one training step on fake tensors, model the device, report the peak.

``trace`` records storage allocations; ``autocast`` emulates CUDA's autocast on CPU;
``cuda_kernels`` (with its rules) allocates what CUDA's kernels allocate; ``analysis`` scans the
timeline; ``sharding`` applies ZeRO/DDP; ``cuda`` models the caching allocator and workspaces;
``gpus`` is the catalog; ``api.estimate`` ties them together.
"""

from memguard.estimator.api import estimate
from memguard.estimator.result import CATEGORIES, Estimate
from memguard.vocab import format_bytes

__all__ = ["estimate", "Estimate", "CATEGORIES", "format_bytes"]
