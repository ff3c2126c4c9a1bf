"""The planner's front door: ``memguard.plan`` and every planner call made from outside the planner.

The guard, the command line, the framework integrations and ``memguard/__init__`` import the
planner only from here:

* :func:`plan` (``memguard.plan``) and :func:`plan_request` (the same for a
  :class:`~memguard.planner._request.PlanRequest`): check the request, pick what to plan
  (``finetune="lora"``: a LoRA twin), read the plan cache, run the training search
  (:func:`memguard.planner._search.search`) or the evaluation sizing
  (:func:`memguard.planner._eval_sizing.size_eval`), and, when nothing fits a fine-tune, measure the
  alternatives (:func:`alternatives`);
* :func:`fit_shape`: the micro-batch of a new batch shape under an existing plan, from probe
  traces only (what the guard asks when a batch of another shape arrives);
* :func:`fit_gpus`: which catalog GPUs, and how many of each, fit a job;
* the values those callers pass around: :class:`~memguard.planner._plan.Plan`,
  :class:`~memguard.planner._request.PlanRequest`, :data:`DEFAULT_HEADROOM`,
  :class:`~memguard.planner._cache.PlanCache` and :func:`~memguard.planner._cache.plan_key`,
  :class:`~memguard.planner._session.TraceSession` (the cached traces of one model and batch).

A batch's way through: :func:`plan` packs the options into a ``PlanRequest``;
:meth:`~memguard.planner._request.PlanRequest.resolve` checks them and resolves the target into a
:class:`~memguard.planner._request.SearchSpace`; a :class:`~memguard.planner._session.TraceSession`
traces 1- and 2-block probes of the step (:mod:`memguard.planner._probe`); the search ranks every
configuration by the cost model (:mod:`memguard.planner._cost`), verifies the best with one full
trace, and :func:`memguard.planner._assemble.build_plan` makes the ``Plan``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from memguard.batch import batch_size, first_dim
from memguard.errors import ConfigError, InfeasiblePlanError
from memguard.planner import _finetune as finetune
from memguard.planner._cache import PlanCache, plan_key
from memguard.planner._eval_sizing import size_eval
from memguard.planner._plan import Plan
from memguard.planner._probe import divisors
from memguard.planner._request import DEFAULT_HEADROOM, OPTION_NAMES, PlanRequest, SearchSpace, shape_problems
from memguard.planner._search import search
from memguard.planner._session import TraceSession

__all__ = [
    "plan",
    "plan_request",
    "fit_shape",
    "fit_gpus",
    "GpuFit",
    "alternatives",
    "Plan",
    "PlanRequest",
    "PlanCache",
    "plan_key",
    "TraceSession",
    "DEFAULT_HEADROOM",
    "OPTION_NAMES",
    "divisors",
]

log = logging.getLogger("memguard")


def plan(
    model: nn.Module,
    batch: Any,
    *,
    global_batch_size: int,
    gpu: str | None = None,
    budget_bytes: int | None = None,
    world_size: int = 1,
    device: str = "cuda",
    optimizer: Any = None,
    loss_fn: Callable | None = None,
    precision: str | Sequence[str] | None = None,
    activation_checkpointing: bool | None = None,
    zero_stage: int | Sequence[int] | None = None,
    offload_optimizer: bool | None = False,
    headroom: float = DEFAULT_HEADROOM,
    make_batch: Callable[[int], Any] | None = None,
    cache: bool | Any = False,
    keep_outputs: bool = False,
    max_shape: Any = None,
    train: bool = True,
    finetune: str | None = None,
    strategy: str | Sequence[str] | None = None,
    cpu: str | None = None,
    torch_version: str | None = None,
    cuda_version: str | None = None,
    cudnn_version: str | int | None = None,
    gradient_compression: str | None = None,
    powersgd: Any = None,
    gpus_per_node: int | None = None,
    verify_budget_s: float | None = None,
) -> Plan:
    """Choose micro-batch, accumulation, precision, checkpointing and sharding for a budget.

    Knobs ``precision``, ``activation_checkpointing``, ``zero_stage`` and ``offload_optimizer``:
    None lets memguard choose, a value fixes it, a sequence restricts it. With ``precision=None``
    memguard considers ``"32-true"`` and the fastest mixed precision the GPU supports
    (``bf16-mixed`` where bf16 exists, else ``16-mixed``); ``*-true`` precisions are used only
    when you list them. ZeRO stages are considered only when ``world_size > 1``, unless fixed.
    This is :func:`plan_request` with the options gathered in a
    :class:`~memguard.planner._request.PlanRequest`.

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimate`; ``batch`` is one
            example micro-batch; other sizes are made along dim 0 (or by ``make_batch(n)``).
        global_batch_size: samples per optimizer step over all ranks.
        gpu: catalog name; None = the current CUDA device.
        budget_bytes: bytes per rank (overrides the GPU's memory less its context).
        world_size: data-parallel ranks.
        device: ``"cuda"`` or ``"cpu"`` (the CPU needs ``budget_bytes`` or reads MemAvailable).
        headroom: fraction of the budget kept free (default 0.10, see the module docstring).
        make_batch: ``make_batch(n)`` returns an example batch of ``n`` samples.
        cache: True (or a :class:`memguard.planner._cache.PlanCache`) to reuse and store plans on
            disk, keyed by model structure, batch shapes, target and options.
        keep_outputs: True plans for a hand-written loop (``out = model(**batch)``) that keeps the
            output object alive through backward, the optimizer step and the next forward.
        max_shape: plan for the longest batch the data can produce: ``{"seq_len": L}`` and/or
            per-entry non-batch shapes (:func:`memguard.data.max_batch_shape` scans a dataset for
            it); ``Plan.reasons["planned_shape"]`` says which shape was planned for.
        train: False plans an evaluation step instead (:mod:`memguard.planner._eval_sizing`):
            ``global_batch_size`` is the evaluation batch over all ranks, the plan's
            ``micro_batch_size`` the most samples per forward, and the training-only knobs must be
            left at their defaults.
        finetune: None plans the model as given; ``"full"`` too, and when nothing fits the error
            lists measured LoRA, QLoRA, 8-bit AdamW, bf16-true and CPU-offload alternatives
            (``.alternatives``; :func:`alternatives`); ``"lora"`` plans a LoRA twin of
            the model (peft adapters on every linear layer of the repeated blocks, base in bf16);
            ``"qlora"`` a QLoRA twin (the base in 4-bit NF4 as ``BitsAndBytesConfig(load_in_4bit=True,
            bnb_4bit_use_double_quant=True)`` loads it, prepared by ``prepare_model_for_kbit_training``:
            the other weights in fp32, every block checkpointed). A model loaded with bitsandbytes' 4-bit
            layers is planned as given (its layers are traced as :class:`memguard.estimator._nf4.NF4Linear`).
        strategy: None = DDP, or DeepSpeed ZeRO at stages >= 1 (as before strategies existed);
            ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"`` fixes it; a sequence lets memguard choose among
            them (``Plan.strategy`` says which). Under ``"fsdp2"`` ``zero_stage`` is FSDP2's sharding
            level (see :func:`memguard.estimate`) and ``*-mixed`` precisions mean its
            ``MixedPrecisionPolicy`` with fp32 gradient reduction and no autocast.
        cpu: for ``device="cpu"``: the CPU whose kernel paths are modelled, None or ``"host"`` (this
            one) or an instruction-set level such as ``"avx2"`` (see :func:`memguard.estimate`).
        torch_version, cuda_version, cudnn_version: the CUDA target's torch, CUDA and cuDNN versions
            (see :func:`memguard.estimate`); None = the installed torch and its default wheel's.
        gradient_compression, powersgd: ``"powersgd"`` plans for DDP with torch's ``powerSGD_hook``
            (its error-feedback, P/Q state and the hook's transients in every estimate; only
            ``zero_stage=0``, ``world_size > 1``; see :func:`memguard.estimate`). memguard never chooses
            compression itself: it is lossy (it changes what the model learns), so it is the user's choice;
            the cost model does not credit its smaller all-reduce either.
        gpus_per_node: None (default) plans ``world_size`` data-parallel ranks as above. A number
            searches parallel layouts of ``world_size`` GPUs in nodes of ``gpus_per_node``
            (:mod:`memguard.planner._layouts`): tensor parallelism inside a node, pipeline stages
            (1F1B, GPipe, every micro-batch count) across nodes, FSDP2, DDP or HSDP over the rest,
            with precision, checkpointing and micro-batch, ranked by a cost model of compute, the
            pipeline bubble and each collective over the catalog's NVLink/PCIe and network figures.
            ``Plan.layout`` is the chosen :class:`memguard.Layout`, ``explain()`` lists the layouts
            tried and why each lost; ``world_size`` is then every GPU and ``global_batch_size``
            need only split over the chosen layout's data-parallel replicas.
        verify_budget_s: with ``gpus_per_node``: the chosen layout is verified with a full
            ``memguard.estimate(..., layout=...)`` when that is predicted (from the model's op count, not
            a clock) to take at most this many seconds, else by the short verification (the model cut to
            a few blocks, every figure extrapolated; see :mod:`memguard.planner._layouts`) where that fits;
            None = 20 s, 0 = never, ``math.inf`` = always a full trace. ``Plan.reasons["estimate"]`` says
            which it was.

    Returns:
        The :class:`~memguard.Plan`, verified with one full trace.

    Raises:
        ConfigError: bad arguments, all listed at once.
        MissingDependencyError: ``finetune="lora"`` without ``peft``.
        InfeasiblePlanError: nothing fits; ``.closest`` is the nearest plan, with suggestions.
    """
    request = PlanRequest(
        global_batch_size=global_batch_size, gpu=gpu, budget_bytes=budget_bytes, world_size=world_size,
        device=device, optimizer=optimizer, loss_fn=loss_fn, precision=precision,
        activation_checkpointing=activation_checkpointing, zero_stage=zero_stage,
        offload_optimizer=offload_optimizer, headroom=headroom, make_batch=make_batch, cache=cache,
        keep_outputs=keep_outputs, max_shape=max_shape, train=train, finetune=finetune, strategy=strategy,
        cpu=cpu, torch_version=torch_version, cuda_version=cuda_version, cudnn_version=cudnn_version,
        gradient_compression=gradient_compression, powersgd=powersgd, gpus_per_node=gpus_per_node,
        verify_budget_s=verify_budget_s,
    )
    return plan_request(model, batch, request)


def plan_request(model: nn.Module, batch: Any, request: PlanRequest, *, session: TraceSession | None = None) -> Plan:
    """:func:`memguard.plan` for a :class:`~memguard.planner._request.PlanRequest`.

    Args:
        model, batch: as for :func:`memguard.plan`.
        request: the options.
        session: a :class:`~memguard.planner._session.TraceSession` for this model, batch and request
            (its traces are reused, e.g. across budgets, GPUs and world sizes); default: a new one.

    Returns:
        The :class:`~memguard.Plan`, verified with one full trace.

    Raises:
        ConfigError: bad options (all listed at once), a batch without a batch dimension, or a
            ``session`` made for another model, batch or tracing options.
        InfeasiblePlanError: nothing fits; ``.closest`` is the nearest plan, with suggestions.
    """
    if request.train is False and session is None:
        return size_eval(model, batch, request, request.resolve_eval(batch))
    problems = request.problems()
    if request.train is False:
        problems.append("session= traces training steps; plan an evaluation step (train=False) without session=")
    if first_dim(batch) is None:
        problems.append("batch must hold at least one tensor with a batch dimension (dim 0)")
    if session is not None:
        problems.extend(session.mismatches(model, batch, request))
    if request.max_shape is not None and not problems:
        problems.extend(shape_problems(batch, request.max_shape))
    if problems:
        raise ConfigError(problems)
    variant = None
    if request.finetune in ("lora", "qlora"):
        variant = finetune.finetune_variant(model, request)
        if variant.model is not model:  # traces of the user's model do not apply to its (Q)LoRA twin
            model, request, session = variant.model, variant.request, None
    space = request.resolve()
    if session is None:
        session = TraceSession.for_request(model, batch, request)
    store = None
    if request.cache:
        store = request.cache if isinstance(request.cache, PlanCache) else PlanCache()
        key = _cache_key(session, request, space)
        hit = store.get(key)
        if hit is not None:
            log.info("memguard: plan read from cache %s", store.path_for(key))
            return hit

    if request.gpus_per_node is not None:
        from memguard.planner._layouts import search_layouts

        result = search_layouts(session, space, request)
        if store is not None:
            store.put(key, result)
        return result
    try:
        result = search(session, space)
    except InfeasiblePlanError as exc:
        if request.finetune == "full":
            alts = alternatives(model, batch, request, session=session)
            raise InfeasiblePlanError(exc.reason, closest=exc.closest, alternatives=alts,
                                      suggestions=finetune.suggestion_lines(alts, space.usable_bytes) + exc.suggestions
                                      ) from None
        if request.finetune is None:
            raise InfeasiblePlanError(exc.reason, closest=exc.closest, suggestions=exc.suggestions + [
                "fine-tuning? finetune='full' measures LoRA, QLoRA, 8-bit AdamW, bf16-true and CPU-offload "
                "alternatives; finetune='lora' or 'qlora' plans LoRA or QLoRA directly"]) from None
        raise
    if variant is not None and variant.reason:
        result = result.replace(reasons={**result.reasons, "finetune": variant.reason})
    if session.shape_reason is not None:
        result = result.replace(reasons={**result.reasons, "planned_shape": session.shape_reason})
    if store is not None:
        store.put(key, result)
    return result


def _cache_key(session: TraceSession, request: PlanRequest, space: SearchSpace) -> str:
    """The plan cache's key of ``request`` (see :mod:`memguard.planner._cache`): the traced model and
    batch, the step, and every resolved option a plan depends on."""
    return plan_key(session.model, session.traced_batch, request.optimizer, request.loss_fn, dict(
        global_batch_size=request.global_batch_size, gpu=space.spec.name if space.spec else None,
        budget_bytes=space.budget_bytes, world_size=request.world_size, device=request.device,
        precision=space.precisions, ckpt=space.checkpointing, zero=space.zero_stages, offload=space.offloads,
        headroom=request.headroom, keep_outputs=request.keep_outputs, finetune=request.finetune,
        **({"strategy": space.shardings} if request.strategy is not None else {}),
        **({"cpu": request.cpu} if request.cpu is not None else {}),
        **({"gpus_per_node": request.gpus_per_node} if request.gpus_per_node is not None else {}),
        **({"powersgd": repr(session.powersgd)} if session.powersgd is not None else {}),
        **({"stack": repr(space.spec.stack)} if space.spec is not None and space.spec.stack is not None else {})))


def alternatives(model: nn.Module, batch: Any, request: PlanRequest, *, only: Sequence[str] | None = None,
                 session: TraceSession | None = None) -> list[finetune.Alternative]:
    """Measured ways to make a fine-tune of ``model`` fit ``request``'s budget, smallest peak first.

    :func:`memguard.planner._finetune.alternatives`, each alternative planned by :func:`plan_request`
    (see there for ``only`` and ``session``).
    """
    return finetune.alternatives(model, batch, request, plan_with=plan_request, only=only, session=session)


def fit_shape(model: nn.Module, batch: Any, plan: Plan, *, most: int, optimizer: Any = None,
              loss_fn: Callable | None = None, keep_outputs: Any = False, sizes: Sequence[int] | None = None) -> int:
    """The largest micro-batch up to ``most`` predicted to fit ``plan``'s budget for batches like ``batch``.

    The probe model (:class:`memguard.planner._probe.ProbeModel`) of the new shape, with the plan's
    precision, checkpointing and sharding: 1- and 2-block probe traces at one micro-batch (on the
    CUDA target also the 2-block probe at twice it, for the allocator model), so two or three small
    traces. Memory is not affine in the sequence length (attention scores grow with its square on
    the CPU target and CUDA's math path), so a new shape needs new probes, but none of the search or
    verification.

    Args:
        model: the eager module (not its ``torch.compile`` wrapper).
        batch: a batch of the new shape (its tensors may be on ``meta``: only shapes are read).
        plan: the plan in force.
        most: the largest micro-batch considered (the planned one).
        optimizer, loss_fn, keep_outputs: the step, as the plan was made for it.
        sizes: the micro-batches to try, largest first (e.g. the halvings of ``most`` under
            ``torch.compile``); None: every size from 1 to ``most``, by bisection.

    Returns:
        The micro-batch (1 when none of ``sizes`` is predicted to fit).

    Raises:
        ConfigError: the plan's target cannot be resolved here. Tracing errors propagate.

    Known limitations:
        With activation checkpointing in the plan, the probes trace a module whose blocks are already
        checkpointed, so the "no checkpointing" probe is not one; the prediction may then be low.
    """
    request = PlanRequest(global_batch_size=plan.global_batch_size, optimizer=optimizer, loss_fn=loss_fn,
                          world_size=plan.world_size, device=plan.device, gpu=plan.gpu, budget_bytes=plan.budget_bytes,
                          headroom=plan.headroom, precision=plan.precision, keep_outputs=keep_outputs,
                          strategy=plan.strategy)
    space = request.resolve()
    session = TraceSession.for_request(model, batch, request)
    k = plan.checkpoint_blocks if plan.activation_checkpointing else 0
    probe = session.probe_model(plan.precision, zero_stage=plan.zero_stage, world_size=plan.world_size,
                                spec=space.spec, offload=plan.offload_optimizer, checkpointing=k > 0,
                                strategy=plan.strategy)
    # The CPU target's peak is its live bytes, which the probe features predict (the larger of the
    # forward/backward and the optimizer moments, ProbeModel.allocated); the extended traces at a
    # second micro-batch that ProbeModel.predict replays would only refine that moment, for one more trace.
    peak = probe.allocated if plan.device == "cpu" else probe.predict
    n = batch_size(batch)

    def fits(m: int) -> bool:
        # gradients are present while a micro-batch runs when it is not the step's first
        accumulating = plan.grad_accum_steps > 1 or m < n
        return peak(m, k, 2 if accumulating else 1) <= space.usable_bytes

    if sizes is not None:
        return next((m for m in sizes if fits(m)), 1)
    lo, hi = 1, most  # the peak grows with the micro-batch: the largest that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------------------- GPU sizing
@dataclass(frozen=True)
class GpuFit:
    """The fewest GPUs of one kind that fit the job, and the plan for them.

    Attributes:
        gpu: catalog name.
        count: the world size that fits, or None when none up to ``max_gpus`` does.
        plan: the plan at that world size, or None.
        reason: why it does not fit, when it does not.
    """

    gpu: str
    count: int | None
    plan: Plan | None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "count": self.count, "plan": self.plan.to_dict() if self.plan else None,
                "reason": self.reason}


def fit_gpus(
    model: nn.Module,
    batch: Any,
    *,
    global_batch_size: int,
    gpus: Iterable[str] | None = None,
    max_gpus: int = 64,
    optimizer: Any = None,
    loss_fn: Callable | None = None,
    make_batch: Callable[[int], Any] | None = None,
    **plan_options: Any,
) -> list[GpuFit]:
    """For each GPU, the smallest power-of-two world size (dividing the global batch) that fits.

    One :class:`~memguard.planner._session.TraceSession` is shared by every GPU and world size asked
    about, because a trace depends on neither: the probes are traced once, and each verification
    trace is reused wherever the same micro-batch and checkpointing come up again.

    Args:
        gpus: catalog names (default: the whole catalog).
        max_gpus: the largest world size tried.
        plan_options: other :func:`memguard.plan` options (precision, zero_stage, headroom, ...).

    Returns:
        One :class:`GpuFit` per GPU, cheapest-looking first (fewest GPUs, then least memory).

    Raises:
        ConfigError: bad arguments (unknown GPU names, options ``plan`` refuses).
    """
    from memguard.estimator.gpus import GPUS, get_gpu

    forbidden = {"gpu", "world_size", "budget_bytes", "device"} & set(plan_options)
    if forbidden:
        raise ConfigError(f"fit_gpus chooses {', '.join(sorted(forbidden))} itself; drop them")
    names: Sequence[str] = [get_gpu(g).name for g in gpus] if gpus is not None else [
        g.name for g in GPUS.values() if g.memory_bytes
    ]
    first = names[0] if names else None
    request = PlanRequest.from_options(global_batch_size=global_batch_size, optimizer=optimizer, loss_fn=loss_fn,
                                       make_batch=make_batch, device="cuda", gpu=first, **plan_options)
    request.check()
    session = TraceSession.for_request(model, batch, request)
    sizes = [n for n in (2**i for i in range(0, 31)) if n <= max_gpus and global_batch_size % n == 0]
    fits: list[GpuFit] = []
    for name in names:
        last = ""
        for n in sizes:
            try:
                p = plan_request(model, batch, dataclasses.replace(request, gpu=name, world_size=n), session=session)
            except InfeasiblePlanError as exc:
                last = str(exc).splitlines()[0]
                continue
            fits.append(GpuFit(name, n, p))
            break
        else:
            fits.append(GpuFit(name, None, None, last or f"no world size up to {max_gpus} divides the global batch"))
    fits.sort(key=lambda f: (f.count is None, f.count or 0, get_gpu(f.gpu).memory_bytes))
    return fits
