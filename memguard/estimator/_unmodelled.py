"""CUDA kernels whose memory the CUDA model does not replay: what they are, and a bound on each.

The CUDA target is traced on CPU fake tensors, and the trace sees tensors only. Some CUDA kernels
allocate through the caching allocator without a tensor the CPU would also create: CUB's
temporary storage, cuDNN's workspaces, scratch tensors a CUDA kernel makes for itself. Where
memguard has a rule (:mod:`memguard.estimator._cuda_rules`, :mod:`memguard.estimator._cuda_attention`)
the rule allocates them; this module lists the rest. While the trace runs under
:class:`~memguard.estimator._cuda_kernels.CudaKernelModel`, every call of a function registered
here with :func:`unmodelled` reports an :class:`Unmodelled` entry (the hook is
:data:`~memguard.estimator._cuda_kernels.UNMODELLED`), and so does every ATen op the trace's recorder
sees that is registered in :data:`~memguard.estimator._cuda_kernels.UNMODELLED_OPS` (reductions,
``topk`` and scatters, which autograd also runs itself); the pricing names each in
``Estimate.notes`` and adds the largest to ``Estimate.peak_upper_bytes`` (:func:`upper_bound`).

What is listed, and why (paths under ``aten/src/ATen/`` of torch 2.13 unless said otherwise):

* **cuDNN RNN** (``nn.LSTM``/``GRU``/``RNN``: ``torch.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``):
  ``native/cudnn/RNN.cpp`` ``_cudnn_rnn`` allocates a ``workspace`` for the call and a ``reserve``
  buffer kept for backward, both of the sizes cuDNN reports at run time
  (``cudnnGetRNNTempSpaceSizes``); ``_cudnn_rnn_backward`` takes another workspace. No bound
  follows from the shapes in PyTorch's source: **unbounded**. (The trace records the CPU's
  per-step activations in place of the reserve.)
* **cuDNN convolution workspaces** (``F.conv1d/2d/3d``, ``F.conv_transpose1d/2d/3d``, so every
  ``nn.Conv*``): ``native/cudnn/Conv_v8.cpp`` ``run_conv_plan`` requests the chosen execution plan's
  ``getWorkspaceSize()`` bytes from the caching allocator for each forward, backward-data and
  backward-filter call and frees them on return; which plan runs is cuDNN's heuristic choice
  (``get_configs_from_heuristics``), or, under ``torch.backends.cudnn.benchmark``, the fastest of a
  timed search whose shared workspace is the largest candidate's up to the largest free block
  (:func:`cudnn_benchmark_workspace_bytes`). No bound follows from the shapes: **unbounded**, unless
  a cap is set (``CUDNN_CONV_WSCAP_DBG``, or ``CudaTarget.conv_workspace_bytes``), which then bounds
  each call's workspace (:func:`conv_workspace`). A plan whose workspace the allocator cannot give
  is skipped for the next (``try_configs``/``try_plans`` catch ``OutOfMemoryError``; Conv_v7.cpp's
  ``AlgoIterator::try_all`` likewise), so the workspace is memory cuDNN takes when it is free; it
  shows in ``max_memory_reserved``, and pytorch#49207 (a request for a workspace limit) reports
  out-of-memory errors caused by large heuristic workspaces nonetheless.
* **Sort** (``torch.sort``/``argsort``/``msort`` and their methods) along a dimension longer
  than 4096: ``native/cuda/Sort.h`` ``should_use_small_sort`` (``size(dim) <= 4096``) takes the
  in-place bitonic sort (no extra memory); longer ones take ``native/cuda/Sort.cu``
  ``launch_stable_sort_kernel``, whose three paths allocate index buffers through the caching
  allocator and run CUB radix sorts (:func:`sort_workspace_bytes`).
* **Embedding backward's sort** (``F.embedding`` with more than 3072 indices, or
  ``scale_grad_by_freq``): the rule allocates the tensors of ``native/cuda/Embedding.cu``
  ``embedding_dense_backward_cuda``, not the CUB temporary storage of its
  ``cuda::cub::radix_sort_pairs`` on the indices, nor that of the segment scans of
  ``native/cuda/EmbeddingBackwardKernel.cu`` (:func:`embedding_backward_workspace_bytes`).
* **Layer/RMS-norm weight-gradient partial buffers** when the GPU's SM count is unknown: the rule
  (:func:`memguard.estimator._cuda_rules.layer_norm_partial_rows`) allocates them only when it can
  evaluate ``native/cuda/layer_norm_kernel.cu``'s ``N / 32 < sm_count / 2`` (the catalog's NVIDIA
  GPUs carry their SM counts, :attr:`memguard.estimator.gpus.GPUSpec.sm_count`); without an SM count
  (a spec without one, ``GENERIC``, fake CUDA tensors on a GPU) or on ROCm, whose launch is not
  replayed, the largest buffers the condition allows are listed (:func:`layer_norm_partial_bytes`).
* **Group-norm backward's scratch**: ``native/cuda/group_norm_kernel.cu``
  ``GroupNormBackwardKernelImplInternal`` allocates ``ds``, ``db`` (``[N, C]``), ``c1`` (``[N, C]``)
  and ``c2``, ``c3`` (``[N, G]``), all in the accumulate type, for a contiguous input; no rule
  allocates them (:func:`group_norm_backward_bytes`). Its channels-last path allocates more,
  not read here: **unbounded** for channels-last inputs.
* **CUB scans of ``cumsum``/``cumprod``** over a tensor that is a single scan (1-D, or every other
  dimension of size 1): ``native/cuda/ScanUtils.cuh`` ``scan_dim`` calls ``cuda::cub::inclusive_scan``
  (:func:`scan_workspace_bytes`); other shapes run ATen's block scans, which allocate nothing. Under
  deterministic algorithms newer releases take ``inclusive_deterministic_scan`` for floating sums,
  not read: **unbounded** there.
* **Sorting ``index_put_``** (``index_put(_)`` with ``accumulate=True``, and the backward of ``x[index]``
  with integer index tensors): native/cuda/Indexing.cu ``index_put_with_sort_kernel`` sorts the linear
  indices with CUB and keeps four int64 index arrays meanwhile (:func:`index_put_sort_bytes`).
* **``x[index] = v``, ``index_add`` and ``index_copy`` under deterministic algorithms** (ATen ``index_put_``,
  ``index_put`` and ``_index_put_impl_`` without ``accumulate``, ``index_add(_)`` (so the backward of
  ``index_select``), ``index_copy(_)``, registered in :data:`~memguard.estimator._cuda_kernels.UNMODELLED_OPS`,
  only while ``torch.use_deterministic_algorithms(True)`` is set): native/TensorAdvancedIndexing.cpp
  ``_index_put_impl_`` takes the sorting kernel (newer sources only for a value of more than one element,
  :data:`INDEX_PUT_ONE_VALUE_UNSORTED_SINCE`), native/cuda/Indexing.cu ``index_add_cuda_impl`` calls it
  accumulating on ``source * alpha``, TensorAdvancedIndexing.cpp ``index_copy_out`` without; the bound
  follows ``index_put_with_sort_kernel`` (:func:`sorting_index_put_bytes`: int32 index conversions, the
  linear index with ``wrapIndexOnce``'s range checks, the value's expansion, copies of a non-contiguous or
  permuted ``self``, the sort).
* **``torch._foreach_norm``** (ATen ``_foreach_norm`` and ``_foreach_powsum``, so ``clip_grad_norm_`` with
  ``foreach=True``): native/cuda/ForeachReduceOp.cu allocates ``output_per_tensor``, one partial
  in the accumulate type for each 65536-element chunk of the longest tensor, times the tensors
  (:func:`foreach_norm_partials_bytes`); off its fast path, the largest per-tensor norm's Reduce.cuh
  staging. ``clip_grad_norm_`` with ``foreach=None`` takes its per-tensor path in a trace, as
  ``torch.utils._foreach_utils._has_foreach_support`` refuses fake tensors, so there the trace records
  per-tensor ``linalg_vector_norm`` calls, not ``_foreach_norm``.
* **``topk``** (ATen ``topk``, registered in :data:`~memguard.estimator._cuda_kernels.UNMODELLED_OPS`):
  native/cuda/TensorTopK.cu ``launch_gather_topk_kernel`` copies a non-contiguous input and, when
  ``should_use_multiblock(num_slices, slice_size)``, runs ``mbtopk::launch``, whose ``kthValues``,
  ``ks_to_find``, ``desired``, ``counts``, ``digit_cum_sum``, ``withinKCounts`` and ``kthCounts`` come from
  the caching allocator, with two CUB scans by key (:func:`topk_multiblock_bytes`; ``num_blocks``
  follows ``get_items_per_thread`` with the GPU's SM count, without one the most blocks); the
  single-block kernel allocates nothing. native/cuda/TensorTopK.cpp ``topk_out_cuda`` then sorts
  results of ``k > 4096`` with two result-sized buffers, Sort.cu's sort and a gather
  (:func:`topk_workspace_bytes`); on ROCm ``should_use_sort`` sorts a long 1-D input whole instead
  (newer sources not for float32 past 500000 elements: the larger of the two paths is taken).
* **Scatter under deterministic algorithms** (ATen ``scatter``/``scatter_`` with a ``src`` tensor,
  ``scatter_add(_)``, ``scatter_reduce(_)`` with a sum or mean, ``scatter(_).reduce`` with ``"add"``,
  only while ``torch.use_deterministic_algorithms(True)`` is set; so the backward of ``gather`` too):
  native/TensorAdvancedIndexing.cpp ``_scatter_via_index_put`` runs the sorting ``index_put_`` on the
  index's (or, for a broadcast index, its one dimension's) linear indices, plus copies of a
  non-contiguous ``self`` and of a ``src`` not dense as viewed (:func:`deterministic_scatter_bytes`).
* **Reductions split over blocks** (ATen ops ``sum``, ``nansum``, ``prod``, ``mean``, ``linalg_vector_norm``
  / ``norm``, ``amax``/``amin``, ``max``/``min`` (full and ``.dim``), ``argmax``/``argmin``,
  ``var``/``std``/``var_mean``/``std_mean``, registered by ATen overload in
  :data:`~memguard.estimator._cuda_kernels.UNMODELLED_OPS`, so that autograd's own reductions, such as
  a Linear bias gradient's ``sum``, are seen): native/cuda/Reduce.cuh ``gpu_reduce_kernel`` allocates
  ``ReduceConfig::global_memory_size()`` bytes of staging and ``semaphore_size()`` bytes of semaphores
  when ``setReduceConfig`` splits each output's inputs over ``ctas_per_output > 1`` blocks, which
  depends on the SM count (:func:`set_reduce_config`, replayed line by line with the GPU's SM count,
  which the catalog's GPUs carry; without an SM count, or on ROCm, the largest split any GPU can choose), plus an ``AccumulationBuffer`` for 16-bit outputs of inputs
  past 32-bit indexing (:func:`reduce_workspace`). Complex ``var``/``std`` and ``any``/``all``,
  ``aminmax``, ``logsumexp`` (whose inner reductions the trace does not see) are not listed.

Bounds of CUB's temporary storage follow CCCL's ``cub/device/dispatch/dispatch_radix_sort.cuh``
(the onesweep ``allocation_sizes``: bins, lookback, an extra key and value buffer when more than
one pass runs, counters; each aliased at 256-byte alignment by ``AliasTemporaries``) and
``cub/agent/single_pass_scan_operators.cuh`` (``ScanTileState::AllocationSize``:
``(num_tiles + TILE_STATUS_PADDING) * sizeof(TxnWord)``), as ATen's ``cuda/cub.cuh`` ``CUB_WRAPPER``
allocates them from the caching allocator for the call. Where CUB's tuning decides a size, the
bound takes the largest value the formula admits: 8-byte offsets and counters, 8 radix bits per
pass (256 digits), a onesweep tile of at least 256 items (every CUB tuning policy's tile: 256 to
512 threads times several items per thread; an assumption, not checked per GPU), a scan tile of
at least one item.

Not listed, and why: convolutions with ``torch.backends.cudnn.enabled = False`` run ATen's own CUDA
kernels (``slow_conv2d``'s im2col ``columns`` and the like), not read here; ``nonzero``, ``unique``, boolean masking and other ops whose output size
depends on values cannot run on fake tensors, so no estimate contains them; ``cross_entropy`` /
``nll_loss`` allocate on CUDA what their meta kernels do (see :mod:`memguard.estimator._cuda_rules`).
Not bounded yet (so not listed, and not in the bound): the copies ``index_put_with_sort_kernel`` makes
of ``self`` and ``value`` for an accumulating ``index_put(_)`` call (:func:`index_put`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from torch.overrides import TorchFunctionMode

from memguard.estimator._cuda_kernels import UNMODELLED, UNMODELLED_OPS, CudaTarget

_MiB = 1 << 20


@dataclass(frozen=True)
class Unmodelled:
    """Memory one call's CUDA kernels allocate that the trace does not replay.

    Attributes:
        mechanism: what allocates it, e.g. ``"CUB radix-sort temporary storage"``.
        op: the call, with its shapes.
        allocations: the sizes (bytes) of the buffers live together at the worst moment of the call
            (forward or backward), each requested from the caching allocator separately; empty when
            no bound exists (``bound_bytes`` is then None).
        bounded: False where no bound follows from the shapes.
        source: the PyTorch (or CUB) source that allocates it.
        detail: what else the user should know about it (e.g. how to bound it); may be empty.
    """

    mechanism: str
    op: str
    allocations: tuple[int, ...]
    bounded: bool
    source: str
    detail: str = ""

    @property
    def bound_bytes(self) -> int | None:
        """Bytes requested at the worst moment, or None where there is no bound."""
        return sum(self.allocations) if self.bounded else None


#: ``finder(target, args, kwargs) -> entries`` for one torch function.
Finder = Callable[[CudaTarget, tuple, dict], list[Unmodelled]]


def unmodelled(*funcs: Callable) -> Callable[[Finder], Finder]:
    """Register the decorated finder for each of ``funcs`` in :data:`~memguard.estimator._cuda_kernels.UNMODELLED`."""

    def register(finder: Finder) -> Finder:
        for f in funcs:
            UNMODELLED[f] = finder
        return finder

    return register


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _backward_runs(t: torch.Tensor) -> bool:
    """Whether autograd will run ``t``'s part of this call's backward (not under ``no_grad``: an
    evaluation step, whose kernels have no backward)."""
    return t.requires_grad and torch.is_grad_enabled()


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(int(s)) for s in t.shape)}] {str(t.dtype).replace('torch.', '')}"


# --------------------------------------------------------------------------------------------
# CUB temporary storage
# --------------------------------------------------------------------------------------------

#: cub/util_device.cuh ``AliasTemporaries``: every aliased allocation starts at a 256-byte boundary.
CUB_ALIGN = 256
#: dispatch_radix_sort.cuh: 8 radix bits per pass at most (RADIX_DIGITS = 256) in CUB's policies.
CUB_RADIX_DIGITS = 256
#: dispatch_radix_sort.cuh: ``PORTION_SIZE = ((1 << 28) - 1) / TILE * TILE``, at least 2**27 items.
CUB_PORTION_ITEMS = 1 << 27
#: The smallest onesweep tile assumed (items per block), see the module docstring.
CUB_MIN_TILE = 256
#: single_pass_scan_operators.cuh: ``TILE_STATUS_PADDING`` (one warp).
CUB_TILE_STATUS_PADDING = 32
#: single_pass_scan_operators.cuh: ``TxnWord`` of a tile descriptor for values of at most 8 bytes.
CUB_TXN_WORD = 16


def cub_radix_sort_bytes(n: int, key_bytes: int, value_bytes: int = 0) -> int:
    """A bound on CUB's temporary storage for ``DeviceRadixSort::SortPairs`` (or ``SortKeys`` with
    ``value_bytes=0``) of ``n`` items, not overwriting its input.

    dispatch_radix_sort.cuh onesweep ``allocation_sizes``, each rounded up to :data:`CUB_ALIGN`:
    bins ``num_portions * num_passes * RADIX_DIGITS`` offsets, lookback ``max_num_blocks *
    RADIX_DIGITS`` offsets, an extra key and value buffer of ``n`` items each (when more than one
    pass runs: counted always), counters ``num_portions * num_passes``. ``num_passes`` is at most
    the key's bits / 8 rounded up (8 radix bits per pass gives the most bins), ``max_num_blocks``
    at most ``ceil(min(n, portion) / 256)``; offsets and counters are counted as 8 bytes.
    """
    if n <= 0:
        return 0
    portions = -(-n // CUB_PORTION_ITEMS)
    passes = -(-(8 * key_bytes) // 8)
    blocks = -(-min(n, CUB_PORTION_ITEMS) // CUB_MIN_TILE)
    sizes = [
        portions * passes * CUB_RADIX_DIGITS * 8,  # bins
        blocks * CUB_RADIX_DIGITS * 8,  # lookback
        n * key_bytes,  # extra key buffer
        n * value_bytes,  # extra value buffer
        portions * (8 * key_bytes) * 8,  # counters (num_passes <= key bits, at 1 radix bit a pass)
    ]
    return sum(_aligned(s) for s in sizes)


def cub_segmented_radix_sort_bytes(n: int, key_bytes: int, value_bytes: int) -> int:
    """CUB's temporary storage for ``DeviceSegmentedRadixSort::SortPairs`` of ``n`` items in all:
    dispatch_radix_sort.cuh ``DispatchSegmentedRadixSort``'s two allocations, an extra key and an
    extra value buffer of ``n`` items each (the input is not overwritten), 256-byte aligned."""
    return _aligned(n * key_bytes) + _aligned(n * value_bytes)


def cub_scan_bytes(n: int, value_bytes: int = 8) -> int:
    """A bound on CUB's temporary storage for a single-pass scan (``DeviceScan``, and the
    ``DeviceSelect::UniqueByKey`` of the embedding backward) of ``n`` items: the tile status of
    single_pass_scan_operators.cuh, ``(num_tiles + 32) * sizeof(TxnWord)`` (16 bytes for values
    of at most 8 bytes, else status, partial and inclusive values, ``1 + 2 * value_bytes``), with
    one item a tile at least, plus the grid queue / selected-count word, each 256-byte aligned."""
    if n <= 0:
        return 0
    word = CUB_TXN_WORD if value_bytes <= 8 else 1 + 2 * value_bytes
    return _aligned((n + CUB_TILE_STATUS_PADDING) * word) + _aligned(8)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // CUB_ALIGN) * CUB_ALIGN if nbytes else 0


# --------------------------------------------------------------------------------------------
# cuDNN RNN
# --------------------------------------------------------------------------------------------

_RNN_SOURCE = ("aten/src/ATen/native/cudnn/RNN.cpp _cudnn_rnn / _cudnn_rnn_backward: workspace and reserve "
               "of cudnnGetRNNTempSpaceSizes' run-time sizes")


@unmodelled(torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)
def rnn(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``nn.LSTM``/``GRU``/``RNN``: cuDNN's (MIOpen's on ROCm) workspace and reserve, unbounded."""
    x = args[0] if args else kwargs.get("input", kwargs.get("data"))
    if not isinstance(x, torch.Tensor):
        return []
    library = "MIOpen" if target.vendor == "amd" else "cuDNN"
    return [Unmodelled(f"{library} RNN workspace and reserve space", f"RNN layer on input {_shape(x)}", (), False,
                       _RNN_SOURCE)]


