"""OOM recovery under FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): the agreement protocol of
:mod:`memguard.guard._sharded`, before each of FSDP1's collectives.

FSDP1's collectives run inside forward and backward, from module-level functions of
``torch/distributed/fsdp/_runtime_utils.py`` (torch 2.13):

* ``_unshard(state, handle, unshard_stream, pre_unshard_stream)``: the all-gather of a
  ``FlatParamHandle``'s flat parameter (``FlatParamHandle.unshard``, ``_flat_param.py``), called by
  ``_pre_forward_unshard`` (each FSDP unit's pre-forward), ``_pre_backward_hook`` (its pre-backward)
  and ``_prefetch_handle`` (forward and backward prefetching), each looking ``_unshard`` up in that
  module when it runs;
* ``_reduce_grad(state, handle)``: the reduce-scatter of the unsharded gradient (and, under HSDP, an
  all-reduce), and ``_reduce_grad_no_shard(state, handle)``: the all-reduce of ``NO_SHARD``, both called
  by ``_post_backward_hook`` (registered on each flat parameter's ``AccumulateGrad``) the same way.

:func:`fsdp1_rank_group` replaces those three module attributes (once per process) with wrappers that,
for the FSDP states of a model memguard guards and only while one of its attempts runs
(:meth:`ShardedRankGroup.armed`), run one agreement before the collective: a rank that ran out of
memory in compute reports at the end of its attempt, its peers meet that report at their next
agreement and leave forward/backward with :class:`memguard.guard._sharded.PeerAbort`. An error
inside the collective itself (its buffers) tears the process groups down and every rank raises the
same error (:meth:`ShardedRankGroup.stop`). Every other call (another model, ``state_dict``,
``summon_full_params``, evaluation) runs FSDP's function unchanged.

After a failed attempt :meth:`FSDP1RankGroup.reset` puts FSDP1's per-iteration state back where the
root's ``_post_backward_final_callback`` leaves it after a full backward: every flat parameter
resharded (``_reshard``) and its padded unsharded storage freed (also the root's, which FSDP1 keeps
from forward to backward: ``FlatParamHandle.needs_unshard`` decides from that storage whether the
next forward all-gathers, and it must decide alike on every rank), the post-backward hooks
registered in the failed forward removed (``_post_backward_hook_state``), the handles' flags
(``_ran_pre_backward_hook``, ``_needs_pre_backward_unshard``, ``_post_forward_index``,
``_prefetched``, ``_training_state``) and each state's ``training_state`` reset, the root's
``_post_backward_callback_queued`` cleared and its execution-order record moved to the next iteration
(``_exec_order_data.next_iter``); then the partial gradients are dropped (the flat parameters'
unsharded ``.grad``, ``_saved_grad_shard`` and the original parameters' ``.grad``).

Known limitations:
    The root must be an FSDP1 instance whose forward each micro-batch goes through (as Accelerate's
    prepared model is). HSDP (``HYBRID_SHARD``) and CPU offload are refused: memguard's agreement
    covers one process group, and offloaded gradients are copied asynchronously. FSDP1 with
    ``use_orig_params=False`` and ``True`` are both handled. The agreement count per micro-batch is
    about ``3 x units`` (an all-gather per unit in forward and in backward, a reduce-scatter per unit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.guard._sharded import PeerAbort, ShardedRankGroup, ShardingStopped

# The FSDP1 functions that start collectives (torch 2.13, torch/distributed/fsdp/_runtime_utils.py), and what each
# starts (for the error of a failure inside it).
_COLLECTIVES = {"_unshard": "all-gather", "_reduce_grad": "reduce-scatter", "_reduce_grad_no_shard": "all-reduce"}
_ORIGINALS: dict[str, Callable[..., Any]] = {}
#: id(FSDP state) -> the group guarding it
_GROUPS: dict[int, "FSDP1RankGroup"] = {}


def _fsdp1_states(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]


def is_fsdp1_model(model: Any) -> bool:
    """Whether ``model`` is (or contains) a ``FullyShardedDataParallel`` (FSDP1) module."""
    return isinstance(model, nn.Module) and bool(_fsdp1_states(model))


def _install_wrappers() -> None:
    """Replace FSDP1's collective functions in ``_runtime_utils`` with guarded ones (once per process)."""
    if _ORIGINALS:
        return
    from torch.distributed.fsdp import _runtime_utils

    for name, what in _COLLECTIVES.items():
        original = getattr(_runtime_utils, name)
        _ORIGINALS[name] = original
        setattr(_runtime_utils, name, _guarded(original, what))


