"""OOM recovery under tensor parallelism (and FSDP2 x TP): an agreement before every collective of the TP group.

Why FSDP2's hooks are not enough. Tensor parallelism's collectives run inside forward and backward
too, and they are not started by a few methods of a few objects: a ``DTensor`` redistributes from
``Partial`` to ``Replicate`` (a rowwise Linear's output), from ``Replicate`` back (a colwise
Linear's input gradient), between ``Shard`` s (sequence parallelism), through
``torch/distributed/tensor/placement_types.py`` (``funcol.all_reduce``, ``all_gather_single``,
``reduce_scatter_single``), ``_collective_utils.py`` (``torch.ops._c10d_functional.all_to_all_single``
directly), ``parallel/loss.py`` (``loss_parallel``'s all-reduces), ``_nonlinear_redux.py``, and from
``DTensor`` dispatch itself (``_dispatch.py`` imports ``redistribute_local_tensor`` by name), in
forward, in autograd's backward and in the optimizer's or ``clip_grad_norm_``'s reductions (torch
2.13). Wrapping Python functions would miss some of them.

The single entry point. All of them end in the tensor-parallel dimension's ``ProcessGroup``: the
functional collectives resolve the mesh dimension to its group name and call the group's virtual
``allreduce`` / ``all_gather_single`` / ``reduce_scatter_single`` / ``all_to_all_single``
(``torch/csrc/distributed/c10d/Functional.cpp``), and ``torch.distributed``'s calls do the same. A
``ProcessGroup`` can be a Python subclass whose methods override those virtual calls
(``torch/csrc/distributed/c10d/PyProcessGroup.hpp``: ``PYBIND11_OVERRIDE`` for each collective),
registered as a c10d backend (``torch.distributed.Backend.register_backend``; a creator that returns a
``ProcessGroup`` subclass is used as the group itself: ``distributed_c10d._new_process_group_helper``)
and chosen for one mesh dimension (``init_device_mesh(..., backend_override={"tp": ...})``).
:class:`GuardedGroup` is that group: it holds a real gloo backend (``ProcessGroupGloo`` over the
group's own prefix store, exactly as c10d builds one), registered as its CPU backend so that what it
does not override (``scatter`` when the parameters are distributed) goes there directly, and it runs
:meth:`TPRankGroup.boundary` before each collective it overrides. This is what
:mod:`memguard.integrations._deepspeed_guard` does by wrapping DeepSpeed's comm backend object.

The protocol is :mod:`memguard.guard._sharded`'s, over every rank of the job: every rank runs the
same program, so the k-th collective (FSDP2's all-gathers and reduce-scatters over ``dp_shard``,
tensor parallelism's over ``tp``) is the same on every rank, and one agreement over the whole world
before each keeps every group in step: a rank that runs out of memory in compute reports it at the
end of its attempt, its peers meet that report at their next agreement and leave forward/backward
(:class:`~memguard.guard._sharded.PeerAbort`), every rank resets (FSDP2's per-step state, every
gradient), halves the micro-batch and runs the same samples again. An error inside a collective after
the agreement passed stops every rank with the same error (:meth:`ShardedRankGroup.stop`).

Known limitations:
    gloo (CPU) only: on CUDA the tensor-parallel dimension keeps NCCL and :func:`memguard.step`
    refuses to guard it (a ``ConfigError``), rather than hang. Data-parallel replicas (DDP, HSDP)
    with tensor parallelism are not guarded. Each collective of the tensor-parallel group costs one
    extra all-reduce of ``world_size + 1`` int32 values while an attempt runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.guard._sharded import PeerAbort, ShardedRankGroup, ShardingStopped, _fsdp_state_of, fsdp_states

logger = logging.getLogger("memguard")

#: The c10d backend name of :class:`GuardedGroup` (``init_device_mesh(backend_override={"tp": GUARDED_BACKEND})``).
GUARDED_BACKEND = "memguard_guarded_gloo"

#: The collectives ``PyProcessGroup`` lets a Python subclass override (torch 2.13,
#: ``torch/csrc/distributed/c10d/PyProcessGroup.hpp``; the functional collectives call the
#: ``*_single`` / ``*_coalesced`` ones from ``Functional.cpp``). Each override agrees, then runs
#: ``ProcessGroup``'s own method, which dispatches to the registered gloo backend (pybind11 lets a
#: ``super()``-style call of the base method through without re-entering the override).
_OVERRIDES = ("allreduce", "allreduce_coalesced", "allgather", "all_gather_single", "all_gather_single_coalesced",
              "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "all_to_all_single",
              "broadcast", "barrier")

#: The rank groups whose agreements guard the guarded groups' collectives (one per job in practice).
_ACTIVE: list["TPRankGroup"] = []


def _make_guarded_class() -> type:
    def method(name: str) -> Callable[..., Any]:
        base = getattr(dist.ProcessGroup, name)
        where = f"tensor parallelism's {name}"

        def call(self: Any, *args: Any) -> Any:
            rg = next((g for g in _ACTIVE if g.armed_now), None)
            if rg is not None:
                rg._boundary()
            try:
                return base(self, *args)  # c10d's own method: the registered gloo backend runs it
            except Exception as exc:
                if rg is None or isinstance(exc, (PeerAbort, ShardingStopped)):
                    raise
                raise rg.collective_failed(exc, where) from exc

        # pybind11 runs the base method instead of the override when the calling frame is a function of the
        # method's name whose first argument is the object (pybind11.h, get_type_override: the super() check)
        call.__code__ = call.__code__.replace(co_name=name)
        call.__name__ = call.__qualname__ = name
        return call

    def __init__(self: Any, inner: Any, rank: int, size: int) -> None:
        dist.ProcessGroup.__init__(self, rank, size)
        self.inner = inner
        # every collective runs on this gloo backend: the overridden ones after an agreement, the others
        # (scatter when parameters are distributed, send/recv) directly
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)

    def group_name(self: Any) -> str:
        # the name c10d registered this group under (multi_threaded_pg.py does the same for its Python group)
        return dist.distributed_c10d._world.pg_names[self]

    attrs: dict[str, Any] = {name: method(name) for name in _OVERRIDES}
    attrs.update(__init__=__init__, group_name=property(group_name), getBackendName=lambda self: GUARDED_BACKEND,
                 __doc__="A gloo process group that runs memguard's agreement before each collective (see "
                         "memguard.guard._tp).")
    return type("GuardedGroup", (dist.ProcessGroup,), attrs)


GuardedGroup: type | None = None


def _create(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """The c10d backend creator of :data:`GUARDED_BACKEND`: a :class:`GuardedGroup` over a real gloo backend."""
    return GuardedGroup(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)  # type: ignore[misc]


def register_backend() -> str:
    """Register :data:`GUARDED_BACKEND` with c10d (once per process); its name."""
    global GuardedGroup
    if GuardedGroup is None:
        GuardedGroup = _make_guarded_class()
    if GUARDED_BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(GUARDED_BACKEND, _create, devices=["cpu"])
    return GUARDED_BACKEND


def is_guarded_group(group: Any) -> bool:
    """Whether ``group`` is a :class:`GuardedGroup`."""
    return GuardedGroup is not None and isinstance(group, GuardedGroup)


@dataclass(eq=False)
class TPRankGroup(ShardedRankGroup):
    """Every rank of a tensor-parallel (optionally FSDP2 x TP) job, as the guard uses them.

    The agreements run over the whole world (``group`` None: the default gloo group), before each
    FSDP2 collective (the base class's wrappers) and each collective of a :class:`GuardedGroup`.
    """

    framework: str = "tensor parallelism"
    restart_advice: str = ("Restart the job with a smaller micro_batch_size (or activation checkpointing, or a "
                           "larger tp)")
    store_prefix: str = "memguard/tp/stopped/"

    @property
    def armed_now(self) -> bool:
        return self._armed and self.world_size > 1

    def collective_failed(self, exc: BaseException, where: str) -> ShardingStopped:
        """An error inside a collective after its agreement: a peer may already wait in it, so every rank
        stops with the same error (see the module docstring)."""
        if self.peer_stopped():
            return ShardingStopped(self.stopped_error(exc))
        return ShardingStopped(self.stop(exc, where))

    def install(self) -> None:
        super().install()
        if self not in _ACTIVE:
            _ACTIVE.append(self)

    def uninstall(self) -> None:
        super().uninstall()
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def tp_rank_group(model: nn.Module, mesh: Any) -> TPRankGroup:
    """The :class:`TPRankGroup` of a model laid out on ``mesh`` (every rank must call it).

    Raises:
        ConfigError: the mesh's tensor-parallel dimension is not a :class:`GuardedGroup` (CUDA, or a
            mesh not made by :func:`memguard.integrations.parallel.apply`), the default group is not
            gloo, or the layout has data-parallel replicas.
    """
    problems = []
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names and mesh["tp"].size() > 1 and not is_guarded_group(mesh["tp"].get_group()):
        problems.append("memguard recovers from an OOM under tensor parallelism only on gloo (CPU) ranks whose "
                        "tensor-parallel group memguard made (memguard.integrations.parallel.apply on a CPU model); "
                        "this one is not, and an OOM on one rank would leave its peers waiting in a collective: "
                        "train it without memguard.step, with a micro-batch that fits")
    if "dp_replicate" in names and mesh["dp_replicate"].size() > 1:
        problems.append("memguard does not recover from an OOM with data-parallel replicas (dp_replicate > 1) under "
                        "tensor parallelism or HSDP yet: use dp_shard instead")
    if str(dist.get_backend()) != "gloo":
        problems.append("the default process group must be gloo for memguard's agreements under tensor parallelism")
    if problems:
        raise ConfigError(problems)
    states = fsdp_states(model)
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store: peers raise a PeerFailedError without the failing rank's details
        store = None
    rg = TPRankGroup(group=None, world_size=dist.get_world_size(), rank=dist.get_rank(), src=0,
                     device=torch.device("cpu"), broadcast_buffers=False,
                     root=_fsdp_state_of(model) if states else None, states=states, model=model, store=store)
    rg.install()
    return rg


def unguarded_tensor_parallel(module: nn.Module, rank_group: Any) -> str | None:
    """Why the guard must not run ``module``: it has tensor-parallel parameters (``DTensor`` s on a mesh
    with a ``"tp"`` dimension larger than 1, or on a mesh larger than 1 without FSDP2) but its rank group
    does not agree before their collectives, so an OOM on one rank would leave its peers waiting in one
    (a hang). None when the guard may run it."""
    if isinstance(rank_group, TPRankGroup):
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no tensor parallelism
        return None
    fsdp = bool(fsdp_states(module))
    for p in module.parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        # "tp": torchtitan's, Accelerate's and memguard's name; "tensor_parallel": Lightning's (ModelParallelStrategy)
        tp = next((n for n in ("tp", "tensor_parallel") if n in names), None)
        if (tp is not None and mesh[tp].size() > 1) or (not fsdp and mesh.size() > 1):
            return ("the model is tensor-parallel (its parameters are DTensors on a tensor-parallel mesh), and "
                    "memguard.step recovers from an OOM under tensor parallelism only when the agreements run before "
                    "its collectives: lay it out with memguard.integrations.parallel.apply(model, layout) and "
                    "prepare it with memguard.integrations.parallel.prepare(model, optimizer, micro_batch_size=...) "
                    "instead of memguard.prepare (gloo/CPU ranks); otherwise train it without memguard.step")
    return None
