"""``memguard.plan``: the fastest configuration that fits a memory budget.

How the search works (and why it traces so little):

1. **Probes.** For a precision and a checkpointing mode, the model is traced with only 1 and 2 of
   its repeated blocks kept (``keep_blocks``), at the example micro-batch. Every quantity of a
   stack of identical blocks is affine in the number of blocks, so two points give the whole
   model; every activation and temporary of the forward/backward is proportional to the batch
   (dim 0), while parameters, gradients and optimizer state are not. So one probe pair predicts
   the peak at any micro-batch, any number of checkpointed blocks (interpolating between the
   "none" and "all" probes) and any ZeRO stage (a re-scan of the same traces with other factors).
   For the CUDA target, whose caching allocator is affine in nothing, the probes are extended into
   a trace of every block and replayed through the allocator model (:mod:`memguard.planner.probe`).
2. **Search.** Every divisor of the per-rank batch is a micro-batch candidate; for each
   precision x ZeRO stage x offload, the fewest checkpointed blocks that fit are solved for, and
   the cost model (``memguard.planner.cost``) ranks the candidates by predicted samples/s. Ties
   go to the simpler plan (no checkpointing, lower ZeRO stage, no offload, then larger
   micro-batch). Probes of a precision or checkpointing mode whose best conceivable throughput
   cannot beat the best plan found are never traced.
3. **Verification.** The winner is estimated with one full trace; if it does not fit after all,
   the next candidate is verified (and the configuration that missed is queued one micro-batch
   smaller), and so on.

The budget is per rank: the GPU's memory less its CUDA context (or ``budget_bytes``), and the
plan keeps ``headroom`` of it free (default 10%: the estimator is within ~1% of the real CPU
allocator; the rest covers CUDA kernels' own workspaces, fragmentation from other work and the
allocator model's simplifications).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import nn

from memguard.batch import first_dim, resize_batch
from memguard.errors import ConfigError, InfeasiblePlanError
from memguard.estimator.pricing import estimate_from_trace
from memguard.estimator.targets import Target, traced_precision, unwrap_model
from memguard.estimator.tracing import TraceRequest, fsdp2_layout, run_trace
from memguard.estimator.blocks import find_blocks, hidden_size
from memguard.estimator.result import Estimate
from memguard.planner.cost import CPU_TFLOPS, CostInputs, step_seconds
from memguard.planner.plan import Plan
from memguard.planner.probe import (
    ProbeFeatures,
    ProbeModel,
    divisors,
    extend_trace,
    interpolate_trace,
    with_gradients_present,
)
from memguard.planner.request import DEFAULT_HEADROOM, PlanRequest
from memguard.vocab import PRECISIONS, format_bytes

__all__ = ["plan", "plan_request", "DEFAULT_HEADROOM", "Planner", "PROBE_MICRO_BATCH"]

log = logging.getLogger("memguard")

PROBE_MICRO_BATCH = 8
_MAX_VERIFY = 6


@dataclass(frozen=True)
class _Candidate:
    strategy: str
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    checkpoint_blocks: int
    zero_stage: int
    offload_optimizer: bool
    predicted_bytes: int
    step_seconds: float
    throughput: float

    def key(self, precision_rank: dict[str, int], strategy_rank: dict[str, int] | None = None) -> tuple:
        return (
            -float(f"{self.throughput:.3g}"),  # throughput first, to 3 significant digits
            self.checkpoint_blocks,
            (strategy_rank or {}).get(self.strategy, 0),  # then the strategy listed first
            self.zero_stage,
            self.offload_optimizer,
            precision_rank[self.precision],
            -self.micro_batch_size,
        )


@dataclass
class Planner:
    """Traces shared by every question asked about one model and example batch.

    :func:`plan_request` makes one per call unless given one; :func:`memguard.planner.sizing.fit_gpus`
    and the command line share one across budgets, GPUs and world sizes (traces are cached by
    everything they depend on: precision, checkpointing, kept blocks, micro-batch and the CUDA target).
    """

    model: nn.Module
    batch: Any
    optimizer: Any = None
    loss_fn: Callable | None = None
    device: str = "cuda"
    make_batch: Callable[[int], Any] | None = None
    keep_outputs: bool = False
    #: Plan for the worst-case batch of this shape (see :mod:`memguard.data`); None: the example batch's.
    max_shape: Any = None
    #: Called after each new trace with what was traced (precision, ckpt, keep, m, grads_present) and
    #: the seconds it took, e.g. to report progress.
    on_trace: Callable[[dict, float], None] | None = None
    #: The CPU target's CPU (``cpu=`` of :func:`memguard.plan`): None = this host.
    cpu: Any = None
    _traces: dict = field(default_factory=dict)
    _extended: dict = field(default_factory=dict)
    _peaks: dict = field(default_factory=dict)
    _cost: CostInputs | None = None
    _whole: bool = False
    _first_precision: str | None = None

    @classmethod
    def for_request(cls, model: nn.Module, batch: Any, request: PlanRequest) -> "Planner":
        """A planner for ``model`` and ``batch`` with the request's tracing options."""
        return cls(model, batch, optimizer=request.optimizer, loss_fn=request.loss_fn, device=request.device,
                   make_batch=request.make_batch, keep_outputs=request.keep_outputs, max_shape=request.max_shape,
                   cpu=request.cpu)

    def mismatches(self, model: nn.Module, batch: Any, request: PlanRequest) -> list[str]:
        """Why this planner's traces cannot answer ``request`` for ``model`` and ``batch`` (empty if they can)."""
        out = []
        if unwrap_model(model) is not self.model or batch is not self.batch:
            out.append("planner= was made for another model or example batch; make one with "
                       "Planner.for_request(model, batch, request)")
        for name in ("optimizer", "loss_fn", "device", "make_batch", "keep_outputs", "max_shape", "cpu"):
            if getattr(request, name) is not getattr(self, name) and getattr(request, name) != getattr(self, name):
                out.append(f"planner= traces with {name}={getattr(self, name)!r} but the request has "
                           f"{name}={getattr(request, name)!r}; make the planner with Planner.for_request")
        return out

    def __post_init__(self) -> None:
        self.model = unwrap_model(self.model)
        self.example_m = first_dim(self.batch) or 1
        from memguard.data import planning_batch

        # the batch every trace is made from: the example batch, or its worst case for max_shape
        self.traced_batch, self.shape_reason = planning_batch(self.batch, self.max_shape)
        # The probes' micro-batch. Activations are affine, not proportional, in the micro-batch (a
        # few buffers do not grow with it); probing at a moderate size keeps that intercept's share
        # small, and costs nothing: fake tensors make a trace's cost independent of sizes.
        self.m0 = max(self.example_m, PROBE_MICRO_BATCH)
        self.num_blocks = len(find_blocks(self.model))

    @property
    def trace_count(self) -> int:
        """How many distinct steps this planner has traced so far."""
        return len(self._traces)

    def batch_of(self, n: int) -> Any:
        if self.make_batch is not None:
            made = self.make_batch(n)
            if self.max_shape is None:
                return made
            from memguard.data import worst_case_batch

            return worst_case_batch(made, self.max_shape)
        return resize_batch(self.traced_batch, self.example_m, n)

    def trace(self, precision: str, *, ckpt: int = 0, keep: int | None = None, m: int | None = None,
              grads_present: bool = False, flops: bool = False, spec: Any = None, fsdp2: Any = None):
        """One step traced as :func:`memguard.estimate` traces it (cached).

        Args:
            precision: the traced precision (see ``traced_precision``).
            ckpt: repeated blocks checkpointed.
            keep: repeated blocks kept (the probes), or None for the whole model.
            m: the micro-batch, or None for the example batch.
            grads_present: gradients exist when the micro-batch starts (accumulation).
            flops: count FLOPs too.
            spec: the CUDA target's GPU spec (kernel choices depend on it); None on the CPU.
            fsdp2: the :class:`~memguard.estimator.fsdp2.FSDP2Layout` of an FSDP2 target (its
                offload setting does not change the trace), or None.
        """
        spec = spec if self.device == "cuda" else None
        if fsdp2 is not None:
            import dataclasses

            # level 1 differs from level 2 only when gradients accumulate unsynchronised
            stage = 2 if fsdp2.zero_stage == 1 and not grads_present else fsdp2.zero_stage
            fsdp2 = dataclasses.replace(fsdp2, offload=False, zero_stage=stage)
        key = (precision, ckpt, keep, m, grads_present, flops, getattr(spec, "name", None), fsdp2)
        if key not in self._traces:
            start = time.perf_counter()
            batch = self.traced_batch if m is None else self.batch_of(m)
            request = TraceRequest(
                device=self.device, precision=precision, checkpoint_blocks=ckpt, grads_present=grads_present,
                keep_blocks=keep, count_flops=flops, keep_outputs=self.keep_outputs, gpu=spec,
                cpu=self._cpu_target(), fsdp2=fsdp2,
            )
            self._traces[key] = run_trace(self.model, batch, request, optimizer=self.optimizer, loss_fn=self.loss_fn)
            log.debug("memguard traced %s", key)
            if self.on_trace is not None:
                self.on_trace(dict(precision=precision, ckpt=ckpt, keep=keep, m=m, grads_present=grads_present),
                              time.perf_counter() - start)
        return self._traces[key]

    def _cpu_target(self) -> Any:
        if self.device != "cpu":
            return None
        from memguard.estimator.cpu_kernels import CpuTarget

        return CpuTarget.named(self.cpu)

    def probe_points(self, spec: Any = None) -> list[int | None]:
        """[1, 2] (blocks kept in the probes), or [None] (trace the whole model) when the model
        has no repeated blocks or cannot run with fewer of them."""
        if self.num_blocks < 2 or self._whole:
            return [None]
        try:
            self.trace(self._first_precision or "32-true", keep=1, m=self.m0, flops=True, spec=spec)
        except ConfigError as exc:
            log.info("memguard: the model does not run with fewer blocks (%s); probing it whole", exc)
            self._whole = True
            return [None]
        return [1, 2]

    def _layout(self, strategy: str, precision: str, zero_stage: int, world_size: int):
        """The FSDP2 layout a trace needs (None for DDP and DeepSpeed, whose sharding is a re-scan)."""
        return fsdp2_layout(strategy, precision, zero_stage, world_size, False, self.device)

    def _probe_trace(self, precision: str, zero_stage: int, ckpt_all: bool, j: int | None, spec: Any,
                     strategy: str = "ddp", world_size: int = 1, grads_present: bool = False):
        """The probe trace keeping ``j`` blocks (None: the whole model), with all of them checkpointed or none."""
        traced = traced_precision(precision, zero_stage, strategy)
        ck = (self.num_blocks if j is None else j) if ckpt_all else 0
        layout = self._layout(strategy, precision, zero_stage, world_size)
        flops = (not ckpt_all and layout is None and not grads_present
                 and traced == precision == (self._first_precision or "32-true"))  # FLOPs: once
        return self.trace(traced, ckpt=ck, keep=j, m=self.m0, flops=flops, spec=spec, fsdp2=layout,
                          grads_present=grads_present)

    def _features(self, precision: str, ckpt_all: bool, *, zero_stage: int, world_size: int, spec: Any,
                  offload: bool, strategy: str = "ddp") -> ProbeFeatures:
        feats = []
        for j in self.probe_points(spec):
            tr = self._probe_trace(precision, zero_stage, ckpt_all, j, spec, strategy, world_size)
            # allocated bytes only: the CPU target's evaluation is the sharded timeline without the allocator
            target = Target(device="cpu", precision=precision, zero_stage=zero_stage, world_size=world_size,
                            strategy=strategy, offload_optimizer=offload)
            _, tl = estimate_from_trace(tr, target, micro_batch_size=self.m0)
            feats.append(ProbeFeatures.of(tl))
        if len(feats) == 1:
            return feats[0]
        return feats[0].extrapolate(feats[1], 1, 2, self.num_blocks)

    def _whole_traces(self, precision: str, zero_stage: int, ckpt_all: bool, spec: Any, strategy: str = "ddp",
                      world_size: int = 1, grads_present: bool = False) -> tuple:
        """Traces of every block at the probes' micro-batch and at twice it: the probes extended (the
        2-block probe at twice the micro-batch is extended as the one at the micro-batch is), or the
        whole model traced where the probes are not one block apart."""
        layout = self._layout(strategy, precision, zero_stage, world_size)
        key = (traced_precision(precision, zero_stage, strategy), ckpt_all, getattr(spec, "name", None), layout,
               grads_present)
        if key not in self._extended:
            traced = traced_precision(precision, zero_stage, strategy)
            n = self.num_blocks
            points = self.probe_points(spec)
            m1 = 2 * self.m0
            pair = None
            if len(points) == 2:
                one, two = (self._probe_trace(precision, zero_stage, ckpt_all, j, spec, strategy, world_size,
                                              grads_present) for j in points)
                two_m1 = self.trace(traced, ckpt=2 if ckpt_all else 0, keep=2, m=m1, spec=spec, fsdp2=layout,
                                    grads_present=grads_present)
                pair = extend_trace(one, two, n, others=[two_m1])
                if pair is not None and layout is not None and n > 3 and not self._extends_to_three(
                        one, two, traced, ckpt_all, spec, layout, grads_present):
                    pair = None  # FSDP2's buffers did not line up block by block: trace the whole model
                if pair is None:  # other kernels at the larger micro-batch: extend it on its own
                    one_m1 = self.trace(traced, ckpt=1 if ckpt_all else 0, keep=1, m=m1, spec=spec, fsdp2=layout,
                                        grads_present=grads_present)
                    pair = [extend_trace(one, two, n), extend_trace(one_m1, two_m1, n)]
                    pair = None if None in pair or layout is not None else pair
            if pair is None:  # no repeated blocks, probes that do not line up: trace the whole model
                ck = n if ckpt_all else 0
                pair = [self.trace(traced, ckpt=ck, m=m, spec=spec, fsdp2=layout, grads_present=grads_present)
                        for m in (self.m0, m1)]
            self._extended[key] = tuple(pair)
        return self._extended[key]

    def _extends_to_three(self, one, two, traced: str, ckpt_all: bool, spec: Any, layout: Any,
                          grads_present: bool) -> bool:
        """Whether the probes extended to 3 blocks give the 3-block trace's peak exactly.

        FSDP2's per-block buffers are handed between blocks (the reduce-scatter input lives until the
        next group's reduce-scatter, ``ReduceScatterState`` in ``_fsdp_param_group.py``; backward
        prefetches the next group), and with checkpointing the alignment of the 1- and 2-block traces
        can assign them to the wrong block, so the extension is checked against one more probe.
        """
        from memguard.estimator.analysis import scan

        three = self.trace(traced, ckpt=3 if ckpt_all else 0, keep=3, m=self.m0, spec=spec, fsdp2=layout,
                           grads_present=grads_present)
        extended = extend_trace(one, two, 3)
        return extended is not None and scan(extended).peak_bytes == scan(three).peak_bytes

    def _device_trace(self, precision: str, zero_stage: int, ckpt_all: bool, spec: Any, m: int,
                      strategy: str = "ddp", world_size: int = 1, grads_present: bool = False):
        """The whole model's trace at micro-batch ``m``: each tensor's size is affine in the micro-batch
        (a tensor's shape has the batch as a factor, or not at all), so traces at two micro-batches give
        every tensor's size at any other (:func:`memguard.planner.probe.interpolate_trace`)."""
        base, other = self._whole_traces(precision, zero_stage, ckpt_all, spec, strategy, world_size, grads_present)
        m1 = 2 * self.m0
        if len(base.events) != len(other.events) and m >= m1:  # the larger micro-batch's kernels
            return interpolate_trace(other, m1, other, m1, m)
        return interpolate_trace(base, self.m0, other, m1, m)

    def probe_model(self, precision: str, *, zero_stage: int, world_size: int, spec: Any, offload: bool,
                    checkpointing: bool, strategy: str | None = None) -> ProbeModel:
        """The probe model of one target (see :mod:`memguard.planner.probe`).

        Args:
            precision: the precision planned for.
            zero_stage, world_size, offload: the sharding.
            spec: the CUDA target's GPU spec (None on the CPU).
            checkpointing: also probe with every block checkpointed, so that ``predict`` takes ``k > 0``.
            strategy: "ddp", "deepspeed" or "fsdp2" (None: DeepSpeed at ``zero_stage >= 1``, else DDP).
        """
        strategy = strategy or ("deepspeed" if zero_stage >= 1 else "ddp")
        common = dict(zero_stage=zero_stage, world_size=world_size, spec=spec, offload=offload, strategy=strategy)
        f_off = self._features(precision, False, **common)
        f_on = self._features(precision, True, **common) if checkpointing and self.num_blocks >= 1 else None
        model = ProbeModel(f_off, f_on, self.m0, self.num_blocks)
        if self.device == "cpu" or spec is not None:
            def device_peak(m: int, ckpt_all: bool, accumulating: bool) -> int:
                key = (strategy, precision, zero_stage, world_size, getattr(spec, "name", None), offload, m, ckpt_all,
                       accumulating)
                if key not in self._peaks:
                    # FSDP2 level 1 accumulates unsharded gradients without synchronising: traced as such;
                    # otherwise accumulation only allocates the (sharded) gradients up front
                    traced_accum = accumulating and strategy == "fsdp2" and zero_stage == 1
                    whole = self._device_trace(precision, zero_stage, ckpt_all, spec, m, strategy, world_size,
                                               traced_accum)
                    if accumulating and not traced_accum:
                        whole = with_gradients_present(whole)
                    target = Target(device=self.device, precision=precision, zero_stage=zero_stage,
                                    world_size=world_size, gpu=spec, strategy=strategy, offload_optimizer=offload)
                    est, _ = estimate_from_trace(whole, target, micro_batch_size=m,
                                                 checkpointed=self.num_blocks if ckpt_all else 0)
                    self._peaks[key] = est.peak_bytes
                return self._peaks[key]

            model.device_peak = device_peak
        return model

    def cost_inputs(self, spec, precision: str) -> CostInputs:
        """FLOPs and op counts (the same for every precision) from ``precision``'s probes."""
        if self._cost is None:
            pts = self.probe_points(spec)
            trs = [self.trace(precision, keep=j, m=self.m0, flops=True, spec=spec) for j in pts]
            if len(trs) == 2:
                def lin(a, b):
                    return a + (self.num_blocks - 1) * (b - a)
                flops = lin(trs[0].flops, trs[1].flops)
                ops = lin(trs[0].num_ops, trs[1].num_ops)
                params = lin(trs[0].num_trainable_params, trs[1].num_trainable_params)
            else:
                flops, ops, params = trs[0].flops, trs[0].num_ops, trs[0].num_trainable_params
            self._cost = CostInputs(
                flops_per_sample=max(flops, 1) / self.m0, ops_per_micro_batch=ops, num_params=int(params),
                num_blocks=self.num_blocks, device=self.device, tflops={}, interconnect_gbps=0.0,
            )
        c = self._cost
        if self.device == "cpu" or spec is None:
            tflops = {p: CPU_TFLOPS for p in PRECISIONS}
            link = 0.0
        else:
            half = {"bf16": spec.bf16_tflops, "16": spec.fp16_tflops}
            tflops = {
                "32-true": spec.fp32_tflops,
                "16-mixed": half["16"], "16-true": half["16"],
                "bf16-mixed": half["bf16"], "bf16-true": half["bf16"],
            }
            link = spec.interconnect_gbps
        return CostInputs(c.flops_per_sample, c.ops_per_micro_batch, c.num_params, c.num_blocks, c.device,
                          tflops, link)


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
) -> Plan:
    """Choose micro-batch, accumulation, precision, checkpointing and sharding for a budget.

    Knobs ``precision``, ``activation_checkpointing``, ``zero_stage`` and ``offload_optimizer``:
    None lets memguard choose, a value fixes it, a sequence restricts it. With ``precision=None``
    memguard considers ``"32-true"`` and the fastest mixed precision the GPU supports
    (``bf16-mixed`` where bf16 exists, else ``16-mixed``); ``*-true`` precisions are used only
    when you list them. ZeRO stages are considered only when ``world_size > 1``, unless fixed.
    This is :func:`plan_request` with the options gathered in a
    :class:`~memguard.planner.request.PlanRequest`.

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
        cache: True (or a :class:`memguard.planner.cache.PlanCache`) to reuse and store plans on
            disk, keyed by model structure, batch shapes, target and options.
        keep_outputs: True plans for a hand-written loop (``out = model(**batch)``) that keeps the
            output object alive through backward, the optimizer step and the next forward.
        max_shape: plan for the longest batch the data can produce: ``{"seq_len": L}`` and/or
            per-entry non-batch shapes (:func:`memguard.data.max_batch_shape` scans a dataset for
            it); ``Plan.reasons["planned_shape"]`` says which shape was planned for.
        train: False plans an evaluation step instead (:func:`memguard.planner.eval_plan.plan_eval_for`):
            ``global_batch_size`` is the evaluation batch over all ranks, the plan's
            ``micro_batch_size`` the most samples per forward, and the training-only knobs must be
            left at their defaults.
        finetune: None plans the model as given; ``"full"`` too, and when nothing fits the error
            lists measured LoRA, QLoRA, 8-bit AdamW, bf16-true and CPU-offload alternatives
            (``.alternatives``; :mod:`memguard.planner.finetune`); ``"lora"`` plans a LoRA twin of
            the model (peft adapters on every linear layer of the repeated blocks, base in bf16).
        strategy: None = DDP, or DeepSpeed ZeRO at stages >= 1 (as before strategies existed);
            ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"`` fixes it; a sequence lets memguard choose among
            them (``Plan.strategy`` says which). Under ``"fsdp2"`` ``zero_stage`` is FSDP2's sharding
            level (see :func:`memguard.estimate`) and ``*-mixed`` precisions mean its
            ``MixedPrecisionPolicy`` with fp32 gradient reduction and no autocast.
        cpu: for ``device="cpu"``: the CPU whose kernel paths are modelled, None or ``"host"`` (this
            one) or an instruction-set level such as ``"avx2"`` (see :func:`memguard.estimate`).

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
        cpu=cpu,
    )
    return plan_request(model, batch, request)


def plan_request(model: nn.Module, batch: Any, request: PlanRequest, *, planner: "Planner | None" = None) -> Plan:
    """:func:`memguard.plan` for a :class:`~memguard.planner.request.PlanRequest`.

    Args:
        model, batch: as for :func:`memguard.plan`.
        request: the options.
        planner: a :class:`Planner` for this model, batch and request (its traces are reused, e.g.
            across budgets, GPUs and world sizes); default: a new one.

    Returns:
        The :class:`~memguard.Plan`, verified with one full trace.

    Raises:
        ConfigError: bad options (all listed at once), a batch without a batch dimension, or a
            ``planner`` made for another model, batch or tracing options.
        InfeasiblePlanError: nothing fits; ``.closest`` is the nearest plan, with suggestions.
    """
    if request.train is False and planner is None:
        from memguard.planner.eval_plan import plan_eval_for

        return plan_eval_for(model, batch, **{k: v for k, v in request.options().items() if k != "train"})
    problems = request.problems()
    if request.train is False:
        problems.append("planner= traces training steps; plan an evaluation step (train=False) without planner=")
    if first_dim(batch) is None:
        problems.append("batch must hold at least one tensor with a batch dimension (dim 0)")
    if planner is not None:
        problems.extend(planner.mismatches(model, batch, request))
    if request.max_shape is not None and not problems:
        from memguard.data import planning_batch

        try:
            planning_batch(batch, request.max_shape)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    variant = None
    if request.finetune == "lora":
        from memguard.planner.finetune import finetune_variant

        variant = finetune_variant(model, request)
        if variant.model is not model:  # traces of the user's model do not apply to its LoRA twin
            model, request, planner = variant.model, variant.request, None
    space = request.resolve()
    if planner is None:
        planner = Planner.for_request(model, batch, request)
    store = None
    if request.cache:
        from memguard.planner.cache import PlanCache, plan_key

        store = request.cache if isinstance(request.cache, PlanCache) else PlanCache()
        key = plan_key(planner.model, planner.traced_batch, request.optimizer, request.loss_fn, dict(
            global_batch_size=request.global_batch_size, gpu=space.spec.name if space.spec else None,
            budget_bytes=space.budget_bytes, world_size=request.world_size, device=request.device,
            precision=space.precisions, ckpt=space.checkpointing, zero=space.zero_stages, offload=space.offloads,
            headroom=request.headroom, keep_outputs=request.keep_outputs, finetune=request.finetune,
            **({"strategy": space.shardings} if request.strategy is not None else {}),
            **({"cpu": request.cpu} if request.cpu is not None else {})))
        hit = store.get(key)
        if hit is not None:
            log.info("memguard: plan read from cache %s", store.path_for(key))
            return hit

    try:
        result = _search(planner, space.spec, global_batch_size=request.global_batch_size,
                         world_size=request.world_size, budget=space.budget_bytes, usable=space.usable_bytes,
                         headroom=request.headroom, precisions=space.precisions, ckpts=space.checkpointing,
                         zeros=space.zero_stages, offloads=space.offloads,
                         explicit_precision=space.explicit_precision,
                         shardings=space.shardings or tuple(("deepspeed" if z else "ddp", z) for z in space.zero_stages))
    except InfeasiblePlanError as exc:
        if request.finetune == "full":
            from memguard.planner.finetune import alternatives, suggestion_lines

            alts = alternatives(model, batch, request, planner=planner)
            raise InfeasiblePlanError(exc.reason, closest=exc.closest, alternatives=alts,
                                      suggestions=suggestion_lines(alts, space.usable_bytes) + exc.suggestions
                                      ) from None
        if request.finetune is None:
            raise InfeasiblePlanError(exc.reason, closest=exc.closest, suggestions=exc.suggestions + [
                "fine-tuning? finetune='full' measures LoRA, QLoRA, 8-bit AdamW, bf16-true and CPU-offload "
                "alternatives; finetune='lora' plans LoRA directly"]) from None
        raise
    if variant is not None and variant.reason:
        result = result.replace(reasons={**result.reasons, "finetune": variant.reason})
    if planner.shape_reason is not None:
        result = result.replace(reasons={**result.reasons, "planned_shape": planner.shape_reason})
    if store is not None:
        store.put(key, result)
    return result


def _search(planner: Planner, spec, *, global_batch_size, world_size, budget, usable, headroom, precisions, ckpts,
            zeros, offloads, explicit_precision, shardings=()) -> Plan:
    local = global_batch_size // world_size
    sizes = divisors(local)[::-1]
    n_blocks = planner.num_blocks
    if n_blocks < 1:
        ckpts = tuple(c for c in ckpts if not c) or (False,)
    planner._first_precision = planner._first_precision or precisions[0]
    cost = planner.cost_inputs(spec, precisions[0])
    rank = {p: i for i, p in enumerate(sorted(precisions, key=lambda p: (p != "32-true", p)))}
    shardings = shardings or tuple(("deepspeed" if z else "ddp", z) for z in zeros)
    configs = [(st, z, o) for st, z in shardings for o in offloads if not (o and z == 0)]
    strategy_rank: dict[str, int] = {}
    for st, _ in shardings:
        strategy_rank.setdefault(st, len(strategy_rank))

    def seconds(p, m, k, z, o, st=None):
        return step_seconds(cost, micro_batch_size=m, grad_accum_steps=local // m, world_size=world_size,
                            precision=p, checkpoint_blocks=k, zero_stage=z, offload_optimizer=o, strategy=st)

    # Best conceivable throughput of each (precision, checkpointing) pair, ignoring memory.
    pairs = []
    for p in precisions:
        for ck in ckpts:
            k = 1 if ck else 0
            best = min(seconds(p, m, k, z, o, st) for m in sizes[:1] for st, z, o in configs)
            pairs.append((global_batch_size / best, p, ck))
    pairs.sort(key=lambda t: -t[0])

    candidates: list[_Candidate] = []
    origin: dict[_Candidate, tuple[ProbeModel, bool]] = {}  # a candidate's probe model and checkpointing
    closest: _Candidate | None = None
    for bound, p, ck in pairs:
        if candidates and bound < max(c.throughput for c in candidates):
            continue  # cannot beat what is already found: do not trace it
        for st, z, o in configs:
            model = planner.probe_model(p, zero_stage=z, world_size=world_size, spec=spec, offload=o,
                                        checkpointing=ck, strategy=st)
            for m in sizes:
                accum = local // m
                k = _fewest_blocks(model, m, accum, usable) if ck else 0
                allocated = model.allocated(m, k, accum)
                # the device holds at least the allocated bytes: past the budget they are the closeness
                # measure, and the allocator model need not run
                pred = allocated if allocated > usable else model.predict(m, k, accum)
                s = seconds(p, m, k, z, o, st)
                cand = _Candidate(st, p, m, accum, k, z, o, pred, s, global_batch_size / s)
                if closest is None or pred < closest.predicted_bytes:
                    closest = cand
                if pred <= usable:
                    candidates.append(cand)
                    origin[cand] = (model, ck)
                    break
    if not candidates:
        raise _infeasible(planner, spec, closest, budget=budget, usable=usable, world_size=world_size,
                          global_batch_size=global_batch_size, headroom=headroom, zeros=zeros, offloads=offloads)
    def smaller(cand: _Candidate) -> _Candidate | None:
        """The same configuration at the next smaller micro-batch, when a larger one missed."""
        model, ck = origin[cand]
        below = [m for m in sizes if m < cand.micro_batch_size]
        if not below:
            return None
        m = below[0]
        accum = local // m
        k = _fewest_blocks(model, m, accum, usable) if ck else 0
        sec = seconds(cand.precision, m, k, cand.zero_stage, cand.offload_optimizer, cand.strategy)
        new = _Candidate(cand.strategy, cand.precision, m, accum, k, cand.zero_stage, cand.offload_optimizer,
                         model.predict(m, k, accum), sec, global_batch_size / sec)
        origin[new] = origin[cand]
        return new

    queue = sorted(candidates, key=lambda c: c.key(rank, strategy_rank))
    tried: list[tuple[_Candidate, Estimate]] = []
    worst = 1.0  # how far predictions have fallen short of full traces so far
    while queue and len(tried) < _MAX_VERIFY:
        cand = queue.pop(0)
        if cand.predicted_bytes * worst <= usable:
            est = _verify(planner, spec, cand, world_size, usable)
            tried.append((cand, est))
            if est.peak_bytes <= usable:
                return _make_plan(planner, spec, cand, est, world_size=world_size,
                                  global_batch_size=global_batch_size, budget=budget, headroom=headroom,
                                  candidates=candidates, precisions=precisions, explicit_precision=explicit_precision,
                                  strategies=[st for st, _ in shardings])
            worst = max(worst, est.peak_bytes / max(cand.predicted_bytes, 1))
            log.info("memguard: candidate %s predicted %s but verified at %s; trying the next",
                     cand, format_bytes(cand.predicted_bytes), format_bytes(est.peak_bytes))
        # a miss (or one predicted as optimistically as the last miss): try a smaller micro-batch too
        follow = smaller(cand)
        if follow is not None:
            queue.append(follow)
            queue.sort(key=lambda c: c.key(rank, strategy_rank))
    if closest is not None and all(c is not closest for c, _ in tried):
        # last resort: the configuration with the smallest predicted peak of all
        est = _verify(planner, spec, closest, world_size, usable)
        if est.peak_bytes <= usable:
            return _make_plan(planner, spec, closest, est, world_size=world_size,
                              global_batch_size=global_batch_size, budget=budget, headroom=headroom,
                              candidates=candidates, precisions=precisions, explicit_precision=explicit_precision,
                                  strategies=[st for st, _ in shardings])
        tried.append((closest, est))
    cand, est = min(tried, key=lambda t: t[1].peak_bytes)
    raise _infeasible(planner, spec, cand, budget=budget, usable=usable, world_size=world_size,
                      global_batch_size=global_batch_size, headroom=headroom, zeros=zeros, offloads=offloads,
                      verified=est)


def _fewest_blocks(model: ProbeModel, m: int, accum: int, usable: int) -> int:
    """The fewest checkpointed blocks (>= 1) predicted to fit at micro-batch ``m``, or all of them if none does.

    The allocated bytes fall as more blocks are checkpointed, and the device holds at least those:
    the search starts from the fewest blocks whose allocated bytes fit.
    """
    n = model.num_blocks

    def fewest(fits) -> int:
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    if model.allocated(m, n, accum) > usable or model.predict(m, n, accum) > usable:
        return n
    return fewest(lambda k: model.allocated(m, k, accum) <= usable and model.predict(m, k, accum) <= usable)


def _verify(planner: Planner, spec, cand: _Candidate, world_size: int, usable: int | None = None) -> Estimate:
    tr = planner.trace(traced_precision(cand.precision, cand.zero_stage, cand.strategy), ckpt=cand.checkpoint_blocks,
                       m=cand.micro_batch_size, grads_present=cand.grad_accum_steps > 1, spec=spec,
                       fsdp2=planner._layout(cand.strategy, cand.precision, cand.zero_stage, world_size))
    target = Target(device=planner.device, precision=cand.precision, zero_stage=cand.zero_stage,
                    world_size=world_size, gpu=spec, strategy=cand.strategy,
                    offload_optimizer=cand.offload_optimizer)
    est, _ = estimate_from_trace(tr, target, micro_batch_size=cand.micro_batch_size,
                                 checkpointed=cand.checkpoint_blocks, limit_bytes=usable)
    return est


def _make_plan(planner, spec, cand: _Candidate, est: Estimate, *, world_size, global_batch_size, budget, headroom,
               candidates, precisions, explicit_precision, strategies=()) -> Plan:
    n = planner.num_blocks
    reasons = {
        "micro_batch_size": (
            f"{cand.micro_batch_size} x {cand.grad_accum_steps} accumulation x {world_size} ranks = {global_batch_size}; "
            f"the fastest split predicted to fit ({cand.throughput:.3g} samples/s by the cost model)"
        ),
        "precision": (
            f"{cand.precision}: fixed by you" if len(precisions) == 1 and explicit_precision else
            f"{cand.precision}: fastest of {', '.join(precisions)} that fits"
            + (f" ({_rate(spec, cand.precision):g} TFLOP/s on {spec.name})" if spec is not None and planner.device == "cuda" and _rate(spec, cand.precision) else "")
        ),
        "activation_checkpointing": (
            "off: fits without recomputation" if cand.checkpoint_blocks == 0 else
            f"{cand.checkpoint_blocks} of {n} blocks: the fewest that let micro-batch {cand.micro_batch_size} fit "
            f"(+{100 * cand.checkpoint_blocks / (3 * n):.0f}% compute)"
        ),
        "zero_stage": (
            "0: one device" if world_size == 1 and cand.zero_stage == 0 else
            f"{cand.zero_stage}: the least sharding (and communication) that fits and is fastest"
        ),
    }
    if len(set(strategies)) > 1:
        reasons["strategy"] = f"{cand.strategy}: the fastest of {', '.join(dict.fromkeys(strategies))} that fits"
    elif cand.strategy == "fsdp2":
        reasons["strategy"] = "fsdp2: asked for"
    if cand.offload_optimizer:
        reasons["offload_optimizer"] = "optimizer state in host memory: nothing fits on the device otherwise"
    blocks = find_blocks(planner.model)
    plan = Plan(
        micro_batch_size=cand.micro_batch_size,
        grad_accum_steps=cand.grad_accum_steps,
        world_size=world_size,
        global_batch_size=global_batch_size,
        precision=cand.precision,
        activation_checkpointing=cand.checkpoint_blocks > 0,
        checkpoint_blocks=cand.checkpoint_blocks,
        zero_stage=cand.zero_stage,
        offload_optimizer=cand.offload_optimizer,
        budget_bytes=int(budget),
        estimate=est,
        device=planner.device,
        gpu=spec.name if (spec is not None and planner.device == "cuda" and spec.memory_bytes) else None,
        headroom=float(headroom),
        throughput=float(cand.throughput),
        reasons=reasons,
        block_class=type(blocks[0]).__name__ if blocks else None,
        hidden_size=hidden_size(planner.model),
        strategy=cand.strategy,
        notes=strategy_notes(cand.strategy, cand.precision, cand.zero_stage, cand.offload_optimizer,
                             type(blocks[0]).__name__ if blocks else None),
    )
    from memguard.planner.notes import notes_for_plan

    return plan.replace(notes=tuple(plan.notes) + tuple(notes_for_plan(plan)))


def strategy_notes(strategy: str, precision: str, zero_stage: int, offload: bool, block_class: str | None
                   ) -> tuple[str, ...]:
    """How to run a plan's sharding, one sentence each (``Plan.notes``); empty for DDP and DeepSpeed."""
    if strategy != "fsdp2":
        return ()
    from memguard.estimator.fsdp2 import describe_stage

    blocks = f"each {block_class}" if block_class else "each repeated block"
    notes = [
        f"FSDP2: fully_shard {blocks}, then the root module (memguard.integrations.fsdp.apply(model, plan) does "
        f"this), with {describe_stage(zero_stage)}."
    ]
    if precision.endswith("-mixed"):
        dtype = "torch.bfloat16" if precision.startswith("bf16") else "torch.float16"
        notes.append(f"{precision} under FSDP2 is MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype=torch.float32) "
                     "with no autocast.")
    if zero_stage == 1:
        notes.append("Call model.set_requires_gradient_sync(False) before every micro-batch but the last of a step, "
                     "and True before the last.")
    if offload:
        notes.append("offload_optimizer under FSDP2 is CPUOffloadPolicy: sharded parameters, gradients and optimizer "
                     "state in host memory; the optimizer steps on the CPU.")
    return tuple(notes)


