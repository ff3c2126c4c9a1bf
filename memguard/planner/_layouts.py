"""The layout planner: data, tensor and pipeline parallel layouts of ``world_size`` GPUs in nodes of
``gpus_per_node``, searched with precision, checkpointing and micro-batch, ranked by a cost model.

``memguard.plan(..., world_size=N, gpus_per_node=K)`` runs :func:`search_layouts`. The layouts
(:func:`layout_degrees`): tensor parallelism ``tp`` divides ``K`` (it stays inside a node, on its
NVLink or PCIe link), pipeline stages ``pp`` divide the number of nodes (stages cross nodes),
and the rest is data parallel: FSDP2 (``dp_shard``), DDP (``dp_replicate``, without TP) or HSDP
(shards inside a node, replicas across), each pipeline layout under ``1F1B`` and ``GPipe`` with
every micro-batch count that splits a replica's batch.

Memory (:class:`LayoutProfile`, :meth:`LayoutProfile.rank_bytes`): no candidate is traced.
The profile comes from a few probe traces of the model cut to 1 and 2 repeated blocks (the
planner's probes, :mod:`memguard.planner._probe`: each takes well under a second even for a 405B
model on fake tensors), without and with checkpointing, in the precision's own dtypes and in
FSDP2's (its mixed policy computes in the 16-bit dtype, as ``*-true`` does), plus one pair of
tensor-parallel probes at ``tp=2`` (``parallelize_module`` over a fake process group,
:func:`memguard.estimator._tp_trace.trace_tp_step`) that measures which share of a block's
activations tensor parallelism splits. From them, per parameter and per sample: model-state bytes,
one block's activations (plain and checkpointed) and the rest of the model's (embeddings, head,
loss). A rank's peak is then counted analytically for its stage:

* parameters: the stage's blocks (their tensor-parallel Linear layers divided by ``tp``, counted
  from the plan :func:`memguard.estimator._layout.resolve_tp_plan` gives, the rest replicated),
  the embeddings on the first stage, the head and final norm on the last, at the probes' state and
  gradient bytes per parameter, divided by ``dp_shard`` under FSDP2;
* FSDP2's unsharded buffers (``_fsdp_param_group.py``, torch 2.13): two blocks' parameters in the
  compute dtype (the block in use and the prefetched one), one block's unsharded gradients and its
  reduce-scatter input in the reduce dtype, the root group's (embeddings and head) parameters and
  gradients; under pipelining, the stage keeps its unsharded parameters and accumulates unsharded
  gradients in the reduce dtype through the step (``torch/distributed/pipelining/stage.py``,
  ``backward_maybe_with_nosync``: ``set_reshard_after_backward(False)``,
  ``set_requires_gradient_sync(False)`` until the last micro-batch; ``_fsdp_param.py``,
  ``to_accumulated_grad_if_needed``);
* DDP's bucket copies of the gradients (as :mod:`memguard.estimator._sharding` counts them);
* activations: the micro-batches a stage keeps in flight (``GPipe`` all ``M``; ``1F1B`` ``pp - s``
  on stage ``s``, as the schedule's action order keeps them, the figures
  :mod:`memguard.estimator._pipeline` traces), each with the stage's blocks (plain ones with the
  split share divided by ``tp``; checkpointed ones keep only their input, which tensor parallelism
  without sequence parallelism replicates: Korthikanti et al. 2022, arXiv 2205.05198, 2sbh per
  layer under full recompute), one block's recomputation, the head and loss on the last stage, the
  p2p receive buffers torch's ``PipelineStage`` keeps for every micro-batch (the input's on every
  stage but the first, the output gradient's on every stage but the last: ``stage.py``,
  ``_prepare_forward_infra`` / ``_prepare_backward_infra``) and one micro-batch's send;
* the optimizer step's own transients, per parameter, from the probes.

These are allocated bytes (no CUDA allocator model) plus the target's BLAS workspaces; the winner is
verified with a real ``memguard.estimate(..., layout=...)`` where that estimates the layout (not DDP
over pipeline stages or over tensor-parallel shards) and a full
trace is predicted to take at most ``verify_budget_s`` (default :data:`VERIFY_BUDGET_S`). The
prediction is the model's op count (counted on the probes) times :data:`SECONDS_PER_OP` and
:func:`trace_seconds`' DTensor factor, not a clock reading, so the same request gets the same plan on
an idle and on a loaded host. Where the full trace is over budget but a *short verification* is
not, the winner is verified on the model cut to a few blocks (:func:`short_points`: a stack of plain
or of checkpointed blocks at 4 and 8 of them; one with ``k`` of ``n`` checkpointed at (plain,
checkpointed) = (2, 2), (6, 2) and (2, 6); :func:`memguard.estimator._tracing.keeping_blocks`), each a real
``estimate(..., layout=...)`` with the CUDA allocator model, and every figure extrapolated affinely to
the whole stack (:func:`extrapolate`). Repeated blocks add the same tensors, so allocated bytes are
affine in the blocks, to the byte on Llama 3.1 8B and 70B shapes; the caching allocator's overhead
is not: its segments come in steps, and on deep checkpointed stacks it grows faster than the short
traces show (``benchmarks/short_verification.py``, against full traces: FSDP2, FSDP2 x TP and HSDP
without or with half the blocks checkpointed -0.3% to +0.3%, all 32 checkpointed -1.6%, 70B on
FSDP 256 with 78 of 80 checkpointed -5.6%, at a fifth to a third of the time). So a short
verification that finds a layout over the budget rejects it, while one that finds it fitting leaves
it a note to verify it fully; the plan's headroom (10% by default) is what covers the difference.
Pipeline layouts are verified by full traces only (their cost is the schedule's micro-batches, not
the depth). A verification that finds the model short sizes the
next candidate with that shortfall (:data:`_MAX_VERIFY` at most). ``Plan.reasons["estimate"]`` says
which it is.

Known limitations:
    Against real layout estimates of a small Llama (``tests/planner/test_layouts.py``) DDP, FSDP2
    and TP are within 10%, checkpointed FSDP2 x TP 14% high, the first pipeline stage 13.5% low on
    the CPU target (3% on CUDA). Only one TP plan is searched (the config's
    ``base_model_tp_plan``, which replicates embeddings and head, unlike torchtitan's), only
    ``1F1B``/``GPipe``, FSDP2 only at level 3, and no optimizer offload or PowerSGD.

Cost (:func:`layout_seconds`, in the conventions of :mod:`memguard.planner._cost`, except that the
data-parallel collectives overlap compute: FSDP2 prefetches the next group's all-gather and
reduce-scatters on a separate stream during backward (``torch.distributed.fsdp.fully_shard`` docs,
implicit prefetching; ``_fsdp_param_group.py``), DDP all-reduces buckets as backward produces them
(Li et al. 2020, PyTorch Distributed, arXiv 2006.15704, section 3.2.3); only their time beyond the
compute counts. Tensor-parallel all-reduces sit on the critical path (no async TP) and pipeline
p2p is counted in full, a conservative bound):

* compute: the step's FLOPs (counted on the probes) over the ``N`` GPUs at the precision's rate
  times ``MFU``, checkpointing's recomputation ``1 + k/(3L)``, at least the per-op launch floor
  per micro-batch;
* pipeline bubble: ``(p - 1) / (m + p - 1)`` of the step idle for ``p`` stages and ``m``
  micro-batches under GPipe and 1F1B (Narayanan et al. 2021, arXiv 2104.04473, section 2.2; Huang
  et al. 2019, GPipe, arXiv 1811.06965), i.e. compute times ``(m + p - 1) / m``;
* tensor parallelism: 4 all-reduces of a block's input per block and micro-batch (2 forward, 2
  backward; Shoeybi et al. 2019, Megatron-LM, arXiv 1909.08053, section 3), 2 more for each
  recomputed block, ring all-reduce ``2 (t - 1) / t`` of the bytes, over the node's link
  (``GPUSpec.interconnect_gbps``);
* data parallelism: FSDP2 all-gathers in the compute dtype (twice per micro-batch at
  ``reshard_after_forward=True``) and reduce-scatters in the reduce dtype per micro-batch (once per
  step under pipelining, above), ``(D - 1) / D`` of the stage's parameters; HSDP adds an all-reduce
  of the shard over replicas; DDP all-reduces the gradients once per step. A group confined to a
  node uses its link, one spanning nodes the network (``GPUSpec.scale_out_gbps``, per GPU);
* pipeline p2p: each micro-batch's block input forward and its gradient backward, over the network
  when stages sit in different nodes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from memguard.errors import ConfigError, InfeasiblePlanError
from memguard.estimator._layout import Layout, _style_for, check_model_fits, resolve_tp_plan
from memguard.estimator._pipeline import decoder_parts, stage_bounds
from memguard.planner._cost import LAUNCH_S, MFU
from memguard.planner._probe import ProbeFeatures, divisors
from memguard.vocab import format_bytes

log = logging.getLogger("memguard")

#: The schedules the layout planner searches (those :mod:`memguard.estimator._pipeline` traces).
SEARCHED_SCHEDULES = ("1F1B", "GPipe")
#: Full verifications at most (each traces the whole model under its layout).
_MAX_VERIFY = 2
#: A verification predicted (:func:`trace_seconds`) to take longer than this is skipped, so that planning
#: stays a matter of seconds; ``plan(verify_budget_s=...)`` changes it (0: never verify; ``math.inf``:
#: always, where ``estimate(layout=...)`` supports the layout).
VERIFY_BUDGET_S = 20.0
#: The short verification's depths (see the module docstring): a stack of plain or of checkpointed blocks is
#: traced at 4 and at 8 of them; one with some checkpointed at (plain, checkpointed) = (2, 2), (6, 2) and (2, 6).
SHORT_DEPTHS = (4, 8)
SHORT_MIXED = ((2, 2), (6, 2), (2, 6))
#: CPU seconds a full trace spends per ATen op of the step (forward, backward, optimizer; views not counted),
#: measured with ``time.process_time`` on a 2-core AMD EPYC (Zen 4) host: a Llama 3.1 8B-shaped model
#: (``benchmarks/layout_planner.py``'s shapes, bf16-mixed, H100 target, sequence 8192, micro-batch 1) ran 22,045
#: ops in 4.26 s of CPU time, 1.93e-4 s per op (the probes: 1.92e-4 for the 2-block one, after torch's warm-up).
#: A constant, not the probes' clock: what the prediction decides (verify or not) must not depend on host load.
SECONDS_PER_OP = 2.0e-4
#: How much longer a trace under FSDP2 or tensor parallelism takes than a plain one (DTensor dispatch and the
#: fake collectives), measured as above: ``estimate(layout=Layout(dp_shard=8))`` 10.6 s (2.5x),
#: ``Layout(dp_shard=4, tp=2)`` 13.9 s (3.3x, taken as 3.5: a TP trace's cost grows with the plan's boundaries).
DTENSOR_FACTOR = {"fsdp2": 2.5, "tp": 3.5}


def trace_seconds(ops: float, lay: Layout) -> float:
    """The predicted seconds of a full ``estimate(layout=lay)`` trace of a step of ``ops`` ATen ops, on the host
    :data:`SECONDS_PER_OP` was measured on (a figure for deciding, not a measurement)."""
    factor = DTENSOR_FACTOR["tp"] if lay.tp > 1 else DTENSOR_FACTOR["fsdp2"] if lay.dp_shard > 1 else 1.0
    return ops * SECONDS_PER_OP * factor


def _dtype_bytes(precision: str) -> tuple[int, int]:
    """(compute dtype, FSDP2 reduce dtype) bytes: 16-bit compute under every 16-bit precision;
    memguard's FSDP2 mixed policy reduces in fp32 (:func:`memguard.estimator._tracing.fsdp2_layout`)."""
    if precision == "32-true":
        return 4, 4
    return 2, 4 if precision.endswith("-mixed") else 2


