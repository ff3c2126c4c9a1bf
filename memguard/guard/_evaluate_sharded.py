"""Guarded evaluation of a sharded model (FSDP2, FSDP1, DeepSpeed ZeRO-3): every rank runs the same forwards,
and an OOM is recovered on all.

FSDP2 is the running example below; FSDP1 (:mod:`memguard.guard._fsdp1`: each unit's pre-forward
all-gather) and ZeRO-3 engines (``memguard.integrations._deepspeed_guard``: the parameter coordinator's
all-gathers) run the same steps with their own rank group, whose ``reset_forward_state`` puts their
units or parameters back after a failed forward. :func:`eval_rank_group` picks the group.

An FSDP2 (``fully_shard``) model all-gathers each group's parameters in its forward
(``FSDPParamGroup.pre_forward`` calls ``unshard``; torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``). If one rank split its evaluation
batch alone it would run more forwards, so more all-gathers, than its peers, and they would wait
for each other forever. :func:`split_eval_sharded` keeps the ranks in step:

1. **One agreement before the first forward** (an all-reduce, MAX, of ``world_size + 3`` int32
   values on the :class:`~memguard.guard._sharded.ShardedRankGroup`'s agreement group): every
   rank's outcome (a batch without a batch dimension is reported, so its peers raise
   :class:`~memguard.PeerFailedError` instead of waiting), the largest local batch, the smallest
   starting micro-batch (the explicit ``micro_batch_size`` or the remembered eval micro-batch of
   each rank; the largest local batch when no rank has one) and the smallest ``max_retries``. Every
   rank then cuts micro-batches at the same offsets, ``[start, start + size)`` of the largest batch:
   a rank whose own batch ends before ``start`` runs a *padding* forward on its first sample,
   whose result is discarded, so every rank runs the same number of forwards.
2. **Each forward runs with the agreement protocol armed** (:meth:`ShardedRankGroup.armed`: an
   agreement before each of FSDP's all-gathers, see :mod:`memguard.guard._sharded`) and ends with
   one agreement of its own. A rank that runs out of memory in a block's compute reports at its end
   agreement; its peers meet that report at their next all-gather's agreement
   (:class:`~memguard.guard._sharded.PeerAbort`) or at their own end agreement. Every rank then
   discards the micro-batch's results, resets FSDP2's per-iteration state
   (:meth:`ShardedRankGroup.reset_forward_state`, gradients untouched), halves the micro-batch and
   continues from the same ``start``, logging the retry on every rank.
3. **What cannot be made safe fails the same way on every rank**: an OOM inside FSDP's all-gather
   (after its agreement) tears the process groups down and every rank raises the same
   :class:`~memguard.OOMRecoveryError` (:meth:`ShardedRankGroup.stop`); an error that is not an
   OOM is raised on its rank and as :class:`~memguard.PeerFailedError` on the others.

A micro-batch's result is joined (:class:`memguard.guard._evaluate._Joiner`) before its end
agreement, so a join that runs out of memory is reported there too; a join of a micro-batch that a
peer failed is undone. One more agreement after the merge (``combine=`` or the joined result) makes
an error there fail every rank.

Cost: ``2 + forwards`` agreements plus one per all-gather (6 for a batch that fits, on a model of a
root and two block groups). Measured on 2 gloo ranks sharing a 2-core host under a load of ~9
(``tests/guard/fsdp2_eval_worker.py`` with ``time_calls``, medians, loss-only ``fn``): 64 samples x
256 positions per rank, 0.56/0.62 s per call against 0.49/0.47 s for the plain ``no_grad`` forward
(rank 0/1); 16 x 64, 0.087/0.094 s against 0.049/0.034 s. Each agreement is a host round trip that
waits for the slower rank, so the cost is a few milliseconds per agreement on such a host, not a
fraction of the forward. Not measured on GPUs.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import torch.distributed as dist
from torch import nn

from memguard.batch import batch_size
from memguard.errors import ConfigError, OOMRecoveryError, PeerFailedError
from memguard.guard._distributed import ERROR, OK, OOM
from memguard.guard._oom import (
    Halvings,
    free_memory,
    is_oom_error,
    oom_summary,
    release_exception,
    turn_off_onednn_after,
)
from memguard.guard._sharded import (
    PeerAbort,
    ShardedRankGroup,
    ShardingStopped,
    _fsdp_state_of,
    is_fsdp_model,
    sharded_rank_group,
)

log = logging.getLogger("memguard")

#: "None" in the agreement's min-encoded values (int32 all-reduce MAX of ``_NONE - value``).
_NONE = 1 << 30


def _peer_failed(codes: Sequence[int]) -> PeerFailedError:
    bad = list(codes).index(ERROR)
    return PeerFailedError(f"rank {bad} failed in evaluation with an error that is not an out-of-memory error (see "
                           "that rank's log); this rank stops too so that no rank waits forever", rank=bad)


def split_eval_sharded(
    batch: Any,
    run: Callable[[Any], Any],
    *,
    ranks: ShardedRankGroup,
    state: Any,
    micro_batch_size: int | None = None,
    weight_fn: Callable[[Any], Any] | None = None,
    combine: Callable[[Sequence[Any], Sequence[float]], Any] | None = None,
    max_retries: int | None = None,
    loss_only_hint: str | None = None,
) -> Any:
    """:func:`memguard.guard._evaluate.split_eval` for an FSDP2 model, on every rank of its group at once.

    Every rank must call it (with its own share of the evaluation batch, of any size); the arguments
    are :func:`~memguard.guard._evaluate.split_eval`'s, ``ranks`` the model's
    :class:`~memguard.guard._sharded.ShardedRankGroup`. ``state.padding_forwards`` counts the
    padding forwards this rank ran (see the module docstring).

    Returns:
        This rank's merged result, as :func:`~memguard.guard._evaluate.split_eval` gives it.

    Raises:
        ConfigError: this rank's batch has no batch dimension (its peers raise PeerFailedError).
        OOMRecoveryError: one sample does not fit, or the (agreed) ``max_retries`` OOMs happened, on
            any rank: every rank raises it; or an OOM inside FSDP's all-gather (every rank, the same
            message; the process groups are torn down).
        PeerFailedError: a peer failed with an error that is not an OOM.
        Exception: this rank's own error that is not an OOM.
    """
    try:
        return _split(batch, run, ranks, state, micro_batch_size, weight_fn, combine, max_retries, loss_only_hint)
    except ShardingStopped as stopped:
        raise stopped.error from None


def _split(batch: Any, run: Callable[[Any], Any], ranks: ShardedRankGroup, state: Any, micro_batch_size: int | None,
           weight_fn: Callable[[Any], Any] | None, combine: Any, max_retries: int | None,
           loss_only_hint: str | None) -> Any:
    from memguard.guard._evaluate import _LOSS_ONLY, _Joiner, _size_of, _slice, shape_signature

    code, problem, n, sig, cap = OK, None, 0, None, None
    try:
        n = batch_size(batch)
        sig = shape_signature(batch)
        cap = micro_batch_size or state.remembered(sig)
    except ConfigError as exc:
        code, problem = ERROR, exc
    retries = _NONE if max_retries is None else max_retries
    codes, values = ranks.agree(code, [n, _NONE - (cap or _NONE), _NONE - retries])
    if problem is not None:
        raise problem
    if max(codes) == ERROR:
        raise _peer_failed(codes)
    n_max = values[0]
    agreed_cap = _NONE - values[1] if values[1] else None
    agreed_retries = _NONE - values[2]
    size = agreed_cap or n_max
    halvings = Halvings(None if agreed_retries == _NONE else agreed_retries)
    hint = loss_only_hint or _LOSS_ONLY
    results: list[Any] = []
    weights: list[Any] = []
    joiner: _Joiner | None = None
    state.forwards = state.padding_forwards = 0
    start = 0
    while start < n_max:
        stop_all = min(start + size, n_max)   # the micro-batch as the ranks agree on it
        stop = min(stop_all, n)                # this rank's part of it (empty past its batch's end)
        real = start < n
        if not real:
            micro = _slice(batch, 0, 1)        # a padding forward: the same all-gathers as the peers' forwards
        elif (start, stop) == (0, n):
            micro = batch
        else:
            micro = _slice(batch, start, stop)
        code, error, summary, abort, snap, kept = OK, None, "", None, None, False
        try:
            with ranks.armed(n, stop_all - start):
                out = run(micro)
            if real:
                m = stop - start
                weight = weight_fn(micro) if weight_fn is not None else m
                if m == n or combine is not None:
                    results.append(out)
                    weights.append(weight)
                    kept = True
                else:
                    if joiner is None:
                        joiner = _Joiner(n, hint)
                    snap = joiner.snapshot()
                    joiner.add(out, start, stop, weight)
            del out
        except PeerAbort as exc:  # a peer's failure met this rank's agreement before an all-gather
            abort = exc
        except ShardingStopped:
            raise
        except Exception as exc:  # noqa: BLE001 - an OOM is retried; anything else reported, then raised
            if is_oom_error(exc):
                turn_off_onednn_after(exc)
                release_exception(exc)
                code, summary = OOM, oom_summary(exc)
                del exc
                free_memory()  # give the memory back before the agreement, which allocates a little
                if joiner is not None:
                    try:
                        if joiner.to_host():  # the joined outputs took the device memory: the retry runs without them
                            free_memory()
                    except OOMRecoveryError as too_large:
                        code, error = ERROR, too_large
            else:
                code, error = ERROR, exc
        if abort is not None:
            codes = abort.codes
        else:
            codes, _ = ranks.agree(code, [n])
        worst = max(codes)
        if worst == OK:
            if real:
                state.forwards += 1
            else:
                state.padding_forwards += 1
            start = stop_all
            continue
        # the micro-batch failed somewhere: undo it here, on every rank
        if kept:
            results.pop()
            weights.pop()
        if snap is not None and joiner is not None:
            joiner.restore(snap)
        ranks.reset_forward_state()
        if worst == ERROR:
            if code == ERROR:
                raise error  # type: ignore[misc]
            raise _peer_failed(codes)
        state.oom_retries += 1
        failed = stop_all - start
        where = ", ".join(str(r) for r, c in enumerate(codes) if c == OOM)
        detail = f" ({summary})" if code == OOM else ""
        if halvings.stop(failed) is not None:
            why = "one sample does not fit" if failed == 1 else f"{halvings.done + 1} OOMs in one evaluation"
            held = (f"; the outputs joined so far take {_size_of(list(joiner.joined.values()))} ({hint})"
                    if joiner is not None and joiner.joined else "")
            raise OOMRecoveryError(
                f"evaluation ran out of memory on rank {where}{detail} and cannot split further: {why}; evaluate "
                f"in a 16-bit precision, with shorter sequences, or drop the optimizer state during evaluation{held}",
                micro_batch_size=failed)
        free_memory()
        size = halvings.halve(failed)
        log.warning("memguard: OOM in evaluation at micro-batch %d on rank %s%s; every rank halves to %d and continues "
                    "from sample %d (training micro-batch unchanged)", failed, where, detail, size, start)
    if sig is not None and (agreed_cap is not None or halvings.done):
        state.remember(sig, size)  # the same size on every rank
    code, error, merged = OK, None, None
    try:
        if joiner is not None:
            merged = joiner.result()
        elif len(results) == 1:
            merged = results[0]
        elif results:
            try:
                merged = combine(results, weights)
            except Exception as exc:  # noqa: BLE001 - only an OOM is turned into memguard's error
                if not is_oom_error(exc):
                    raise
                raise OOMRecoveryError(f"evaluation's outputs cannot be joined: combine= ran out of memory "
                                       f"({oom_summary(exc)}); {hint}", micro_batch_size=size) from exc
    except Exception as exc:  # noqa: BLE001 - reported to the peers, then raised
        code, error = ERROR, exc
    codes, _ = ranks.agree(code, [n])
    if code == ERROR:
        raise error  # type: ignore[misc]
    if max(codes) == ERROR:
        raise _peer_failed(codes)
    return merged


# The rank groups made by eval_rank_group for sharded models that memguard.prepare did not see.
_GROUPS: "weakref.WeakKeyDictionary[nn.Module, ShardedRankGroup]" = weakref.WeakKeyDictionary()

#: Front-end modules that find the rank group of their framework's sharded models, by the top-level package of
#: the model's class: each defines ``eval_rank_group(model) -> ShardedRankGroup | None``. They import the
#: framework, which the guard core does not; they are imported only for a model of that framework.
_FRAMEWORK_GROUPS = {"deepspeed": "memguard.integrations._deepspeed_guard"}


def eval_rank_group(model: nn.Module) -> ShardedRankGroup | None:
    """The :class:`ShardedRankGroup` that :func:`memguard.evaluate` runs ``model``'s forwards under, or None.

    None unless ``torch.distributed`` is initialised with more than one rank in the model's group and the
    model's forward starts collectives: a model with ``fully_shard`` applied (FSDP2), an FSDP1
    ``FullyShardedDataParallel`` module, or a DeepSpeed ZeRO-3 engine (the first value ``deepspeed.initialize``
    returns; ZeRO-0/1/2 forwards start no collective, so each rank splits alone as under DDP). The group of
    ``memguard.prepare(..., strategy="fsdp2")``, of a framework adapter or of ``integrations.deepspeed.step`` is
    reused; for any other model one is made on the first call (every rank must make that call: it may create a
    gloo group for the agreements) and kept with the model.

    Raises:
        ConfigError: ``model`` has FSDP2 submodules but is not the FSDP2 root (pass the root module,
            the one ``fully_shard`` was applied to last), or uses a 2-D mesh (HSDP); an FSDP1 model under
            HYBRID_SHARD or CPU offload; a ZeRO-3 module that is not its engine (pass the engine).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    framework = _FRAMEWORK_GROUPS.get(type(model).__module__.split(".")[0])
    if framework is not None or any(hasattr(p, "ds_id") for p in model.parameters()):
        import importlib

        return importlib.import_module(_FRAMEWORK_GROUPS["deepspeed"]).eval_rank_group(model)
    from memguard.guard import _fsdp1

    if _fsdp1.is_fsdp1_model(model):
        # the group guarding these units now (a framework adapter's, whose wrappers look it up by unit), else a new one
        rg = _fsdp1._GROUPS.get(id(_fsdp1._fsdp1_states(model)[0])) or _fsdp1.fsdp1_rank_group(model)
        return rg if rg is not None and rg.world_size > 1 else None
    if not is_fsdp_model(model):
        from memguard.guard._tp import prepared_tensor_parallel_group

        tp = prepared_tensor_parallel_group(model)  # memguard.prepare's TP agreements (memguard.guard._tp)
        return tp if tp is not None and tp.world_size > 1 else None
    from memguard.guard._core import _GUARDS

    try:
        guard = _GUARDS.get(model)
    except TypeError:  # not weakly referenceable: cannot have been prepared
        guard = None
    rg = getattr(guard, "rank_group", None)
    if not isinstance(rg, ShardedRankGroup):
        rg = _GROUPS.get(model)
    if rg is None:
        if _fsdp_state_of(model) is None:
            raise ConfigError("memguard.evaluate was given a module whose submodules are sharded with fully_shard "
                              "but which is not itself the FSDP2 root; pass the root module (the one fully_shard "
                              "was applied to last, or the model memguard.prepare(..., strategy='fsdp2') returned)")
        rg = sharded_rank_group(model)
        _GROUPS[model] = rg
    return rg if rg is not None and rg.world_size > 1 else None
