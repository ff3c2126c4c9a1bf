"""Guarded evaluation: run an eval batch in micro-batches when it does not fit, with the unsplit result.

Validation often runs with a larger batch than training (no gradients, so it "should" fit) and then
OOMs where training did not. :func:`evaluate` runs the batch through the model in micro-batches of
at most the planned (or remembered) eval micro-batch; on a real OOM it frees the failed attempt,
halves the micro-batch and continues from the micro-batch that failed, so every sample is evaluated
exactly once. The results are merged so that the metric equals the unsplit one
(:func:`combine_outputs`): per-sample tensors are concatenated along dim 0 in order, and a 0-dim
result (a mean loss) is the mean of the micro-batches' means weighted by their sample counts (or by
``weight_fn``, e.g. the tokens a token-mean loss averaged over).

The evaluation's micro-batch lives in its own state, per model and exact batch shape (the exact
signatures of :mod:`memguard.guard._shapes`, dtypes included): an eval OOM never
changes the training micro-batch of :func:`memguard.step`, the Lightning callback or the
Accelerate hooks (the guard core is not touched). :func:`split_eval` is the framework-free core
that the Lightning callback's validation and test hooks call with the user's own step.

Sharded models: for a model sharded with FSDP2 (``fully_shard``; prepared by
``memguard.prepare(..., strategy="fsdp2")`` or not) on more than one rank, :func:`evaluate` must be
called on every rank of its group at once, and the ranks split together
(:mod:`memguard.guard._evaluate_sharded`): they agree on the micro-batch and on the number of
forwards (a rank with fewer samples runs padding forwards, whose results are discarded), run each
forward with FSDP2's all-gathers behind memguard's agreements, and on an OOM on any rank halve
together and continue from the micro-batch that failed (logged on every rank). An OOM inside an
all-gather stops every rank with the same :class:`OOMRecoveryError`.

Known limitations:
    Under FSDP2, an OOM on a rank while its joined outputs are on the device moves them to the host
    and halves (a single process retries the same micro-batch first). Other sharded models — FSDP1,
    DeepSpeed ZeRO-3, tensor or pipeline parallel ones, HSDP (a 2-D mesh) — still split on each rank
    independently, which is only safe while no rank splits: evaluate them with a planned
    ``micro_batch_size``, the same on every rank. A collective that ``fn`` runs itself (a metric
    all-reduced per micro-batch) is not behind an agreement and can hang when a peer fails before it.

Joining the outputs (:class:`_Joiner`): the pieces and the whole are never held at once. When the
first micro-batch's result arrives, each per-sample tensor of the whole batch is allocated once,
with that piece's dtype and non-batch shape, and every piece is copied into its rows as it comes
and then dropped, so the outputs cost their joined size plus one micro-batch's. Where the joined
tensor does not fit on the model's device (its allocation, or a later micro-batch's forward, runs
out of memory), the joined tensors are moved to host (CPU) memory and the pieces copied there;
the result then lives on the CPU. Where it does not fit there either, :class:`OOMRecoveryError`
says so and names the way out: a ``fn`` that returns the loss (or metrics reduced per micro-batch)
instead of the outputs. A per-sample tensor whose dim 0 is not a multiple of the micro-batch's
samples is kept per piece and concatenated at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from memguard.batch import batch_size, call_model, map_tensors
from memguard.errors import ConfigError, OOMRecoveryError
from memguard.guard._oom import (
    Halvings,
    free_memory,
    is_oom_error,
    oom_summary,
    release_exception,
    released_oom,
    turn_off_onednn_after,
)
from memguard.guard._shapes import Signature, signature_of

log = logging.getLogger("memguard")

#: Batch shapes remembered per model (least recently used dropped first): one per sequence length
#: of a variable-length validation set is enough in practice, and the state stays small.
_MAX_SIGNATURES = 64


def shape_signature(batch: Any) -> tuple:
    """The non-batch shapes and dtypes of ``batch``'s tensors: batches with the same signature need
    the same memory per sample, so they share an eval micro-batch (the :meth:`Signature.key` of
    ``signature_of(batch, exact=True)``)."""
    return signature_of(batch, exact=True).key()


@dataclasses.dataclass
class EvalStatus:
    """The evaluation guard's state for one model.

    Attributes:
        micro_batch_size: per shape signature, the eval micro-batch that worked last (after any
            halving): the next eval batch of that shape starts from it instead of OOMing again, and
            a new, smaller shape starts from a larger one's size, scaled (see :meth:`remembered`).
        oom_retries: OOMs recovered from during evaluation, in total.
        forwards: forwards run by the last :func:`evaluate` call (1 when the batch fitted whole),
            on this rank's samples.
        padding_forwards: forwards of the last call on a sharded model whose results were discarded:
            this rank had fewer samples than a peer and ran them so that every rank runs the same
            forwards (see :mod:`memguard.guard._evaluate_sharded`).
    """

    micro_batch_size: "OrderedDict[tuple, int]" = dataclasses.field(default_factory=OrderedDict)
    oom_retries: int = 0
    forwards: int = 0
    padding_forwards: int = 0

    def remembered(self, signature: tuple) -> int | None:
        """The micro-batch to start from for ``signature``: its own if known; else, from a known
        signature at least as large in every dim (:meth:`Signature.covers`), that one's size scaled by
        how much smaller the inputs that differ are (:meth:`Signature.scaled`); else None (the whole
        batch is tried)."""
        size = self.micro_batch_size.get(signature)
        if size is not None:
            self.micro_batch_size.move_to_end(signature)
            return size
        want = Signature.from_key(signature)
        known = [Signature.from_key(k).scaled(n, want) for k, n in self.micro_batch_size.items()
                 if Signature.from_key(k).covers(want)]
        return max(known) if known else None

    def remember(self, signature: tuple, size: int) -> None:
        self.micro_batch_size[signature] = size
        self.micro_batch_size.move_to_end(signature)
        while len(self.micro_batch_size) > _MAX_SIGNATURES:
            self.micro_batch_size.popitem(last=False)


_STATES: "weakref.WeakKeyDictionary[Any, EvalStatus]" = weakref.WeakKeyDictionary()


def eval_status(owner: Any) -> EvalStatus:
    """The evaluation state of ``owner`` (a model, or any object a front-end keys it by), created empty."""
    state = _STATES.get(owner)
    if state is None:
        state = _STATES[owner] = EvalStatus()
    return state


def _slice(batch: Any, start: int, stop: int) -> Any:
    return map_tensors(batch, lambda t: t[start:stop] if t.dim() > 0 else t)


def split_eval(
    batch: Any,
    run: Callable[[Any], Any],
    *,
    state: EvalStatus,
    micro_batch_size: int | None = None,
    weight_fn: Callable[[Any], Any] | None = None,
    combine: Callable[[Sequence[Any], Sequence[float]], Any] | None = None,
    max_retries: int | None = None,
    loss_only_hint: str | None = None,
    ranks: Any = None,
) -> Any:
    """Run ``run(micro_batch)`` over ``batch`` in micro-batches, halving on an OOM; merge the results.

    This is the framework-free core of :func:`evaluate` and of the Lightning callback's validation
    and test hooks: it sets no grad mode and no train/eval mode (the caller does).

    Args:
        batch: the evaluation batch (see :mod:`memguard.batch`).
        run: ``run(micro_batch) -> result`` (the forward and whatever the step returns).
        state: where the micro-batch per shape signature and the OOM count are kept.
        micro_batch_size: start from this many samples per forward (a plan's); None: what
            ``state`` remembers for this batch's shape, else the whole batch.
        weight_fn: ``weight_fn(micro_batch) -> weight`` of a micro-batch's 0-dim results (default:
            its sample count); e.g. the number of labelled tokens for a token-mean loss.
        combine: ``combine(results, weights) -> result`` of every result at once, instead of the
            default join (:func:`combine_outputs`' rules, applied as each result comes: :class:`_Joiner`).
        max_retries: give up after this many OOMs in this call (None: until one sample fails).
        loss_only_hint: what an error about outputs too large to join tells the user to do instead,
            in the front-end's terms (default: :func:`evaluate`'s loss-only ``fn``).
        ranks: for a model sharded with FSDP2, its
            :class:`~memguard.guard._sharded.ShardedRankGroup`
            (:func:`~memguard.guard._evaluate_sharded.eval_rank_group`): every rank of it must call
            this at once, and the ranks split, pad and halve together
            (:func:`~memguard.guard._evaluate_sharded.split_eval_sharded`). None: this rank alone.

    Returns:
        The merged result; exactly ``run(batch)``'s result when the batch runs whole.

    Raises:
        ConfigError: ``batch`` has no batch dimension or its tensors disagree on it, or
            ``micro_batch_size`` is not a positive int.
        OOMRecoveryError: one sample does not fit, or ``max_retries`` OOMs happened (raised from
            the last OOM); or the merged result does not fit in memory (the joined tensors, or
            ``combine``'s own allocations): the message names the loss-only alternative.
        Exception: any other error of ``run``, unchanged.
        PeerFailedError: with ``ranks``, a peer failed with an error that is not an OOM.
    """
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ConfigError(f"micro_batch_size={micro_batch_size!r} must be a positive int or None")
    if ranks is not None:
        from memguard.guard._evaluate_sharded import split_eval_sharded

        return split_eval_sharded(batch, run, ranks=ranks, state=state, micro_batch_size=micro_batch_size,
                                  weight_fn=weight_fn, combine=combine, max_retries=max_retries,
                                  loss_only_hint=loss_only_hint)
    state.padding_forwards = 0
    n = batch_size(batch)
    sig = shape_signature(batch)
    cap = micro_batch_size or state.remembered(sig)
    size = cap or n  # may exceed n: each micro-batch is cut at n below, and a cap is remembered whole
    results: list[Any] = []  # with combine=: every result, for it; else the joiner takes each as it comes
    weights: list[Any] = []
    joiner: _Joiner | None = None
    hint = loss_only_hint or _LOSS_ONLY
    start, halvings = 0, Halvings(max_retries)
    state.forwards = 0
    while start < n:
        stop = min(start + size, n)
        micro = batch if (start, stop) == (0, n) else _slice(batch, start, stop)
        try:
            out = run(micro)
        except Exception as exc:  # noqa: BLE001 - only OOMs are handled; everything else re-raised
            if not is_oom_error(exc):
                raise
            turn_off_onednn_after(exc)
            release_exception(exc)
            state.oom_retries += 1
            failed = stop - start
            summary = oom_summary(exc)
            if joiner is not None and joiner.to_host():
                # the joined outputs took the device memory: the same micro-batch again, now that they are on the host
                del exc, micro
                free_memory()
                log.warning("memguard: OOM in evaluation at micro-batch %d (%s); retrying it with the joined outputs "
                            "in host memory (training micro-batch unchanged)", failed, summary)
                continue
            if halvings.stop(failed) is not None:
                why = "one sample does not fit" if failed == 1 else f"{halvings.done + 1} OOMs in one evaluation"
                held = (f"; the outputs joined so far take {_size_of(list(joiner.joined.values()))} ({hint})"
                        if joiner is not None and joiner.joined else "")
                raise OOMRecoveryError(
                    f"evaluation ran out of memory and cannot split further: {why} ({summary}); evaluate in a "
                    f"16-bit precision, with shorter sequences, or drop the optimizer state during evaluation{held}",
                    micro_batch_size=failed,
                ) from exc
            del exc, micro
            free_memory()
            size = halvings.halve(failed)
            log.warning("memguard: OOM in evaluation at micro-batch %d (%s); halving to %d (training "
                        "micro-batch unchanged)", failed, summary, size)
            continue
        m = stop - start
        weight = weight_fn(micro) if weight_fn is not None else m
        state.forwards += 1
        if m == n:  # the whole batch in one forward: its result as it is
            results.append(out)
        elif combine is not None:
            results.append(out)
            weights.append(weight)
        else:
            if joiner is None:
                joiner = _Joiner(n, hint)
            joiner.add(out, start, stop, weight)
        del out, micro  # a piece is not held past its copy into the joined result
        start = stop
    if cap is not None or halvings.done:
        # Only a cap or an OOM says how large a micro-batch may be: a batch that ran whole, or a short
        # last batch, must not shrink what the next, full batches start from.
        state.remember(sig, size)
    if joiner is not None:
        return joiner.result()
    if len(results) == 1:
        return results[0]
    try:
        return combine(results, weights)
    except Exception as exc:  # noqa: BLE001 - only an OOM is turned into memguard's error
        summary = released_oom(exc)
        raise OOMRecoveryError(f"evaluation's outputs cannot be joined: combine= ran out of memory ({summary}); "
                               f"{hint}", micro_batch_size=size) from exc


def step_in_micro_batches(
    user_step: Callable[..., Any],
    batch: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    state: EvalStatus,
    before_micro: Callable[[Any], None] | None = None,
    micro_batch_size: int | None = None,
    max_retries: int | None = None,
    loss_only_hint: str | None = None,
    ranks: Any = None,
) -> Any:
    """A framework's evaluation step (``validation_step(batch, batch_idx)``) run on micro-batches.

    What the Lightning callback's validation and test hooks call in place of the user's step: the
    framework has already set the grad mode and ``eval()``; ``user_step(micro, *args, **kwargs)``
    runs per micro-batch, its return values merged by :func:`combine_outputs` (None stays None).

    Args:
        user_step: the user's step.
        batch: the evaluation batch the framework passed.
        args, kwargs: the step's other arguments (``batch_idx``, ``dataloader_idx``).
        state: the model's :class:`EvalStatus` (:func:`eval_status`).
        before_micro: called with each micro-batch before the step, e.g. to make the framework's
            logging weight a logged mean by the micro-batch's size.
        micro_batch_size, max_retries, loss_only_hint, ranks: as for :func:`split_eval` (an adapter
            evaluating an FSDP2 module passes ``ranks=eval_rank_group(module)``, from
            :mod:`memguard.guard._evaluate_sharded`, on every rank).

    Returns:
        The merged return value of the step.

    Raises:
        As :func:`split_eval`.
    """
    kwargs = dict(kwargs or {})

    def run(micro: Any) -> Any:
        if before_micro is not None:
            before_micro(micro)
        return user_step(micro, *args, **kwargs)

    return split_eval(batch, run, state=state, micro_batch_size=micro_batch_size, max_retries=max_retries,
                      loss_only_hint=loss_only_hint, ranks=ranks)


@contextlib.contextmanager
def _eval_mode(model: nn.Module, on: bool) -> Iterator[None]:
    """``model.eval()`` for the block, each module's own ``training`` flag restored after."""
    if not on:
        yield
        return
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in flags:
            m.training = was


def evaluate(
    model: nn.Module,
    batch: Any,
    fn: Callable[[nn.Module, Any], Any] | None = None,
    *,
    micro_batch_size: int | None = None,
    plan: Any = None,
    weight_fn: Callable[[Any], Any] | None = None,
    combine: Callable[[Sequence[Any], Sequence[float]], Any] | None = None,
    inference_mode: bool = False,
    eval_mode: bool = True,
    max_retries: int | None = None,
) -> Any:
    """Evaluate ``model`` on ``batch`` without running out of memory; the result is the unsplit one.

    ``fn(model, micro_batch)`` (default: call the model with the batch, as :func:`memguard.step`
    does) runs under ``torch.no_grad()`` (or ``torch.inference_mode()``) with the model in
    ``eval()`` mode, on micro-batches of at most ``micro_batch_size`` samples (or the ``plan``'s,
    or the size remembered for this batch shape, or the whole batch); on an OOM the micro-batch
    that failed is halved and evaluation continues from it. The results are merged by
    :func:`combine_outputs`: per-sample tensors concatenated along dim 0, 0-dim results
    (mean losses) averaged with the micro-batches' sample counts (or ``weight_fn``) as weights, so
    ``evaluate(model, batch).loss`` equals ``model(**batch).loss`` and the logits are the same.

    The joined outputs are built without holding the pieces and the whole at once: each per-sample
    tensor of the whole batch is allocated when the first micro-batch's result arrives and every
    piece is copied in and dropped. It is on the model's device, or in host (CPU) memory when it
    does not fit there (its allocation, or a later forward next to it, runs out of memory; logged).
    For outputs too large for that, return only what the metric needs from ``fn`` (the loss, or
    metrics reduced per micro-batch): ``fn=lambda m, b: m(**b).loss``.

    Example::

        for batch in val_loader:
            out = memguard.evaluate(model, batch)          # a transformers ModelOutput
            metric.update(out.logits.argmax(-1), batch["labels"])

    Args:
        model: the model (moved nowhere; its train/eval flags are restored afterwards).
        batch: one evaluation batch (see :mod:`memguard.batch`), already on the model's device.
        fn: ``fn(model, micro_batch) -> result``; None calls the model.
        micro_batch_size: the most samples per forward, e.g. the eval plan's.
        plan: an evaluation :class:`~memguard.Plan` (``memguard.plan(..., train=False)``): its
            ``micro_batch_size`` is used when ``micro_batch_size`` is None.
        weight_fn: ``weight_fn(micro_batch) -> weight`` of 0-dim results (default: samples).
            For a loss that averages over labelled tokens (transformers' causal LM loss ignores
            label -100 and the first position), pass the count of those tokens to get the exact
            unsplit mean.
        combine: ``combine(results, weights) -> result`` to merge results another way.
        inference_mode: run under ``torch.inference_mode()`` instead of ``torch.no_grad()``.
        eval_mode: put the model in ``eval()`` mode for the call (default True).
        max_retries: give up after this many OOMs in one call (None: until one sample fails).
            Under FSDP2 the ranks use the smallest ``max_retries`` and ``micro_batch_size`` of any rank.

    Returns:
        The merged result (see :func:`combine_outputs`).

    Raises:
        ConfigError: bad arguments (all listed at once), or results that cannot be merged
            (pass ``combine=``).
        OOMRecoveryError: a single sample does not fit, ``max_retries`` was exceeded, or the joined
            outputs do not fit in device or host memory (the message names the loss-only ``fn``).
            Under FSDP2, on every rank when it happens on one, or on an OOM inside an all-gather.
        PeerFailedError: under FSDP2, a peer failed with an error that is not an OOM.

    Under FSDP2 on several ranks every rank must call this at once (each with its own share of
    the batch, of any size); see the module docstring.

    Known limitations:
        See the module docstring (sharded models, joining the outputs). Values that depend on
        the whole batch at once (batch-norm in train mode, a loss normalised by the batch's
        maximum) differ when split; with ``eval_mode=True`` batch-norm uses its running stats.
    """
    problems = []
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if fn is not None and not callable(fn):
        problems.append(f"fn must be a callable(model, batch) -> result, got {type(fn).__name__}")
    if plan is not None:
        reasons = getattr(plan, "reasons", {})
        if not hasattr(plan, "micro_batch_size"):
            problems.append(f"plan must be a memguard.Plan, got {type(plan).__name__}")
        elif "mode" not in reasons:
            log.info("memguard: evaluate() was given a training plan; its micro-batch %d is used as the eval "
                     "micro-batch (an eval plan, memguard.plan(..., train=False), usually allows more)",
                     plan.micro_batch_size)
    for name, value in (("inference_mode", inference_mode), ("eval_mode", eval_mode)):
        if not isinstance(value, bool):
            problems.append(f"{name}={value!r} must be True or False")
    if max_retries is not None and not (isinstance(max_retries, int) and max_retries >= 0):
        problems.append(f"max_retries={max_retries!r} must be a non-negative int or None")
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        problems.append(f"micro_batch_size={micro_batch_size!r} must be a positive int or None")
    if problems:
        raise ConfigError(problems)
    if micro_batch_size is None and plan is not None:
        micro_batch_size = plan.micro_batch_size

    def run(micro: Any) -> Any:
        return fn(model, micro) if fn is not None else call_model(model, micro)

    from memguard.guard._evaluate_sharded import eval_rank_group

    ranks = eval_rank_group(model)  # an FSDP2 model on several ranks: they split together
    grad = torch.inference_mode() if inference_mode else torch.no_grad()
    with _eval_mode(model, eval_mode), grad:
        return split_eval(batch, run, state=eval_status(model), micro_batch_size=micro_batch_size,
                          weight_fn=weight_fn, combine=combine, max_retries=max_retries, ranks=ranks)


def _weighted_mean(values: Sequence[Any], weights: Sequence[Any]) -> Any:
    total = sum(float(w) for w in weights)
    if isinstance(values[0], torch.Tensor):
        acc = None
        for v, w in zip(values, weights):
            term = v.to(torch.float64) * float(w) if v.is_floating_point() else v * float(w)
            acc = term if acc is None else acc + term
        return (acc / total).to(values[0].dtype)
    return sum(float(v) * float(w) for v, w in zip(values, weights)) / total


def combine_outputs(results: Sequence[Any], weights: Sequence[Any], *, path: str = "result") -> Any:
    """Merge the results of consecutive micro-batches into the result of the whole batch.

    Per leaf, matched across the results by position in the same structure:

    * a tensor with dims: concatenated along dim 0 (its dim 0 is the samples);
    * a 0-dim floating tensor or a Python float: the weighted mean (the micro-batch's mean, weighted
      by its sample count or ``weight_fn``), computed in float64;
    * None, a string, an int or a bool that is the same in every result: kept;
    * mappings (``dict``, transformers' ``ModelOutput``), tuples (named too), lists and dataclasses:
      merged entry by entry and rebuilt as the same type;
    * a transformers key/value cache (``past_key_values`` of a model called with ``use_cache``):
      None, logged; an evaluation does not need it (``use_cache=False`` avoids building it).

    This takes every result at once (for a ``combine=`` of one's own to fall back on);
    :func:`split_eval` itself joins as the results come (:class:`_Joiner`), by the same rules.

    Args:
        results: one result per micro-batch, in batch order.
        weights: the weight of each result's 0-dim values.
        path: where in the result this is (for error messages).

    Returns:
        The merged result.

    Raises:
        ConfigError: results whose structure differs, or a leaf that none of the rules merges
            (a 0-dim integer tensor, differing ints or strings); pass ``combine=``.
    """
    kv_paths: list[str] = []

    def leaf(where: str, values: Sequence[Any]) -> Any:
        if _is_kv_cache(values[0]):
            kv_paths.append(where)
            return None
        return _merge_leaf(where, values, weights)

    merged = _zip_map(list(results), leaf, path)
    _log_kv_caches(kv_paths)
    return merged


def _log_kv_caches(paths: Sequence[str]) -> None:
    for where in paths:
        log.info("memguard: %s is a key/value cache, which is not merged across micro-batches: the merged result "
                 "holds None there (call the model with use_cache=False not to build it at all)", where)


def _zip_map(results: list, leaf: Callable[[str, list], Any], path: str, rebuild: bool = True) -> Any:
    """Walk ``results`` (the same structure each) in parallel and rebuild the first's structure, its
    leaves ``leaf(path, [the results' leaves there])`` (``rebuild=False``: only walk, return None).
    The containers are :func:`combine_outputs`'."""
    first = results[0]
    if isinstance(first, torch.Tensor) or first is None or isinstance(first, (str, bytes, bool, int, float)):
        return leaf(path, results)
    if isinstance(first, Mapping):
        keys = list(first.keys())
        if any(not isinstance(r, Mapping) or list(r.keys()) != keys for r in results):
            raise ConfigError(f"{path} has different keys in different micro-batches; pass combine=")
        merged = {k: _zip_map([r[k] for r in results], leaf, f"{path}[{k!r}]", rebuild) for k in keys}
        return _rebuild_mapping(first, merged) if rebuild else None
    if isinstance(first, (tuple, list)):
        if any(not isinstance(r, (tuple, list)) or len(r) != len(first) for r in results):
            raise ConfigError(f"{path} has different lengths in different micro-batches; pass combine=")
        items = [_zip_map([r[i] for r in results], leaf, f"{path}[{i}]", rebuild) for i in range(len(first))]
        if not rebuild:
            return None
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    if _is_kv_cache(first):
        return leaf(path, results)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(r) is not type(first) for r in results):
            raise ConfigError(f"{path} is a {type(first).__name__} in some micro-batches only; pass combine=")
        merged = {f.name: _zip_map([getattr(r, f.name) for r in results], leaf, f"{path}.{f.name}", rebuild)
                  for f in dataclasses.fields(first)}
        return dataclasses.replace(first, **merged) if rebuild else None
    raise ConfigError(f"{path} is a {type(first).__name__}, which memguard cannot merge across micro-batches; "
                      "pass combine=lambda results, weights: ...")