@dataclass(frozen=True)
class Activations:
    """Bytes per sample from one precision's probes (see the module docstring)."""

    block: float  # one plain block's activations and temporaries at the peak
    block_ckpt: float  # one checkpointed block's (its input)
    rest: float  # embeddings, head, loss, inputs
    states_per_param: float  # params + optimizer state
    grads_per_param: float
    opt_extra_per_param: float  # the optimizer step's transients


@dataclass
class LayoutProfile:
    """What the layout planner knows of a model's step: parameter counts and per-precision probes."""

    num_blocks: int
    p_block_tp: int  # a block's parameters that tensor parallelism shards
    p_block_rep: int  # a block's parameters it replicates (norms, biases of replicated layers)
    p_first: int  # the input embeddings
    p_last: int  # everything else outside the blocks (final norm, head)
    tp_shared: float  # share of a plain block's activations tensor parallelism does not split
    acts: dict = field(default_factory=dict)  # (precision, fsdp2) -> Activations
    tp_degrees: tuple[int, ...] = (1,)
    tp_reason: str = ""
    pipeline: bool = False  # the model splits into pipeline stages
    ops_per_step: float = 0.0  # the whole model's ATen ops per micro-batch (counted on the probes)
    ops_per_block: float = 0.0  # the ops one more block adds per micro-batch (0: not probed)
    fixed_bytes: int = 0  # the target's BLAS workspaces (CUDA), the same on every rank
    block_class: str | None = None  # the repeated block's class name (FSDP2 wraps each; Plan.block_class)

    def block_params(self, tp: int) -> float:
        return self.p_block_tp / tp + self.p_block_rep

    def stage_params(self, tp: int, pp: int, s: int) -> float:
        lo, hi = stage_bounds(self.num_blocks, pp, s)
        return (hi - lo) * self.block_params(tp) + (self.p_first if s == 0 else 0) + (
            self.p_last if s == pp - 1 else 0)

    def rank_bytes(self, lay: Layout, precision: str, m: int, n_micro: int, k: int, s: int) -> dict[str, float]:
        """Predicted allocated bytes of stage ``s``'s ranks by part (see the module docstring).

        ``n_micro``: micro-batches per step (accumulation, or the pipeline's count); ``k``:
        checkpointed blocks per stage."""
        fsdp = lay.dp_shard > 1
        a = self.acts[(precision, fsdp)]
        cd, rd = _dtype_bytes(precision)
        tp, pp, D = lay.tp, lay.pp, lay.dp_shard
        lo, hi = stage_bounds(self.num_blocks, pp, s)
        blocks = hi - lo
        k = min(k, blocks)
        p_loc = self.stage_params(tp, pp, s)
        states = p_loc * (a.states_per_param + a.grads_per_param) / D
        buffers = 0.0
        if fsdp:
            blk = self.block_params(tp)
            root = (self.p_first if s == 0 else 0) + (self.p_last if s == pp - 1 else 0)
            if pp > 1:  # the stage stays unsharded through the step, gradients accumulate unsharded
                buffers = p_loc * (cd + rd) + blk * cd
            else:
                buffers = blk * (2 * cd + cd + rd) + root * 2 * cd
        elif lay.dp_replicate > 1:
            buffers = p_loc * a.grads_per_param  # DDP's bucket copies
        plain = a.block * (self.tp_shared + (1 - self.tp_shared) / tp)
        per_micro = m * ((blocks - k) * plain + k * a.block_ckpt)
        if pp == 1:
            flight = 1
        elif lay.pp_schedule == "GPipe":
            flight = n_micro
        else:
            flight = min(n_micro, pp - s)
        act = flight * per_micro
        rest = 0.0
        if s == pp - 1:
            rest = m * a.rest * (n_micro if (pp > 1 and lay.pp_schedule == "GPipe") else 1)
        # the head's logits and loss are freed before the blocks' backward recomputes one block
        recompute = m * max(plain - a.block_ckpt, 0.0) if k else 0.0
        act += max(rest, recompute)
        if pp > 1:
            # torch's PipelineStage makes a receive buffer per micro-batch, on the first step, and keeps them:
            # for its input on every stage but the first, for its output's gradient on every stage but the last
            # (torch/distributed/pipelining/stage.py, _prepare_forward_infra / _prepare_backward_infra: one
            # _RecvInfo buffer per chunk); plus the send of one micro-batch, which gloo holds until it is waited on
            act += (n_micro * ((s > 0) + (s < pp - 1)) + 1) * m * a.block_ckpt
        opt = states + p_loc * a.opt_extra_per_param / D
        return {"model_states": states, "buffers": buffers + self.fixed_bytes, "activations": act,
                "optimizer_step": opt + self.fixed_bytes}

    def peak(self, lay: Layout, precision: str, m: int, n_micro: int, k: int) -> tuple[int, list[int]]:
        """The highest stage's peak and each stage's."""
        peaks = []
        for s in range(lay.pp):
            parts = self.rank_bytes(lay, precision, m, n_micro, k, s)
            peaks.append(int(max(parts["model_states"] + parts["buffers"] + parts["activations"],
                                 parts["optimizer_step"])))
        return max(peaks), peaks


