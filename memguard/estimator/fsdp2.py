"""FSDP2 (``torch.distributed.fsdp.fully_shard``): one rank's training step, traced for real.

Rather than a formula for what FSDP2 holds, memguard runs FSDP2 itself on the fake model: the
traced copy is sharded with ``fully_shard`` exactly as :func:`memguard.integrations.fsdp.apply`
shards a model (each repeated block of :func:`memguard.estimator.blocks.find_container`, then the
root), over a *fake* process group of the planned world size
(``torch.testing._internal.distributed.fake_pg``: collectives that move no data, which is how
torchtitan estimates FSDP memory). So the trace holds FSDP2's own allocations for rank 0:

* the sharded parameters (``FSDPParam._sharded_param_data``, padded to a multiple of the world
  size on dim 0: ``_fsdp_param.py``, ``_init_sharded_param``), their sharded gradients (views into
  the reduce-scatter output: ``_fsdp_collectives.py``, ``foreach_reduce``) and the optimizer's
  state, created by the real optimizer on the sharded ``DTensor`` parameters;
* each group's all-gather buffer (``all_gather_copy_in``) and unsharded parameters
  (``FSDPParam.init_all_gather_outputs``/``alloc_storage``), freed by ``reshard``
  (``free_storage``: ``untyped_storage().resize_(0)``), with the forward's deferred free of the
  previous all-gather result (``FSDPParamGroup.wait_for_unshard``: ``AllGatherState``) and the
  backward's prefetch of the next group (``FSDPState._pre_backward`` → ``_backward_prefetch``);
* the reduce-scatter input (``chunk_cat`` of the unsharded gradients in ``reduce_dtype``) and
  output, with the inputs kept until the next reduce-scatter (``ReduceScatterState``);
* the root's parameters, which FSDP2 keeps unsharded from forward to backward
  (``_fsdp_state.py``, ``_lazy_init``: the root's ``post_forward_mesh_info = None``).

Storage resizes (``alloc_storage``/``free_storage``) are not ATen ops, so while tracing
``torch.UntypedStorage.resize_`` is wrapped to record them as frees and allocations.

``zero_stage`` is FSDP2's sharding level: 3 = ``reshard_after_forward=True``; 2 = ``False``;
1 = ``False`` with gradient synchronisation only on the last micro-batch
(``set_requires_gradient_sync(False)`` before the others), so that under accumulation the
unsharded gradients accumulate across micro-batches as under ZeRO-1. ``*-mixed`` precisions are
``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` with no autocast: the
parameters stay fp32 and sharded, the all-gather casts them to 16 bits, the whole forward and
backward run in 16 bits and the gradients are reduced in fp32 (``_fsdp_api.py``).
``offload_optimizer=True`` is ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer
state on the host; the device holds the all-gathered parameters, activations and the
reduce-scatter buffers.

Known limitations:
    The fake process group is the default group for the duration of a trace: a trace run inside a
    process that already has a default process group (a running job) sets the job's groups aside
    while it traces and puts them back (:func:`fake_world`).
    Under ``CPUOffloadPolicy`` the short-lived device copies of one group's shards (host-to-device
    before the all-gather, device-to-host after the reduce-scatter) are counted as host memory.
    Rank 0 is traced: with uneven sharding it holds the largest shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from memguard.errors import ConfigError

__all__ = ["FSDP2Layout", "trace_fsdp2_step", "shard_model", "fold_categories", "fsdp2_factors", "describe_stage", "GATHERED",
           "REDUCE", "FSDP2_NOTE"]

#: Trace category of FSDP2's all-gather buffers and unsharded parameters (reported as "params").
GATHERED = "params_unsharded"
#: Trace category of FSDP2's unsharded gradients and reduce-scatter buffers (reported as "grads").
REDUCE = "grads_unsharded"

FSDP2_NOTE = ("FSDP2: *-mixed precision means MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32) "
              "with no autocast; zero_stage {stage} = {what}; rank 0 of {world} traced with FSDP2 itself")


@dataclass(frozen=True)
class FSDP2Layout:
    """How the traced copy is sharded (what :func:`memguard.integrations.fsdp.apply` does).

    Attributes:
        world_size: ranks of the (fake) process group.
        zero_stage: 3 = ``reshard_after_forward=True``; 2 = ``False``; 1 = ``False`` with gradient
            sync only on the last micro-batch.
        mp_dtype: ``MixedPrecisionPolicy.param_dtype`` (``reduce_dtype`` fp32), or None for none.
        offload: ``CPUOffloadPolicy`` (sharded states on the host).
        backend: the collective backend of the target: ``"gloo"`` (the CPU target) copies through
            temporaries of its own (see :data:`GLOO_TEMPORARIES`); ``"nccl"`` (CUDA) allocates no
            tensors through PyTorch's allocator for FSDP2's collectives.
    """

    world_size: int
    zero_stage: int = 3
    mp_dtype: torch.dtype | None = None
    offload: bool = False
    backend: str = "nccl"

    @property
    def reshard_after_forward(self) -> bool:
        return self.zero_stage == 3


def fsdp2_factors(offload: bool):
    """Category factors for an FSDP2 trace (already one rank's): 1, or with ``CPUOffloadPolicy`` 0 for
    the sharded parameters, gradients, optimizer state and the optimizer step's temporaries, which
    live and run on the host (``_fsdp_param.py``: ``offload_to_cpu`` keeps ``_sharded_param_data``
    on the CPU; ``_fsdp_collectives.py``, ``foreach_reduce``: the sharded gradient is copied to the
    host). The unsharded parameters and the reduce-scatter buffers stay on the device."""
    from memguard.estimator.sharding import ShardFactors

    if not offload:
        return ShardFactors()
    return ShardFactors(params=0.0, grads=0.0, optimizer=0.0, optimizer_temporaries=0.0)


#: What gloo allocates inside FSDP2's two collectives, as (op name, which tensor's bytes), measured
#: on CPU with torch.profiler and read in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:
#: ``reduce_scatter_tensor_coalesced`` clones the input (``inputTensors[i].clone()``), all-reduces the
#: clone and copies this rank's chunk out; ``allgather`` gathers into a flat temporary the size of
#: the output (``newLikeFlat``) and copies it into the output tensors. Each lives only during the op.
GLOO_TEMPORARIES = {"_reduce_scatter_base_": "input", "_allgather_base_": "output"}


def describe_stage(stage: int) -> str:
    """One phrase on what an FSDP2 sharding level means."""
    return {3: "reshard_after_forward=True", 2: "reshard_after_forward=False",
            1: "reshard_after_forward=False, gradients synchronised on the last micro-batch only"}.get(stage, "?")


def fold_categories(breakdown: dict[str, int]) -> dict[str, int]:
    """FSDP2's own categories folded into the reported ones (all-gathered → params, reduce → grads)."""
    out = dict(breakdown)
    for cat, into in ((GATHERED, "params"), (REDUCE, "grads")):
        if cat in out:
            out[into] = out.get(into, 0) + out.pop(cat)
    return out


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is rank 0) and its 1-D mesh.

    In a running job (a default process group exists, e.g. ``memguard.prepare(..., strategy="fsdp2")``
    planning on the first step), the job's groups are set aside while the fake one is the default and
    put back afterwards, exactly as they were: torch.distributed keeps its groups in module-level maps
    (``distributed_c10d._World``) and a name registry (``_register_process_group``); only the fake
    group's entries are added and removed.

    Raises:
        ConfigError: torch.distributed is not built in.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("estimating FSDP2 needs torch.distributed, which this torch build lacks")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    running = dist.is_initialized()
    with _job_groups_aside() if running else contextlib.nullcontext():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield init_device_mesh("cpu", (world_size,))
        finally:
            if not running:
                dist.destroy_process_group()


