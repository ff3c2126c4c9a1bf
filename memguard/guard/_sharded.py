"""OOM recovery under FSDP2 (``fully_shard``) that cannot hang: agreement before every collective.

Why DDP's protocol is not enough. Under DistributedDataParallel memguard runs every micro-batch
on the module inside the wrapper, so no collective starts until every rank has reported its
outcome (:mod:`memguard.guard._distributed`). FSDP2 cannot be bypassed that way: its all-gathers
(``FSDPParamGroup.unshard``, from each block's pre-forward and pre-backward hooks and from
prefetching) and its reduce-scatters (``FSDPParamGroup.post_backward``, from the autograd graph and
from the root's final backward callback) run *inside* forward and backward (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_state.py`` and ``_fsdp_param_group.py``). A rank that
runs out of memory in a block's compute leaves forward or backward at once, while its peer goes
on to the next block and waits forever in an all-gather the failed rank never joins.

The protocol (every rank runs the same program, so every rank calls FSDP's collectives the same
number of times, in the same order):

1. **An agreement before every FSDP collective.** :meth:`ShardedRankGroup.install` wraps each
   ``FSDPParamGroup``'s ``unshard`` and ``post_backward`` (the only two methods that start FSDP2's
   collectives) on the instance. While a guarded attempt runs, each call first runs one agreement:
   an all-reduce (MAX) of ``world_size + 1`` int32 values (each rank's outcome, the largest local
   batch), the same shape as the agreement that ends an attempt.
2. **A rank that fails in compute reports at once.** An OOM (or any error) in a block's compute
   propagates out of forward/backward to the window (:mod:`memguard.guard._window`), which gives the
   memory back and calls the end-of-attempt agreement with "OOM". Its peers are in, or will reach,
   the agreement before their next FSDP collective: the two calls meet, the peers see the failure
   and raise :class:`PeerAbort` from inside FSDP's hook, which leaves their forward/backward too.
   Every collective issued before the failure was issued by every rank (each came after an
   agreement that all ranks passed), so no rank is left waiting in one, and no agreement is left
   unmatched: the peers take their outcome from the agreement they were in and do not agree again.
3. **Reset, halve, re-run.** Every rank then resets FSDP2's per-step state: the root state's
   ``_reset_iter_state`` (waits for issued all-gathers/reduce-scatters, drops pending all-gather
   results, reduce-scatter states and post-reduce events, clears the post-forward order and the
   final-callback flag, sets every group to IDLE and reshards it), then drops the partial
   gradients (unsharded accumulated gradients of a no-sync micro-batch, unsharded ``.grad`` and the
   sharded ``.grad``) and restores gradient synchronisation. The window halves the micro-batch and
   runs the same samples again.
4. **What cannot be made safe fails the same way on every rank, fast.** An error *inside* FSDP's
   collective path after the agreement passed (for example the all-gather output or the
   reduce-scatter input cannot be allocated) leaves the peers inside a collective this rank will
   never join. The failing rank then writes the error to the process group's key-value store and
   aborts its process groups (``torch.distributed.distributed_c10d._abort_process_group``): the
   peers' pending collectives fail at once (gloo: "Connection closed by peer"), memguard reads the
   store and every rank raises the same :class:`memguard.OOMRecoveryError` (or, for an error that
   is not an OOM, the failing rank its own error and the others :class:`memguard.PeerFailedError`).
   Training cannot go on in that process: the process groups are gone; restart the job with a
   smaller micro-batch (or more sharding, or activation checkpointing). A peer that dies outright
   (killed by the operating system's OOM killer) closes its connections too: the others' next
   agreement or collective fails at once and they raise :class:`memguard.PeerFailedError`.

Where the agreement runs. With a gloo process group, on the FSDP group itself. With NCCL (or any
other backend) on a gloo group over the same ranks, created once by :func:`sharded_rank_group`:
the agreement then costs a host round trip, but no device synchronisation, and a CUDA OOM is
raised on the host by the caching allocator, so the host-side protocol sees it.

Cost per step. Each agreement is one all-reduce of ``world_size + 1`` int32 values. A micro-batch
makes about ``4 x groups - 1`` of them (groups = the FSDP2 groups: blocks + root): an all-gather
per group in forward and in backward, a backward prefetch per block, a reduce-scatter per group),
plus one that ends the attempt. Measured on 2 gloo ranks sharing one busy 2-core CPU host
(``tests/guard/fsdp2_worker.py`` with ``time_steps``: a 2-block MLP, 64 samples per rank in 4
micro-batches, medians of 15 interleaved steps): 45 agreements per step, 0.8 ms each, and a step of
0.435 s against 0.420 s with the same agreements skipped (+3.5%). The agreements run on the host,
between FSDP's own collectives, and keep the ranks in step at each boundary: a rank cannot run
ahead of a slow peer by more than one group, which FSDP's all-gathers mostly impose anyway. Not
measured on GPUs here: there the compute per group is shorter, so the same host round trips weigh
more.

Known limitations:
    The agreements are armed only while a guarded training attempt runs: inside
    :func:`memguard.step`, and inside the micro-batches that the Lightning, Trainer and Accelerate
    adapters run through the guard (:mod:`memguard.guard._fsdp2_frameworks`,
    :mod:`memguard.guard._fsdp1`, :mod:`memguard.integrations._deepspeed_guard` subclass this group). FSDP
    collectives outside an attempt (an evaluation loop, a ``state_dict`` call) run as FSDP runs them;
    ``memguard.evaluate`` arms them for each of its forwards (:mod:`memguard.guard._evaluate_sharded`). Explicit forward prefetching
    (``set_modules_to_forward_prefetch``) and custom all-gather/reduce-scatter hooks are covered
    (they go through ``unshard``/``post_backward``). HSDP (a 2-D mesh: FSDP2 all-reduces over the
    replicas inside ``post_backward``) is refused: the agreement covers one mesh dimension. The
    protocol relies on every rank calling FSDP's collectives in the same order, as FSDP2 itself
    does; collectives the training code starts itself (a metric all-reduced inside the loss
    function) are not covered and can still hang when a peer fails before them.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from memguard.errors import OOMRecoveryError, PeerFailedError
from memguard.guard._distributed import OK, RankGroup
from memguard.guard._oom import is_oom_error, oom_summary

logger = logging.getLogger("memguard")

# The FSDPParamGroup methods that start FSDP2's collectives (torch 2.13,
# torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): all-gather and reduce-scatter (+ HSDP all-reduce).
_COLLECTIVE_METHODS = ("unshard", "post_backward")
_STORE_PREFIX = "memguard/fsdp2/stopped/"


class PeerAbort(Exception):
    """Raised inside FSDP's hook on a rank whose peer reported a failure at an agreement.

    Attributes:
        codes: every rank's outcome, as the agreement returned them.
        values: the agreed values (element-wise maximum).
    """

    def __init__(self, codes: list[int], values: list[int]):
        bad = [r for r, c in enumerate(codes) if c != OK]
        super().__init__(f"rank {', '.join(map(str, bad))} failed; leaving forward/backward at an agreement")
        self.codes = codes
        self.values = values


class ShardingStopped(Exception):
    """A failure that cannot be recovered: the process groups are torn down; ``error`` is what every rank raises."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def is_fsdp_model(model: nn.Module) -> bool:
    """Whether ``model`` (or a submodule) was sharded with ``fully_shard`` (FSDP2)."""
    return any(_fsdp_state_of(m) is not None for m in model.modules())