# ----------------------------------------------------------------------------------------------
# The profile


def _features(session: Any, precision: str, ckpt: bool, j: int, spec: Any) -> ProbeFeatures:
    from memguard.estimator._pricing import estimate_from_trace
    from memguard.estimator._targets import Target

    # plain probes count FLOPs too, so the cost model's inputs (TraceSession.cost_inputs) reuse them
    tr = session.trace(precision, ckpt=j if ckpt else 0, keep=j, m=session.m0, spec=spec, flops=not ckpt)
    target = Target(device="cpu", precision=precision, zero_stage=0, world_size=1, strategy="ddp")
    _, tl = estimate_from_trace(tr, target, micro_batch_size=session.m0)
    return ProbeFeatures.of(tl)


def _activations(session: Any, precision: str, act_precision: str, spec: Any, p_block: int, ckpt: bool
                 ) -> Activations:
    m0 = session.m0
    s1, s2 = (_features(session, precision, False, j, spec) for j in (1, 2))
    a1, a2 = (_features(session, act_precision, False, j, spec) for j in (1, 2)) if act_precision != precision \
        else (s1, s2)
    block = max(a2.act - a1.act, 0.0) / m0
    if ckpt:
        c1, c2 = (_features(session, act_precision, True, j, spec) for j in (1, 2))
        block_ckpt = max(c2.act - c1.act, 0.0) / m0
    else:  # not searched: a block's input, for the communication terms, is at most its activations' share
        block_ckpt = block / 34  # 2sbh of 34sbh+ per layer (Korthikanti et al. 2022, arXiv 2205.05198)
    per = max(p_block, 1)
    states = (s2.states - s1.states) / per
    grads = (s2.grads_total - s1.grads_total) / per
    extra = max((s2.opt_peak - s1.opt_peak) - (s2.states - s1.states) - (s2.grads_total - s1.grads_total), 0.0) / per
    return Activations(block=block, block_ckpt=block_ckpt, rest=max(a1.act / m0 - block, 0.0),
                       states_per_param=states, grads_per_param=grads, opt_extra_per_param=extra)


def _param_counts(model: nn.Module, plan: dict | None) -> tuple[int, int, int, int]:
    from memguard.estimator._blocks import find_blocks

    blocks = find_blocks(model)
    block = blocks[0]
    prefix = next(n for n, mod in model.named_modules() if mod is block)
    p_block = sum(p.numel() for p in block.parameters())
    p_tp = 0
    if plan:
        for name, mod in block.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if _style_for(plan, full) is not None:
                p_tp += sum(p.numel() for p in mod.parameters(recurse=False))
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    p_first = sum(p.numel() for p in emb.parameters()) if isinstance(emb, nn.Module) else 0
    p_last = max(total - len(blocks) * p_block - p_first, 0)
    return p_tp, p_block - p_tp, p_first, p_last