def _merge_leaf(path: str, values: Sequence[Any], weights: Sequence[Any]) -> Any:
    """:func:`combine_outputs`'s rule for one leaf, given its value in every result."""
    first = values[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(r, torch.Tensor) for r in values):
            raise ConfigError(f"{path} is a tensor in some micro-batches only; pass combine=")
        if first.dim() == 0:
            if not first.is_floating_point():
                raise ConfigError(f"{path} is a 0-dim {first.dtype} tensor, which is neither per-sample nor a mean; "
                                  "pass combine=lambda results, weights: ...")
            return _weighted_mean(values, weights)
        return torch.cat(list(values), dim=0)
    if first is None or isinstance(first, (str, bytes, bool, int)) and not isinstance(first, float):
        if any(r != first for r in values):
            raise ConfigError(f"{path} differs between micro-batches ({values[0]!r} vs others) and memguard "
                              "cannot merge it; pass combine=")
        return first
    if isinstance(first, float):
        return _weighted_mean(values, weights)
    raise ConfigError(f"{path} is a {type(first).__name__}, which memguard cannot merge across micro-batches; "
                      "pass combine=lambda results, weights: ...")


#: What an :class:`OOMRecoveryError` about joined outputs tells the user to do instead.
_LOSS_ONLY = ("evaluate with a fn that returns only what the metric needs, reduced per micro-batch, e.g. "
              "memguard.evaluate(model, batch, fn=lambda m, b: m(**b).loss) (0-dim results are averaged, "
              "nothing per-sample is kept), or pass combine= to reduce the results another way")