# --------------------------------------------------------------------------------------------
# cuDNN convolution workspaces
# --------------------------------------------------------------------------------------------

#: native/cudnn/Conv_v7.cpp ``allocate_workspace`` and Conv_v8.cpp ``generate_and_filter_plans``
#: (``TORCH_CHECK_WITH(OutOfMemoryError, ... < 1_TiB, "Not enough memory for workspace!")``): a
#: workspace of 1 TiB or more is refused as an out-of-memory error (cuDNN sometimes reports sizes
#: near 2**63).
CUDNN_WORKSPACE_REFUSED = 1 << 40


def cache_info_largest(free_device_bytes: int, largest_cached_free_block: int) -> int:
    """What ``CUDACachingAllocator::cacheInfo`` reports as the largest block a workspace may take:
    c10/cuda/CUDACachingAllocator.cpp starts from ``cudaMemGetInfo``'s free memory ("an optimistic
    initial guess of *largest") and raises it to any larger free cached block (``cache_info_aux``)."""
    return max(int(free_device_bytes), int(largest_cached_free_block))


def cudnn_benchmark_workspace_bytes(candidates: Iterable[int], max_block_size: int,
                                    allocatable: int | None = None, api: str = "v8") -> int:
    """The workspace ``torch.backends.cudnn.benchmark`` allocates for one convolution's plan search.

    ``api="v8"`` (the default path from torch 2.0; ``TORCH_CUDNN_V8_API_DISABLED=1`` takes v7):
    native/cudnn/Conv_v8.cpp ``generate_and_filter_plans`` keeps the plans whose workspace is at most
    ``max_block_size`` (:func:`cache_info_largest`), allocates the largest of them, and halves the
    size on each out-of-memory error until an allocation succeeds (``allocatable``: the most the
    allocator can give; None: all of it); the timed plans share that one block, freed when
    ``get_plans_from_find`` returns. ``api="v7"``: Conv_v7.cpp ``getMaxWorkspaceSize`` takes the
    largest nonzero candidate not above ``max_block_size`` and ``findAlgorithms`` allocates it
    (then ``emptyCache()``: "the above benchmarking uses a huge amount of memory, e.g. a few GBs").

    Raises:
        ValueError: ``api`` is neither ``"v8"`` nor ``"v7"``.
        MemoryError: the chosen size is 1 TiB or more (:data:`CUDNN_WORKSPACE_REFUSED`), which torch
            reports as an out-of-memory error.
    """
    if api not in ("v8", "v7"):
        raise ValueError(f"api={api!r}: the cuDNN convolution paths are 'v8' and 'v7'")
    sizes = [int(c) for c in candidates if int(c) <= max_block_size and (api == "v8" or int(c) > 0)]
    size = max(sizes, default=0)
    if size >= CUDNN_WORKSPACE_REFUSED:
        raise MemoryError("Not enough memory for workspace!")
    if api == "v8" and allocatable is not None:
        while size and size > allocatable:
            size //= 2
    return size


def _cudnn_conv_phases(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, ...]:
    """The cuDNN calls one convolution makes: the forward, and in backward
    (``cudnn_convolution_backward`` in native/cudnn/ConvShared.cpp) the data gradient when the
    input needs one and the filter gradient when the weight does; each takes its own workspace."""
    phases = ["forward"]
    if _backward_runs(x):
        phases.append("backward data")
    if _backward_runs(weight):
        phases.append("backward filter")
    return tuple(phases)


def conv_workspace(target: CudaTarget, name: str, x: Any, weight: Any) -> list[Unmodelled]:
    """The workspace entry of one convolution call ``name`` (``"conv2d"``, ``"conv_transpose2d"``, ...).

    The forward and backward calls each hold one workspace, freed before the next starts, so the
    worst moment of the call holds one. With a cap (:func:`memguard.estimator._cuda_rules.conv_workspace_cap_bytes`)
    that one is at most the cap, also during a ``cudnn.benchmark`` search (its candidates are the
    capped plans: :func:`cudnn_benchmark_workspace_bytes`); without one it is unbounded. The entry
    is named by the function and its calls, not by shapes: the bound does not depend on them.
    """
    from memguard.estimator._cuda_rules import conv_workspace_cap_bytes

    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return []
    benchmark = bool(torch.backends.cudnn.benchmark)
    op = f"{name} ({', '.join(_cudnn_conv_phases(x, weight))})"
    if target.vendor == "amd":
        return [Unmodelled("MIOpen convolution workspace", op, (), False,
                           "aten/src/ATen/native/miopen/Conv_miopen.cpp (MIOpen's find and workspace; not read here)")]
    if not torch.backends.cudnn.enabled:
        return []  # ATen's own CUDA convolutions (slow_conv2d and friends): not listed, see the module docstring
    cap = conv_workspace_cap_bytes(target)
    mechanism = "cuDNN convolution workspace" + (" and cudnn.benchmark's plan search" if benchmark else "")
    source = ("aten/src/ATen/native/cudnn/Conv_v8.cpp run_conv_plan: the plan's workspace per call; "
              + ("get_plans_from_find/generate_and_filter_plans: the largest candidate up to the largest free block"
                 if benchmark else "get_configs_from_heuristics/try_configs: cuDNN's heuristic order"))
    if cap is not None:
        return [Unmodelled(mechanism, op, (cap,), True, source + "; capped by CUDNN_CONV_WSCAP_DBG")]
    detail = ("cuDNN skips a plan whose workspace the allocator cannot give (try_configs catches OutOfMemoryError), "
              "so it takes what is free, and the freed block stays cached (reserved) after the call; pytorch#49207 "
              "reports out-of-memory errors traced to large heuristic workspaces all the same"
              + ("; under cudnn.benchmark the first step's search takes up to all free memory" if benchmark else "")
              + "; set CUDNN_CONV_WSCAP_DBG (MiB) to bound it")
    return [Unmodelled(mechanism, op, (), False, source, detail)]