def _tp_shared(session: Any, precision: str, spec: Any, plan: dict, a: Activations) -> float:
    """The share of a plain block's activations a ``tp=2`` probe does not split: the 1-block probe
    under ``tp=2``, less the rest of the model (replicated by the default plan), against a block's
    activations without tensor parallelism."""
    from memguard.estimator._pricing import estimate_from_trace
    from memguard.estimator._targets import Target
    from memguard.estimator._tp_trace import trace_tp_step
    from memguard.estimator._tracing import TraceRequest, trace_spec

    spec_1 = trace_spec(TraceRequest(device=session.device, precision=precision, keep_blocks=1, gpu=spec,
                                     cpu=session._cpu_target()))
    # the optimizer does not change activations; AdamW(foreach=False) accepts mixed DTensor parameters
    tr = trace_tp_step(session.model, session.batch_of(session.m0), spec_1, tp=2, plan=plan, fsdp=None,
                       optimizer=lambda params: torch.optim.AdamW(params, foreach=False), loss_fn=session.loss_fn)
    target = Target(device="cpu", precision=precision, zero_stage=0, world_size=1, strategy="ddp")
    _, tl = estimate_from_trace(tr, target, micro_batch_size=session.m0)
    split = max(ProbeFeatures.of(tl).act / session.m0 - a.rest, 0.0)
    if a.block <= 0:
        return 1.0
    return min(max(2 * split / a.block - 1, 0.0), 1.0)


def build_profile(session: Any, precisions: Iterable[str], spec: Any, gpus_per_node: int,
                  checkpointing: Iterable[bool] = (False, True)) -> LayoutProfile:
    """The :class:`LayoutProfile` of the session's model for ``precisions`` (a few probe traces).

    Raises:
        ConfigError: the model has no repeated blocks to probe and split.
    """
    model = session.model
    precisions = tuple(precisions)
    session._first_precision = session._first_precision or precisions[0]
    if session.probe_points(spec) == [None]:
        raise ConfigError("the layout search needs a model of repeated blocks (a ModuleList of identical layers) "
                          "that runs cut down to 1 and 2 of them: drop gpus_per_node= and plan data parallelism "
                          "with world_size= alone")
    tp_candidates = [t for t in divisors(gpus_per_node) if t > 1]
    problems: list[str] = []
    plan, _ = resolve_tp_plan(model, Layout(tp=2), problems) if tp_candidates else (None, "")
    degrees, reason = [1], ""
    if problems or plan is None:
        reason = "tensor parallelism not searched: " + "; ".join(problems or ["no plan"])
    else:
        for t in tp_candidates:
            fit: list[str] = []
            check_model_fits(model, Layout(tp=t), plan, fit)
            if not fit:
                degrees.append(t)
            elif not reason:
                reason = f"tp={t} and up not searched: {fit[0]}"
    p_tp, p_rep, p_first, p_last = _param_counts(model, plan if len(degrees) > 1 else None)
    if len(degrees) == 1:
        p_tp, p_rep = 0, p_tp + p_rep
    from memguard.estimator._blocks import find_blocks

    blocks = find_blocks(model)
    profile = LayoutProfile(num_blocks=session.num_blocks, p_block_tp=p_tp, p_block_rep=p_rep, p_first=p_first,
                            p_last=p_last, tp_shared=1.0, tp_degrees=tuple(degrees), tp_reason=reason,
                            pipeline=decoder_parts(model) is not None,
                            block_class=type(blocks[0]).__name__ if blocks else None)
    ckpt = True in tuple(checkpointing)
    if session.device == "cuda":
        from memguard.estimator._pricing import estimate_from_trace
        from memguard.estimator._targets import Target

        tr = session.trace(precisions[0], keep=1, m=session.m0, spec=spec, flops=True)
        est, _ = estimate_from_trace(tr, Target(device="cuda", precision=precisions[0], gpu=spec),
                                     micro_batch_size=session.m0)
        profile.fixed_bytes = int(est.breakdown.get("workspace", 0))
    for p in precisions:
        policy = p.replace("-mixed", "-true")  # FSDP2's mixed policy computes in the 16-bit dtype
        for fsdp in (False, True):
            if fsdp and policy == p:
                profile.acts[(p, fsdp)] = profile.acts[(p, False)]
                continue
            profile.acts[(p, fsdp)] = _activations(session, p, policy if fsdp else p, spec, p_tp + p_rep, ckpt)
    if len(degrees) > 1:
        first = next(iter(precisions))
        try:
            profile.tp_shared = _tp_shared(session, first, spec, plan, profile.acts[(first, False)])
        except ConfigError as exc:
            profile.tp_degrees, profile.tp_reason = (1,), f"tensor parallelism not searched: {exc}"
    cost = session.cost_inputs(spec, precisions[0])
    profile.ops_per_step, profile.ops_per_block = cost.ops_per_micro_batch, cost.ops_per_block
    return profile


# ----------------------------------------------------------------------------------------------
# Layouts and their cost


