"""FSDP1's tracer and recorder: rank 0 of a real ``FullyShardedDataParallel`` step on the fake model.

:func:`trace_fsdp1_step` runs the step over a fake process group
(:func:`~memguard.estimator._fsdp2.fake_world`), the traced copy wrapped as
:func:`~memguard.estimator._fsdp1.wrap_model` wraps a model; what the trace then holds is described in
:mod:`memguard.estimator._fsdp1`. The classes extend FSDP2's (:mod:`memguard.estimator._fsdp2_trace`),
whose recorder already names collective buffers and records storage resizes (FSDP1's
``_alloc_storage``/``_free_storage`` are ``untyped_storage().resize_`` too, ``torch/distributed/utils.py``):

* :class:`FSDP1Tracer` wraps the copy (the wrapper is the module the step calls), maps each flat
  parameter back to the user's parameters for an optimizer instance's groups, and runs one unrecorded
  micro-batch (forward and backward) before the recorded one, so that the recorded step is a steady
  one: FSDP1 initialises lazily in the first forward (``_lazy_init``: buffers cast to ``buffer_dtype``,
  streams, the execution order its prefetching follows from the second iteration on,
  ``_exec_order_utils.py``), and under accumulation the sharded gradient of the micro-batch before
  is the one FSDP1 accumulates into (``_runtime_utils.py``, ``_accumulate_sharded_grad``);
* :class:`FSDP1Recorder` also counts gloo's staging buffer of the list all-gather FSDP1 uses on CPU
  (``c10d::allgather_``; ``ProcessGroupGloo.cpp``, ``AsyncAllgatherWork``: ``newLikeFlat(outputs[0])``,
  the size of all outputs).
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from memguard.batch import compute_loss
from memguard.estimator._fsdp1 import FSDP1Layout, wrap_model
from memguard.estimator._fsdp2 import GATHERED, fake_world
from memguard.estimator._fsdp2_trace import FSDP2Tracer, ShardedRecorder
from memguard.estimator._result import Category
from memguard.estimator._trace import ScalarStub, StepTracer, Trace, TraceSpec, quiet_fake_tensor_log


def trace_fsdp1_step(model: nn.Module, batch: Any, spec: TraceSpec, layout: FSDP1Layout, *, optimizer=None,
                     loss_fn=None) -> Trace:
    """Trace one steady-state step of rank 0 of an FSDP1 job (see :mod:`memguard.estimator._fsdp1`).

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimator._trace.trace_step`.
        spec: the trace spec (no autocast: FSDP1's ``MixedPrecision`` casts).
        layout: the wrapping.

    Raises:
        ConfigError: the model, batch or loss cannot be traced, or FSDP1 cannot wrap the model.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with quiet_fake_tensor_log(), fake_world(layout.world_size) as mesh, warnings.catch_warnings(), \
                _storage_checks_by_identity():
            # FSDP1 compares storages by data_ptr (_flat_param.py, _same_storage), which a fake tensor warns about
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            warnings.filterwarnings("ignore", message=".*NO_SHARD.*deprecated.*")  # the user asked for NO_SHARD
            return FSDP1Tracer(model, batch, optimizer, loss_fn, spec, layout, mesh).run()
    finally:
        if gc_was_enabled:
            gc.enable()


@contextlib.contextmanager
def _storage_checks_by_identity() -> Iterator[None]:
    """FSDP1's storage checks by data pointer, by storage identity and size while tracing.

    ``_flat_param.py`` asks whether a storage is allocated with ``_data_ptr_allocated``
    (``torch/distributed/utils.py``: ``untyped_storage().data_ptr() > 0``) and whether two tensors share
    one with ``_same_storage`` (equal ``data_ptr``); a fake tensor's storage has no data pointer (0), so
    ``SHARD_GRAD_OP`` with ``use_orig_params`` fails its assertion that the unsharded flat parameter is
    allocated. A real storage's pointer is non-zero exactly while its size is (``resize_(0)`` frees it),
    and two live storages share a pointer exactly when they are one storage: the same answers."""
    from torch.distributed.fsdp import _flat_param

    saved = _flat_param._data_ptr_allocated, _flat_param._same_storage

    def allocated(tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().nbytes() > 0

    def same(a: Any, b: Any) -> bool:
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)  # as _same_storage unwraps DTensors
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata

    _flat_param._data_ptr_allocated, _flat_param._same_storage = allocated, same
    try:
        yield
    finally:
        _flat_param._data_ptr_allocated, _flat_param._same_storage = saved


class FSDP1Tracer(FSDP2Tracer):
    """:class:`~memguard.estimator._trace.StepTracer` for rank 0 of an FSDP1 job (see the module docstring)."""

    def __init__(self, model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, spec: TraceSpec,
                 layout: FSDP1Layout, mesh: Any) -> None:
        self._wrapper: nn.Module | None = None
        super().__init__(model, batch, optimizer, loss_fn, spec, layout, mesh)

    def make_recorder(self) -> "FSDP1Recorder":
        return FSDP1Recorder(self.trace, self.spec.cpu_target, gloo=self.layout.backend == "gloo",
                             cuda_target=self.spec.cuda_target)

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """Wrap the copy in FSDP1; return the user's parameter of each parameter the optimizer will see
        (an original parameter by name, or a flat parameter by its first original)."""
        with self.mode:
            self._wrapper = wrap_model(fmodel, self.layout, blocks)
        return _originals_of(self._wrapper, dict(self.model.named_parameters()))

    def traced_root(self, fmodel: nn.Module) -> nn.Module:
        """The FSDP1 root; the loss is computed inside its forward (:func:`_through_root`)."""
        if self._wrapper is None:
            return fmodel
        self.loss_fn = _through_root(self.loss_fn, fmodel)
        return self._wrapper

    def build_optimizer(self, originals: dict[int, Any]) -> torch.optim.Optimizer:
        """The optimizer (its state built as FSDP2's tracer builds it), then one unrecorded micro-batch
        so that the recorded one is a steady step (see the module docstring); without accumulation its
        gradients are dropped as ``zero_grad(set_to_none=True)`` drops them."""
        opt = super().build_optimizer(originals)
        with self.mode, ScalarStub():
            compute_loss(self.fmodel, self.fbatch, self.loss_fn).backward()
            if not self.spec.grads_present:
                opt.zero_grad(set_to_none=True)
                for flat in _flat_params(self.fmodel):
                    flat.grad = None  # what the next forward does (_reset_flat_param_grad_info_if_needed)
        return opt

    def start_state(self) -> None:
        """Under accumulation the unrecorded micro-batch of :meth:`build_optimizer` left FSDP1's gradients."""

    def register(self) -> None:
        StepTracer.register(self)
        for flat in _flat_params(self.fmodel):
            # the sharded flat parameter (FlatParamHandle.shard keeps it as flat_param._local_shard): a unit
            # whose flat parameter is unsharded here (.data the padded unsharded one, e.g. a frozen unit of a
            # LoRA model under use_orig_params=False) still holds its shard, which .data does not reach
            self.recorder.register(getattr(flat, "_local_shard", flat), Category.PARAMS)
            self.recorder.register(flat, Category.PARAMS)
            if flat.grad is not None:
                self.recorder.register(flat.grad, Category.GRADS)


class FSDP1Recorder(ShardedRecorder):
    """FSDP2's :class:`~memguard.estimator._fsdp2_trace.ShardedRecorder`, plus gloo's staging buffer of
    ``c10d::allgather_`` (the list all-gather FSDP1 runs on CPU: ``FlatParamHandle._all_gather_flat_param``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.gloo and getattr(func, "_opname", None) == "allgather_" and not self._closed:
            # c10d::allgather_(output_tensors: list[list[Tensor]], input_tensors: list[Tensor], ...)
            outputs = [t for group in args[0] for t in group]
            self.temporary(sum(t.numel() * t.element_size() for t in outputs), GATHERED)
        return out


def _through_root(loss_fn: Any, inner: nn.Module) -> Any:
    """A ``loss_fn(root, batch)`` that runs ``loss_fn(inner, batch)`` (or the default loss of
    :func:`memguard.batch.compute_loss`) inside the FSDP1 root's forward, as Lightning runs ``training_step``
    under ``FSDPStrategy`` (``lightning/pytorch/strategies/strategy.py``, ``_ForwardRedirection``: the wrapped
    module's ``forward`` stands in for one call, restored before the step runs): the root's pre-forward
    all-gathers its flat parameter and its post-forward registers the pre-backward hooks on the loss, whichever
    method of the module computes it."""

    def loss(root: nn.Module, batch: Any) -> Any:
        def redirected(*_args: Any, **_kwargs: Any) -> Any:
            del inner.forward  # the module's own forward again, for the loss's own calls of the module
            return compute_loss(inner, batch, loss_fn)

        inner.forward = redirected
        try:
            return root()
        finally:
            inner.__dict__.pop("forward", None)

    return loss


def _flat_params(root: nn.Module) -> list[Any]:
    """Every FSDP1 unit's ``FlatParameter`` (``FullyShardedDataParallel._handle.flat_param``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = []
    for m in FullyShardedDataParallel.fsdp_modules(root):
        handle = getattr(m, "_handle", None)
        if handle is not None:
            out.append(handle.flat_param)
    return out


def _originals_of(root: nn.Module, by_name: dict[str, Any]) -> dict[int, Any]:
    """The user's parameter of each parameter of the wrapped copy: an original parameter by its name
    without FSDP1's ``_fsdp_wrapped_module.`` prefixes (``_common_utils.clean_tensor_name``); a flat
    parameter (``use_orig_params=False``) by the first parameter flattened into it (``FlatParameter._fqns``,
    relative to the unit's module)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    out: dict[int, Any] = {}
    for name, p in root.named_parameters():
        original = by_name.get(clean_tensor_name(name))
        if original is not None:
            out[id(p)] = original
    for name, m in root.named_modules():
        if isinstance(m, FullyShardedDataParallel) and getattr(m, "_handle", None) is not None:
            flat = m._handle.flat_param
            prefix = clean_tensor_name(name)
            fqn = ".".join(x for x in (prefix, flat._fqns[0]) if x) if flat._fqns else ""
            if id(flat) not in out and fqn in by_name:
                out[id(flat)] = by_name[fqn]
    return out

