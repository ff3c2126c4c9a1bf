"""FSDP2's agreement protocol for a model a framework sharded: Lightning's ``ModelParallelStrategy``,
Accelerate's FSDP2 plugin and the HF Trainer under FSDP2 (through Accelerate).

:func:`memguard.guard._sharded.sharded_rank_group` arms the protocol of :mod:`memguard.guard._sharded`
(an agreement before every FSDP2 collective, reset, halve, redo) on a model whose root module is
the FSDP2 root that runs forward first. Frameworks do not always give it one:

* Lightning's ``ModelParallelStrategy`` calls ``LightningModule.training_step`` directly, never the
  LightningModule's ``forward`` (``Strategy.training_step`` in
  ``lightning/pytorch/strategies/strategy.py``, 2.6: it redirects through ``forward`` only when
  ``strategy.model`` is a wrapper, and ``ModelParallelStrategy`` wraps nothing). A
  ``fully_shard(self)`` in ``configure_model`` then never becomes FSDP2's root: FSDP2 makes root
  the first state whose forward runs (``FSDPState._lazy_init``,
  ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``, torch 2.13), so each top-level
  ``fully_shard``-ed submodule the step calls is a root of its own.
* ``configure_model`` may shard only a submodule (``fully_shard(self.model)``), or several.

:func:`framework_rank_group` therefore takes every FSDP2 state under the framework's module, arms
the same agreement on every FSDP param group (through :func:`sharded_rank_group` on one top-level
FSDP2 module, whose checks and agreement group it reuses), and resets every state that became a
root (:meth:`FrameworkShardedRankGroup.reset`). Gradient synchronisation is left to the framework
(Lightning's and Accelerate's ``no_sync`` for accumulation): micro-batches within one of the
framework's batches each run FSDP2's reduce-scatter as the framework's setting says.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.guard._sharded import (ShardedRankGroup, _fsdp_state_of, _param_groups, drop_partial_grads, fsdp_states,
                                     sharded_rank_group)


@dataclasses.dataclass(eq=False)
class FrameworkShardedRankGroup(ShardedRankGroup):
    """A :class:`ShardedRankGroup` over every FSDP2 state of a framework's module, however many roots it has."""

    def reset(self, params: Sequence[nn.Parameter] = ()) -> None:
        """Reset FSDP2's per-step state after a failed attempt, on every rank.

        Every state that became a root is reset with ``FSDPState._reset_iter_state`` (which resets
        the groups of every state it owns, and clears its shared flags: the post-forward order,
        ``iter_forward_root`` and ``post_backward_final_callback_queued``); groups no root owns
        (never run) are reset alone. Then the partial gradients are dropped as in
        :meth:`ShardedRankGroup.reset`.
        """
        self.reset_forward_state()
        drop_partial_grads(self.states, params)

    def reset_forward_state(self) -> None:
        """After a failed forward-only attempt: every state that became a root reset with
        ``_reset_iter_state`` (a framework may have several roots, see :meth:`reset`), groups no root owns
        alone; gradients are left as they are (an evaluation makes none)."""
        self._armed = False
        done: set[int] = set()
        for state in self.states:
            if state._is_root:
                state._reset_iter_state()
                done.update(id(pg) for s in state._state_ctx.all_states for pg in s._fsdp_param_groups)
        for pg in _param_groups(self.states):
            if id(pg) not in done:
                pg._reset_iter_state()


def top_fsdp2_modules(module: nn.Module) -> list[nn.Module]:
    """The FSDP2 (``fully_shard``) modules of ``module`` that no other FSDP2 module contains, in module order."""
    tops: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if _fsdp_state_of(m) is not None:
            tops.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return tops


def framework_rank_group(module: nn.Module) -> FrameworkShardedRankGroup | None:
    """The agreement protocol armed on every FSDP2 group of ``module``; None when nothing in it is FSDP2
    or there is no process group. Every rank must call it (it may create a gloo group).

    Raises:
        memguard.ConfigError: the FSDP2 modules are sharded over a 2-D mesh (HSDP) or over different
            process groups (as :func:`sharded_rank_group` refuses them).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    tops = top_fsdp2_modules(module)
    if not tops:
        return None
    base = sharded_rank_group(tops[0])  # the mesh checks, the agreement group and the store
    base.uninstall()  # its wrappers call back into `base`; the group below installs its own
    states = fsdp_states(module)
    pgs = {id(pg._all_gather_process_group) for pg in _param_groups(states)}
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    if any(isinstance(pg.mesh_info, DDPMeshInfo) for pg in _param_groups(states)):
        raise ConfigError("the model is sharded over a 2-D mesh (HSDP) or replicated; memguard recovers from OOM "
                          "under FSDP2 over one mesh dimension only (fully_shard(..., mesh=1-D mesh))")
    if len(pgs) > 1:
        raise ConfigError("the model's FSDP2 modules use different process groups; memguard recovers from OOM on "
                          "models sharded over one mesh dimension only (pass the same mesh to every fully_shard)")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields.update(states=states, model=module, sync_last_only=False, _installed=False, agreements=0)
    rg = FrameworkShardedRankGroup(**fields)
    rg.install()  # one rank too: no agreement runs then, but an OOM still needs the reset
    return rg


def is_fsdp2(module: Any) -> bool:
    """Whether anything in ``module`` is sharded with ``fully_shard``."""
    return isinstance(module, nn.Module) and bool(top_fsdp2_modules(module))