def layout_degrees(world: int, gpus_per_node: int, profile: LayoutProfile, strategies: tuple[str, ...] | None
                   ) -> list[Layout]:
    """Every layout of ``world`` GPUs searched (schedules and micro-batch counts aside)."""
    nodes = max(world // gpus_per_node, 1)
    out = []
    for tp in profile.tp_degrees:
        if world % tp:
            continue
        pps = [p for p in divisors(nodes) if p <= profile.num_blocks and world % (tp * p) == 0]
        if not profile.pipeline:
            pps = [1]
        for pp in pps:
            dp = world // (tp * pp)
            kinds = []
            if dp == 1:
                kinds.append((1, 1))
            else:
                kinds.append((1, dp))  # FSDP2
                if tp == 1:
                    kinds.append((dp, 1))  # DDP
                inner = gpus_per_node // tp
                if 1 < inner < dp and dp % inner == 0:
                    kinds.append((dp // inner, inner))  # HSDP: shards inside a node
            for rep, shard in kinds:
                st = "fsdp2" if shard > 1 else "ddp"
                if strategies is not None and st not in strategies and not (dp == 1):
                    continue
                scheds = SEARCHED_SCHEDULES if pp > 1 else ("1F1B",)
                for sched in scheds:
                    out.append(Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, pp_schedule=sched))
    return out


@dataclass(frozen=True)
class LayoutCost:
    """Seconds of one optimizer step by term (see the module docstring)."""

    compute: float
    bubble: float
    tp_comm: float
    dp_comm: float
    pp_comm: float

    @property
    def dp_exposed(self) -> float:
        """The data-parallel collectives' time beyond the compute they overlap with."""
        return max(self.dp_comm - self.compute, 0.0)

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.dp_exposed + self.pp_comm

    def describe(self) -> str:
        return (f"{self.total:.3g} s/step = compute {self.compute:.3g} + bubble {self.bubble:.3g} + TP all-reduce "
                f"{self.tp_comm:.3g} + data-parallel {self.dp_exposed:.3g} exposed (of {self.dp_comm:.3g}, the rest "
                f"overlapped) + pipeline p2p {self.pp_comm:.3g}")


def layout_seconds(profile: LayoutProfile, lay: Layout, *, precision: str, m: int, n_micro: int, k: int,
                   flops_per_sample: float, ops_per_micro: float, rate: float, intra_gbps: float, net_gbps: float,
                   gpus_per_node: int) -> LayoutCost:
    """Predicted seconds of one optimizer step under ``lay`` (see the module docstring)."""
    L, tp, pp = profile.num_blocks, lay.tp, lay.pp
    a = profile.acts[(precision, lay.dp_shard > 1)]
    cd, rd = _dtype_bytes(precision)
    k_total = min(k * pp, L)
    recompute = 1.0 + (k_total / (3.0 * L) if L else 0.0)
    per_micro = max(flops_per_sample * m * recompute / (tp * pp * rate * MFU), ops_per_micro / pp * LAUNCH_S)
    compute = n_micro * per_micro
    bubble = compute * (pp - 1) / n_micro if pp > 1 else 0.0
    intra, net = intra_gbps * 1e9, net_gbps * 1e9
    tp_comm = 0.0
    blocks = math.ceil(L / pp)
    if tp > 1:
        # a block's input per sample is what a checkpointed block keeps: the all-reduced tensor's size
        msg = m * a.block_ckpt
        tp_comm = n_micro * (4 * blocks + 2 * min(k, blocks)) * msg * 2 * (tp - 1) / tp / intra
    p_loc = profile.stage_params(tp, pp, 0)
    D, R = lay.dp_shard, lay.dp_replicate
    dp_comm = 0.0
    if D > 1:
        bw = intra if tp * D <= gpus_per_node else net
        gathers = 2 * n_micro if pp == 1 else 1
        reduces = n_micro if pp == 1 else 1
        dp_comm = (gathers * cd + reduces * rd) * p_loc * (D - 1) / D / bw
        if R > 1:
            dp_comm += reduces * 2 * (R - 1) / R * p_loc / D * rd / net
    elif R > 1:
        bw = intra if tp * R <= gpus_per_node else net
        dp_comm = 2 * (R - 1) / R * p_loc * a.grads_per_param / bw
    pp_comm = 0.0
    if pp > 1:
        bw = net if lay.dp_replicate * lay.dp_shard * tp >= gpus_per_node else intra
        pp_comm = 2 * n_micro * m * a.block_ckpt / bw
    return LayoutCost(compute, bubble, tp_comm, dp_comm, pp_comm)


@dataclass(frozen=True)
class LayoutCandidate:
    """One configuration the layout search priced."""

    layout: Layout
    precision: str
    micro_batch_size: int
    grad_accum_steps: int
    checkpoint_blocks: int  # per stage
    predicted_bytes: int
    stage_peaks: tuple[int, ...]
    cost: LayoutCost
    fits: bool

    def describe(self) -> str:
        lay = self.layout
        micro = (f"{lay.pp_schedule}, {lay.pp_microbatches} micro-batches of {self.micro_batch_size}" if lay.pp > 1
                 else f"micro-batch {self.micro_batch_size} x accumulation {self.grad_accum_steps}")
        ck = f", {self.checkpoint_blocks} blocks checkpointed" + (" per stage" if lay.pp > 1 else "") \
            if self.checkpoint_blocks else ""
        return f"{lay.describe()}, {self.precision}, {micro}{ck}"


def _fewest_k(profile: LayoutProfile, lay: Layout, p: str, m: int, n: int, usable: int, ckpt: bool
              ) -> tuple[int, int, list[int]]:
    """The fewest checkpointed blocks per stage predicted to fit (all of them if none does)."""
    peak, stages = profile.peak(lay, p, m, n, 0)
    if peak <= usable or not ckpt:
        return 0, peak, stages
    hi = max(stage_bounds(profile.num_blocks, lay.pp, s)[1] - stage_bounds(profile.num_blocks, lay.pp, s)[0]
             for s in range(lay.pp))
    lo_k, hi_k = 1, hi
    top, top_st = profile.peak(lay, p, m, n, hi)
    if top > usable:
        return hi, top, top_st
    while lo_k < hi_k:
        mid = (lo_k + hi_k) // 2
        if profile.peak(lay, p, m, n, mid)[0] <= usable:
            hi_k = mid
        else:
            lo_k = mid + 1
    peak, stages = profile.peak(lay, p, m, n, lo_k)
    return lo_k, peak, stages


def rank_layouts(profile: LayoutProfile, *, world: int, gpus_per_node: int, global_batch_size: int,
                 precisions: tuple[str, ...], checkpointing: tuple[bool, ...], usable: int, rates: dict,
                 flops_per_sample: float, ops_per_micro: float, intra_gbps: float, net_gbps: float,
                 strategies: tuple[str, ...] | None = None) -> list[LayoutCandidate]:
    """Every searched configuration, the fitting ones fastest first, then the rest by predicted peak.

    For each layout, precision and micro-batch the fewest checkpointed blocks that fit are taken
    (where checkpointing is allowed)."""
    out = []
    ckpt = True in checkpointing
    no_ckpt = False in checkpointing
    for base in layout_degrees(world, gpus_per_node, profile, strategies):
        dp = base.dp_replicate * base.dp_shard
        if global_batch_size % dp:
            continue
        local = global_batch_size // dp
        for p in precisions:
            rate = rates.get(p, 0.0) * 1e12
            if rate <= 0:
                continue
            for m in divisors(local):
                n = local // m
                if base.pp > 1:
                    if base.pp_schedule == "1F1B" and n < base.pp:
                        continue
                    lay = dataclasses.replace(base, pp_microbatches=n)
                    accum = 1
                else:
                    lay, accum = base, n
                k, peak, stages = _fewest_k(profile, lay, p, m, n, usable, ckpt)
                if k == 0 and not no_ckpt:  # checkpointing required
                    k = 1 if profile.num_blocks else 0
                    peak, stages = profile.peak(lay, p, m, n, k)
                    if peak > usable:
                        k, peak, stages = _fewest_k(profile, lay, p, m, n, usable, True)
                cost = layout_seconds(profile, lay, precision=p, m=m, n_micro=n, k=k,
                                      flops_per_sample=flops_per_sample, ops_per_micro=ops_per_micro, rate=rate,
                                      intra_gbps=intra_gbps, net_gbps=net_gbps, gpus_per_node=gpus_per_node)
                out.append(LayoutCandidate(lay, p, m, accum, k, peak, tuple(stages), cost, peak <= usable))
    out.sort(key=lambda c: (not c.fits, c.cost.total if c.fits else c.predicted_bytes, c.predicted_bytes))
    return out


def same_layout(a: Layout, b: Layout) -> bool:
    """Equal degrees and schedule (micro-batch counts aside)."""
    return (a.dp_replicate, a.dp_shard, a.tp, a.pp, a.pp_schedule if a.pp > 1 else "") == (
        b.dp_replicate, b.dp_shard, b.tp, b.pp, b.pp_schedule if b.pp > 1 else "")


def report_lines(ranked: list[LayoutCandidate], winner: LayoutCandidate, usable: int, limit: int = 12,
                 traced: dict[int, int] | None = None, ratio: float = 1.0) -> list[str]:
    """One line per layout tried (its best configuration), and why it lost or won.

    ``traced``: the verified peaks (full or short verification) of the candidates verified (by ``id``); ``ratio``: the shortfall they
    found in the layout model, with which the search sized the candidates after them."""
    traced = traced or {}

    def still_fits(c: LayoutCandidate) -> bool:  # by the layout model sized with the shortfall, and by any trace
        return c.fits and c.predicted_bytes * ratio <= usable and traced.get(id(c), 0) <= usable

    best: dict = {}
    for c in ranked:  # each layout's fastest configuration that still fits, else its first
        key = (c.layout.dp_replicate, c.layout.dp_shard, c.layout.tp, c.layout.pp,
               c.layout.pp_schedule if c.layout.pp > 1 else "")
        if key not in best or (not still_fits(best[key]) and still_fits(c)) or c is winner:
            best[key] = c
    lines = []
    items = list(best.values())
    for c in items[:limit]:
        if same_layout(c.layout, winner.layout) and c is winner:
            why = f"chosen: {c.cost.describe()}"
        elif id(c) in traced and traced[id(c)] > usable:
            why = (f"does not fit: predicted {format_bytes(c.predicted_bytes)}, but its verification found "
                   f"{format_bytes(traced[id(c)])} (of {format_bytes(usable)} usable)")
        elif c.fits and c.predicted_bytes * ratio > usable:
            why = (f"does not fit once sized with the shortfall a verification found ({format_bytes(c.predicted_bytes)} "
                   f"x {ratio:.3g} = {format_bytes(int(c.predicted_bytes * ratio))})")
        elif c.fits:
            why = (f"fits ({format_bytes(c.predicted_bytes)}) but slower: {c.cost.total:.3g} s/step vs "
                   f"{winner.cost.total:.3g}")
        else:
            why = (f"does not fit: needs {format_bytes(c.predicted_bytes)} at best (of {format_bytes(usable)} "
                   "usable)")
        lines.append(f"{c.describe()}: {why}")
    if len(items) > limit:
        fit = sum(1 for c in items[limit:] if still_fits(c))
        lines.append(f"... {len(items) - limit} more layouts ({fit} fit, all slower)")
    return lines


# ----------------------------------------------------------------------------------------------
# The search


def search_layouts(session: Any, space: Any, request: Any) -> Any:
    """The fastest layout plan that fits (see the module docstring).

    Raises:
        ConfigError: no layout of ``world_size`` GPUs splits ``global_batch_size``, or the model cannot
            be probed.
        InfeasiblePlanError: no layout fits; ``.closest`` is the nearest one's plan.
    """
    from memguard.estimator._blocks import hidden_size

    start = time.perf_counter()
    spec = space.spec
    world, K = request.world_size, request.gpus_per_node
    K = min(K, world)
    strategies = None if request.strategy is None else tuple(
        [request.strategy] if isinstance(request.strategy, str) else request.strategy)
    profile = build_profile(session, space.precisions, spec, K, space.checkpointing)
    cost_in = session.cost_inputs(spec, space.precisions[0])
    rates = cost_in.tflops
    intra = spec.interconnect_gbps if spec is not None else 0.0
    net = spec.scale_out_gbps if spec is not None else 0.0
    if space.device == "cpu" or spec is None:
        intra = net = 1.0  # the CPU target: only ratios matter
    ranked = rank_layouts(profile, world=world, gpus_per_node=K, global_batch_size=space.global_batch_size,
                          precisions=space.precisions, checkpointing=space.checkpointing, usable=space.usable_bytes,
                          rates=rates, flops_per_sample=cost_in.flops_per_sample,
                          ops_per_micro=cost_in.ops_per_micro_batch, intra_gbps=intra, net_gbps=net,
                          strategies=strategies)
    if not ranked:
        dps = sorted({world // (t * p) for t in profile.tp_degrees for p in divisors(max(world // K, 1))
                      if world % (t * p) == 0})
        raise ConfigError(f"global_batch_size {space.global_batch_size} splits over none of the data-parallel "
                          f"degrees the layouts of {world} GPUs have ({', '.join(map(str, dps))}): use a multiple "
                          f"of one of them")
    searched = time.perf_counter() - start
    budget_s = VERIFY_BUDGET_S if request.verify_budget_s is None else float(request.verify_budget_s)
    tried = []
    ratio = 1.0  # how far a verification has found the layout model short (CUDA: the allocator's overhead)
    for _ in range(_MAX_VERIFY):
        fitting = [c for c in ranked if c.predicted_bytes * ratio <= space.usable_bytes
                   and all(c is not t for t, _, _ in tried)]
        if not fitting:
            break
        cand = fitting[0]
        est, verified = _estimate(session, space, cand, profile, budget_s=budget_s)
        tried.append((cand, est, verified))
        if est.peak_upper_bytes <= space.usable_bytes:
            return _plan(space, cand, est, verified, ranked, profile, searched, time.perf_counter() - start,
                         hidden_size(session.model), tried=tried, ratio=ratio)
        ratio = max(ratio, est.peak_upper_bytes / max(cand.predicted_bytes, 1))
        log.info("memguard: %s predicted %s but verified at %s; the next is sized with that shortfall",
                 cand.describe(), format_bytes(cand.predicted_bytes), format_bytes(est.peak_upper_bytes))
    closest = min(ranked, key=lambda c: c.predicted_bytes)
    est, verified = _estimate(session, space, closest, profile, verify=False)
    closest_plan = _plan(space, closest, est, verified, ranked, profile, searched, time.perf_counter() - start,
                         hidden_size(session.model), fits=False, tried=tried, ratio=ratio)
    need = tried[0][1].peak_upper_bytes if tried else closest.predicted_bytes
    raise InfeasiblePlanError(
        f"no layout of {world} GPUs ({K} per node) fits {format_bytes(space.usable_bytes)} usable per rank; the "
        f"closest ({closest.describe()}) needs {format_bytes(need)}",
        closest=closest_plan,
        suggestions=["more GPUs (a larger world_size), or GPUs with more memory",
                     "a shorter sequence or a smaller global batch"])


def verifiable(cand: LayoutCandidate) -> bool:
    """Whether ``memguard.estimate(..., layout=...)`` estimates the candidate's layout."""
    lay = cand.layout
    ddp_only = lay.dp_replicate > 1 and lay.dp_shard == 1
    if lay.pp > 1:  # stages with FSDP2 and/or TP inside (checkpointed or not), no DDP over stages
        return not ddp_only
    return not (ddp_only and lay.tp > 1)


def short_points(n: int, k: int) -> list[tuple[int, int]] | None:
    """The ``(plain, checkpointed)`` block counts of the short verification's traces of a stack of ``n``
    blocks whose first ``k`` are checkpointed (see the module docstring), or None when they would trace
    as many blocks as the whole stack."""
    k = min(k, n)
    if k == 0:
        points = [(d, 0) for d in SHORT_DEPTHS]
    elif k == n:
        points = [(0, d) for d in SHORT_DEPTHS]
    else:
        points = list(SHORT_MIXED)
    return points if sum(p + c for p, c in points) < n else None


def extrapolate(points: list[tuple[int, int]], values: list[float], plain: int, ckpt: int) -> float:
    """A quantity of the short traces at ``points`` (:func:`short_points`), affine in the plain and the
    checkpointed blocks, at ``plain`` and ``ckpt`` blocks. Three points are ``(p0, c0)``, one with more plain
    blocks ``(p1, c0)`` and one with more checkpointed ones ``(p0, c2)``."""
    (p0, c0), (p1, c1) = points[0], points[1]
    v0, v1 = values[0], values[1]
    if len(points) == 2:  # one axis varies
        x0, x1, x = (p0, p1, plain) if p1 != p0 else (c0, c1, ckpt)
        return v0 + (x - x0) * (v1 - v0) / (x1 - x0)
    (_, c2), v2 = points[2], values[2]
    return v0 + (plain - p0) * (v1 - v0) / (p1 - p0) + (ckpt - c0) * (v2 - v0) / (c2 - c0)


def short_trace_seconds(profile: LayoutProfile, lay: Layout, points: list[tuple[int, int]]) -> float:
    """The predicted seconds of the short verification's traces (:func:`trace_seconds` of each cut model)."""
    n = profile.num_blocks
    return sum(trace_seconds(max(profile.ops_per_step - (n - p - c) * profile.ops_per_block, 0.0), lay)
               for p, c in points)


class NotAffine(Exception):
    """The short traces peak in different phases: their peaks are not one affine function of the blocks."""


def _short_estimate(session: Any, cand: LayoutCandidate, points: list[tuple[int, int]], rows: int,
                    kwargs: dict) -> Any:
    """The candidate's estimate from ``estimate(layout=...)`` of the model cut to each of ``points``'
    blocks (:func:`memguard.estimator._tracing.keeping_blocks`), every figure extrapolated to the whole stack."""
    from memguard.estimator._tracing import keeping_blocks
    from memguard.estimator.api import estimate

    n = session.num_blocks
    k = min(cand.checkpoint_blocks, n)
    ests = []
    for p, c in points:
        with keeping_blocks(p + c):
            ests.append(estimate(session.model, session.batch_of(rows), **{**kwargs, "activation_checkpointing": c}))
    phases = {e.peak_phase for e in ests}
    if len(phases) > 1:
        raise NotAffine(f"the short traces peak in different phases ({', '.join(sorted(phases))})")

    def at(get: Any) -> int:
        return int(round(extrapolate(points, [float(get(e)) for e in ests], n - k, k)))

    keys = sorted({key for e in ests for key in e.breakdown})
    phase_keys = sorted({key for e in ests for key in e.phase_peaks})
    ranks = len(ests[0].rank_peak_bytes)
    depths = " and ".join(f"{p + c}" + (f" ({c} checkpointed)" if c else "") for p, c in points)
    note = (f"short verification: memguard.estimate(..., layout=...) of the model cut to {depths} blocks, every "
            f"figure extrapolated to its {n} blocks ({k} checkpointed); allocated bytes are affine in the blocks, the "
            "caching allocator's overhead may grow faster (up to 5.6% of the peak measured on deep checkpointed "
            "stacks): plan(..., verify_budget_s=math.inf) or memguard.estimate(model, batch, layout=plan.layout, ...) "
            "verifies it fully")
    return dataclasses.replace(
        ests[-1], peak_bytes=at(lambda e: e.peak_bytes),
        breakdown={key: at(lambda e, key=key: e.breakdown.get(key, 0)) for key in keys},
        allocated_peak_bytes=at(lambda e: e.allocated_peak_bytes),
        peak_upper_bytes=at(lambda e: e.peak_upper_bytes), model_state_bytes=at(lambda e: e.model_state_bytes),
        num_params=at(lambda e: e.num_params), num_trainable_params=at(lambda e: e.num_trainable_params),
        phase_peaks={key: at(lambda e, key=key: e.phase_peaks.get(key, 0)) for key in phase_keys},
        rank_peak_bytes=tuple(at(lambda e, r=r: e.rank_peak_bytes[r]) for r in range(ranks)),
        activation_checkpointing=k, notes=ests[-1].notes + (note,))


def _estimate(session: Any, space: Any, cand: LayoutCandidate, profile: LayoutProfile, verify: bool = True,
              budget_s: float = VERIFY_BUDGET_S) -> tuple[Any, str]:
    """The candidate's estimate and how it was verified: ``"full"`` (a real ``estimate(layout=...)``, where
    it is supported and predicted by :func:`trace_seconds` to take at most ``budget_s``), ``"short"`` (the
    short verification, where the full one is over budget and it is not), or ``""`` (the layout model's
    figures)."""
    lay = cand.layout
    # a pipeline estimate traces every stage's share of every micro-batch, the others one micro-batch
    cost_s = trace_seconds(profile.ops_per_step * (lay.pp_microbatches or 1 if lay.pp > 1 else 1), lay)
    points = short_points(profile.num_blocks, cand.checkpoint_blocks) if (
        lay.pp == 1 and profile.ops_per_block > 0) else None
    short_s = short_trace_seconds(profile, lay, points) if points else math.inf
    how = "full" if cost_s <= budget_s else "short" if short_s <= budget_s else ""
    if verify and verifiable(cand) and not how:
        verify = False
        why = (f"not verified: a full trace of this layout is predicted to take about {cost_s:.0f} s ("
               f"{profile.ops_per_step:.3g} ATen ops per micro-batch"
               + (f"; the short verification about {short_s:.0f} s" if points else "")
               + f", over verify_budget_s={budget_s:g}); "
               f"memguard.estimate(model, batch, layout=plan.layout, ...) verifies it"
               + ("; on CUDA verify before trusting it: the layout model counts allocated bytes, not the caching "
                  "allocator's overhead, and on torchtitan's Llama 3.1 8B and 70B layouts full traces found it "
                  f"16-20% short (plan(..., verify_budget_s={math.ceil(cost_s)}) or more verifies it within the "
                  "search)" if space.device == "cuda" else ""))
    else:
        why = ("estimate(layout=...) does not estimate this layout yet" if not verifiable(cand) else
               "not verified")
    if verify and verifiable(cand):
        rows = cand.micro_batch_size * (lay.pp_microbatches or 1)
        kwargs = dict(device=space.device, precision=cand.precision, gpu=space.spec if space.device == "cuda" else None,
                      optimizer=session.optimizer, loss_fn=session.loss_fn, keep_outputs=session.keep_outputs,
                      layout=lay)
        if space.device == "cuda" and space.spec is not None:
            kwargs["gpu"] = space.spec.name if space.spec.memory_bytes else None
        kwargs.update(activation_checkpointing=cand.checkpoint_blocks)  # per stage under pp, as the estimate takes it
        if lay.pp == 1:
            kwargs.update(grad_accum_steps=cand.grad_accum_steps, zero_stage=3 if lay.dp_shard > 1 else 0)
        try:
            if how == "short":
                return _short_estimate(session, cand, points, rows, kwargs), "short"
            from memguard.estimator.api import estimate

            return estimate(session.model, session.batch_of(rows), **kwargs), "full"
        except ConfigError as exc:  # a layout the estimator refuses for this model: the layout model's figure
            log.info("memguard: could not verify %s (%s)", cand.describe(), exc)
        except NotAffine as exc:
            log.info("memguard: could not verify %s by short traces (%s)", cand.describe(), exc)
            why = f"not verified: {exc}; memguard.estimate(model, batch, layout=plan.layout, ...) verifies it"
    from memguard.estimator._result import Estimate

    world = lay.world_size
    ranks = tuple(cand.stage_peaks[r // (world // lay.pp)] for r in range(world))
    s = cand.stage_peaks.index(max(cand.stage_peaks))
    parts = profile.rank_bytes(lay, cand.precision, cand.micro_batch_size,
                               lay.pp_microbatches or cand.grad_accum_steps, cand.checkpoint_blocks, s)
    states = int(parts["model_states"])
    breakdown = {"params": 0, "grads": 0, "optimizer": 0, "activations": int(parts["activations"]),
                 "temporaries": int(parts["buffers"]), "model_states": states}
    est = Estimate(peak_bytes=cand.predicted_bytes, breakdown=breakdown, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=cand.predicted_bytes, device=space.device, precision=cand.precision,
                   zero_stage=3 if lay.dp_shard > 1 else 0, world_size=world,
                   gpu=space.spec.name if space.spec is not None else None,
                   micro_batch_size=cand.micro_batch_size, activation_checkpointing=cand.checkpoint_blocks,
                   num_params=int(profile.num_blocks * (profile.p_block_tp + profile.p_block_rep) + profile.p_first
                                  + profile.p_last),
                   model_state_bytes=states, strategy="fsdp2" if lay.dp_shard > 1 else "ddp",
                   peak_upper_bytes=cand.predicted_bytes, rank_peak_bytes=ranks,
                   notes=(f"layout {lay.describe()}: memguard's layout model (allocated bytes from probe traces, "
                          f"no CUDA allocator model); {why}",))
    return est, ""


def _plan(space: Any, cand: LayoutCandidate, est: Any, verified: str, ranked: list[LayoutCandidate],
          profile: LayoutProfile, searched_s: float, total_s: float, hidden: int | None, fits: bool = True,
          tried: list | None = None, ratio: float = 1.0) -> Any:
    from memguard.planner._plan import Plan

    lay = cand.layout
    traced = {id(c): e.peak_upper_bytes for c, e, ok in (tried or []) if ok}
    usable = space.usable_bytes
    fitting = [c for c in ranked if c.fits and c.predicted_bytes * ratio <= usable and traced.get(id(c), 0) <= usable]
    lines = report_lines(ranked, cand, usable, traced=traced, ratio=ratio)
    if profile.tp_reason:
        lines.append(profile.tp_reason)
    k_total = min(cand.checkpoint_blocks * lay.pp, profile.num_blocks)
    reasons = {
        "layout": (f"{lay.describe()}: the fastest of {len(fitting)} fitting configurations of {len(ranked)} priced "
                   f"({searched_s:.2g} s to search, {total_s:.2g} s with verification); {cand.cost.describe()}"
                   if fits else f"{lay.describe()}: the smallest predicted peak; nothing fits"),
        "estimate": ("verified with memguard.estimate(..., layout=...)" if verified == "full" else
                     "verified by " + est.notes[-1] if verified == "short" else
                     "the layout model's prediction: " + est.notes[-1].split("; ", 1)[-1]),
        "micro_batch_size": cand.describe(),
        "precision": f"{cand.precision}: of {', '.join(space.precisions)}",
        "activation_checkpointing": (f"{cand.checkpoint_blocks} blocks per stage: the fewest that fit"
                                     if cand.checkpoint_blocks else "off: fits without recomputation"),
    }
    return Plan(
        micro_batch_size=cand.micro_batch_size, grad_accum_steps=cand.grad_accum_steps, world_size=lay.world_size,
        global_batch_size=space.global_batch_size, precision=cand.precision,
        activation_checkpointing=cand.checkpoint_blocks > 0, checkpoint_blocks=k_total,
        zero_stage=3 if lay.dp_shard > 1 else 0, budget_bytes=int(space.budget_bytes), estimate=est,
        device=space.device, gpu=space.spec.name if (space.spec is not None and space.device == "cuda"
                                                     and space.spec.memory_bytes) else None,
        headroom=float(space.headroom), throughput=space.global_batch_size / cand.cost.total,
        reasons=reasons, hidden_size=hidden, strategy="fsdp2" if lay.dp_shard > 1 else "ddp", layout=lay,
        layout_report=tuple(lines), block_class=profile.block_class,
    )