@contextlib.contextmanager
def _job_groups_aside() -> Iterator[None]:
    """Hide the job's process groups (see :func:`fake_world`) and restore them, dropping what was added."""
    import torch.distributed.distributed_c10d as c10d

    maps = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_pg_to_tag")
    saved = {name: dict(getattr(c10d, name)) for name in maps}
    tags = {tag: list(groups) for tag, groups in c10d._tags_to_pg.items()}
    default = c10d._world.default_pg
    c10d._world.default_pg = None
    try:
        yield
    finally:
        for pg, name in list(c10d._pg_names.items()):
            if pg not in saved["_pg_names"]:
                torch._C._distributed_c10d._unregister_process_group(name)
        for name, before in saved.items():
            current = getattr(c10d, name)
            current.clear()
            current.update(before)
        c10d._tags_to_pg.clear()
        c10d._tags_to_pg.update(tags)
        c10d._world.default_pg = default


def _local(t: Any) -> Any:
    """The local shard of a DTensor (the tensor that owns memory), else ``t``."""
    return getattr(t, "_local_tensor", t)


def _recorder_class():
    from memguard.estimator.trace import Recorder

    class ShardedRecorder(Recorder):
        """The trace's recorder, unwrapping DTensors to their local shards, naming FSDP2's buffers
        (outputs and out-arguments of its ``fsdp::``/``c10d::`` ops) and recording storage resizes."""

        def __init__(self, trace, cpu_target=None):
            super().__init__(trace, cpu_target)
            self._dead: set[int] = set()  # handles freed (by a resize) whose storage may live on

        def register(self, tensor, category):
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

        def _free(self, handle: int, key: int) -> None:
            # the storage died: free whichever handle holds it now (resizes move it to new handles)
            if self._closed:
                return
            current = self._by_key.pop(key, handle)
            if current not in self._dead:
                self._dead.add(current)
                self._refs.pop(handle, None)
                self.trace.events.append((current, -self.trace.sizes[current]))

        gloo = False

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
            out = super().__torch_dispatch__(func, types, args, kwargs)
            ns = getattr(func, "namespace", "")
            if ns in ("fsdp", "c10d"):
                name = getattr(func, "_opname", None) or str(func)
                reduce = "chunk_cat" in name or "reduce_scatter" in name
                tag = REDUCE if reduce else GATHERED
                from torch.utils._pytree import tree_flatten

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

    return ShardedRecorder


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