def _conv_finder(name: str) -> Finder:
    def finder(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
        x = args[0] if args else kwargs.get("input")
        return conv_workspace(target, name, x, _arg(args, kwargs, 1, "weight", None))

    finder.__name__ = f"{name}_workspace"
    finder.__doc__ = f"``F.{name}``: cuDNN's workspace for its forward and backward calls (:func:`conv_workspace`)."
    return finder


for _name, _f in (("conv1d", F.conv1d), ("conv2d", F.conv2d), ("conv3d", F.conv3d),
                  ("conv_transpose1d", F.conv_transpose1d), ("conv_transpose2d", F.conv_transpose2d),
                  ("conv_transpose3d", F.conv_transpose3d)):
    unmodelled(_f)(_conv_finder(_name))


# --------------------------------------------------------------------------------------------
# Sort
# --------------------------------------------------------------------------------------------

#: native/cuda/Sort.h ``should_use_small_sort``: slices up to this long sort in place (torch 2.13).
SMALL_SORT = 4096
#: native/cuda/Sort.cu ``launch_stable_sort_kernel``: one sort per segment from this slice length.
LARGE_SEGMENT = 1_000_000
#: native/cuda/Sort.cu ``launch_stable_sort_kernel``: fewer segments than this take the full sort.
FULL_SORT_SEGMENTS = 128


def sort_workspace_bytes(shape: tuple[int, ...], dim: int, key_bytes: int, dense_innermost: bool = True
                         ) -> tuple[int, ...]:
    """The buffers CUDA's stable sort allocates beyond its outputs, live together at its worst moment.

    native/cuda/Sort.cu ``launch_stable_sort_kernel`` (keys of ``key_bytes``, int64 indices) with
    ``n`` elements, slices of ``nsort``, ``nsegments = n / nsort``:

    * ``nsegments == 1`` or ``nsort >= 10**6`` (``segmented_sort_large_segments``): an int64
      index array of ``nsort`` and, per segment in turn, ``radix_sort_pairs<key, int64>(nsort)``;
    * ``nsegments < 128`` (``segmented_sort_pairs_by_full_sort``): two ``int2`` arrays of ``n``, then
      ``radix_sort_pairs<key, int2>(n)`` with no key output (cuda/cub.cuh allocates one of ``n``
      keys), then ``radix_sort_keys<int64>(n)`` on the segment ids;
    * otherwise (``segmented_sort_pairs``): an int64 reverse-index array of ``n`` and
      ``DeviceSegmentedRadixSort::SortPairs`` of ``n``.

    A sort along a dimension that is not innermost, or of a tensor that is not dense, first makes
    dense copies of the input, values and indices (native/cuda/Sort.cpp); those are counted too
    when ``dense_innermost`` is False (``n * (2 * key_bytes + 8)``). Slices of at most
    :data:`SMALL_SORT` sort in place and allocate nothing: ``()``.
    """
    n = math.prod(shape)
    if n == 0 or not shape:
        return ()
    nsort = int(shape[dim])
    if nsort <= SMALL_SORT:
        return ()
    nsegments = n // nsort
    copies = (n * key_bytes, n * key_bytes, n * 8) if not dense_innermost else ()
    if nsegments == 1 or nsort >= LARGE_SEGMENT:
        return copies + (nsort * 8, cub_radix_sort_bytes(nsort, key_bytes, 8))
    if nsegments < FULL_SORT_SEGMENTS:
        first = (n * key_bytes, cub_radix_sort_bytes(n, key_bytes, 8))
        second = (cub_radix_sort_bytes(n, 8, 0),)
        return copies + (n * 8, n * 8) + (first if sum(first) >= sum(second) else second)
    return copies + (n * 8, cub_segmented_radix_sort_bytes(n, key_bytes, 8))


def _sort_call(target: CudaTarget, x: Any, dim: int, what: str) -> list[Unmodelled]:
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.is_sparse:
        return []
    d = dim % x.dim()
    dense_innermost = x.is_contiguous() and d == x.dim() - 1
    allocs = sort_workspace_bytes(tuple(x.shape), d, x.element_size(), dense_innermost)
    if not allocs:
        return []
    return [Unmodelled("stable sort's index buffers and CUB radix-sort temporary storage",
                       f"{what} of {_shape(x)} along dim {d}", allocs, True,
                       "aten/src/ATen/native/cuda/Sort.cu launch_stable_sort_kernel; aten/src/ATen/cuda/cub.cuh; "
                       "cub/device/dispatch/dispatch_radix_sort.cuh")]


@unmodelled(torch.sort, torch.Tensor.sort)
def sort(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``torch.sort(input, dim=-1, descending=False, stable=False)`` (``stable`` may be keyword only)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = _arg(args, kwargs, 1, "dim", -1)
    return _sort_call(target, x, dim if isinstance(dim, int) else -1, "torch.sort")


@unmodelled(torch.argsort, torch.Tensor.argsort)
def argsort(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``argsort`` calls ``sort`` (native/Sorting.cpp)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = _arg(args, kwargs, 1, "dim", -1)
    return _sort_call(target, x, dim if isinstance(dim, int) else -1, "torch.argsort")


@unmodelled(torch.msort, torch.Tensor.msort)
def msort(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``msort`` sorts along dim 0 (native/Sorting.cpp)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    return _sort_call(target, x, 0, "torch.msort")


# --------------------------------------------------------------------------------------------
# topk
# --------------------------------------------------------------------------------------------

#: native/cuda/TensorTopK.cu ``mbtopk``: ``BLOCK_THREADS`` and ``RADIX_DIGITS`` (8 radix bits a pass).
TOPK_BLOCK_THREADS = 256
TOPK_RADIX_DIGITS = 256
#: native/cuda/TensorTopK.cu ``mbtopk``: ``MIN_ITEMS_PER_THREAD`` (the most blocks a slice).
TOPK_MIN_ITEMS_PER_THREAD = 4
#: native/cuda/TensorTopK.cu ``mbtopk``: ``MAX_ITEMS_PER_THREAD`` on CUDA.
TOPK_MAX_ITEMS_PER_THREAD = 64
#: native/cuda/TensorTopK.cu ``get_items_per_thread``: ``REGS_PER_THREAD`` on CUDA.
TOPK_REGS_PER_THREAD = 40
#: ``regsPerMultiprocessor``: 64K 32-bit registers an SM on every NVIDIA capability from 5.0 (CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability"); with 40 registers a thread,
#: ``get_items_per_thread``'s ``blocks_per_mp = min(65536 / (40 * 256), maxBlocksPerMultiProcessor)`` is 6
#: (``maxBlocksPerMultiProcessor`` is at least 16 there).
REGS_PER_SM = 65536


def topk_should_use_multiblock(num_slices: int, slice_size: int) -> bool:
    """native/cuda/TensorTopK.cu ``should_use_multiblock`` (the CUDA heuristic of pytorch#74267)."""
    if num_slices > 0xFFFFFFFF or slice_size > 0xFFFFFFFF:
        return False
    s, n = num_slices, slice_size
    return ((s <= 20 and n >= 20000) or (20 < s <= 40 and n >= 10000) or (40 < s <= 80 and n >= 8000)
            or (80 < s < 200 and n >= 5000) or (200 <= s < 800 and n >= 3000)
            or (800 <= s <= 4000 and n >= 800) or (s > 4000 and n >= 400))


def topk_items_per_thread(num_slices: int, slice_size: int, sm_count: int | None) -> int:
    """native/cuda/TensorTopK.cu ``get_items_per_thread`` on CUDA: ``ceil(n / (sm_count * blocks_per_mp *
    256))`` clamped to [4, 64], ``blocks_per_mp`` 6 (:data:`REGS_PER_SM`); without an SM count the fewest
    items a thread, :data:`TOPK_MIN_ITEMS_PER_THREAD`, which gives the most blocks (the bound)."""
    if not sm_count:
        return TOPK_MIN_ITEMS_PER_THREAD
    blocks_per_mp = REGS_PER_SM // (TOPK_REGS_PER_THREAD * TOPK_BLOCK_THREADS)
    ipt = -(-(num_slices * slice_size) // (sm_count * blocks_per_mp * TOPK_BLOCK_THREADS))
    return max(TOPK_MIN_ITEMS_PER_THREAD, min(ipt, TOPK_MAX_ITEMS_PER_THREAD))


def topk_multiblock_bytes(num_slices: int, slice_size: int, elem_bytes: int, sm_count: int | None = None,
                          vendor: str = "nvidia") -> tuple[int, ...]:
    """The buffers ``mbtopk::launch`` (native/cuda/TensorTopK.cu) takes from the caching allocator, all
    live until it returns: ``kthValues`` (``S`` values), ``ks_to_find`` (``2 S`` uint32), ``desired``
    (``2 S`` of the radix type: 8 bytes for 8-byte types, else 4, ``TopKTypeConfig``), ``counts``
    (``num_blocks * 256`` shorts), on CUDA ``digit_cum_sum`` (``S * 256`` uint32), ``withinKCounts`` and
    ``kthCounts`` (``num_blocks`` uint32 each), with ``num_blocks = S * ceil(slice / (items_per_thread *
    256))``; then, on CUDA, two ``cuda::cub::inclusive_sum_by_key`` over ``num_blocks`` counts, one at a
    time: a scan's tile status (:func:`cub_scan_bytes`, key-value pairs of 8 bytes) and one uint32 key a
    tile (cub/device/dispatch/dispatch_scan_by_key.cuh; one item a tile at least). ROCm's launch has no
    ``digit_cum_sum`` nor CUB scans, and larger ``items_per_thread``; it is bounded with 4 items a thread.
    """
    s = num_slices
    ipt = topk_items_per_thread(s, slice_size, sm_count if vendor == "nvidia" else None)
    blocks = s * -(-slice_size // (ipt * TOPK_BLOCK_THREADS))
    radix = 8 if elem_bytes == 8 else 4
    allocs = [s * elem_bytes, 2 * s * 4, 2 * s * radix, blocks * TOPK_RADIX_DIGITS * 2]
    if vendor == "nvidia":
        allocs.append(s * TOPK_RADIX_DIGITS * 4)
    allocs += [blocks * 4, blocks * 4]
    if vendor == "nvidia":
        allocs.append(cub_scan_bytes(blocks, 8) + _aligned(4 * (blocks + 1)))
    return tuple(allocs)


def topk_workspace_bytes(shape: tuple[int, ...], dim: int, k: int, elem_bytes: int, sorted: bool = True,
                         contiguous: bool = True, sm_count: int | None = None, vendor: str = "nvidia"
                         ) -> tuple[int, ...]:
    """The memory ``topk`` on CUDA allocates beyond its outputs, at its worst moment.

    native/cuda/TensorTopK.cpp ``topk_out_cuda``: on ROCm, a 1-D input of at least 10000 elements
    (``should_use_sort``) is sorted whole (``topk_out_with_sort``: ``at::cuda::sort``'s values and int64
    indices of ``n`` and :func:`sort_workspace_bytes`); newer sources keep float32 inputs past 500000 on
    the selection, so for such inputs the larger of the two is returned. On CUDA ``should_use_sort`` is
    false. Otherwise
    (``k > 0``) ``launch_gather_topk_kernel`` makes the input contiguous (a copy when it is not), and runs
    ``mbtopk::launch`` when ``should_use_multiblock(num_slices, slice)`` (:func:`topk_multiblock_bytes`),
    else ``sbtopk::launch``, which allocates nothing. Then, if ``sorted`` and ``k`` exceeds
    :data:`SMALL_SORT` (``should_use_small_sort``; shorter slices sort in place), ``sortedIndices`` and
    ``sortedValues`` (``empty_like``), the sort of the values (:func:`sort_workspace_bytes`, of a
    contiguous ``[.., k, ..]``) and ``indices.gather(dim, sortedIndices)`` (int64, the values' size), the
    sort's workspace freed before the gather. The larger phase is returned.
    """
    n = math.prod(shape)
    if n == 0:
        return ()
    nslice = int(shape[dim]) if shape else 1
    slices = n // nslice
    whole_sort: tuple[int, ...] = ()
    if vendor == "amd" and n >= 10000 and n == nslice:
        whole_sort = (n * elem_bytes, n * 8) + sort_workspace_bytes(tuple(shape), dim, elem_bytes, True)
    if k == 0:
        return whole_sort
    select = () if contiguous else (n * elem_bytes,)
    if topk_should_use_multiblock(slices, nslice):
        select += topk_multiblock_bytes(slices, nslice, elem_bytes, sm_count, vendor)
    phase = select
    if sorted and k > SMALL_SORT and shape:
        out_shape = tuple(k if d == dim else int(s) for d, s in enumerate(shape))
        m = slices * k
        ws = sort_workspace_bytes(out_shape, dim, elem_bytes, dim == len(shape) - 1)
        sort_phase = (m * 8, m * elem_bytes) + (ws if sum(ws) >= m * 8 else (m * 8,))
        if sum(sort_phase) > sum(phase):
            phase = sort_phase
    return whole_sort if sum(whole_sort) >= sum(phase) else phase


_TOPK_SOURCE = ("aten/src/ATen/native/cuda/TensorTopK.cpp topk_out_cuda; aten/src/ATen/native/cuda/TensorTopK.cu "
                "launch_gather_topk_kernel, mbtopk::launch; aten/src/ATen/native/cuda/Sort.cu")


def topk(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """``aten.topk(self, k, dim=-1, largest=True, sorted=True)`` (``torch.topk`` and ``Tensor.topk``)."""
    x = args[0] if args else kwargs.get("self")
    if not isinstance(x, torch.Tensor) or x.is_sparse:
        return []
    k = int(_arg(args, kwargs, 1, "k", 0))
    dim = int(_arg(args, kwargs, 2, "dim", -1))
    sorted_ = bool(_arg(args, kwargs, 4, "sorted", True))
    d = dim % x.dim() if x.dim() else 0
    allocs = topk_workspace_bytes(tuple(int(s) for s in x.shape), d, k, x.element_size(), sorted_,
                                  x.is_contiguous(), target.sm_count, target.vendor)
    if not allocs:
        return []
    slice_size = int(x.shape[d]) if x.dim() else 1
    detail = ""
    if target.vendor == "nvidia" and target.sm_count is None and topk_should_use_multiblock(
            x.numel() // max(slice_size, 1), slice_size):
        detail = ("the GPU's SM count is unknown, so this takes 4 items a thread (the most blocks); "
                  "with one it is at most that")
    return [Unmodelled("topk's radix-select buffers and the sort of its results",
                       f"topk k={k} of {_shape(x)} along dim {d}", allocs, True, _TOPK_SOURCE, detail)]


UNMODELLED_OPS[torch.ops.aten.topk.default] = topk


# --------------------------------------------------------------------------------------------
# Embedding backward
# --------------------------------------------------------------------------------------------


def embedding_backward_workspace_bytes(num_indices: int, index_bytes: int = 8) -> tuple[int, ...]:
    """CUB's temporary storage in CUDA's sort-based embedding backward, at its largest moment.

    native/cuda/Embedding.cu ``embedding_dense_backward_cuda``: ``cuda::cub::radix_sort_pairs`` of the
    indices with their positions (keys and values of the index type); then
    native/cuda/EmbeddingBackwardKernel.cu ``embedding_backward_cuda_kernel``: a
    ``cuda::cub::unique_by_key`` and scans over the segments, one at a time. Each CUB call frees its
    storage before the next, so the bound is the largest: the sort's.
    """
    return (max(cub_radix_sort_bytes(num_indices, index_bytes, index_bytes), cub_scan_bytes(num_indices, index_bytes)),)


@unmodelled(F.embedding)
def embedding(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``F.embedding`` whose CUDA backward sorts (the rule's conditions: dense gradient, no max_norm)."""
    from memguard.estimator._cuda_rules import EMBEDDING_SORT_THRESHOLD

    indices = args[0] if args else kwargs.get("input")
    weight = _arg(args, kwargs, 1, "weight", None)
    max_norm = _arg(args, kwargs, 3, "max_norm", None)
    scale = bool(_arg(args, kwargs, 5, "scale_grad_by_freq", False))
    sparse = bool(_arg(args, kwargs, 6, "sparse", False))
    if (not isinstance(indices, torch.Tensor) or not isinstance(weight, torch.Tensor) or not _backward_runs(weight)
            or sparse or max_norm is not None or indices.is_floating_point()):
        return []
    n = indices.numel()
    if n <= EMBEDDING_SORT_THRESHOLD and not scale:
        return []
    return [Unmodelled("CUB temporary storage of the embedding backward's index sort and segment scans",
                       f"embedding backward of {n} indices into {_shape(weight)}",
                       embedding_backward_workspace_bytes(n, indices.element_size()), True,
                       "aten/src/ATen/native/cuda/Embedding.cu embedding_dense_backward_cuda; "
                       "aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu; cub/device/dispatch/dispatch_radix_sort.cuh")]


# --------------------------------------------------------------------------------------------
# index_put with accumulate (and the backward of advanced indexing)
# --------------------------------------------------------------------------------------------


def index_put_sort_bytes(num_indices: int) -> tuple[int, ...]:
    """The buffers CUDA's sorting ``index_put_`` holds while it sorts ``num_indices`` linear indices.

    native/cuda/Indexing.cu ``index_put_with_sort_kernel`` (taken for ``accumulate=True``, and under
    deterministic algorithms, by ``_index_put_impl_`` in native/TensorAdvancedIndexing.cpp): the int64
    ``linearIndex`` (``computeLinearIndex``), ``sorted_indices``, ``orig_indices`` and ``range``, and
    ``cuda::cub::radix_sort_pairs`` of int64 pairs, all live together. Copies it makes of a
    non-contiguous ``self``, of a broadcast ``value`` or of a permuted ``src`` are not counted: the
    backward of ``x[index]`` (``index_backward``: ``_index_put_impl_`` of the gradient into zeros,
    accumulating) takes contiguous ones.
    """
    if num_indices <= 0:
        return ()
    return (num_indices * 8,) * 4 + (cub_radix_sort_bytes(num_indices, 8, 8),)


def _index_count(index: Any) -> int | None:
    """Elements of the broadcast integer index tensors of an advanced index; 0 without one; None for a
    boolean mask (whose size depends on values: such a call cannot run on fake tensors)."""
    parts = index if isinstance(index, (tuple, list)) else (index,)
    shapes = []
    for part in parts:
        if isinstance(part, torch.Tensor):
            if part.dtype == torch.bool:
                return None
            if not part.is_floating_point():
                shapes.append(tuple(part.shape))
    if not shapes:
        return 0
    return math.prod(torch.broadcast_shapes(*shapes))


_INDEX_SOURCE = ("aten/src/ATen/native/cuda/Indexing.cu index_put_with_sort_kernel; "
                 "cub/device/dispatch/dispatch_radix_sort.cuh")


@unmodelled(torch.Tensor.__getitem__)
def getitem(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``x[index]`` with integer index tensors: its backward accumulates with the sorting ``index_put_``."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not _backward_runs(args[0]):
        return []
    n = _index_count(args[1])
    if not n:
        return []
    return [Unmodelled("sorting index_put_'s index buffers and CUB radix-sort temporary storage",
                       f"backward of advanced indexing of {_shape(args[0])} by {n} indices",
                       index_put_sort_bytes(n), True, _INDEX_SOURCE)]


@unmodelled(torch.index_put, torch.Tensor.index_put, torch._C.TensorBase.index_put, torch.Tensor.index_put_,
            torch._C.TensorBase.index_put_)
def index_put(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``index_put(_)(input, indices, values, accumulate=True)``: the sorting kernel
    (native/TensorAdvancedIndexing.cpp ``_index_put_impl_``). Without ``accumulate`` the kernel sorts only
    under deterministic algorithms, which the ATen-level :func:`index_put_op` names (it also sees
    ``x[index] = v``, which calls ``index_put_`` below any torch function)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    indices = _arg(args, kwargs, 1, "indices", None)
    accumulate = bool(_arg(args, kwargs, 3, "accumulate", False))
    if not isinstance(x, torch.Tensor) or not accumulate:
        return []
    n = _index_count(tuple(indices) if indices is not None else ())
    if not n:
        return []
    return [Unmodelled("sorting index_put_'s index buffers and CUB radix-sort temporary storage",
                       f"index_put with accumulate into {_shape(x)} at {n} indices", index_put_sort_bytes(n), True,
                       _INDEX_SOURCE)]


# --------------------------------------------------------------------------------------------
# scatter under deterministic algorithms
# --------------------------------------------------------------------------------------------


def deterministic_scatter_bytes(self_shape: tuple[int, ...], dim: int, index_shape: tuple[int, ...],
                                index_strides: tuple[int, ...], src_bytes: int, src_is_view_dense: bool,
                                self_contiguous: bool, self_bytes: int) -> tuple[int, ...]:
    """The buffers a CUDA ``scatter``/``scatter_add``/``scatter_reduce`` (sum, mean) takes under
    ``torch.use_deterministic_algorithms(True)``, at the worst moment.

    native/TensorAdvancedIndexing.cpp ``scatter_impl`` / ``scatter_add`` call ``_scatter_via_index_put``,
    which runs ``mut_out.index_put_(indices, src_view, accumulate)`` with ``src_view =
    as_strided(src, index.sizes(), src.strides())``: for a 1-D ``self``, or an ``index`` of stride 0 along
    every other dimension (``broadcast_index``), one index along ``dim`` (``index.size(dim)`` of them in
    the broadcast case); otherwise an index for every dimension (``dim``'s, and ``arange``s expanded to
    ``index``'s shape), ``index.numel()`` linear indices. ``_index_put_impl_`` takes the sorting kernel
    (deterministic), :func:`index_put_sort_bytes` of those indices, plus the copies
    native/cuda/Indexing.cu ``index_put_with_sort_kernel`` makes: of ``self`` when it is not contiguous,
    and of the values (``expandedValue.contiguous()``) when ``src_view`` is not dense, both also for a
    broadcast index along a dimension other than 0 (``makeLinearIndex`` moves it to the front, so
    ``self`` is permuted), all counted live with the sort: a bound.
    """
    m = math.prod(index_shape)
    if m == 0:
        return ()
    broadcast = all(index_strides[i] == 0 for i in range(len(index_shape)) if i != dim)
    num = int(index_shape[dim]) if broadcast and len(index_shape) > 1 else m
    # one index along a dim other than 0: makeLinearIndex moves it to the front (transposeToFront), and
    # index_put_with_sort_kernel copies the permuted self (``src.contiguous()``); the values are counted too
    front = broadcast and len(index_shape) > 1 and dim != 0
    copies = () if self_contiguous and not front else (math.prod(self_shape) * self_bytes,)
    if not src_is_view_dense or front:
        copies += (m * src_bytes,)
    return copies + index_put_sort_bytes(num)


#: ATen scatters that take ``_scatter_via_index_put`` under deterministic algorithms: overload ->
#: index of ``reduce`` (None: always taken; else only for ``"sum"``/``"mean"``/``"add"``).
_SCATTERS: dict[Any, int | None] = {}


def scatter(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """``scatter(_)`` with a ``src`` tensor, ``scatter_add(_)`` and ``scatter_reduce(_)`` with a sum or mean,
    only under ``torch.use_deterministic_algorithms(True)`` (``warn_only`` too: ATen checks
    ``deterministicAlgorithms()`` alone)."""
    if not torch.are_deterministic_algorithms_enabled():
        return []
    x = args[0] if args else kwargs.get("self")
    dim = _arg(args, kwargs, 1, "dim", 0)
    index = _arg(args, kwargs, 2, "index", None)
    src = _arg(args, kwargs, 3, "src", None)
    if not all(isinstance(t, torch.Tensor) for t in (x, index, src)) or x.is_sparse:
        return []
    reduce_at = _SCATTERS[func]
    if reduce_at is not None and _arg(args, kwargs, reduce_at, "reduce", None) not in ("sum", "mean", "add"):
        return []
    ndim = max(x.dim(), 1)
    d = int(dim) % ndim
    ishape = tuple(int(s) for s in index.shape) or (1,)
    istrides = tuple(int(s) for s in index.stride()) or (1,)
    dense = _dense_layout(ishape, tuple(int(s) for s in src.stride()) or (1,))
    allocs = deterministic_scatter_bytes(tuple(int(s) for s in x.shape) or (1,), d, ishape, istrides,
                                         src.element_size(), dense, x.is_contiguous(), x.element_size())
    if not allocs:
        return []
    name = str(func).replace("aten.", "")
    return [Unmodelled("deterministic scatter's sorting index_put_ (index buffers, CUB radix-sort storage, copies)",
                       f"{name} into {_shape(x)} along dim {d} at {_shape(index)} indices", allocs, True,
                       "aten/src/ATen/native/TensorAdvancedIndexing.cpp _scatter_via_index_put; " + _INDEX_SOURCE,
                       "taken because torch.use_deterministic_algorithms(True) is set")]


def _register_scatters() -> None:
    aten = torch.ops.aten
    for name, reduce_at in [("scatter_add.default", None), ("scatter_add_.default", None), ("scatter.src", None),
                            ("scatter_.src", None), ("scatter.reduce", 4), ("scatter_.reduce", 4),
                            ("scatter_reduce.two", 4), ("scatter_reduce_.two", 4)]:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            _SCATTERS[op] = reduce_at
            UNMODELLED_OPS[op] = scatter


_register_scatters()


# --------------------------------------------------------------------------------------------
# index_put_ without accumulate, index_add and index_copy under deterministic algorithms
# --------------------------------------------------------------------------------------------
#
# Read in the PyTorch repository (aten/src/ATen/native/TensorAdvancedIndexing.cpp ``_index_put_impl_``,
# ``index_copy_out``; native/cuda/Indexing.cu ``index_put_with_sort_kernel``, ``makeLinearIndex``,
# ``computeLinearIndex``, ``wrapIndexOnce``, ``index_add_cuda_impl``), in versions before and after 2.13,
# not at release tags: the buffers below are the same in all of them, except where said.

#: native/TensorAdvancedIndexing.cpp ``_index_put_impl_``: newer sources take the sorting kernel without
#: ``accumulate`` only for a value of more than one element (``deterministicAlgorithms() && value_.numel() > 1``;
#: a one-element value writes the same number to every duplicate, so the order does not matter), older
#: ones for every value (``accumulate || deterministicAlgorithms()``). The release that changed it was not
#: pinned down: sources already written with ``std::optional`` (mid-2024) still lack the condition, a later
#: one written with ``std::string_view`` has it, and so does every newer source read. Targets before this
#: version count the sort for a one-element value too (an over-count for any release that already skips it).
INDEX_PUT_ONE_VALUE_UNSORTED_SINCE = (2, 9)


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """c10 ``is_contiguous``: the strides of the dimensions of size > 1 are the row-major ones."""
    step = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != step:
            return False
        step *= n
    return True


def _expanded_strides(shape: tuple[int, ...], strides: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...]:
    """``Tensor.expand(to)``'s strides (ExpandUtils.h ``inferExpandGeometry``): 0 where a dimension of
    size 1 (or a missing leading one) is broadcast."""
    lead = len(to) - len(shape)
    out = []
    for d, n in enumerate(to):
        i = d - lead
        out.append(0 if i < 0 or (shape[i] == 1 and n != 1) else strides[i])
    return tuple(out)


def sorting_index_put_bytes(self_shape: tuple[int, ...], self_contiguous: bool, elem_bytes: int,
                            indices: list, value_numel: int, value_contiguous: bool,
                            target: CudaTarget | None = None) -> tuple[int, ...]:
    """The buffers of CUDA's sorting ``index_put_`` (native/cuda/Indexing.cu ``index_put_with_sort_kernel``,
    reached from ``_index_put_impl_``) at its worst moment, as the source writes them.

    ``indices`` has, for each leading dimension of ``self``, None (not indexed) or ``(shape, strides,
    itemsize)`` of an integer index tensor (itemsize 4: int32, 8: int64). Two phases, the larger returned:

    1. ``makeLinearIndex``: int32 indices are converted (``i.to(at::kLong)``, an int64 copy of each, live
       until it returns); non-adjacent indexed dimensions are moved to the front (``transposeToFrontAndInvPerm``,
       views). ``computeLinearIndex`` then, for each index in turn, runs ``wrapIndexOnce``: ``index.max()``
       and ``index.min()`` (full reductions of the broadcast index, Reduce.cuh's staging:
       :func:`reduce_workspace_bytes`, one at a time) and ``index.remainder(dim_size)``, multiplied by the
       dimension's stride (two int64 tensors of the ``M`` broadcast indices, live together until the
       statement ends), added into ``linearIndex`` (``M`` int64) from the second index on.
    2. the sort: ``expandedValue`` (``value.expand(vals_shape).contiguous()``, older sources the same
       expansion when ``value.numel()`` is short: a copy of ``nElemBefore * M * sliceSize`` elements unless
       the value is already contiguous and that large), ``src.contiguous()`` of the permuted ``self`` when
       the indexed dimensions were moved, and :func:`index_put_sort_bytes` of ``M`` (``linearIndex``,
       ``sorted_indices``, ``orig_indices``, ``range``, CUB's ``radix_sort_pairs``); it runs only when
       ``M > 0`` and ``sliceSize > 0``.

    Both phases also hold ``self.contiguous()`` of a non-contiguous ``self``. CUDA before 11.3 and ROCm sort
    fewer than 50000 indices with thrust instead (``index_put_with_sort_kernel_thrust_helper`` in sources
    that have it); the CUB bound is used there too.
    """
    ndim = len(self_shape)
    idx = list(indices) + [None] * (ndim - len(indices))
    defined = [d for d in range(ndim) if idx[d] is not None]
    if not defined:
        return ()
    bshape = tuple(int(s) for s in torch.broadcast_shapes(*(tuple(idx[d][0]) for d in defined)))
    m = math.prod(bshape)
    self_numel = math.prod(self_shape)
    self_copy = () if self_contiguous else (self_numel * elem_bytes,)
    if m == 0:
        return self_copy
    adjacent = defined == list(range(defined[0], defined[-1] + 1))
    if adjacent:
        before = math.prod(self_shape[:defined[0]])
        slice_size = math.prod(self_shape[defined[-1] + 1:])
        permuted = False
    else:  # transposeToFront: indexed dimensions first, in order, then the others
        perm = defined + [d for d in range(ndim) if d not in defined]
        before = 1
        slice_size = math.prod(self_shape[d] for d in range(ndim) if d not in defined)
        src_shape = tuple(self_shape[d] for d in perm)
        base = _contiguous_strides(tuple(self_shape))
        permuted = not _contiguous(src_shape, tuple(base[d] for d in perm))
    conversions = tuple(math.prod(idx[d][0]) * 8 for d in defined if idx[d][2] == 4)
    # phase 1: computeLinearIndex, index after index
    kernel = reduce_kernel("values", torch.int64, (torch.int64,))
    linear_phase: tuple[int, ...] = ()
    for k, d in enumerate(defined):
        shape, strides, _ = idx[d]
        shape, strides = tuple(int(s) for s in shape), tuple(int(s) for s in strides)
        if idx[d][2] == 4:
            strides = _contiguous_strides(shape)  # the int64 copy is contiguous
        ex = _expanded_strides(shape, strides, bshape)
        staging = reduce_workspace_bytes(bshape, tuple(range(len(bshape))), kernel, target, ex) if bshape else ()
        held = (m * 8,) if k else ()  # linearIndex from the first index on
        step = held + (staging if sum(staging) > 2 * m * 8 else (m * 8, m * 8))
        if sum(step) > sum(linear_phase):
            linear_phase = step
    phase1 = self_copy + conversions + linear_phase
    if slice_size == 0:
        return phase1
    needed = before * m * slice_size
    value_copy = () if value_contiguous and value_numel == needed else (needed * elem_bytes,)
    src_copy = (self_numel * elem_bytes,) if permuted else ()
    phase2 = self_copy + value_copy + src_copy + index_put_sort_bytes(m)
    return phase2 if sum(phase2) >= sum(phase1) else phase1


def _index_parts(indices: Any) -> list | None:
    """``Tensor?[] indices`` as :func:`sorting_index_put_bytes` takes them; None when a boolean or byte
    mask is among them (``expandTensors`` turns it into ``nonzero()``, whose size depends on values)."""
    parts: list = []
    for t in indices or ():
        if t is None:
            parts.append(None)
        elif not isinstance(t, torch.Tensor) or t.dtype in (torch.bool, torch.uint8):
            return None
        else:
            parts.append((tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.element_size()))
    return parts


_DET_INDEX_SOURCE = ("aten/src/ATen/native/TensorAdvancedIndexing.cpp _index_put_impl_; aten/src/ATen/native/cuda/"
                     "Indexing.cu index_put_with_sort_kernel, makeLinearIndex, computeLinearIndex; "
                     "cub/device/dispatch/dispatch_radix_sort.cuh")
_DETERMINISTIC = "taken because torch.use_deterministic_algorithms(True) is set"


def _one_value_unsorted(target: CudaTarget, numel: int) -> bool:
    return numel <= 1 and target.torch_version >= INDEX_PUT_ONE_VALUE_UNSORTED_SINCE


def index_put_op(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """ATen ``index_put_``/``index_put``/``_index_put_impl_`` without ``accumulate`` under deterministic
    algorithms: ``x[index] = v`` (THPVariable_setitem's ``index_put_``), an explicit ``index_put(_)``.

    With ``accumulate=True`` it reports nothing: :func:`index_put` (explicit calls) and :func:`getitem`
    (the backward of ``x[index]``) name those at the torch-function level. The out-of-place ``index_put``
    writes into its clone (``self.clone(at::MemoryFormat::Preserve)``, the op's output), whose layout decides
    the copy of a non-contiguous ``self``.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return []
    x = args[0] if args else kwargs.get("self")
    indices = _arg(args, kwargs, 1, "indices", None)
    values = _arg(args, kwargs, 2, "values", None)
    accumulate = bool(_arg(args, kwargs, 3, "accumulate", False))
    if accumulate or not isinstance(x, torch.Tensor) or not isinstance(values, torch.Tensor) or x.is_sparse:
        return []
    parts = _index_parts(indices)
    if parts is None or all(p is None for p in parts) or _one_value_unsorted(target, values.numel()):
        return []
    dest = out if func is torch.ops.aten.index_put.default and isinstance(out, torch.Tensor) else x
    allocs = sorting_index_put_bytes(tuple(int(s) for s in x.shape), dest.is_contiguous(), x.element_size(),
                                     parts, values.numel(), values.is_contiguous(), target)
    if not allocs:
        return []
    n = math.prod(torch.broadcast_shapes(*(p[0] for p in parts if p is not None)))
    name = str(func).replace("aten.", "")
    detail = _DETERMINISTIC + ("; x[index] = v calls it" if func is torch.ops.aten.index_put_.default else "")
    if values.numel() <= 1:
        detail += (f"; a one-element value: newer releases skip the sort for it, counted below torch "
                   f"{INDEX_PUT_ONE_VALUE_UNSORTED_SINCE[0]}.{INDEX_PUT_ONE_VALUE_UNSORTED_SINCE[1]}")
    return [Unmodelled("deterministic index_put_'s sort (index buffers, CUB radix-sort storage, copies)",
                       f"{name} under deterministic algorithms into {_shape(x)} at {n} indices", allocs, True,
                       _DET_INDEX_SOURCE, detail)]


def _deterministic_index_args(args: tuple, kwargs: dict, out: Any) -> tuple | None:
    """``(self, dim, index, source, result)`` of an ``index_add``/``index_copy`` call under deterministic
    algorithms (``dim`` made non-negative, ``result`` the out tensor or ``self``), or None when the
    algorithms are not deterministic or the call is not one the sorting kernel runs (sparse, 0-d)."""
    if not torch.are_deterministic_algorithms_enabled():
        return None
    x = args[0] if args else kwargs.get("self")
    dim = _arg(args, kwargs, 1, "dim", 0)
    index = _arg(args, kwargs, 2, "index", None)
    source = _arg(args, kwargs, 3, "source", None)
    if not all(isinstance(t, torch.Tensor) for t in (x, index, source)) or x.dim() == 0 or x.is_sparse:
        return None
    return x, int(dim) % x.dim(), index, source, out if isinstance(out, torch.Tensor) else x


def index_add_op(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """ATen ``index_add``/``index_add_`` under deterministic algorithms (so the backward of ``index_select``).

    native/cuda/Indexing.cu ``index_add_cuda_impl``: ``result.index_put_(indices, source * alpha, true)``
    with ``indices`` None for the dimensions before ``dim`` and ``index.to(at::kLong)`` at ``dim``: the int64
    copy of an int32 index and ``source * alpha`` (a new tensor of ``source``'s size, laid out as ``source``
    when that is dense, else contiguous) live through the sorting kernel (:func:`sorting_index_put_bytes`,
    accumulating, so for any size of ``source``).
    """
    parsed = _deterministic_index_args(args, kwargs, out)
    if parsed is None:
        return []
    x, d, index, source, dest = parsed
    ishape = tuple(int(s) for s in index.shape)
    # index.to(at::kLong): the index itself when int64, else a contiguous int64 copy
    converted = index.element_size() == 4
    conversion = (index.numel() * 8,) if converted else ()
    istrides = _contiguous_strides(ishape) if converted else tuple(int(s) for s in index.stride())
    scaled = (source.numel() * source.element_size(),)
    scaled_contiguous = source.is_contiguous() or not _dense(source)
    parts = [None] * d + [(ishape, istrides, 8)]
    sort = sorting_index_put_bytes(tuple(int(s) for s in x.shape), dest.is_contiguous(), x.element_size(), parts,
                                   source.numel(), scaled_contiguous, target)
    if not sort:
        return []
    allocs = conversion + scaled + sort
    name = str(func).replace("aten.", "")
    return [Unmodelled("deterministic index_add's sorting index_put_ (index buffers, CUB radix-sort storage, copies)",
                       f"{name} under deterministic algorithms into {_shape(x)} along dim {d} at "
                       f"{index.numel()} indices", allocs, True,
                       "aten/src/ATen/native/cuda/Indexing.cu index_add_cuda_impl; " + _DET_INDEX_SOURCE,
                       _DETERMINISTIC)]


def index_copy_op(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """ATen ``index_copy``/``index_copy_`` under deterministic algorithms.

    native/TensorAdvancedIndexing.cpp ``index_copy_out`` (``result.is_cuda() &&
    globalContext().deterministicAlgorithms()``): ``result.index_put_(indices, source, false)`` with the
    (int64) ``index`` at ``dim``, so :func:`sorting_index_put_bytes` whenever ``_index_put_impl_`` sorts
    without accumulating (see :data:`INDEX_PUT_ONE_VALUE_UNSORTED_SINCE`).
    """
    parsed = _deterministic_index_args(args, kwargs, out)
    if parsed is None or _one_value_unsorted(target, parsed[3].numel()):
        return []
    x, d, index, source, dest = parsed
    ishape = tuple(int(s) for s in index.shape)
    parts = [None] * d + [(ishape, tuple(int(s) for s in index.stride()), index.element_size())]
    allocs = sorting_index_put_bytes(tuple(int(s) for s in x.shape), dest.is_contiguous(), x.element_size(), parts,
                                     source.numel(), source.is_contiguous(), target)
    if not allocs:
        return []
    name = str(func).replace("aten.", "")
    return [Unmodelled("deterministic index_copy's sorting index_put_ (index buffers, CUB radix-sort storage, copies)",
                       f"{name} under deterministic algorithms into {_shape(x)} along dim {d} at "
                       f"{index.numel()} indices", allocs, True,
                       "aten/src/ATen/native/TensorAdvancedIndexing.cpp index_copy_out; " + _DET_INDEX_SOURCE,
                       _DETERMINISTIC)]


def _register_deterministic_indexing() -> None:
    aten = torch.ops.aten
    for name, finder in [("index_put_.default", index_put_op), ("index_put.default", index_put_op),
                         ("_index_put_impl_.default", index_put_op), ("index_add.default", index_add_op),
                         ("index_add_.default", index_add_op), ("index_copy.default", index_copy_op),
                         ("index_copy_.default", index_copy_op)]:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            UNMODELLED_OPS[op] = finder


_register_deterministic_indexing()


# --------------------------------------------------------------------------------------------
# torch._foreach_norm: the per-tensor partials
# --------------------------------------------------------------------------------------------

#: native/cuda/MultiTensorApply.cuh ``kChunkSize`` (torch 2.13's installed header; the same in the older
#: sources read): the elements one block of ``multi_tensor_apply`` reduces into one partial.
FOREACH_CHUNK_SIZE = 65536
#: pytorch#118441 (torch 2.3) added the infinity norm to ``_foreach_norm``'s fast path; before, only 1 and 2.
FOREACH_NORM_INF_SINCE = (2, 3)
_FOREACH_SOURCE = ("aten/src/ATen/native/cuda/ForeachReduceOp.cu foreach_tensor_norm_cuda / "
                   "foreach_tensor_norm_cuda_internal: output_per_tensor (ntensors x max_chunks_per_tensor in the "
                   "accumulate type)")


def foreach_norm_partials_bytes(numels: Iterable[int], out_dtype: torch.dtype) -> int:
    """``output_per_tensor`` of CUDA's ``_foreach_norm`` (and ``_foreach_powsum``) fast path
    (native/cuda/ForeachReduceOp.cu: ``foreach_tensor_norm_cuda_internal`` in the source that has
    ``_foreach_powsum`` and no ``_foreach_global_norm``, as the installed torch 2.13 does; in older sources
    ``foreach_tensor_norm_cuda`` itself): ``at::zeros({ntensors * max_chunks_per_tensor},
    opmath(output dtype))`` (older sources: of the input's dtype, the same without ``dtype``),
    ``max_chunks_per_tensor`` the most ``ceil(numel / kChunkSize)`` over the tensors
    (:data:`FOREACH_CHUNK_SIZE`); live while ``multi_tensor_apply`` (whose tensor lists travel as kernel
    arguments, native/cuda/MultiTensorApply.cuh) and ``lpnorm_cleanup`` run, freed when the op returns.
    Sources newer than 2.13 (with ``_foreach_global_norm``) also allocate a 320-element ``global_output``
    (``_foreach_tensor_norm_cuda_impl``), not counted: no target has them."""
    numels = [int(n) for n in numels]
    if not numels:
        return 0
    chunks = max(-(-n // FOREACH_CHUNK_SIZE) for n in numels)
    return len(numels) * chunks * _acc_bytes(out_dtype)


def foreach_norm(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """ATen ``_foreach_norm(tensors, ord=2, dtype=None)`` (``clip_grad_norm_``'s foreach path) and
    ``_foreach_powsum`` (the same without the root; its fast path only for ``ord`` 1 and 2).

    The fast path (``can_use_fast_route``, native/ForeachUtils.h: one device and dtype, strided,
    non-overlapping and dense; no integer or complex tensor; ``ord`` 1, 2 or, from
    :data:`FOREACH_NORM_INF_SINCE`, infinity) allocates
    :func:`foreach_norm_partials_bytes`. Otherwise ``foreach_tensor_norm_slow`` runs one
    ``linalg_vector_norm`` a tensor, one at a time: the largest of their Reduce.cuh staging buffers
    (:func:`reduce_workspace_bytes`) is listed instead, as the trace does not see those inner reductions.
    """
    tensors = [t for t in (args[0] if args else kwargs.get("self", ())) if isinstance(t, torch.Tensor)]
    if not tensors:
        return []
    ord_ = _arg(args, kwargs, 1, "ord", 2)
    dtype = _arg(args, kwargs, 2, "dtype", None)
    p = float(ord_)
    first = tensors[0]
    out_dtype = dtype or first.dtype
    if out_dtype.is_complex:
        out_dtype = out_dtype.to_real()
    odd = any(t.dtype.is_complex or not (t.dtype.is_floating_point) for t in tensors)
    powsum = func is getattr(getattr(torch.ops.aten, "_foreach_powsum", None), "Scalar", None)
    fast_ord = p in (1.0, 2.0) or (not powsum and p == math.inf and target.torch_version >= FOREACH_NORM_INF_SINCE)
    fast = (not odd and fast_ord and all(t.dtype == first.dtype and t.device == first.device and not t.is_sparse
                                         and _dense(t) for t in tensors))
    name = "_foreach_powsum" if powsum else "_foreach_norm"
    what = f"{name} (ord={ord_:g}) of {len(tensors)} tensors" if isinstance(ord_, (int, float)) else \
        f"{name} of {len(tensors)} tensors"
    if fast:
        nbytes = foreach_norm_partials_bytes([t.numel() for t in tensors], out_dtype)
        if not nbytes:
            return []
        largest = max(t.numel() for t in tensors)
        return [Unmodelled(f"{name}'s per-tensor partials (output_per_tensor)",
                           f"{what}, the largest of {largest} elements", (nbytes,), True, _FOREACH_SOURCE,
                           f"{len(tensors)} x ceil({largest} / {FOREACH_CHUNK_SIZE}) partials of "
                           f"{_acc_bytes(out_dtype)} bytes")]
    if odd and any(not (t.dtype.is_floating_point or t.dtype.is_complex) for t in tensors):
        return []  # integer tensors: linalg_vector_norm refuses them
    if powsum:
        return [Unmodelled("_foreach_powsum's slow path", what, (), False,
                           "aten/src/ATen/native/ForeachOpsKernels.cpp foreach_tensor_powsum_slow (not read here)")]
    best: tuple[int, ...] = ()
    for t in tensors:
        if t.numel() == 0 or t.is_sparse:
            continue
        kernel = reduce_kernel("sum", t.dtype, (out_dtype,))
        allocs = reduce_workspace_bytes(tuple(int(s) for s in t.shape), tuple(range(t.dim())), kernel, target,
                                        tuple(int(s) for s in t.stride()) if _dense(t) else None)
        if sum(allocs) > sum(best):
            best = allocs
    if not best:
        return []
    return [Unmodelled(f"{name}'s slow path: per-tensor norms' cross-block staging",
                       what, best, True, "aten/src/ATen/native/ForeachOpsKernels.cpp foreach_tensor_norm_slow; "
                       + _REDUCE_SOURCE, "the fast path's conditions (can_use_fast_route, ord 1/2/inf) do not hold")]


UNMODELLED_OPS[torch.ops.aten._foreach_norm.Scalar] = foreach_norm
if hasattr(torch.ops.aten, "_foreach_powsum"):  # newer releases (torch 2.13 has it)
    UNMODELLED_OPS[torch.ops.aten._foreach_powsum.Scalar] = foreach_norm


# --------------------------------------------------------------------------------------------
# Layer norm / RMS norm partial buffers without an SM count
# --------------------------------------------------------------------------------------------


def layer_norm_partial_bytes(m: int, n: int, grads: int, grad_bytes: int) -> tuple[int, ...]:
    """The largest partial buffers ``LaunchGammaBetaBackwardCUDAKernel`` may allocate for ``grads``
    weight gradients (2 for layer norm with a bias, 1 for RMS norm) of an ``[m, n]`` input when the
    SM count is unknown: native/cuda/layer_norm_kernel.cu takes them when ``m > 64 * 1024`` (and
    ``n / 32 < sm_count / 2``), ``[min(32768 / ceil(n / 32), ceil(m / 32)), n]`` in the weight's
    dtype each, all live together (see :func:`memguard.estimator._cuda_rules.layer_norm_partial_rows`);
    the finder adds the ``.sum(0)`` that reduces them (its outputs and Reduce.cuh staging)."""
    if m <= 64 * 1024:
        return ()
    rows = min((64 * 1024 // 2) // -(-n // 32), -(-m // 32))
    return tuple(rows * n * grad_bytes for _ in range(grads))


def _norm_entry(target: CudaTarget, x: Any, shape: Any, params: list, what: str) -> list[Unmodelled]:
    evaluated = target.sm_count is not None and target.vendor == "nvidia"
    if evaluated or not isinstance(x, torch.Tensor) or shape is None:
        return []  # with an NVIDIA GPU's SM count the rule allocates the buffers itself
    grads = [p for p in params if isinstance(p, torch.Tensor) and _backward_runs(p)]
    if not grads:
        return []
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    n = math.prod(shape)
    m = x.numel() // max(n, 1)
    allocs = layer_norm_partial_bytes(m, n, len(grads), grads[0].element_size())
    if not allocs:
        return []
    # then ``dgamma_blocks.sum(0)`` (and dbeta's) while both buffers live: each sum's output, and the
    # Reduce.cuh staging of one (they run in turn; the largest split, as the SM count is not used),
    # which the trace sees when the rule runs the sums itself (with an SM count)
    rows = allocs[0] // (n * grads[0].element_size())
    kernel = reduce_kernel("sum", grads[0].dtype, (grads[0].dtype,))
    staging = reduce_workspace_bytes((rows, n), (0,), kernel, CudaTarget(capability=target.capability,
                                                                          vendor=target.vendor))
    allocs += (n * grads[0].element_size(),) * len(grads) + staging
    why = ("the GPU's SM count is unknown, so the rule cannot decide" if target.sm_count is None
           else "ROCm's launch is not replayed")
    return [Unmodelled(f"weight-gradient partial buffers ({why})",
                       f"{what} of {_shape(x)}", allocs, True,
                       "aten/src/ATen/native/cuda/layer_norm_kernel.cu LaunchGammaBetaBackwardCUDAKernel")]


@unmodelled(F.layer_norm, torch.layer_norm)
def layer_norm(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``F.layer_norm``: dgamma and dbeta partial buffers."""
    x = args[0] if args else kwargs.get("input")
    return _norm_entry(target, x, _arg(args, kwargs, 1, "normalized_shape", None),
                       [_arg(args, kwargs, 2, "weight", None), _arg(args, kwargs, 3, "bias", None)], "layer_norm")


@unmodelled(F.rms_norm, torch.rms_norm)
def rms_norm(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``F.rms_norm``: the dgamma partial buffer (the fused kernel, torch >= 2.8)."""
    from memguard.estimator._cuda_rules import FUSED_RMS_NORM_SINCE

    if target.torch_version < FUSED_RMS_NORM_SINCE:
        return []
    x = args[0] if args else kwargs.get("input")
    return _norm_entry(target, x, _arg(args, kwargs, 1, "normalized_shape", None),
                       [_arg(args, kwargs, 2, "weight", None)], "rms_norm")


# --------------------------------------------------------------------------------------------
# Group norm backward
# --------------------------------------------------------------------------------------------


def group_norm_backward_bytes(n: int, c: int, groups: int, acc_bytes: int, input_grad: bool = True
                              ) -> tuple[int, ...]:
    """native/cuda/group_norm_kernel.cu ``GroupNormBackwardKernelImplInternal`` (contiguous input):
    ``ds``, ``db`` ``[N, C]``, and for the input gradient ``c1`` ``[N, C]``, ``c2``, ``c3`` ``[N, G]``,
    all of the accumulate type and live together."""
    out = (n * c * acc_bytes, n * c * acc_bytes)
    if input_grad:
        out += (n * c * acc_bytes, n * groups * acc_bytes, n * groups * acc_bytes)
    return out


@unmodelled(F.group_norm)
def group_norm(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``F.group_norm(input, num_groups, weight, bias, eps)`` with a gradient to compute."""
    x = args[0] if args else kwargs.get("input")
    groups = _arg(args, kwargs, 1, "num_groups", None)
    weight, bias = _arg(args, kwargs, 2, "weight", None), _arg(args, kwargs, 3, "bias", None)
    needs = [t for t in (x, weight, bias) if isinstance(t, torch.Tensor) and _backward_runs(t)]
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(groups, int) or not needs:
        return []
    source = "aten/src/ATen/native/cuda/group_norm_kernel.cu GroupNormBackwardKernelImplInternal"
    what = f"group_norm backward of {_shape(x)}, {groups} groups"
    if not x.is_contiguous():
        return [Unmodelled("group-norm backward scratch (channels-last path)", what, (), False, source)]
    acc = 8 if x.dtype == torch.float64 else 4  # kAccType: fp32 for 16-bit and fp32 inputs
    return [Unmodelled("group-norm backward scratch", what,
                       group_norm_backward_bytes(int(x.shape[0]), int(x.shape[1]), groups, acc, x.requires_grad),
                       True, source)]


# --------------------------------------------------------------------------------------------
# cumsum / cumprod: CUB's single-pass scan
# --------------------------------------------------------------------------------------------


def scan_workspace_bytes(numel: int, scan_len: int, value_bytes: int, contiguous: bool = True) -> tuple[int, ...]:
    """What CUDA's ``cumsum``/``cumprod`` allocate beyond their output at their largest moment.

    native/cuda/ScanUtils.cuh ``scan_dim``: ``self.expect_contiguous()`` (a dense copy of a
    non-contiguous input), then, when the whole tensor is one scan (``self.numel() ==
    self.size(dim)``), ``cuda::cub::inclusive_scan``, whose CUB temporary storage CUB_WRAPPER
    (cuda/cub.cuh) takes from the caching allocator (:func:`cub_scan_bytes`); any other shape runs
    ATen's own block-scan kernels (``scan_innermost_dim``/``scan_outer_dim``), which allocate nothing.
    """
    copies = (numel * value_bytes,) if not contiguous else ()
    if numel == 0 or numel != scan_len:
        return copies
    return copies + (cub_scan_bytes(numel, value_bytes),)


def _scan_entry(what: str, target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    x = args[0] if args else kwargs.get("input")
    dim = _arg(args, kwargs, 1, "dim", None)
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0 or x.is_sparse:
        return []
    dtype = _arg(args, kwargs, 2, "dtype", None) or x.dtype
    value_bytes = max(x.element_size(), dtype.itemsize)
    scan_len = int(x.shape[dim % x.dim()])
    source = "aten/src/ATen/native/cuda/ScanUtils.cuh scan_dim; cub/agent/single_pass_scan_operators.cuh"
    op = f"{what} of {_shape(x)} along dim {dim % x.dim()}" + (" and its backward" if _backward_runs(x) else "")
    if x.numel() == scan_len and torch.are_deterministic_algorithms_enabled() and (
            x.is_floating_point() or x.is_complex()):
        # newer ScanUtils.cuh: cuda::cub::inclusive_deterministic_scan for floating sums, not read here
        return [Unmodelled("CUB deterministic scan temporary storage", op, (), False, source)]
    allocs = scan_workspace_bytes(x.numel(), scan_len, value_bytes, x.is_contiguous())
    if not allocs:
        return []
    # the backward (derivatives.yaml: a cumsum of the flipped gradient, for cumprod inside
    # cumprod_backward) scans the same number of items: the same bound, at another moment
    return [Unmodelled("CUB scan temporary storage", op, allocs, True, source)]


@unmodelled(torch.cumsum, torch._C.TensorBase.cumsum)
def cumsum(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``torch.cumsum``/``Tensor.cumsum``: CUB's scan when the tensor is one scan."""
    return _scan_entry("cumsum", target, args, kwargs)


@unmodelled(torch.cumprod, torch._C.TensorBase.cumprod)
def cumprod(target: CudaTarget, args: tuple, kwargs: dict) -> list[Unmodelled]:
    """``torch.cumprod``/``Tensor.cumprod``: CUB's scan when the tensor is one scan."""
    return _scan_entry("cumprod", target, args, kwargs)


# --------------------------------------------------------------------------------------------
# Reductions split across blocks: Reduce.cuh's global staging buffer and semaphores
# --------------------------------------------------------------------------------------------
#
# Every ``TensorIterator`` reduction of ATen's CUDA backend (``sum``, ``mean``, ``amax``, ``var_mean``,
# ``linalg_vector_norm``, ...; the kernels of native/cuda/Reduce*Kernel.cu) runs
# native/cuda/Reduce.cuh ``gpu_reduce_kernel``. It picks a launch configuration with
# ``setReduceConfig``; when the reduced dimension is long and the outputs are too few to fill the
# GPU, that config splits each output's inputs over ``ctas_per_output`` blocks
# (``config.input_mult[CTA] != 0``, ``should_global_reduce``), and ``gpu_reduce_kernel`` takes a
# staging buffer of ``config.global_memory_size()`` bytes and ``config.semaphore_size()`` bytes of
# semaphores from ``c10::cuda::CUDACachingAllocator::get()->allocate`` for the launch; both are
# ``at::DataPtr`` locals freed when the call returns. An input too large for 32-bit indexing is
# reduced in parts (``iter.with_32bit_indexing()``), each with its own config and buffers, one after
# the other; a 16-bit output whose accumulator is wider then also keeps an ``AccumulationBuffer``
# for the whole call. The fake trace allocates only the outputs, so these buffers are listed here.
# Paths are those of aten/src/ATen/ in torch 2.13; line numbers are those of native/cuda/Reduce.cuh as
# torch 2.13 installs it with its headers (include/ATen/native/cuda/Reduce.cuh): ``mnt_wrapper`` 60-68,
# ``ReduceConfig`` 74-218 (``set_block_dimension`` 100-108, ``global_memory_size`` 193-202,
# ``semaphore_size`` 204-209), ``AccumulationBuffer`` 978-1013, ``get_output_vec_size`` 1015-1037,
# ``setReduceConfig`` 1039-1186 (the split over blocks 1165-1184), ``gpu_reduce_kernel`` 1188-1291
# (the accumulation buffer 1218-1234, the 32-bit parts 1236-1244, the staging allocations 1257-1267).
# The iterator follows TensorIterator.cpp (``compute_strides``, ``reorder_dimensions``,
# ``coalesce_dimensions``, in newer releases as ``detail::ti_build`` functions; ``can_use_32bit_indexing``,
# ``get_dim_to_split``, ``split``, ``SplitUntil32Bit``). Which ``gpu_reduce_kernel`` instance runs (its
# ``arg_t``, ``vt0``) follows native/cuda/ReduceSumProdKernel.cu, ReduceMomentKernel.cu,
# ReduceNormKernel.cu, ReduceMaxValuesKernel.cu, ReduceMinValuesKernel.cu, ReduceArgMaxKernel.cu and
# ReduceArgMinKernel.cu, read in the PyTorch repository (not at the 2.13 tag: the functors'
# template arguments, which these use, have been stable across the versions read).

#: Reduce.cuh ``mnt_wrapper<T>::MAX_NUM_THREADS``: 512 threads a block, 256 for ``complex<double>``.
REDUCE_MAX_THREADS = 512
#: Reduce.cuh ``setReduceConfig``: ``min_values_per_thread`` (16; 128 under ``USE_ROCM``).
REDUCE_MIN_VALUES_PER_THREAD = {"nvidia": 16, "amd": 128}
#: Reduce.cuh ``setReduceConfig``: ``max_values_per_thread``.
REDUCE_MAX_VALUES_PER_THREAD = 256
#: ``at::cuda::warp_size()``: 32 on NVIDIA GPUs, 64 on the CDNA GPUs (MI200, MI300) of ROCm builds.
WARP_SIZE = {"nvidia": 32, "amd": 64}
#: ``cudaDeviceProp::maxThreadsPerMultiProcessor`` (read by ``setReduceConfig``) by compute
#: capability: the CUDA C++ Programming Guide's "Technical Specifications per Compute Capability",
#: "Maximum number of resident threads per SM".
MAX_THREADS_PER_SM = {(7, 0): 2048, (7, 2): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 7): 2048,
                      (8, 9): 1536, (9, 0): 2048}
#: The most resident threads any compute capability has (the same table): used for one not listed,
#: which gives the largest target grid, so the largest split (an upper bound).
MAX_THREADS_PER_SM_ANY = 2048
_INT32_MAX = (1 << 31) - 1


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    """Reduce.cuh ``last_pow2``: the largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << (n.bit_length() - 1) if n > 1 else 1


@dataclass(frozen=True)
class ReduceIter:
    """A reduction's ``TensorIterator`` as its CUDA kernel sees it: after TensorIterator.cpp
    ``reorder_dimensions`` (reduced dimensions first, then by ascending stride) and
    ``coalesce_dimensions``; dimension 0 moves fastest. :func:`reduce_iter` builds one.

    Attributes:
        shape: the iterator's sizes.
        strides: byte strides of every operand, the outputs first and the input last; an output's
            stride is 0 along a reduced dimension.
        input_offset: the input's first element, in bytes past an allocator-aligned address
            (``get_output_vec_size`` reads its alignment; the caching allocator's blocks are 512-byte aligned).
    """

    shape: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    input_offset: int = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def noutputs(self) -> int:
        return len(self.strides) - 1

    def numel(self) -> int:
        return math.prod(self.shape)

    def num_reduce_dims(self) -> int:
        """TensorIterator.cpp ``num_reduce_dims``: dimensions where the first output's stride is 0."""
        return sum(1 for s in self.strides[0] if s == 0)

    def num_output_elements(self) -> int:
        """TensorIterator.cpp ``num_output_elements``."""
        return math.prod(n for n, s in zip(self.shape, self.strides[0]) if s != 0 or n == 0)

    def can_use_32bit_indexing(self) -> bool:
        """TensorIterator.cpp ``can_use_32bit_indexing``: ``numel`` and every operand's largest byte
        offset (plus one) at most ``INT32_MAX``."""
        if self.numel() > _INT32_MAX:
            return False
        return all(1 + sum((n - 1) * s for n, s in zip(self.shape, st)) <= _INT32_MAX for st in self.strides)

    def split(self) -> tuple["ReduceIter", "ReduceIter"]:
        """TensorIterator.cpp ``get_dim_to_split`` (the dimension any operand spans most bytes along,
        the highest on ties) and ``split`` (the first ``size / 2`` as a copy, the rest kept)."""
        best, dim = -1, -1
        for d in range(self.ndim - 1, -1, -1):
            if self.shape[d] == 0:
                continue
            for st in self.strides:
                extent = (self.shape[d] - 1) * abs(st[d])
                if extent > best:
                    best, dim = extent, d
        first = self.shape[dim] // 2
        head = self.shape[:dim] + (first,) + self.shape[dim + 1:]
        tail = self.shape[:dim] + (self.shape[dim] - first,) + self.shape[dim + 1:]
        return (ReduceIter(head, self.strides, self.input_offset),  # narrow(dim, 0, first)
                ReduceIter(tail, self.strides, self.input_offset + first * self.strides[-1][dim]))


def reduce_iter(shape: Iterable[int], dims: Iterable[int], in_bytes: int, strides: Iterable[int] | None = None,
                out_bytes: Iterable[int] = (4,), out_strides: Iterable[Iterable[int]] | None = None,
                offset: int = 0) -> ReduceIter:
    """The :class:`ReduceIter` of reducing a tensor of ``shape`` (element ``strides``, contiguous
    when None; ``in_bytes`` an element) over ``dims`` into outputs of ``out_bytes`` an element.

    ``out_strides`` gives each output's element stride along every input dimension (any value along
    a reduced one; None: contiguous outputs of the kept dimensions, as the reductions' meta
    functions allocate them). As TensorIterator.cpp builds a reduction
    (``TensorIterator::reduce_op``, ``is_reduction``, outputs not resized): ``compute_strides``
    (an output's stride is 0 where it has size 1 and the input not: ``review_reduce_result`` gives
    the reduced dimensions size 1), ``reorder_dimensions`` (start from the reversed order, insertion
    sort by ``should_swap``: reduced dimensions of an output to the front, then the smaller
    stride first, ties to the smaller size) and ``coalesce_dimensions``.
    """
    shape = tuple(int(n) for n in shape)
    ndim = len(shape)
    reduced = {d % ndim for d in dims} if ndim else set()
    if strides is None:
        strides = _contiguous_strides(shape)
    strides = tuple(int(s) for s in strides)
    out_bytes = tuple(out_bytes)
    if out_strides is None:
        kept = _contiguous_strides(tuple(n for d, n in enumerate(shape) if d not in reduced))
        it = iter(kept)
        one = tuple(0 if d in reduced else next(it) for d in range(ndim))
        out_strides = [one] * len(out_bytes)
    ops = []
    for elt, ost in zip(out_bytes, out_strides):
        ost = tuple(ost)
        ops.append([0 if (d in reduced and shape[d] != 1) else ost[d] * elt for d in range(ndim)])
    ops.append([s * in_bytes for s in strides])
    noutputs = len(out_bytes)

    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        for arg, st in enumerate(ops):
            s0, s1 = st[d0], st[d1]
            if arg < noutputs and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    if ndim > 1:
        for i in range(1, ndim):
            d1 = i
            for d0 in range(i - 1, -1, -1):
                c = should_swap(perm[d0], perm[d1])
                if c > 0:
                    perm[d0], perm[d1] = perm[d1], perm[d0]
                    d1 = d0
                elif c < 0:
                    break
    else:
        perm = list(range(ndim))
    sh = [shape[p] for p in perm]
    ops = [[st[p] for p in perm] for st in ops]

    if ndim > 1:  # coalesce_dimensions
        prev = 0
        for d in range(1, ndim):
            if sh[prev] == 1 or sh[d] == 1 or all(sh[prev] * st[prev] == st[d] for st in ops):
                if sh[prev] == 1:
                    for st in ops:
                        st[prev] = st[d]
                sh[prev] *= sh[d]
            else:
                prev += 1
                if prev != d:
                    for st in ops:
                        st[prev] = st[d]
                    sh[prev] = sh[d]
        sh = sh[:prev + 1]
        ops = [st[:prev + 1] for st in ops]
    return ReduceIter(tuple(sh), tuple(tuple(st) for st in ops), int(offset) * in_bytes)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class ReduceConfig:
    """The ``ReduceConfig`` Reduce.cuh ``setReduceConfig`` chooses (the fields that size its buffers)."""

    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    block_width: int
    block_height: int
    output_vec_size: int
    input_mult: tuple[int, int, int]
    step_input: int
    step_output: int
    ctas_per_output: int

    @property
    def should_global_reduce(self) -> bool:
        return self.input_mult[2] != 0

    @property
    def grid_x(self) -> int:
        """``grid().x``: ``div_up(num_outputs / output_vec_size, step_output)``."""
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    @property
    def values_per_thread(self) -> int:
        return _div_up(self.num_inputs, self.step_input)

    def global_memory_size(self) -> int:
        """``ReduceConfig::global_memory_size``: ``element_size_bytes * num_outputs * ctas_per_output``,
        times ``block().x * output_vec_size`` without a block-x reduction (``input_mult[BLOCK_X] == 0``)."""
        if not self.should_global_reduce:
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if self.input_mult[0] == 0:
            size *= self.block_width * self.output_vec_size
        return size

    def semaphore_size(self) -> int:
        """``ReduceConfig::semaphore_size``: ``sizeof(int) * grid().x``."""
        return 4 * self.grid_x if self.should_global_reduce else 0


def _output_vec_size(it: ReduceIter, scalar_bytes: int) -> int:
    """Reduce.cuh ``get_output_vec_size``: 4, halved until it divides the input's address (in
    elements), the first kept dimension's size and every other input stride (in elements)."""
    vec = 4

    def update(n: int) -> None:
        nonlocal vec
        while n % vec:
            vec //= 2

    update(it.input_offset // scalar_bytes)  # the input's address / sizeof(scalar_t)
    index = it.num_reduce_dims()
    update(it.shape[index])
    for j, s in enumerate(it.strides[it.noutputs]):
        if j != index:
            update(int(s / scalar_bytes))  # int64 division in C++ (truncating)
    return vec


def set_reduce_config(it: ReduceIter, arg_bytes: int, scalar_bytes: int, *, input_vec_size: int = 4,
                      max_threads: int = REDUCE_MAX_THREADS, sm_count: int | None = None,
                      threads_per_sm: int | None = None, vendor: str = "nvidia") -> ReduceConfig:
    """Reduce.cuh ``setReduceConfig<arg_t, scalar_t, vt0, input_vec_size>(iter)``, line by line.

    ``arg_bytes`` is ``sizeof(arg_t)`` (the accumulator), ``scalar_bytes`` ``sizeof(scalar_t)`` (the
    input's element). Block shape: ``dim0`` (mapped to ``block.x``) is the reduced extent when the
    reduction runs along the input's fastest-moving dimension, else the outputs; ``dim0`` is divided
    by ``input_vec_size`` ("vectorize along input": fastest-dimension reductions of one reduced
    dimension with ``dim0 >= 128``) or by ``get_output_vec_size`` ("vectorize along output"), both
    only for a unit-stride fastest dimension; ``set_block_dimension`` (``max_num_threads =
    MAX_NUM_THREADS / output_vec_size``; ``block_width = min(dim0_pow2, warp_size)``, ``block_height =
    min(dim1_pow2, max_num_threads / block_width)``, ``block_width = min(dim0_pow2, max_num_threads /
    block_height)``). Then ``input_mult[0]`` (split over lanes) or ``output_mult[0]``; over warps
    when ``values_per_thread() >= min(block_height * 16, 256)``; and over blocks when the warps split,
    ``values_per_thread() >= 256`` and ``grid().x <= target_grid_size = multiProcessorCount *
    (maxThreadsPerMultiProcessor / num_threads)``: ``ctas_per_output = max(min(div_up(target_grid_size,
    grid), div_up(values_per_thread, 16)), div_up(values_per_thread, 256))`` (at least 64 on ROCm),
    kept when above 1.

    With ``sm_count=None`` the target grid is taken as unbounded, which gives the largest split any
    GPU can choose: ``ctas_per_output = div_up(values_per_thread, min_values_per_thread)``, as the
    minimum then takes its second term. ``threads_per_sm=None`` with an SM count takes
    :data:`MAX_THREADS_PER_SM_ANY` (the largest target grid for that SM count).
    """
    num_outputs = it.num_output_elements()
    num_inputs = it.numel() // num_outputs
    input_strides = it.strides[-1]
    nred = it.num_reduce_dims()
    if it.ndim > 0:
        fastest = nred == it.ndim or input_strides[0] < input_strides[nred]
        if fastest:
            dim0, dim1, moving = num_inputs, num_outputs, input_strides[0]
        else:
            dim0, dim1, moving = num_outputs, num_inputs, input_strides[nred]
    else:
        fastest, moving, dim0, dim1 = True, scalar_bytes, 1, 1
    output_vec = 1
    if moving == scalar_bytes:
        if fastest and dim0 >= 128 and nred == 1:
            dim0 //= input_vec_size  # Case 1: vectorize along input
        elif not fastest:
            output_vec = _output_vec_size(it, scalar_bytes)  # Case 2: vectorize along output
            dim0 //= output_vec
    # ReduceConfig::set_block_dimension
    mnt = max_threads // output_vec
    warp = WARP_SIZE.get(vendor, 32)
    dim0_pow2 = _last_pow2(dim0) if dim0 < mnt else mnt
    dim1_pow2 = _last_pow2(dim1) if dim1 < mnt else mnt
    width = min(dim0_pow2, warp)
    height = min(dim1_pow2, mnt // width)
    width = min(dim0_pow2, mnt // height)
    num_threads = width * height

    input_mult = [0, 0, 0]
    step_input = step_output = 1
    if it.ndim == 0 or fastest:
        input_mult[0] = step_input  # split_input(block_width)
        step_input *= width
    else:
        step_output *= width  # split_output(block_width)
    min_values = REDUCE_MIN_VALUES_PER_THREAD.get(vendor, 16)
    max_values = REDUCE_MAX_VALUES_PER_THREAD
    if _div_up(num_inputs, step_input) >= min(height * 16, max_values):  # split_across_warps
        input_mult[1] = step_input
        step_input *= height
    else:
        step_output *= height
    grid = _div_up(num_outputs // output_vec, step_output)
    values_per_thread = _div_up(num_inputs, step_input)
    if sm_count is None:
        target_grid = None  # unknown: any grid may be below it
    else:
        target_grid = sm_count * ((threads_per_sm or MAX_THREADS_PER_SM_ANY) // num_threads)
    ctas = 1
    if input_mult[1] != 0 and values_per_thread >= max_values and (target_grid is None or grid <= target_grid):
        by_values = _div_up(values_per_thread, min_values)
        by_grid = by_values if target_grid is None else _div_up(target_grid, grid)
        ctas = max(min(by_grid, by_values), _div_up(values_per_thread, max_values))
        if ctas > 1:
            if vendor == "amd":
                ctas = max(ctas, 64)
            input_mult[2] = step_input  # split_input(ctas_per_output)
            step_input *= ctas
        else:
            ctas = 1
    return ReduceConfig(arg_bytes, num_outputs, num_inputs, width, height, output_vec, tuple(input_mult),
                        step_input, step_output, ctas)


def _leaves_32bit(it: ReduceIter) -> list[ReduceIter]:
    """TensorIterator.cpp ``SplitUntil32Bit``: halve (:meth:`ReduceIter.split`) until each part can use
    32-bit indexing; the parts run one after another."""
    if it.numel() == 0 or it.can_use_32bit_indexing():
        return [it]
    head, tail = it.split()
    return _leaves_32bit(head) + _leaves_32bit(tail)


@dataclass(frozen=True)
class ReduceKernel:
    """The types of one ``gpu_reduce_kernel<scalar_t, out_scalar_t, vt0, input_vec_size>`` instance.

    Attributes:
        arg_bytes: ``sizeof(arg_t)``, the accumulator (the first argument of ``ops_t::reduce``).
        scalar_bytes: ``sizeof(scalar_t)``, the input element the kernel reads.
        out_bytes: ``sizeof(out_scalar_t)`` of each output.
        can_accumulate_in_output: ``gpu_reduce_kernel``'s constant: ``arg_t`` converts to the output
            type and the input and output are not both ``Half`` (or ``complex<Half>``), nor both ``BFloat16``.
        input_vec_size: the template argument (``vt0``: 4 by default, 2 for the Welford kernels).
        max_threads: ``mnt_wrapper<scalar_t>::MAX_NUM_THREADS``.
    """

    arg_bytes: int
    scalar_bytes: int
    out_bytes: tuple[int, ...] = (4,)
    can_accumulate_in_output: bool = True
    input_vec_size: int = 4
    max_threads: int = REDUCE_MAX_THREADS


def reduce_workspace(it: ReduceIter, kernel: ReduceKernel, target: CudaTarget | None = None
                     ) -> tuple[tuple[int, ...], ReduceConfig | None]:
    """What ``gpu_reduce_kernel`` allocates beyond its outputs at its largest moment, and the config
    of the part that allocates most (None when no part splits over blocks).

    The allocations are the ``AccumulationBuffer`` (when the input needs 64-bit indexing and the
    output cannot accumulate, an output-sized buffer of ``arg_t`` if that is wider than the output:
    ``output_memory_size * sizeof(arg_t)``, live for the whole call), then the staging buffer and the
    semaphores of the 32-bit part whose split needs most (:func:`set_reduce_config`; the parts run in turn).
    """
    target = target or CudaTarget()
    sm_count, threads = target.sm_count, None
    if target.vendor == "nvidia":
        threads = MAX_THREADS_PER_SM.get(tuple(target.capability), MAX_THREADS_PER_SM_ANY)
    elif sm_count is not None:
        sm_count = None  # maxThreadsPerMultiProcessor of AMD GPUs is not tabled here: the largest split
    if it.numel() == 0:
        return (), None
    allocs: tuple[int, ...] = ()
    if not kernel.can_accumulate_in_output and not it.can_use_32bit_indexing() \
            and kernel.out_bytes[0] < kernel.arg_bytes:
        out_elt = kernel.out_bytes[0]
        size = max([out_elt] + [n * s for n, s in zip(it.shape, it.strides[0])]) // out_elt
        allocs = (size * kernel.arg_bytes,)
    best: ReduceConfig | None = None
    seen: set[tuple] = set()
    for leaf in _leaves_32bit(it):
        key = (leaf.shape, leaf.input_offset)
        if key in seen:
            continue
        seen.add(key)
        cfg = set_reduce_config(leaf, kernel.arg_bytes, kernel.scalar_bytes, input_vec_size=kernel.input_vec_size,
                                max_threads=kernel.max_threads, sm_count=sm_count, threads_per_sm=threads,
                                vendor=target.vendor)
        if cfg.should_global_reduce and (best is None or cfg.global_memory_size() + cfg.semaphore_size()
                                         > best.global_memory_size() + best.semaphore_size()):
            best = cfg
    if best is not None:
        allocs += (best.global_memory_size(), best.semaphore_size())
    return allocs, best


def reduce_workspace_bytes(shape: Iterable[int], dims: Iterable[int], kernel: ReduceKernel,
                           target: CudaTarget | None = None, strides: Iterable[int] | None = None,
                           out_strides: Iterable[Iterable[int]] | None = None, offset: int = 0) -> tuple[int, ...]:
    """:func:`reduce_workspace` of reducing a tensor of ``shape`` over ``dims`` (see :func:`reduce_iter`)."""
    it = reduce_iter(shape, dims, kernel.scalar_bytes, strides, kernel.out_bytes, out_strides, offset)
    return reduce_workspace(it, kernel, target)[0]


_LOWP = (torch.float16, torch.bfloat16)


def _acc_bytes(dtype: torch.dtype) -> int:
    """``at::opmath_type`` / ``acc_type<T, true>``: float for 16-bit floats (and ``complex<float>`` for
    ``complex<Half>``), the type itself otherwise."""
    if dtype in _LOWP:
        return 4
    if dtype == torch.complex32:
        return 8
    return dtype.itemsize


def reduce_kernel(family: str, in_dtype: torch.dtype, out_dtypes: tuple[torch.dtype, ...]) -> ReduceKernel:
    """The ``gpu_reduce_kernel`` instance a reduction family runs for these dtypes.

    * ``"sum"`` (sum, nansum, prod, mean, the norms; native/cuda/ReduceSumProdKernel.cu
      ``reduce_dispatch``, ReduceMomentKernel.cu ``mean_kernel_cuda``, ReduceNormKernel.cu): the kernel
      reads the output's dtype (ReduceOpsUtils.h ``make_reduction`` casts the input to it) except for a
      16-bit input into a float output (read as is); ``arg_t`` is the accumulate type of the output's.
    * ``"values"`` (``amax``/``amin``, full ``max``/``min``; ReduceMaxValuesKernel.cu
      ``max_values_kernel_cuda_impl``, ReduceMinValuesKernel.cu): ``arg_t = scalar_t``.
    * ``"index"`` (``max.dim``/``min.dim``: ``MaxOps``, values and indices) and ``"arg"``
      (``argmax``/``argmin``: ``ArgMaxOps<acc_t>``): ``arg_t = pair<_, int64_t>``, 16 bytes.
    * ``"welford"`` (var, std, var_mean, std_mean; ReduceMomentKernel.cu ``std_var_kernel_impl``:
      ``gpu_reduce_kernel<scalar_t, scalar_t, 2>`` with ``WelfordData<acc_scalar_t, int32_t>``:
      ``mean``, ``m2``, ``n`` (int32), ``nf``: 16 bytes in float, 32 in double).
    """
    out_bytes = tuple(d.itemsize for d in out_dtypes)
    out0 = out_dtypes[0]
    if family == "sum":
        scalar = _sum_scalar(in_dtype, out0)
        both16 = scalar == out0 and out0 in (torch.float16, torch.bfloat16, torch.complex32)
        return ReduceKernel(_acc_bytes(out0), scalar.itemsize, out_bytes, not both16,
                            max_threads=256 if scalar == torch.complex128 else REDUCE_MAX_THREADS)
    if family == "values":
        return ReduceKernel(in_dtype.itemsize, in_dtype.itemsize, out_bytes, in_dtype not in _LOWP,
                            max_threads=256 if in_dtype == torch.complex128 else REDUCE_MAX_THREADS)
    if family in ("index", "arg"):
        return ReduceKernel(16, in_dtype.itemsize, out_bytes, False)
    if family == "welford":
        return ReduceKernel(32 if in_dtype == torch.float64 else 16, in_dtype.itemsize, out_bytes, False,
                            input_vec_size=2)
    raise ValueError(f"unknown reduction family {family!r}")


def _sum_scalar(in_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
    """ReduceOpsUtils.h ``make_reduction_from_out_ty``: the dtype the ``"sum"`` family's kernel reads:
    a 16-bit float input into a float output as is (``gpu_lowp_to_f32``), a complex input as the
    complex type of the output's, otherwise the output's dtype (the input cast to it)."""
    if in_dtype in _LOWP and out_dtype == torch.float32:
        return in_dtype
    if in_dtype.is_complex and not out_dtype.is_complex:
        return {torch.float16: torch.complex32, torch.float32: torch.complex64}.get(out_dtype, torch.complex128)
    return out_dtype


#: ATen reductions that run ``gpu_reduce_kernel``: overload -> (family, index of ``dim`` or None for
#: all dimensions, index of ``keepdim``).
_REDUCTIONS: dict[Any, tuple[str, int | None, int | None]] = {}


def _register_reductions() -> None:
    aten = torch.ops.aten
    table = [
        ("sum.default", "sum", None, None), ("sum.dim_IntList", "sum", 1, 2), ("nansum.default", "sum", 1, 2),
        ("prod.default", "sum", None, None), ("prod.dim_int", "sum", 1, 2),
        ("mean.default", "sum", None, None), ("mean.dim", "sum", 1, 2),
        ("linalg_vector_norm.default", "sum", 2, 3), ("norm.Scalar", "sum", None, None),
        ("norm.ScalarOpt_dim", "sum", 2, 3), ("norm.ScalarOpt_dtype", "sum", None, None),
        ("norm.ScalarOpt_dim_dtype", "sum", 2, 3),
        ("amax.default", "values", 1, 2), ("amin.default", "values", 1, 2),
        ("max.default", "values", None, None), ("min.default", "values", None, None),
        ("max.dim", "index", 1, 2), ("min.dim", "index", 1, 2),
        ("argmax.default", "arg", 1, 2), ("argmin.default", "arg", 1, 2),
        ("var.correction", "welford", 1, None), ("std.correction", "welford", 1, None),
        ("var_mean.correction", "welford", 1, None), ("std_mean.correction", "welford", 1, None),
    ]
    for name, family, dim_at, keep_at in table:
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet), overload, None)
        if op is not None:
            _REDUCTIONS[op] = (family, dim_at, keep_at)
            UNMODELLED_OPS[op] = reduction


def _reduced_dims(ndim: int, dim: Any) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({int(d) % ndim for d in dims})) if ndim else ()


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense (c10 ``is_non_overlapping_and_dense``): the strides, in increasing
    order over dimensions of size > 1, are the running products of the sizes."""
    return _dense_layout(tuple(x.shape), tuple(x.stride()))


def _dense_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """:func:`_dense` of a layout given by its sizes and strides."""
    step = 1
    for n, st in sorted(((int(n), int(st)) for n, st in zip(shape, strides) if n != 1), key=lambda p: p[1]):
        if st != step:
            return False
        step *= n
    return True


def _out_strides(x: torch.Tensor, dims: tuple[int, ...], out: torch.Tensor) -> tuple[int, ...] | None:
    """An output's element stride along each input dimension (0 along reduced ones), or None when its
    shape does not line up with the input's."""
    if out.dim() == x.dim():
        return tuple(0 if d in dims else int(out.stride(d)) for d in range(x.dim()))
    if out.dim() != x.dim() - len(dims):
        return None
    kept = iter(out.stride())
    return tuple(0 if d in dims else int(next(kept)) for d in range(x.dim()))


_REDUCE_SOURCE = ("aten/src/ATen/native/cuda/Reduce.cuh setReduceConfig / gpu_reduce_kernel "
                  "(ReduceConfig::global_memory_size, semaphore_size)")


def reduction(target: CudaTarget, func: Any, args: tuple, kwargs: dict, out: Any) -> list[Unmodelled]:
    """An ATen reduction (the forward's ``sum``, autograd's ``sum.dim_IntList`` of a bias gradient):
    Reduce.cuh's staging buffer and semaphores when it splits over blocks."""
    family, dim_at, keep_at = _REDUCTIONS[func]
    x = args[0] if args else kwargs.get("self")
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    if not isinstance(x, torch.Tensor) or not outs or x.numel() == 0 or x.is_sparse or (
            x.is_complex() and family == "welford"):  # complex var/std: not read here
        return []
    if family in ("index",):
        outs = outs[:2]
    elif family == "welford" and func in (torch.ops.aten.var_mean.correction, torch.ops.aten.std_mean.correction):
        outs = outs[:2]
    else:
        outs = outs[:1]
    dim = None if dim_at is None else _arg(args, kwargs, dim_at, "dim", None)
    dims = _reduced_dims(x.dim(), dim)
    strides = [_out_strides(x, dims, o) for o in outs]
    kernel = reduce_kernel(family, x.dtype, tuple(o.dtype for o in outs))
    # make_reduction's self.to(in_dtype): a new tensor, strides kept when dense (preserve_format)
    cast = family == "sum" and _sum_scalar(x.dtype, outs[0].dtype) != x.dtype
    in_strides = x.stride() if not cast or _dense(x) else None
    it = reduce_iter(x.shape, dims, kernel.scalar_bytes, in_strides, kernel.out_bytes,
                     None if any(s is None for s in strides) else strides, 0 if cast else x.storage_offset())
    allocs, cfg = reduce_workspace(it, kernel, target)
    if cfg is None and not allocs:
        return []
    name = str(func).replace("aten.", "")
    op = f"{name} of {_shape(x)} over dims {list(dims)}"
    if cfg is None:
        detail = "the 64-bit-indexed input is reduced in 32-bit parts into an accumulation buffer"
    elif target.sm_count is None:
        detail = (f"the GPU's SM count is unknown, so this is the largest split setReduceConfig can choose "
                  f"(ctas_per_output = {cfg.ctas_per_output}, ceil(values per thread / "
                  f"{REDUCE_MIN_VALUES_PER_THREAD.get(target.vendor, 16)})); with an SM count it is at most that")
    else:
        detail = f"ctas_per_output = {cfg.ctas_per_output} at {target.sm_count} SMs"
    return [Unmodelled("reduction cross-block staging buffer and semaphores", op, allocs, True, _REDUCE_SOURCE,
                       detail)]


_register_reductions()


class UnmodelledFinder(TorchFunctionMode):
    """Collect the :data:`~memguard.estimator._cuda_kernels.UNMODELLED` entries of every call, and run
    each call unchanged: the CUDA target traced on fake CUDA tensors (a GPU is present), where no
    :class:`~memguard.estimator._cuda_kernels.CudaKernelModel` runs but the same kernels go unreplayed
    (fake CUDA tensors allocate their outputs only).

    Args:
        target: the GPU and torch the finders judge by (None: the installed torch, the vendor of its build).
    """

    def __init__(self, target: CudaTarget | None = None) -> None:
        super().__init__()
        self.target = target or CudaTarget.for_spec(None, vendor="amd" if torch.version.hip else "nvidia")
        self.unmodelled: list[Unmodelled] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        finder = UNMODELLED.get(func)
        if finder is not None:
            self.unmodelled.extend(finder(self.target, args, kwargs))
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Composition: the notes and the upper bound
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UpperBound:
    """What the unmodelled kernels add to a CUDA estimate.

    Attributes:
        extra_bytes: reserved bytes the largest bounded entry can add (see :func:`upper_bound`).
        notes: one sentence per distinct (mechanism, call), with its count and bound.
        unbounded: the mechanisms (with their calls) that have no bound.
    """

    extra_bytes: int
    notes: tuple[str, ...]
    unbounded: tuple[str, ...]


def upper_bound(entries: Iterable[Unmodelled], config: Any = None) -> UpperBound:
    """Compose the entries of one traced step into the bound ``Estimate.peak_upper_bytes`` adds.

    A CUDA stream runs one kernel at a time and every listed buffer is freed before its op returns
    (CUB_WRAPPER's ``DataPtr``, the ``at::empty`` scratch of a kernel), so at any moment at most one
    entry's buffers are live, on top of what the trace replays. The caching allocator
    (``CUDACachingAllocator.cpp``) serves each such request from a cached free block or from a new
    segment of ``segment_size(round_size(request))`` bytes, so while it is live reserved memory exceeds
    the replay by at most the sum of those segment sizes for that entry. The bound adds the largest
    such sum over all entries to the peak, wherever the peak is: exact for the moment the entry is
    live, and it assumes (as every replay does) that the cached block the entry leaves behind does not
    make later requests need more memory than the replay gave them. Entries without a bound are not
    in it; they are returned in ``unbounded``.
    """
    from memguard.estimator._cuda import round_size, segment_size
    from memguard.vocab import format_bytes

    groups: dict[tuple[str, str], list[Unmodelled]] = {}
    for e in entries:
        groups.setdefault((e.mechanism, e.op), []).append(e)
    extra = 0
    notes: list[str] = []
    unbounded: list[str] = []
    for (mechanism, op), same in groups.items():
        e = same[0]
        times = f" ({len(same)} calls)" if len(same) > 1 else ""
        if not e.bounded:
            unbounded.append(f"{mechanism}: {op}")
            notes.append(f"not modelled: {mechanism} of {op}{times}, unbounded (sized by the library at run "
                         f"time; {e.source}); peak_upper_bytes does not include it"
                         + (f". {e.detail}" if e.detail else ""))
            continue
        reserved = sum(segment_size(round_size(a, config), config) for a in e.allocations if a)
        extra = max(extra, reserved)
        notes.append(f"not modelled: {mechanism} of {op}{times}, at most {format_bytes(e.bound_bytes)} requested "
                     f"({format_bytes(reserved)} of new segments) while it runs ({e.source}); in peak_upper_bytes"
                     + (f". {e.detail}" if e.detail else ""))
    return UpperBound(extra, tuple(notes), tuple(unbounded))