def _guarded(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    def call(state: Any, handle: Any, *args: Any, **kwargs: Any) -> Any:
        rg = _GROUPS.get(id(state))
        if rg is None or not rg._armed or rg.world_size == 1 or not handle:
            return original(state, handle, *args, **kwargs)
        rg._boundary()
        try:
            return original(state, handle, *args, **kwargs)
        except (PeerAbort, ShardingStopped):
            raise
        except Exception as exc:  # inside FSDP1's collective path: a peer may already wait in it
            if rg.peer_stopped():
                raise ShardingStopped(rg.stopped_error(exc)) from exc
            raise ShardingStopped(rg.stop(exc, f"FSDP1's {what} of a flat parameter")) from exc

    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


@dataclasses.dataclass(eq=False)
class FSDP1RankGroup(ShardedRankGroup):
    """The ranks of an FSDP1 model, with FSDP1's reset (see the module docstring)."""

    fsdp1_states: list = dataclasses.field(default_factory=list)

    def install(self) -> None:
        """Guard this model's FSDP1 states (idempotent)."""
        _install_wrappers()
        for s in self.fsdp1_states:
            _GROUPS[id(s)] = self
        self._installed = True

    def uninstall(self) -> None:
        """Stop guarding this model's FSDP1 states (the wrappers stay, passing every other call through)."""
        for s in self.fsdp1_states:
            if _GROUPS.get(id(s)) is self:
                del _GROUPS[id(s)]
        self._installed = False

    def before_micro_batch(self, last: bool) -> None:
        """FSDP1's gradient synchronisation is the framework's (``no_sync``)."""

    def reset(self, params: Sequence[nn.Parameter] = ()) -> None:
        """Put FSDP1's per-iteration state back as after a full backward, on every rank, and drop the
        partial gradients (see the module docstring)."""
        self._armed = False
        _reset_units(self.fsdp1_states, drop_grads=True)
        for p in params:
            p.grad = None

    def reset_forward_state(self) -> None:
        """After a failed forward-only attempt (an evaluation micro-batch): every unit resharded and idle, as
        :meth:`reset` leaves them, with gradients and the execution-order record left alone (an evaluation
        makes no gradients and must not drop those of a training step in progress)."""
        self._armed = False
        _reset_units(self.fsdp1_states, drop_grads=False)


def _reset_units(states: Sequence[Any], *, drop_grads: bool) -> None:
    """Reshard every FSDP1 unit and reset its handle's per-iteration flags (torch 2.13, ``_runtime_utils.py``,
    ``_flat_param.py``); with ``drop_grads`` also the partial gradients and the root's end-of-backward state."""
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp._flat_param import HandleTrainingState
    from torch.distributed.fsdp._runtime_utils import _reshard

    for state in states:
        handle = state._handle
        if handle:
            flat_param = handle.flat_param
            # Always, and freeing the padded unsharded flat parameter: a unit that kept it (the root keeps its
            # parameters unsharded from forward to backward, and after an evaluation forward) would otherwise
            # skip its next all-gather on this rank only (FlatParamHandle.needs_unshard looks at that storage)
            # while its peers run it. IDLE first: a handle left in FORWARD with gradients enabled makes
            # FlatParamHandle._use_sharded_flat_param skip the original parameters' sharded views (use_orig_params
            # under SHARD_GRAD_OP; torch 2.13 _flat_param.py), and the next forward fails in _writeback_orig_params.
            handle._training_state = HandleTrainingState.IDLE
            _reshard(state, handle, handle.uses_sharded_strategy)
            for key in ("_post_backward_hook_state", "_post_backward_hook_handle"):
                hook = getattr(flat_param, key, None)
                if hook is not None:  # registered by the failed forward; the next one registers its own
                    (hook[-1] if isinstance(hook, tuple) else hook).remove()
                    delattr(flat_param, key)
            handle._ran_pre_backward_hook = False
            handle._needs_pre_backward_unshard = False
            handle._post_forward_index = None
            handle._training_state = HandleTrainingState.IDLE
            handle._prefetched = False
            if drop_grads:
                flat_param.grad = None
                if hasattr(flat_param, "_saved_grad_shard"):
                    delattr(flat_param, "_saved_grad_shard")
                flat_param._post_backward_called = False
                if handle._use_orig_params:
                    for p in flat_param._params or ():
                        p.grad = None
        state.training_state = TrainingState.IDLE
        if drop_grads and state._is_root:
            state._post_backward_callback_queued = False
            state._exec_order_data.next_iter()


def fsdp1_rank_group(model: nn.Module) -> FSDP1RankGroup | None:
    """The agreement protocol armed on every FSDP1 unit of ``model`` (the root FSDP1 wrapper); None when it
    has none or there is no process group. Every rank must call it.

    Raises:
        memguard.ConfigError: HSDP, CPU offload, or units over different process groups.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    states = _fsdp1_states(model)
    if not states:
        return None
    from torch.distributed.fsdp import ShardingStrategy, _runtime_utils

    missing = [name for name in _COLLECTIVES if not hasattr(_runtime_utils, name)]
    if missing:
        raise ConfigError(f"this torch's FSDP1 has no {', '.join(missing)} in torch.distributed.fsdp._runtime_utils, "
                          "where memguard puts its agreement before FSDP1's collectives (torch 2.13 has them); "
                          "use torch 2.13 or FSDP2 (fully_shard)")

    problems = []
    if any(s.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
           for s in states):
        problems.append("the model is sharded with FSDP1's HYBRID_SHARD; memguard recovers from OOM over one process "
                        "group only: use FULL_SHARD or SHARD_GRAD_OP")
    if any(s.cpu_offload.offload_params for s in states):
        problems.append("FSDP1's CPUOffload(offload_params=True) copies gradients to the host asynchronously, which "
                        "memguard's reset does not wait for; drop cpu_offload to let memguard recover from OOM")
    groups = {id(s.process_group): s.process_group for s in states}
    if len(groups) > 1:
        problems.append("the model's FSDP1 units use different process groups; memguard recovers from OOM on models "
                        "sharded over one process group only")
    if problems:
        raise ConfigError(problems)
    group = next(iter(groups.values()))
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    agree_group = group
    if "gloo" not in str(dist.get_backend(group)):  # host-side agreement, as under FSDP2
        agree_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store: peers raise a PeerFailedError without the failing rank's details
        store = None
    import torch

    src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
    rg = FSDP1RankGroup(group=agree_group, world_size=world_size, rank=rank, src=src, device=torch.device("cpu"),
                        broadcast_buffers=False, model=model, store=store, fsdp1_states=states)
    rg.install()
    return rg