class _Joiner:
    """The default join of :func:`split_eval`, fed one micro-batch's result at a time.

    The first result fixes the structure. Each tensor leaf with dims whose dim 0 is a multiple ``r``
    of the micro-batch's samples gets one tensor for the whole batch (``r * n`` rows, the piece's
    dtype and other dims) on the piece's device, or on the CPU when that allocation runs out of
    memory; every piece is copied into its rows and not kept. Other tensors with dims are kept per
    piece and concatenated at the end. 0-dim floats are summed in float64 with their weights;
    constants are compared. :meth:`to_host` moves the joined tensors to the CPU (the caller does so
    when a forward runs out of memory while they take device memory).
    """

    def __init__(self, n: int, hint: str = _LOSS_ONLY) -> None:
        self.n = n
        self.hint = hint
        self.structure: Any = None          # the first result, its joined leaves in place
        self.rows: dict[str, int] = {}      # path -> rows per sample of a joined tensor
        self.joined: dict[str, torch.Tensor] = {}
        self.pieces: dict[str, list[torch.Tensor]] = {}
        self.sums: dict[str, list[Any]] = {}  # path -> [sum of value x weight (float64), total weight, kind]
        self.kv_paths: list[str] = []
        self.moved: list[str] = []          # paths moved to host memory
        self.micro = n                      # the micro-batch of the last result added

    def add(self, out: Any, start: int, stop: int, weight: Any) -> None:
        m = self.micro = stop - start
        if self.structure is None:
            self.structure = _zip_map([out], lambda path, vs: self._first(path, vs[0], m, weight), "result")
        else:
            if self.kv_paths:  # dropped from the structure (a ModelOutput drops a key set to None): drop them here too
                out = _zip_map([out], lambda path, vs: None if _is_kv_cache(vs[0]) else vs[0], "result")
            _zip_map([self.structure, out], lambda path, vs: self._next(path, vs[1], start, m, weight), "result",
                     rebuild=False)

    def snapshot(self) -> tuple:
        """What :meth:`restore` needs to undo the next :meth:`add` (a sharded evaluation adds a result
        before the ranks agree that the micro-batch succeeded everywhere)."""
        return (self.structure is None, {p: list(v) for p, v in self.sums.items()},
                {p: len(v) for p, v in self.pieces.items()}, self.micro)

    def restore(self, snap: tuple) -> None:
        """Undo the :meth:`add` after :meth:`snapshot` (the joined rows it wrote are written again by the
        retry of the same samples)."""
        empty, sums, pieces, micro = snap
        if empty:
            self.__init__(self.n, self.hint)  # type: ignore[misc]
            return
        self.sums = sums
        for p, count in pieces.items():
            del self.pieces[p][count:]
        self.micro = micro

    def _first(self, path: str, value: Any, m: int, weight: Any) -> Any:
        if _is_kv_cache(value):
            self.kv_paths.append(path)
            return None
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                if not value.is_floating_point():
                    raise ConfigError(f"{path} is a 0-dim {value.dtype} tensor, which is neither per-sample nor a "
                                      "mean; pass combine=lambda results, weights: ...")
                self.sums[path] = [_weighted(value.detach().to(torch.float64), weight), float(weight), value.dtype]
                return value
            if value.shape[0] % m or value.shape[0] == 0:
                self.pieces[path] = [value]
                return value
            rows = value.shape[0] // m
            whole = self._allocate(path, (rows * self.n, *value.shape[1:]), value)
            whole[: value.shape[0]].copy_(value)
            self.rows[path], self.joined[path] = rows, whole
            return whole
        if isinstance(value, float):
            self.sums[path] = [_weighted(value, weight), float(weight), float]
        return value

    def _next(self, path: str, value: Any, start: int, m: int, weight: Any) -> Any:
        if path in self.kv_paths:
            return None
        if path in self.joined:
            whole, rows = self.joined[path], self.rows[path]
            if (not isinstance(value, torch.Tensor) or value.dtype != whole.dtype
                    or tuple(value.shape) != (rows * m, *whole.shape[1:])):
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ConfigError(f"{path} is {got} in one micro-batch of {m} samples but "
                                  f"{(rows, *whole.shape[1:])} {whole.dtype} per sample in the first; pass combine=")
            whole[rows * start: rows * (start + m)].copy_(value)
            return whole
        if path in self.pieces:
            if not isinstance(value, torch.Tensor):
                raise ConfigError(f"{path} is a tensor in some micro-batches only; pass combine=")
            self.pieces[path].append(value)
            return None
        if path in self.sums:
            total = self.sums[path]
            if total[2] is float:
                if not isinstance(value, float):
                    raise ConfigError(f"{path} is a float in some micro-batches only; pass combine=")
                total[0] += _weighted(value, weight)
            else:
                if not isinstance(value, torch.Tensor) or value.dim() != 0:
                    raise ConfigError(f"{path} is a 0-dim tensor in some micro-batches only; pass combine=")
                total[0] = total[0] + _weighted(value.detach().to(total[0].device, torch.float64), weight)
            total[1] += float(weight)
            return None
        first = _leaf_at(self.structure, path)
        if isinstance(value, torch.Tensor) or value != first:
            raise ConfigError(f"{path} differs between micro-batches ({first!r} vs others) and memguard cannot merge "
                              "it; pass combine=")
        return None

    def _allocate(self, path: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """The joined tensor: on ``like``'s device, else (out of memory there) in host memory."""
        try:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        except Exception as exc:  # noqa: BLE001 - only OOMs are handled
            summary = released_oom(exc)
        free_memory()
        if like.device.type != "cpu":
            try:
                whole = torch.empty(shape, dtype=like.dtype, device="cpu")
            except Exception as exc:  # noqa: BLE001 - only OOMs are handled
                released_oom(exc)
            else:
                self.moved.append(path)
                log.warning("memguard: the joined %s (%s) does not fit on %s (%s); it is built in host memory and "
                            "the result holds it on the CPU", path, _size(shape, like.dtype), like.device, summary)
                return whole
        raise self.too_large(f"the joined {path} ({_size(shape, like.dtype)}) does not fit in memory ({summary})")

    def to_host(self) -> bool:
        """Move the joined tensors that are not on the CPU there; whether any was moved."""
        on_device = [p for p, t in self.joined.items() if t.device.type != "cpu"]
        if not on_device:
            return False
        for p in on_device:
            try:
                host = self.joined[p].to("cpu")
            except Exception as exc:  # noqa: BLE001 - only OOMs are handled
                summary = released_oom(exc)
                raise self.too_large(f"the joined {p} does not fit in host memory either ({summary})") from None
            self.structure = _zip_map([self.structure], lambda path, vs: host if path == p else vs[0], "result")
            self.joined[p] = host
            self.moved.append(p)
        free_memory()
        log.warning("memguard: out of memory in evaluation while the joined %s take %s of device memory; they are "
                    "moved to host memory and the result holds them on the CPU", ", ".join(on_device),
                    _size_of([self.joined[p] for p in on_device]))
        return True

    def result(self) -> Any:
        _log_kv_caches(self.kv_paths)

        def finish(path: str, values: list) -> Any:
            if path in self.pieces:
                try:
                    return torch.cat(self.pieces.pop(path), dim=0)
                except Exception as exc:  # noqa: BLE001 - only OOMs are handled
                    summary = released_oom(exc)
                    raise self.too_large(f"concatenating {path} ran out of memory ({summary})") from None
            if path in self.sums:
                total, weight, kind = self.sums[path]
                if weight == 0:  # every micro-batch had nothing to average (no labelled token): as unsplit, NaN
                    return float("nan") if kind is float else torch.full_like(total, float("nan")).to(kind)
                return total / weight if kind is float else (total / weight).to(kind)
            return values[0]

        return _zip_map([self.structure], finish, "result")

    def too_large(self, what: str) -> OOMRecoveryError:
        return OOMRecoveryError(f"evaluation's outputs cannot be joined: {what}; {self.hint}",
                                micro_batch_size=self.micro)


def _weighted(value: Any, weight: Any) -> Any:
    """``value * weight``, 0 for a weight of 0 (a micro-batch with nothing to average has a NaN mean)."""
    w = float(weight)
    if w:
        return value * w
    return 0.0 if isinstance(value, float) else torch.zeros_like(value)


def _leaf_at(structure: Any, path: str) -> Any:
    found: list[Any] = []
    _zip_map([structure], lambda p, vs: found.append(vs[0]) if p == path else None, "result", rebuild=False)
    return found[0] if found else None


def _size(shape: tuple, dtype: torch.dtype) -> str:
    from memguard.vocab import format_bytes

    count = 1
    for d in shape:
        count *= int(d)
    return format_bytes(count * torch.empty((), dtype=dtype).element_size())


def _size_of(tensors: Sequence[torch.Tensor]) -> str:
    from memguard.vocab import format_bytes

    return format_bytes(sum(t.numel() * t.element_size() for t in tensors))


def _is_kv_cache(obj: Any) -> bool:
    """A transformers KV cache (``transformers.cache_utils.Cache`` and subclasses), recognised without
    importing transformers: a class named ``*Cache`` defined in a ``transformers`` module."""
    return any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def _rebuild_mapping(first: Mapping, merged: dict) -> Any:
    """A mapping of ``first``'s type holding ``merged``: ``ModelOutput``-style dataclasses take
    keyword arguments, ``dict`` subclasses a dict."""
    kind = type(first)
    if dataclasses.is_dataclass(first):
        try:
            return kind(**merged)
        except TypeError:
            pass
    try:
        return kind(merged)
    except Exception:  # noqa: BLE001 - a Mapping whose constructor takes something else
        return merged
