"""FSDP2's tracer and recorder: :class:`~memguard.estimator._trace.StepTracer` and
:class:`~memguard.estimator._trace.Recorder` subclassed for rank 0 of a real FSDP2 step.

:func:`trace_fsdp2_step` runs the step over a fake process group
(:func:`~memguard.estimator._fsdp2.fake_world`), the traced copy sharded with ``fully_shard``
(:func:`~memguard.estimator._fsdp2.shard_model`); what the trace then holds is described in
:mod:`memguard.estimator._fsdp2`. As PyTorch's ``torch/distributed/_tools/fsdp2_mem_tracker.py``
subclasses ``MemTracker``, the variant is two plain subclasses over the trace's public bases:

* :class:`FSDP2Tracer` shards the copy before the optimizer is built, builds the optimizer's state
  on the sharded ``DTensor`` parameters, and starts a micro-batch after the first from the
  gradients FSDP2 leaves (sharded, or unsharded and unsynchronised at level 1);
* :class:`ShardedRecorder` unwraps DTensors to their local shards, names FSDP2's buffers and
  records storage resizes: FSDP2's ``alloc_storage``/``free_storage`` are not ATen ops, so while
  tracing ``torch.UntypedStorage.resize_`` is wrapped to report them as frees and allocations. It
  also notes the stream each storage is allocated on (``Trace.streams``): FSDP2 runs the same code
  on a CPU mesh, whose ``torch.cpu.stream`` contexts select its streams as CUDA's would
  (``FSDPCommContext.lazy_init``: all-gather copy-in, all-gather, reduce-scatter and all-reduce
  streams), so what it allocates on them (the all-gather buffer in ``foreach_all_gather``, the
  reduce-scatter output that becomes the sharded gradients in ``foreach_reduce``, torch 2.13) is
  priced from those streams' own blocks by the CUDA allocator model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memguard.batch import compute_loss
from memguard.errors import ConfigError
from memguard.estimator._fsdp2 import GATHERED, GLOO_TEMPORARIES, REDUCE, FSDP2Layout, fake_world, shard_model
from memguard.estimator._result import Category
from memguard.estimator._trace import (
    Recorder,
    ScalarStub,
    StepTracer,
    Trace,
    TraceSpec,
    make_optimizer,
    quiet_fake_tensor_log,
    uncached,
)

def trace_fsdp2_step(model: nn.Module, batch: Any, spec: TraceSpec, layout: FSDP2Layout, *, optimizer=None,
                     loss_fn=None) -> Trace:
    """Trace one steady-state step of rank 0 of an FSDP2 job (see :mod:`memguard.estimator._fsdp2`).

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimator._trace.trace_step`.
        spec: the :class:`~memguard.estimator._trace.TraceSpec` (no autocast: FSDP2's policy casts).
        layout: the sharding.

    Returns:
        A :class:`~memguard.estimator._trace.Trace` of one rank's allocations.

    Raises:
        ConfigError: the model, batch or loss cannot be traced, or FSDP2 cannot shard the model.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with quiet_fake_tensor_log(), fake_world(layout.world_size) as mesh:
            return FSDP2Tracer(model, batch, optimizer, loss_fn, spec, layout, mesh).run()
    finally:
        if gc_was_enabled:
            gc.enable()


class FSDP2Tracer(StepTracer):
    """:class:`~memguard.estimator._trace.StepTracer` for rank 0 of an FSDP2 job: the copy sharded by
    FSDP2 before the optimizer is built (:meth:`prepare_model`), the step recorded by a
    :class:`ShardedRecorder` with storage resizes reported (:meth:`recording`), and the state a
    micro-batch after the first starts from as FSDP2 leaves it (:meth:`start_state`).

    Args:
        model, batch, optimizer, loss_fn, spec: as for :class:`~memguard.estimator._trace.StepTracer`
            (always a training step).
        layout: the sharding.
        mesh: the 1-D ``DeviceMesh`` of the fake process group (:func:`~memguard.estimator._fsdp2.fake_world`).
    """

    def __init__(self, model: nn.Module, batch: Any, optimizer: Any, loss_fn: Any, spec: TraceSpec,
                 layout: FSDP2Layout, mesh: Any) -> None:
        self.layout, self.mesh = layout, mesh  # before the base's __init__, which makes the recorder
        super().__init__(model, batch, optimizer, loss_fn, spec)

    def make_recorder(self) -> ShardedRecorder:
        return ShardedRecorder(self.trace, self.spec.cpu_target, gloo=self.layout.backend == "gloo",
                               cuda_target=self.spec.cuda_target)

    def recording(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(self.recorder)
        stack.enter_context(_record_resizes(self.recorder))
        return stack

    def start_state(self) -> None:
        """The state a micro-batch after the first starts from: sharded gradients (levels 3 and
        2) or, at level 1, the unsharded gradients accumulated without synchronisation, made by
        one unrecorded micro-batch with gradient sync off."""
        if self.layout.zero_stage == 1:
            self.fmodel.set_requires_gradient_sync(False)
            with ScalarStub():
                compute_loss(self.fmodel, self.fbatch, self.loss_fn).backward()
            self.fmodel.set_requires_gradient_sync(True)
        else:
            super().start_state()

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """Shard the copy as :func:`~memguard.estimator._fsdp2.shard_model` shards a model; return the
        original (unsharded) parameter of each sharded one, for an optimizer instance's groups.

        Raises:
            ConfigError: FSDP2 refuses the model.
        """
        with self.mode:
            try:
                # the offload policy's host copies do not change what the device holds in a fake
                # trace (evaluation moves the sharded states to the host: fsdp2_factors)
                shard_model(fmodel, dataclasses.replace(self.layout, offload=False), self.mesh, blocks)
                # A framework may run the root through another method than forward (Lightning's
                # training_step): FSDP2 runs its root hooks there too once the method is registered
                # (torch.distributed.fsdp.register_fsdp_forward_method), as the user's own
                # ModelParallelStrategy set-up would have FSDP2 gather the root's parameters.
                if callable(getattr(fmodel, "training_step", None)):
                    from torch.distributed.fsdp import register_fsdp_forward_method

                    register_fsdp_forward_method(fmodel, "training_step")
            except Exception as exc:  # noqa: BLE001 - FSDP2 refusing the model is the user's problem
                raise ConfigError(f"FSDP2 (fully_shard) could not shard the model: {type(exc).__name__}: "
                                  f"{exc}") from exc
        sharded_originals = {}
        by_name = dict(self.model.named_parameters())
        for name, p in fmodel.named_parameters():
            if name in by_name:
                sharded_originals[id(p)] = by_name[name]
        return sharded_originals

    def build_optimizer(self, originals: dict[int, Any]) -> torch.optim.Optimizer:
        """The optimizer over the sharded DTensor parameters, its lazily built state made by one
        step on zero gradients under the fake mode (the base's warm-up runs on meta, which DTensors
        do not)."""
        opt = make_optimizer(self.optimizer, self.params, originals, self.spec.foreach)
        with self.mode, ScalarStub():
            for p in self.trainable:
                p.grad = torch.zeros_like(p)
            with uncached(self.mode):
                opt.step()
            opt.zero_grad(set_to_none=True)
        return opt

    def register(self) -> None:
        super().register()
        # the padded shard storage each sharded parameter views (FSDPParam._sharded_param_data)
        for p in self.params:
            self.recorder.register(p, Category.PARAMS)
        # level 1 under accumulation: the unsharded gradients kept without synchronisation
        # (FSDPParamGroup.post_backward: ``unsharded_accumulated_grad`` or the unsharded .grad)
        for fsdp_param in _fsdp_params(self.fmodel):
            for g in (fsdp_param.unsharded_accumulated_grad,
                      getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)):
                if g is not None:
                    self.recorder.register(g, Category.GRADS)


class ShardedRecorder(Recorder):
    """The trace's :class:`~memguard.estimator._trace.Recorder`, unwrapping DTensors to their local
    shards, naming FSDP2's buffers (outputs and out-arguments of its ``fsdp::``/``c10d::`` ops) and
    recording storage resizes (:meth:`resized`).

    Args:
        trace, cpu_target, cuda_target: as for :class:`~memguard.estimator._trace.Recorder`.
        gloo: the collectives run on gloo (the CPU target), which allocates temporaries of its own
            inside them (:data:`~memguard.estimator._fsdp2.GLOO_TEMPORARIES`).
    """

    def __init__(self, trace: Trace, cpu_target: Any = None, *, gloo: bool = False, cuda_target: Any = None) -> None:
        super().__init__(trace, cpu_target, cuda_target)
        self.gloo = gloo  # the collectives run on gloo (the CPU target): see GLOO_TEMPORARIES
        self._dead: set[int] = set()  # handles freed (by a resize) whose storage may live on
        self._default_stream = torch.cpu.current_stream()
        self._stream_ids: dict[Any, int] = {}

    def _tag_streams(self, first: int) -> None:
        """Note the current stream of the handles from ``first`` on, when it is not the default."""
        trace = self.trace
        if len(trace.sizes) <= first:
            return
        stream = torch.cpu.current_stream()
        if stream is self._default_stream:
            return
        sid = self._stream_ids.setdefault(stream, len(self._stream_ids) + 1)
        for handle in range(first, len(trace.sizes)):
            trace.streams[handle] = sid

    def register(self, tensor, category):
        first = len(self.trace.sizes)
        try:
            return self._register(tensor, category)
        finally:
            self._tag_streams(first)

    def _register(self, tensor, category):
        tensor = _local(tensor)
        if not isinstance(tensor, torch.Tensor):
            return None
        st = tensor.untyped_storage()
        handle = self._by_key.get(st._cdata)
        if handle is not None and (handle in self._dead or st.nbytes() != self.trace.sizes[handle]):
            self.resized(st, st.nbytes())  # resized without resize_ (an out= op): a new handle
            handle = self._by_key.get(st._cdata)
            if handle in self._dead:
                return handle
        return super().register(tensor, category)

    def handle_of(self, tensor):
        return super().handle_of(_local(tensor))

    def resized(self, storage: Any, nbytes: int) -> None:
        """A registered storage resized in place: its handle is freed and, unless the new size is
        0, a new handle allocated, so that every handle is allocated once and freed once (the
        allocator model and the planner's trace extension rely on it)."""
        key = storage._cdata
        handle = self._by_key.get(key)
        if handle is None or self._closed:
            return
        trace = self.trace
        if handle not in self._dead:
            if trace.sizes[handle] == nbytes:
                return
            trace.events.append((handle, -trace.sizes[handle]))
            self._dead.add(handle)
        if nbytes:
            new = len(trace.sizes)
            trace.sizes.append(nbytes)
            trace.category.append(trace.category[handle])
            self.alloc_phase.append(self.phase)
            trace.events.append((new, nbytes))
            self._by_key[key] = new
            self._tag_streams(new)

    def _free(self, handle: int, key: int) -> None:
        # the storage died: free whichever handle holds it now (resizes move it to new handles)
        if self._closed:
            return
        current = self._by_key.pop(key, handle)
        if current not in self._dead:
            self._dead.add(current)
            self._refs.pop(handle, None)
            self.trace.events.append((current, -self.trace.sizes[current]))

    def temporary(self, nbytes: int, category: str) -> None:
        """A storage the backend allocates and frees inside one op (not seen by the dispatcher)."""
        trace = self.trace
        handle = len(trace.sizes)
        trace.sizes.append(nbytes)
        trace.category.append(category)
        self.alloc_phase.append(self.phase)
        trace.events.append((handle, nbytes))
        trace.events.append((handle, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = len(self.trace.sizes)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self._tag_streams(first)  # the op's outputs and its kernel's own buffers
        ns = getattr(func, "namespace", "")
        if ns in ("fsdp", "c10d"):
            name = getattr(func, "_opname", None) or str(func)
            reduce = "chunk_cat" in name or "reduce_scatter" in name
            tag = REDUCE if reduce else GATHERED
            leaves, _ = tree_flatten((args, kwargs or {}, out))
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    h = self.register(leaf, None)
                    if h is not None and not self.trace.category[h]:
                        self.trace.category[h] = tag
            which = GLOO_TEMPORARIES.get(name) if self.gloo else None
            if which is not None and not self._closed:
                # c10d::_allgather_base_(output, input, ...) and _reduce_scatter_base_(output, input, ...)
                t = _local(args[1] if which == "input" else args[0])
                self.temporary(t.numel() * t.element_size(), tag)
        return out


@contextlib.contextmanager
def _record_resizes(recorder: Any) -> Iterator[None]:
    """Report in-place storage resizes (FSDP2's ``alloc_storage``/``free_storage``) to ``recorder``."""
    cls = torch.UntypedStorage
    original = cls.resize_

    def resize_(self, size):
        result = original(self, size)
        recorder.resized(self, int(size))
        return result

    cls.resize_ = resize_
    try:
        yield
    finally:
        cls.resize_ = original


def _fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the sharded copy (each ``fully_shard`` module's parameter group)."""
    out = []
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def _local(t: Any) -> Any:
    """The local shard of a DTensor (the tensor that owns memory), else ``t``."""
    return getattr(t, "_local_tensor", t)