def _fsdp_state_of(module: nn.Module) -> Any:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:  # a torch without FSDP2
        return None
    return _get_module_fsdp_state(module)


def fsdp_states(model: nn.Module) -> list[Any]:
    """The distinct FSDP2 states of ``model``'s modules, root first (module order)."""
    out: list[Any] = []
    for m in model.modules():
        state = _fsdp_state_of(m)
        if state is not None and all(state is not s for s in out):
            out.append(state)
    return out


def _param_groups(states: Sequence[Any]) -> list[Any]:
    return [g for s in states for g in s._fsdp_param_groups]


@dataclass(eq=False)
class ShardedRankGroup(RankGroup):
    """The ranks of an FSDP2 model as the guard uses them (see the module docstring).

    Attributes:
        root: the root FSDP2 state (of the model given to :func:`sharded_rank_group`).
        states: every FSDP2 state of the model.
        sync_last_only: gradient synchronisation only on the last micro-batch of a window (ZeRO
            stage 1 under FSDP2: ``set_requires_gradient_sync(False)`` before the others).
        agreements: agreements run so far (for measuring their cost).
    """

    root: Any = None
    states: list = field(default_factory=list)
    model: Any = None
    sync_last_only: bool = False
    store: Any = None
    agreements: int = 0
    #: The framework whose collectives are guarded, as messages name it.
    framework: str = "FSDP2"
    #: What an unrecoverable OOM inside a collective tells the user to do.
    restart_advice: str = ("Restart the job with a smaller micro_batch_size (or activation checkpointing, or "
                           "reshard_after_forward=True)")
    #: The key-value store prefix under which a stopping rank records its error.
    store_prefix: str = _STORE_PREFIX
    _armed: bool = False
    _n_max: int = 0
    _mbs: int = 0
    _buf: Any = None
    _installed: bool = False

    # ---------------------------------------------------------------------------------- agreement

    def agree(self, code: int, values: Sequence[int] = ()) -> tuple[list[int], list[int]]:
        """One agreement (all-reduce MAX of every rank's code and ``values``) on the agreement group.

        Raises:
            ShardingStopped: the agreement failed: a peer tore the process groups down (its recorded
                error), or this rank could not take part (it then tears them down itself, see :meth:`stop`).
        """
        n = self.world_size + len(values)
        buf = self._buf
        if buf is None or buf.numel() != n:
            buf = self._buf = torch.zeros(n, dtype=torch.int32)
        buf.zero_()
        buf[self.rank] = code
        for i, v in enumerate(values):
            buf[self.world_size + i] = int(v)
        try:
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:
            if self.peer_stopped():  # a torn-down peer: read what it left in the store
                raise ShardingStopped(self.stopped_error(exc)) from exc
            # this rank's own failure (e.g. no memory left for the all-reduce): peers may wait in it
            raise ShardingStopped(self.stop(exc, f"memguard's agreement between {self.framework} collectives")) from exc
        self.agreements += 1
        out = buf.tolist()
        return out[: self.world_size], out[self.world_size:]

    @contextlib.contextmanager
    def armed(self, n_max: int, micro_batch_size: int = 0) -> Iterator[None]:
        """Run FSDP's collectives behind agreements for the duration of one attempt.

        Args:
            n_max: this rank's largest batch in the attempt (sent with every agreement).
            micro_batch_size: the attempt's micro-batch (named by an unrecoverable error).
        """
        self._armed, self._n_max, self._mbs = True, n_max, micro_batch_size
        try:
            yield
        finally:
            self._armed = False

    def _boundary(self) -> None:
        codes, values = self.agree(OK, [self._n_max])
        if max(codes) != OK:
            raise PeerAbort(codes, values)

    # ---------------------------------------------------------------------------------- installation

    def install(self) -> None:
        """Wrap every FSDP param group's collective methods with the agreement (idempotent)."""
        if self._installed:
            return
        for pg in _param_groups(self.states):
            for name in _COLLECTIVE_METHODS:
                original = getattr(pg, name)
                setattr(pg, name, self._guarded(original, name, pg))
        self._installed = True

    def _guarded(self, original: Callable[..., Any], name: str, pg: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._armed or self.world_size == 1:  # one rank: no peer to wait, an OOM here is recoverable
                return original(*args, **kwargs)
            self._boundary()
            try:
                return original(*args, **kwargs)
            except (PeerAbort, ShardingStopped):
                raise
            except Exception as exc:  # inside FSDP's collective path: a peer may already wait in it
                if self.peer_stopped():  # the collective failed because a peer tore the groups down
                    raise ShardingStopped(self.stopped_error(exc)) from exc
                what = "all-gather" if name == "unshard" else "reduce-scatter"
                where = f"FSDP2's {what} of {getattr(pg, '_module_fqn', None) or 'a group'}"
                raise ShardingStopped(self.stop(exc, where)) from exc
        call.__wrapped__ = original  # type: ignore[attr-defined]
        return call

    def uninstall(self) -> None:
        """Undo :meth:`install`."""
        for pg in _param_groups(self.states):
            for name in _COLLECTIVE_METHODS:
                pg.__dict__.pop(name, None)
        self._installed = False

    # ---------------------------------------------------------------------------------- micro-batches

    def before_micro_batch(self, last: bool) -> None:
        """Under ``sync_last_only``, synchronise gradients only in the last micro-batch's backward."""
        if self.sync_last_only and self.model is not None:
            self.model.set_requires_gradient_sync(last)

    # ---------------------------------------------------------------------------------- reset

    def reset(self, params: Sequence[nn.Parameter] = ()) -> None:
        """Reset FSDP2's per-step state after a failed attempt, on every rank (see the module docstring)."""
        self._armed = False
        if self.root is not None and self.root._is_root:
            self.root._reset_iter_state()
        else:  # forward never reached the root's lazy init: nothing ran yet
            for pg in _param_groups(self.states):
                pg._reset_iter_state()
        drop_partial_grads(self.states, params)
        if self.model is not None and self.sync_last_only:
            self.model.set_requires_gradient_sync(True)

    def reset_forward_state(self) -> None:
        """Reset FSDP2's per-iteration state after a failed forward-only attempt (an evaluation micro-batch).

        The first half of :meth:`reset`: the root state's ``_reset_iter_state`` (torch 2.13,
        ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``, ``FSDPState._reset_iter_state``: waits
        for issued all-gathers, drops their pending results, clears the post-forward order, sets every
        group to IDLE and reshards it). Gradients, gradient synchronisation and the accumulated
        unsharded gradients are left as they are: an evaluation does not make any, and must not drop
        those of a training step in progress.
        """
        self._armed = False
        if self.root is not None and self.root._is_root:
            self.root._reset_iter_state()
        else:  # forward never reached the root's lazy init: nothing ran yet
            for pg in _param_groups(self.states):
                pg._reset_iter_state()

    # ---------------------------------------------------------------------------------- stopping

    def _store_key(self) -> str:
        return f"{self.store_prefix}{self.src}"  # one key per group (a stop ends training in this process)

    def stop(self, exc: BaseException, where: str) -> BaseException:
        """Record ``exc`` in the store and tear the process groups down; the error this rank raises.

        The peers' pending collectives then fail, and :meth:`stopped_error` gives them the same error.
        """
        if is_oom_error(exc):
            payload = {"type": "OOMRecoveryError",
                       "message": f"out of memory inside {where} on rank {self.rank} ({oom_summary(exc)}); "
                       "an allocation failure inside a collective cannot be recovered without the ranks' "
                       "collectives going out of step, so every rank stops and the process groups are torn "
                       f"down. {self.restart_advice}", "rank": self.rank}
        else:
            payload = {"type": "PeerFailedError",
                       "message": f"rank {self.rank} failed inside {where} with {type(exc).__name__}: {exc} "
                       "(see that rank's log); the process groups are torn down so that no rank waits forever",
                       "rank": self.rank}
        try:
            if self.store is not None:
                self.store.set(self._store_key(), json.dumps(payload))
        except Exception as store_exc:  # the teardown below still unblocks the peers
            logger.warning("memguard could not record the failure in the store: %s", store_exc)
        logger.error("memguard: %s", payload["message"])
        _abort_all()
        if payload["type"] == "OOMRecoveryError":
            err: BaseException = OOMRecoveryError(payload["message"], micro_batch_size=self._mbs)
            err.__cause__ = exc
            return err
        return exc

    def peer_stopped(self) -> bool:
        """Whether a rank recorded an unrecoverable failure in the store (see :meth:`stop`)."""
        try:
            return self.store is not None and bool(self.store.check([self._store_key()]))
        except Exception:  # the store's host is gone: a peer died
            return True

    def stopped_error(self, exc: BaseException) -> BaseException:
        """The error a peer recorded before tearing the process groups down, or a PeerFailedError."""
        payload = None
        if self.store is not None:
            try:
                key = self._store_key()
                if self.store.check([key]):
                    payload = json.loads(self.store.get(key))
            except Exception:  # the store's host may be gone too
                payload = None
        if payload is None:
            return PeerFailedError(f"the connection to a peer was lost during {self.framework} training ({exc}); this "
                                   "rank stops too so that no rank waits forever", rank=-1)
        if payload["type"] == "OOMRecoveryError":
            return OOMRecoveryError(payload["message"], micro_batch_size=self._mbs)
        return PeerFailedError(payload["message"], rank=int(payload["rank"]))


def drop_partial_grads(states: Sequence[Any], params: Sequence[nn.Parameter] = ()) -> None:
    """Drop the partial gradients of a failed attempt: each FSDP2 parameter's unsharded accumulated gradient
    (a no-sync micro-batch's), its unsharded ``.grad`` and its sharded ``.grad``, and ``params``' ``.grad``."""
    for pg in _param_groups(states):
        for fp in pg.fsdp_params:
            fp.unsharded_accumulated_grad = None
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fp.sharded_param.grad = None
    for p in params:
        p.grad = None


def _abort_all() -> None:
    """Abort every process group of this process, so that peers blocked in a collective fail at once."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception as exc:  # fall back to destroying them
        logger.warning("memguard could not abort the process groups (%s); destroying them", exc)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def sharded_rank_group(model: nn.Module, *, sync_last_only: bool = False) -> ShardedRankGroup:
    """The :class:`ShardedRankGroup` of an FSDP2 ``model`` (the root ``fully_shard``-ed module).

    Every rank must call it (it may create a gloo group for the agreements).

    Raises:
        memguard.ConfigError: ``model`` is not an FSDP2 root, or its groups' meshes differ.
    """
    from memguard.errors import ConfigError

    root = _fsdp_state_of(model)
    if root is None:
        raise ConfigError("the model is not sharded with fully_shard at its root; shard it with "
                          "memguard.integrations.fsdp.apply(model, plan) or fully_shard(model) after its blocks")
    if not hasattr(root, "_reset_iter_state"):
        raise ConfigError("recovering from an OOM under FSDP2 needs FSDPState._reset_iter_state (torch 2.13 has it); "
                          "upgrade torch")
    states = fsdp_states(model)
    groups = {id(pg._all_gather_process_group): pg._all_gather_process_group
              for pg in _param_groups(states)} if _param_groups(states) else {}
    pgs = list(groups.values())
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    if any(isinstance(pg.mesh_info, DDPMeshInfo) for pg in _param_groups(states)):
        raise ConfigError("the model is sharded over a 2-D mesh (HSDP) or replicated; memguard recovers from OOM "
                          "under FSDP2 over one mesh dimension only (fully_shard(..., mesh=1-D mesh))")
    if len(pgs) > 1:
        raise ConfigError("the model's FSDP2 groups use different process groups; memguard recovers from OOM on "
                          "models sharded over one mesh dimension only")
    fsdp_group = pgs[0] if pgs else dist.group.WORLD
    world_size = dist.get_world_size(fsdp_group)
    rank = dist.get_rank(fsdp_group)
    backend = str(dist.get_backend(fsdp_group))
    agree_group = fsdp_group
    if "gloo" not in backend:  # host-side agreement: no device synchronisation at each boundary
        ranks = dist.get_process_group_ranks(fsdp_group)
        agree_group = dist.new_group(ranks, backend="gloo")
    src = dist.get_global_rank(fsdp_group, 0) if fsdp_group is not dist.group.WORLD else 0
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store: peers raise a PeerFailedError without the failing rank's details
        store = None
    rg = ShardedRankGroup(group=agree_group, world_size=world_size, rank=rank, src=src, device=torch.device("cpu"),
                          broadcast_buffers=False, root=root, states=states, model=model,
                          sync_last_only=sync_last_only, store=store)
    rg.install()
    return rg