def shard_model(model: nn.Module, layout: FSDP2Layout, mesh: Any, blocks: list[nn.Module] | None = None) -> None:
    """``fully_shard`` each repeated block (``blocks``, default: the children of
    :func:`~memguard.estimator.blocks.find_container`), then the root, with the layout's
    ``reshard_after_forward``, ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`` and
    ``CPUOffloadPolicy``: the layout the estimate traces, shared with whatever applies a plan so
    that both shard alike. Activation checkpointing, if any, is applied to the blocks first.

    Args:
        model: the module to shard in place.
        layout: the sharding.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks.
        blocks: the modules to shard individually (default: the repeated blocks).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from memguard.estimator.blocks import find_container

    mp = (MixedPrecisionPolicy(param_dtype=layout.mp_dtype, reduce_dtype=torch.float32)
          if layout.mp_dtype is not None else MixedPrecisionPolicy())
    # pinned host memory (CPUOffloadPolicy's default) needs an accelerator: pin only for a CUDA mesh
    pin = getattr(mesh, "device_type", "cpu") == "cuda"
    offload = CPUOffloadPolicy(pin_memory=pin) if layout.offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=layout.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    if blocks is None:
        container = find_container(model)
        blocks = list(container.children()) if container is not None else []
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def trace_fsdp2_step(model: nn.Module, batch: Any, spec: Any, layout: FSDP2Layout, *, optimizer=None,
                     loss_fn=None) -> Any:
    """Trace one steady-state step of rank 0 of an FSDP2 job (see the module docstring).

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimator.trace.trace_step`.
        spec: the :class:`~memguard.estimator.trace.TraceSpec` (no autocast: FSDP2's policy casts).
        layout: the sharding.

    Returns:
        A :class:`~memguard.estimator.trace.Trace` of one rank's allocations.

    Raises:
        ConfigError: the model, batch or loss cannot be traced, or FSDP2 cannot shard the model.
    """
    import gc

    from memguard.estimator.trace import _quiet_fake_tensor_log

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _quiet_fake_tensor_log(), fake_world(layout.world_size) as mesh:
            return _tracer_class()(model, batch, optimizer, loss_fn, spec, layout, mesh).run()
    finally:
        if gc_was_enabled:
            gc.enable()


def _fsdp_params(model: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the sharded copy (each ``fully_shard`` module's parameter group)."""
    out = []
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def _tracer_class():
    from memguard.estimator import trace as tr

    class FSDP2Tracer(tr._StepTracer):
        """:class:`memguard.estimator.trace._StepTracer` with the copy sharded by FSDP2 before the
        optimizer is built, DTensors unwrapped, and storage resizes recorded."""

        def __init__(self, model, batch, optimizer, loss_fn, spec, layout, mesh):
            super().__init__(model, batch, optimizer, loss_fn, spec)
            self.layout, self.mesh = layout, mesh
            self.recorder = _recorder_class()(self.trace, spec.cpu_target)
            self.recorder.gloo = layout.backend == "gloo"

        def run(self):
            with tr._preserved_rng():
                self.setup()
                with self.mode:
                    if self.spec.grads_present:
                        self._accumulated_state()
                with self.mode, self.recorder, _record_resizes(self.recorder):
                    self.register()
                    loss = self.forward()
                    self.backward(loss)
                    self.optimizer_step()
                    del loss
                    self.categorise()
                    self.carry_outputs()
                self.recorder.close()
            return self.trace

        def _accumulated_state(self) -> None:
            """The state a micro-batch after the first starts from: sharded gradients (levels 3 and
            2) or, at level 1, the unsharded gradients accumulated without synchronisation, made by
            one unrecorded micro-batch with gradient sync off."""
            if self.layout.zero_stage == 1:
                self.fmodel.set_requires_gradient_sync(False)
                with tr._ScalarStub():
                    tr.compute_loss(self.fmodel, self.fbatch, self.loss_fn).backward()
                self.fmodel.set_requires_gradient_sync(True)
            else:
                for p in self.trainable:
                    p.grad = torch.zeros_like(p)

        def setup(self) -> None:
            from memguard.estimator.blocks import apply_activation_checkpointing

            spec, trace = self.spec, self.trace
            fmodel, originals, blocks = tr._fake_model(self.model, self.mode, spec.param_dtype, self.device,
                                                       spec.keep_blocks)
            fmodel.train()
            if spec.checkpoint_blocks:
                apply_activation_checkpointing(fmodel, spec.checkpoint_blocks, blocks)
            trace.num_blocks = len(blocks)
            params = list(fmodel.parameters())
            trace.num_params = sum(p.numel() for p in params)
            trace.num_trainable_params = sum(p.numel() for p in params if p.requires_grad)
            trace.trainable_param_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            trace.largest_layer_params = max(
                (sum(p.numel() for p in m.parameters(recurse=False)) for m in fmodel.modules()), default=0)
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
            self.fmodel = fmodel
            self.params = list(fmodel.parameters())  # the sharded DTensor parameters
            self.trainable = [p for p in self.params if p.requires_grad]
            # the original (unsharded) parameter of each sharded one, for an optimizer instance's groups
            sharded_originals = {}
            by_name = dict(self.model.named_parameters())
            for name, p in fmodel.named_parameters():
                if name in by_name:
                    sharded_originals[id(p)] = by_name[name]
            self.fbatch = tr._fake_batch(self.batch, self.mode, spec.param_dtype, self.device)
            self.opt = tr._make_optimizer(self.optimizer, self.params, sharded_originals, spec.foreach)
            with self.mode, tr._ScalarStub():  # lazily built optimizer state: one step on zero gradients
                for p in self.trainable:
                    p.grad = torch.zeros_like(p)
                with tr._uncached(self.mode):
                    self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            if spec.count_flops:
                from torch.utils.flop_counter import FlopCounterMode

                self.flops = [FlopCounterMode(display=False), FlopCounterMode(display=False)]
            if spec.cuda_target is not None:
                from memguard.estimator.cuda_kernels import CudaKernelModel
                from memguard.estimator.trace import load_rules

                load_rules()
                self.kernel_model = CudaKernelModel(spec.cuda_target)

        def register(self) -> None:
            super().register()
            # the padded shard storage each sharded parameter views (FSDPParam._sharded_param_data)
            for p in self.params:
                self.recorder.register(p, "params")
            # level 1 under accumulation: the unsharded gradients kept without synchronisation
            # (FSDPParamGroup.post_backward: ``unsharded_accumulated_grad`` or the unsharded .grad)
            for fsdp_param in _fsdp_params(self.fmodel):
                for g in (fsdp_param.unsharded_accumulated_grad,
                          getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None)):
                    if g is not None:
                        self.recorder.register(g, "grads")

    return FSDP2Tracer
