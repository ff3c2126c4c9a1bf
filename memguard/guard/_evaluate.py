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

Known limitations:
    Ranks split independently: a model whose forward runs collectives (FSDP, ZeRO-3) would need
    every rank to run the same number of forwards, which is not arranged; evaluate such models with
    a planned ``micro_batch_size`` (the same on every rank). The concatenation needs the parts and
    the whole at once (twice the outputs' bytes for a moment); pass ``combine=`` to reduce on the
    fly for very large outputs.
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
        forwards: forwards run by the last :func:`evaluate` call (1 when the batch fitted whole).
    """

    micro_batch_size: "OrderedDict[tuple, int]" = dataclasses.field(default_factory=OrderedDict)
    oom_retries: int = 0
    forwards: int = 0

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
        combine: ``combine(results, weights) -> result`` instead of :func:`combine_outputs`.
        max_retries: give up after this many OOMs in this call (None: until one sample fails).

    Returns:
        The merged result; exactly ``run(batch)``'s result when the batch runs whole.

    Raises:
        ConfigError: ``batch`` has no batch dimension or its tensors disagree on it, or
            ``micro_batch_size`` is not a positive int.
        OOMRecoveryError: one sample does not fit, or ``max_retries`` OOMs happened; raised from
            the last OOM.
        Exception: any other error of ``run``, unchanged.
    """
    if micro_batch_size is not None and not (isinstance(micro_batch_size, int) and micro_batch_size >= 1):
        raise ConfigError(f"micro_batch_size={micro_batch_size!r} must be a positive int or None")
    n = batch_size(batch)
    sig = shape_signature(batch)
    cap = micro_batch_size or state.remembered(sig)
    size = cap or n  # may exceed n: each micro-batch is cut at n below, and a cap is remembered whole
    results: list[Any] = []
    weights: list[Any] = []
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
            if halvings.stop(failed) is not None:
                why = "one sample does not fit" if failed == 1 else f"{halvings.done + 1} OOMs in one evaluation"
                raise OOMRecoveryError(
                    f"evaluation ran out of memory and cannot split further: {why} ({summary}); evaluate in a "
                    "16-bit precision, with shorter sequences, or drop the optimizer state during evaluation",
                    micro_batch_size=failed,
                ) from exc
            del exc, micro
            free_memory()
            size = halvings.halve(failed)
            log.warning("memguard: OOM in evaluation at micro-batch %d (%s); halving to %d (training "
                        "micro-batch unchanged)", failed, summary, size)
            continue
        results.append(out)
        m = stop - start
        weights.append(weight_fn(micro) if weight_fn is not None else m)
        state.forwards += 1
        start = stop
    if cap is not None or halvings.done:
        # Only a cap or an OOM says how large a micro-batch may be: a batch that ran whole, or a short
        # last batch, must not shrink what the next, full batches start from.
        state.remember(sig, size)
    if len(results) == 1:
        return results[0]
    merged = combine(results, weights) if combine is not None else combine_outputs(results, weights)
    return merged


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
        micro_batch_size, max_retries: as for :func:`split_eval`.

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

    return split_eval(batch, run, state=state, micro_batch_size=micro_batch_size, max_retries=max_retries)


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

    Returns:
        The merged result (see :func:`combine_outputs`).

    Raises:
        ConfigError: bad arguments (all listed at once), or results that cannot be merged
            (pass ``combine=``).
        OOMRecoveryError: a single sample does not fit, or ``max_retries`` was exceeded.

    Known limitations:
        See the module docstring (sharded models, concatenation memory). Values that depend on
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

    grad = torch.inference_mode() if inference_mode else torch.no_grad()
    with _eval_mode(model, eval_mode), grad:
        return split_eval(batch, run, state=eval_status(model), micro_batch_size=micro_batch_size,
                          weight_fn=weight_fn, combine=combine, max_retries=max_retries)


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
    first = results[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(r, torch.Tensor) for r in results):
            raise ConfigError(f"{path} is a tensor in some micro-batches only; pass combine=")
        if first.dim() == 0:
            if not first.is_floating_point():
                raise ConfigError(f"{path} is a 0-dim {first.dtype} tensor, which is neither per-sample nor a mean; "
                                  "pass combine=lambda results, weights: ...")
            return _weighted_mean(results, weights)
        return torch.cat(list(results), dim=0)
    if first is None or isinstance(first, (str, bytes, bool, int)) and not isinstance(first, float):
        if any(r != first for r in results):
            raise ConfigError(f"{path} differs between micro-batches ({results[0]!r} vs others) and memguard "
                              "cannot merge it; pass combine=")
        return first
    if isinstance(first, float):
        return _weighted_mean(results, weights)
    if isinstance(first, Mapping):
        keys = list(first.keys())
        if any(list(r.keys()) != keys for r in results):
            raise ConfigError(f"{path} has different keys in different micro-batches; pass combine=")
        merged = {k: combine_outputs([r[k] for r in results], weights, path=f"{path}[{k!r}]") for k in keys}
        return _rebuild_mapping(first, merged)
    if isinstance(first, (tuple, list)):
        if any(len(r) != len(first) for r in results):
            raise ConfigError(f"{path} has different lengths in different micro-batches; pass combine=")
        items = [combine_outputs([r[i] for r in results], weights, path=f"{path}[{i}]") for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*items)
        return type(first)(items)
    if _is_kv_cache(first):
        log.info("memguard: %s is a key/value cache, which is not merged across micro-batches: the merged result "
                 "holds None there (call the model with use_cache=False not to build it at all)", path)
        return None
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        merged = {f.name: combine_outputs([getattr(r, f.name) for r in results], weights, path=f"{path}.{f.name}")
                  for f in dataclasses.fields(first)}
        return dataclasses.replace(first, **merged)
    raise ConfigError(f"{path} is a {type(first).__name__}, which memguard cannot merge across micro-batches; "
                      "pass combine=lambda results, weights: ...")


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