def _rate(spec, precision: str) -> float:
    if precision == "32-true":
        return spec.fp32_tflops
    return spec.bf16_tflops if precision.startswith("bf16") else spec.fp16_tflops


def _infeasible(planner, spec, cand, *, budget, usable, world_size, global_batch_size, headroom, zeros, offloads,
                verified: Estimate | None = None) -> InfeasiblePlanError:
    closest_plan = None
    est = verified
    if cand is not None:
        if est is None:
            est = _verify(planner, spec, cand, world_size)
        closest_plan = Plan(
            micro_batch_size=cand.micro_batch_size, grad_accum_steps=cand.grad_accum_steps, world_size=world_size,
            global_batch_size=global_batch_size, precision=cand.precision,
            activation_checkpointing=cand.checkpoint_blocks > 0, checkpoint_blocks=cand.checkpoint_blocks,
            zero_stage=cand.zero_stage, offload_optimizer=cand.offload_optimizer, budget_bytes=int(budget),
            estimate=est, device=planner.device, gpu=spec.name if spec is not None and spec.memory_bytes else None,
            headroom=float(headroom), throughput=float(cand.throughput),
            reasons={"closest": "the configuration with the smallest predicted peak"},
            block_class=type(blocks[0]).__name__ if (blocks := find_blocks(planner.model)) else None,
            hidden_size=hidden_size(planner.model), strategy=cand.strategy,
            notes=strategy_notes(cand.strategy, cand.precision, cand.zero_stage, cand.offload_optimizer,
                                 type(blocks[0]).__name__ if blocks else None),
        )
    need = est.peak_bytes if est is not None else 0
    suggestions: list[str] = []
    if est is not None:
        states = est.model_state_bytes
        act = need - states
        if 3 not in zeros or world_size == 1:
            suggestions.append(
                "shard model states with ZeRO-3 over more GPUs (world_size > 1, zero_stage=3): "
                f"model states are {format_bytes(states)} per rank now"
            )
        if True not in offloads:
            suggestions.append("offload optimizer state to host memory (offload_optimizer=True with ZeRO >= 1)")
        if act > 0 and usable > states:
            frac = (usable - states) / act
            if frac < 1:
                suggestions.append(f"a shorter sequence or smaller inputs: activations must shrink to about {frac:.0%} of now")
        from memguard.estimator.gpus import GPUS

        bigger = sorted((g for g in GPUS.values() if g.memory_bytes - g.context_bytes > need / (1 - headroom)),
                        key=lambda g: g.memory_bytes)
        if bigger and planner.device == "cuda" and spec is not None and spec.memory_bytes:
            suggestions.append(f"a GPU with more memory, e.g. {bigger[0].name} ({format_bytes(bigger[0].memory_bytes)})")
    msg = (
        f"no configuration fits {format_bytes(usable)} usable per rank ({format_bytes(budget)} budget, "
        f"{headroom:.0%} headroom); the closest needs {format_bytes(need)}"
    )
    return InfeasiblePlanError(msg, closest=closest_plan, suggestions=suggestions)
