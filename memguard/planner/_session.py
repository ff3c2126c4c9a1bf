"""The trace session: the traces and probe models of one model and example batch, cached.

Every question the planner asks about a model's training step (the search's probes and
verifications, the sizing of a new batch shape for the guard, the plot's curves) is answered from
traces of that step on fake tensors (:func:`memguard.estimator._tracing.run_trace`).
A :class:`TraceSession` holds the model, the example batch and the tracing options, and caches
every trace by what it depends on, so that planning the same job for other budgets, GPUs and
world sizes traces nothing twice. :meth:`TraceSession.probe_model` turns the 1- and 2-block probe
traces into a :class:`~memguard.planner._probe.ProbeModel` (see :mod:`memguard.planner._probe`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from memguard.batch import first_dim, resize_batch
from memguard.errors import ConfigError
from memguard.estimator._pricing import estimate_from_trace
from memguard.estimator._targets import Target, traced_precision, unwrap_model
from memguard.estimator._tracing import TraceRequest, fsdp1_layout, fsdp2_layout, run_trace
from memguard.estimator._blocks import find_blocks
from memguard.planner._cost import CPU_TFLOPS, CostInputs
from memguard.planner._probe import (
    ProbeFeatures,
    ProbeModel,
    extend_trace,
    interpolate_trace,
    with_gradients_present,
)
from memguard.planner._request import PlanRequest
from memguard.vocab import PRECISIONS

log = logging.getLogger("memguard")

#: The probes' smallest micro-batch (see :attr:`TraceSession.m0`).
PROBE_MICRO_BATCH = 8


@dataclass
class TraceSession:
    """The traces and probe models of one model and example batch, cached across questions.

    :func:`memguard.planner.api.plan_request` makes one per call unless given one;
    :func:`memguard.planner.api.fit_gpus` and the command line share one across budgets, GPUs and
    world sizes (traces are cached by everything they depend on: precision, checkpointing, kept
    blocks, micro-batch and the CUDA target).
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
    #: ``gradient_compression="powersgd"``'s options (:class:`memguard.estimator._powersgd.PowerSGDOptions`), or None.
    powersgd: Any = None
    _traces: dict = field(default_factory=dict)
    _extended: dict = field(default_factory=dict)
    _peaks: dict = field(default_factory=dict)
    _cost: CostInputs | None = None
    _whole: bool = False
    _first_precision: str | None = None

    @classmethod
    def for_request(cls, model: nn.Module, batch: Any, request: PlanRequest) -> "TraceSession":
        """A session for ``model`` and ``batch`` with the request's tracing options."""
        return cls(model, batch, optimizer=request.optimizer, loss_fn=request.loss_fn, device=request.device,
                   make_batch=request.make_batch, keep_outputs=request.keep_outputs, max_shape=request.max_shape,
                   cpu=request.cpu, powersgd=request.compression([]))

    def mismatches(self, model: nn.Module, batch: Any, request: PlanRequest) -> list[str]:
        """Why this session's traces cannot answer ``request`` for ``model`` and ``batch`` (empty if they can)."""
        out = []
        if unwrap_model(model) is not self.model or batch is not self.batch:
            out.append("session= was made for another model or example batch; make one with "
                       "TraceSession.for_request(model, batch, request)")
        for name in ("optimizer", "loss_fn", "device", "make_batch", "keep_outputs", "max_shape", "cpu"):
            if getattr(request, name) is not getattr(self, name) and getattr(request, name) != getattr(self, name):
                out.append(f"session= traces with {name}={getattr(self, name)!r} but the request has "
                           f"{name}={getattr(request, name)!r}; make the session with TraceSession.for_request")
        if request.compression([]) != self.powersgd:
            out.append(f"session= was made for gradient compression {self.powersgd!r}, the request asks for "
                       f"{request.compression([])!r}; make the session with TraceSession.for_request")
        return out

    def with_compression(self, trace: Any, precision: str) -> Any:
        """``trace`` (of the whole model) with PowerSGD's memory added when the session plans with it
        (:func:`memguard.estimator._powersgd.add_powersgd`, as :func:`memguard.estimate` adds it)."""
        if self.powersgd is None:
            return trace
        from memguard.estimator._powersgd import add_powersgd, grad_dtype_of, powersgd_buckets

        buckets = powersgd_buckets(self.model, self.powersgd, grad_dtype_of(precision))
        return add_powersgd(trace, buckets, self.powersgd)

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
        """How many distinct steps this session has traced so far."""
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
            fsdp2: the :class:`~memguard.estimator._fsdp2.FSDP2Layout` of an FSDP2 target (its
                offload setting does not change the trace), an
                :class:`~memguard.estimator._fsdp1.FSDP1Layout` of an FSDP1 target, or None.
        """
        spec = spec if self.device == "cuda" else None
        fsdp1 = None
        from memguard.estimator._fsdp1 import FSDP1Layout

        if isinstance(fsdp2, FSDP1Layout):  # an FSDP1 target (_layout)
            fsdp1, fsdp2 = fsdp2, None
        if fsdp2 is not None:
            import dataclasses

            # level 1 differs from level 2 only when gradients accumulate unsynchronised
            stage = 2 if fsdp2.zero_stage == 1 and not grads_present else fsdp2.zero_stage
            fsdp2 = dataclasses.replace(fsdp2, offload=False, zero_stage=stage)
        key = (precision, ckpt, keep, m, grads_present, flops, getattr(spec, "name", None), fsdp2, fsdp1)
        if key not in self._traces:
            start = time.perf_counter()
            batch = self.traced_batch if m is None else self.batch_of(m)
            request = TraceRequest(
                device=self.device, precision=precision, checkpoint_blocks=ckpt, grads_present=grads_present,
                keep_blocks=keep, count_flops=flops, keep_outputs=self.keep_outputs, gpu=spec,
                cpu=self._cpu_target(), fsdp2=fsdp2, fsdp1=fsdp1,
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
        from memguard.estimator._cpu_kernels import CpuTarget

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
        """The FSDP2 or FSDP1 layout a trace needs (None for DDP and DeepSpeed, whose sharding is a re-scan)."""
        if strategy == "fsdp1":
            return fsdp1_layout(strategy, precision, zero_stage, world_size, self.device)
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
        from memguard.estimator._analysis import scan

        three = self.trace(traced, ckpt=3 if ckpt_all else 0, keep=3, m=self.m0, spec=spec, fsdp2=layout,
                           grads_present=grads_present)
        extended = extend_trace(one, two, 3)
        return extended is not None and scan(extended).peak_bytes == scan(three).peak_bytes

    def _device_trace(self, precision: str, zero_stage: int, ckpt_all: bool, spec: Any, m: int,
                      strategy: str = "ddp", world_size: int = 1, grads_present: bool = False):
        """The whole model's trace at micro-batch ``m``: each tensor's size is affine in the micro-batch
        (a tensor's shape has the batch as a factor, or not at all), so traces at two micro-batches give
        every tensor's size at any other (:func:`memguard.planner._probe.interpolate_trace`)."""
        base, other = self._whole_traces(precision, zero_stage, ckpt_all, spec, strategy, world_size, grads_present)
        m1 = 2 * self.m0
        if len(base.events) != len(other.events) and m >= m1:  # the larger micro-batch's kernels
            return interpolate_trace(other, m1, other, m1, m)
        return interpolate_trace(base, self.m0, other, m1, m)

    def probe_model(self, precision: str, *, zero_stage: int, world_size: int, spec: Any, offload: bool,
                    checkpointing: bool, strategy: str | None = None) -> ProbeModel:
        """The probe model of one target (see :mod:`memguard.planner._probe`).

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
                    whole = self.with_compression(whole, precision)
                    target = Target(device=self.device, precision=precision, zero_stage=zero_stage,
                                    world_size=world_size, gpu=spec, strategy=strategy, offload_optimizer=offload)
                    est, _ = estimate_from_trace(whole, target, micro_batch_size=m,
                                                 checkpointed=self.num_blocks if ckpt_all else 0)
                    self._peaks[key] = est.peak_bytes
                return self._peaks[key]

            model.device_peak = device_peak
        return model

    def cost_inputs(self, spec, precision: str) -> CostInputs:
        """FLOPs and op counts (the same for every precision) from ``precision``'s probes.

        The first precision asked about is the one whose probes count FLOPs from then on (and in
        which the probes check whether the model runs with fewer blocks).
        """
        self._first_precision = self._first_precision or precision
        if self._cost is None:
            pts = self.probe_points(spec)
            trs = [self.trace(precision, keep=j, m=self.m0, flops=True, spec=spec) for j in pts]
            if len(trs) == 2:
                def lin(a, b):
                    return a + (self.num_blocks - 1) * (b - a)
                flops = lin(trs[0].flops, trs[1].flops)
                ops = lin(trs[0].num_ops, trs[1].num_ops)
                ops_block = trs[1].num_ops - trs[0].num_ops
                params = lin(trs[0].num_trainable_params, trs[1].num_trainable_params)
            else:
                flops, ops, params = trs[0].flops, trs[0].num_ops, trs[0].num_trainable_params
                ops_block = 0
            self._cost = CostInputs(
                flops_per_sample=max(flops, 1) / self.m0, ops_per_micro_batch=ops, num_params=int(params),
                num_blocks=self.num_blocks, device=self.device, tflops={}, interconnect_gbps=0.0,
                ops_per_block=ops_block,
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
                          tflops, link, ops_per_block=c.ops_per_block)
