"""FSDP2 (``torch.distributed.fsdp.fully_shard``): one rank's training step, traced for real.

Rather than a formula for what FSDP2 holds, memguard runs FSDP2 itself on the fake model: the
traced copy is sharded with ``fully_shard`` exactly as :func:`memguard.integrations.fsdp.apply`
shards a model (each repeated block of :func:`memguard.estimator._blocks.find_container`, then the
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

This module holds the layout (:class:`FSDP2Layout`), the fake world (:func:`fake_world`), the
sharding shared with whatever applies a plan (:func:`shard_model`) and what the device model needs
(:func:`fsdp2_factors`, :func:`fold_categories`); the tracer and recorder that run the step are
subclasses of the trace's bases in :mod:`memguard.estimator._fsdp2_trace`.

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
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from memguard.errors import ConfigError

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
    from memguard.estimator._sharding import ShardFactors

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
def fake_world(world_size: int, rank: int = 0) -> Iterator[Any]:
    """A fake default process group of ``world_size`` ranks (this process is ``rank``, 0 by default)
    and its 1-D mesh.

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
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield init_device_mesh("cpu", (world_size,))
        finally:
            _forget_fake_meshes()
            if not running:
                dist.destroy_process_group()


def _forget_fake_meshes() -> None:
    """Drop DTensor's sharding-propagation caches, which hold the fake mesh after a trace.

    A ``DeviceMesh`` compares equal to any mesh of the same ranks and layout, so a sharding cached while
    tracing (``ShardingPropagator.propagate_op_sharding``, an LRU cache keyed by the op's schema, torch
    2.13 ``torch/distributed/tensor/_sharding_prop.py``, and the C++ fast path's cache that
    ``torch._C._clear_DTensor_sharding_propagator_cache`` clears) is found again for the job's real mesh; an
    in-place op (the optimizer's update) then gives the job's parameters the cached spec and with it the
    fake mesh, whose process group no longer exists (``full_tensor`` fails: "Could not resolve the
    process group registered under the name ...")."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor traced nothing with it
        return
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch fast path's cache
    if native is not None:
        native()
    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache = getattr(prop, name, None)
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()


@contextlib.contextmanager
def _job_groups_aside() -> Iterator[None]:
    """Hide the job's process groups (see :func:`fake_world`) and restore them, dropping what was added."""
    import torch.distributed.distributed_c10d as c10d

    maps = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_pg_to_tag")
    saved = {name: dict(getattr(c10d, name)) for name in maps}
    tags = {tag: list(groups) for tag, groups in c10d._tags_to_pg.items()}
    default = c10d._world.default_pg
    # Group names come from a counter (distributed_c10d._process_group_name: str(_world.group_count)); the fake
    # group takes one on the planning rank only, and a group the job creates later (a DeviceMesh) would then be
    # named differently on that rank than on its peers, which functional collectives (DTensor.full_tensor)
    # resolve by name: put the counter back too.
    count = c10d._world.group_count
    c10d._world.default_pg = None
    try:
        yield
    finally:
        c10d._world.group_count = count
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


def shard_model(model: nn.Module, layout: FSDP2Layout, mesh: Any, blocks: list[nn.Module] | None = None) -> None:
    """``fully_shard`` each repeated block (``blocks``, default: the children of
    :func:`~memguard.estimator._blocks.find_container`), then the root, with the layout's
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

    from memguard.estimator._blocks import find_container

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
