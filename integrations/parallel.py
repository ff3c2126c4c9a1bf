"""Lay a plain PyTorch model out over ranks as a :class:`memguard.Layout` (or a plan's ``.layout``) says.

``apply(model, layout)`` does what :func:`memguard.estimate` (``layout=...``) traces, with the same
code where the estimate has it, so that the real job is the one that was estimated:

1. **The device mesh**: ``init_device_mesh(device, (dp_replicate, dp_shard, tp),
   mesh_dim_names=("dp_replicate", "dp_shard", "tp"))`` over every rank of the default process
   group, in torchtitan's order of dimensions (``torchtitan/distributed/parallel_dims.py``), so that
   rank ``r`` sits where :mod:`memguard.estimator._layout` puts it (``Estimate.rank_peak_bytes[r]``).
2. **Tensor parallelism** (``tp > 1``): ``parallelize_module(model, mesh["tp"], plan)`` with the plan
   the estimate uses (:func:`memguard.estimator._layout.resolve_tp_plan`: ``tp_plan=`` if given, else
   ``Layout.tp_plan``, else the model config's ``base_model_tp_plan``, else the Linear layers found by
   name in the repeated blocks), after the checks the estimate makes
   (:func:`~memguard.estimator._layout.check_model_fits`: heads and sharded features divisible by tp).
3. **FSDP2** (``dp_shard > 1``): ``fully_shard`` of each repeated block, then of the root, over
   ``mesh["dp_shard"]`` (``mesh["dp_replicate", "dp_shard"]`` with replicas too: HSDP), by
   :func:`memguard.estimator._fsdp2.shard_model`, the function the estimate traces; TP first, then
   FSDP2, as torchtitan's ``parallelize_llama``. The sharding level is the plan's ``zero_stage``
   (3 = ``reshard_after_forward=True``, as the estimate's default); ``bf16-mixed`` / ``16-mixed`` are
   FSDP2's ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)``.
4. **DDP** (``dp_replicate > 1`` alone): the model wrapped in ``DistributedDataParallel`` over
   ``mesh["dp_replicate"]``, which is then what ``apply`` returns.

Build the optimizer after ``apply`` (TP and FSDP2 replace the parameters with ``DTensor`` s).

5. **Pipeline stages** (``pp > 1``): the mesh is ``(pp, dp_replicate, dp_shard, tp)`` with dimensions
   :data:`PP_MESH_DIMS` (torchtitan's order), and the model, a transformers decoder, is cut in place
   to this rank's stage by the estimate's own cut (:func:`memguard.estimator._pipeline.split_decoder`:
   the blocks split evenly, the embeddings on the first stage, the final norm, head and loss on the
   last). Inside a stage the layout is the estimate's
   (:class:`memguard.estimator._pipeline.ShardedPipelineTracer`, torchtitan's ``parallelize_llama``
   on each stage's model chunk): tensor parallelism over ``mesh["tp"]`` with the resolved plan (2.),
   then FSDP2 of the stage's blocks and of the stage module as root over the data-parallel
   dimensions (3.); torch's pipelining then keeps the stage unsharded and its gradients unsynchronised
   until the last micro-batch (``stage.py``, ``backward_maybe_with_nosync`` / ``perform_reduce_grad``).
   The ``PipelineStage`` (over ``mesh["pp"]``'s group) and its ``ScheduleGPipe`` / ``Schedule1F1B``
   are built by the estimate's :func:`memguard.estimator._pipeline.make_schedule` for the batch's
   micro-batch shape on the first :func:`step`, and recorded in :class:`AppliedLayout`
   (``pipeline``: a :class:`memguard.guard._pipeline_step.PipelineRun`). Train it with :func:`step`
   (each rank passes its data-parallel share; the ranks of a stage that differ only in ``tp`` the
   same rows), which runs the schedule, recovers from an OOM on any rank by halving the micro-batch
   on every rank (a stage of several ranks drains as one: :mod:`memguard.guard._pipeline_step`), and
   steps the optimizer; ``model(...)`` itself no longer runs the whole model.
   A plan's ``checkpoint_blocks`` (the blocks checkpointed over all stages) checkpoints the first
   ``ceil(checkpoint_blocks / pp)`` of each stage's blocks right after the cut, before TP and FSDP2, as
   the planner and the estimate count them per stage (:func:`memguard.estimator._pipeline.checkpoint_stage`).

:func:`memguard.step` runs every layout ``apply`` builds and recovers from an OOM on any rank: under
tensor parallelism and FSDP2 x TP with agreements at every ``ParallelStyle`` boundary
(:mod:`memguard.guard._tp`; prepare the model with ``memguard.prepare`` first, ``strategy="fsdp2"``
with ``dp_shard``), and for a model cut into pipeline stages by dispatching to its
:class:`~memguard.guard._pipeline_step.PipelineRun` (the same as :func:`step`).

Known limitations:
    Pipeline stages are not built with autocast (mixed precision without ``dp_shard``; with it,
    FSDP2's mixed-precision policy runs it, as the estimate traces it). DDP over
    tensor-parallel shards (``dp_replicate`` with ``tp`` but no ``dp_shard``), and DDP over pipeline
    stages, are refused, as the estimate refuses them. HSDP inside pipeline stages (``pp`` with
    ``dp_replicate`` and ``dp_shard``) is built as the estimate takes it but not tested on real ranks
    here.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from memguard.errors import ConfigError
from memguard.estimator._layout import Layout, check_layout, check_model_fits, resolve_tp_plan

__all__ = ["apply", "step", "layout_of", "mesh_of", "AppliedLayout", "lightning_strategy_kwargs",
           "accelerate_parallelism_kwargs"]

#: The mesh dimension names, in torchtitan's order (``parallel_dims.py``), as the estimate's fake mesh
#: (:func:`memguard.estimator._tp_trace.trace_tp_step`) names them.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")

#: The mesh dimension names under pipeline stages (torchtitan's ``parallel_dims.py``: ``pp`` first).
PP_MESH_DIMS = ("pp",) + MESH_DIMS

#: The 16-bit dtype FSDP2's ``MixedPrecisionPolicy`` all-gathers in, by precision (the estimate's
#: :func:`memguard.estimator._tracing.fsdp2_layout` means the same).
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TRUE = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


@dataclass(frozen=True)
class AppliedLayout:
    """What :func:`apply` did to a model.

    Attributes:
        layout: the layout applied (with the tensor-parallel plan it used as ``tp_plan``).
        mesh: the ``DeviceMesh`` of dimensions :data:`MESH_DIMS` (:data:`PP_MESH_DIMS` with pipeline stages).
        tp_plan_source: where the tensor-parallel plan came from (None without tensor parallelism).
        zero_stage: the FSDP2 sharding level (0 without ``dp_shard``).
        precision: the precision name the model was laid out for.
        pipeline: this rank's pipeline stage and its schedules
            (:class:`memguard.guard._pipeline_step.PipelineRun`; None without pipeline stages).
    """

    layout: Layout
    mesh: Any
    tp_plan_source: str | None
    zero_stage: int
    precision: str
    pipeline: Any = None


_APPLIED: "weakref.WeakKeyDictionary[nn.Module, AppliedLayout]" = weakref.WeakKeyDictionary()


def layout_of(model: nn.Module) -> AppliedLayout | None:
    """What :func:`apply` did to ``model`` (the object it returned), or None if it did not lay it out."""
    try:
        return _APPLIED.get(model)
    except TypeError:  # not weak-referenceable: not ours
        return None


def mesh_of(model: nn.Module) -> Any:
    """The ``DeviceMesh`` :func:`apply` laid ``model`` out on.

    Raises:
        ConfigError: ``model`` was not laid out by :func:`apply`.
    """
    applied = layout_of(model)
    if applied is None:
        raise ConfigError("this model was not laid out by memguard.integrations.parallel.apply; call apply(model, "
                          "layout) first")
    return applied.mesh


def _layout_from(plan_or_layout: Any, problems: list[str]) -> Layout | None:
    if isinstance(plan_or_layout, Layout):
        return plan_or_layout
    layout = getattr(plan_or_layout, "layout", None)
    if isinstance(layout, Layout):
        return layout
    problems.append(f"apply() takes a memguard.Layout or a plan with a .layout (a memguard.Layout), got "
                    f"{type(plan_or_layout).__name__}" + (f" whose .layout is {type(layout).__name__}"
                                                          if hasattr(plan_or_layout, "layout") else "")
                    + ": pass memguard.Layout(dp_shard=..., tp=...), or a plan made with a layout")
    return None


def _device_type(model: nn.Module, device: str | None) -> str:
    if device is not None:
        return torch.device(device).type
    types = {p.device.type for p in model.parameters()} - {"meta"}
    if types:
        return sorted(types)[0]
    return "cuda" if torch.cuda.is_available() else "cpu"


def problems_of(model: Any, plan_or_layout: Any, *, tp_plan: Mapping[str, Any] | None = None
                ) -> tuple[list[str], Layout | None, dict[str, Any] | None, str | None]:
    """Every problem :func:`apply` would refuse ``model`` and ``plan_or_layout`` for (all at once), the
    layout, the resolved tensor-parallel plan and its source."""
    import torch.distributed as dist

    problems: list[str] = []
    layout = _layout_from(plan_or_layout, problems)
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        return problems, layout, None, None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        problems.append("the model is wrapped in DistributedDataParallel; pass the plain module (apply() wraps it "
                        "when the layout is data-parallel replicas alone)")
    if any(isinstance(p, _dtensor_type()) for p in model.parameters()):
        problems.append("the model's parameters are already DTensors (tensor-parallel or sharded); pass the model "
                        "before parallelize_module / fully_shard")
    if layout is None:
        return problems, None, None, None
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping):
            problems.append(f"tp_plan must be a mapping {{module name pattern: style}}, got {type(tp_plan).__name__}")
        else:
            layout = dataclasses.replace(layout, tp_plan=dict(tp_plan))
    zero_stage = getattr(plan_or_layout, "zero_stage", 0)
    check_layout(layout, zero_stage=zero_stage, world_size=1, strategy=None, problems=problems)
    if problems:
        return problems, layout, None, None
    if layout.pp > 1:
        _pipeline_problems(model, plan_or_layout, layout, problems)
    if not (dist.is_available() and dist.is_initialized()):
        problems.append("no process group: call torch.distributed.init_process_group on every rank before apply()")
    elif dist.get_world_size() != layout.world_size:
        problems.append(f"the layout {layout.describe()} needs {layout.world_size} ranks, but the process group has "
                        f"{dist.get_world_size()}: start {layout.world_size} ranks, or use a layout whose "
                        f"dp_replicate x dp_shard x tp x pp is {dist.get_world_size()}")
    plan, source = None, None
    if layout.tp > 1:
        plan, source = resolve_tp_plan(model, layout, problems)
        check_model_fits(model, layout, plan, problems)
    return problems, layout, plan, source


def _pipeline_problems(model: nn.Module, plan_or_layout: Any, layout: Layout, problems: list[str]) -> None:
    """What pipeline stages cannot be built for (the estimate's own refusals,
    :func:`memguard.estimator._layout._estimate_pp`, and what :func:`apply` does not combine with them)."""
    from memguard.estimator._pipeline import decoder_parts

    parts = decoder_parts(model)
    if parts is None:
        problems.append(f"apply() does not build pipeline stages for {type(model).__name__}: they are cut from "
                        "transformers decoder models (a base model with layers, embed_tokens and norm, and an "
                        "lm_head), as the estimate cuts them; drop Layout(pp=...)")
    elif len(parts[1]) < layout.pp:
        problems.append(f"Layout(pp={layout.pp}) needs at least {layout.pp} blocks, the model has {len(parts[1])}: "
                        f"use pp <= {len(parts[1])}")
    precision = getattr(plan_or_layout, "precision", "32-true") or "32-true"
    if precision in _MIXED and layout.dp_shard == 1:  # with dp_shard, FSDP2's mixed-precision policy (as estimated)
        problems.append(f"precision={precision!r} (autocast) is not built under Layout(pp=...) without dp_shard yet: "
                        "use '32-true' or a '*-true' precision, or dp_shard > 1 (FSDP2's mixed-precision policy)")
    if parts is not None and len(parts[1]) >= layout.pp:
        _stage_checkpoint_blocks(plan_or_layout, layout, len(parts[1]), problems)


def _stage_checkpoint_blocks(plan_or_layout: Any, layout: Layout, num_blocks: int, problems: list[str]) -> int:
    """The blocks each pipeline stage checkpoints (its first ones) for a plan's ``checkpoint_blocks``.

    A plan's ``checkpoint_blocks`` counts the model's blocks checkpointed over all stages: the layout
    planner checkpoints ``k`` blocks of each stage and records ``min(k * pp, num_blocks)``
    (``memguard/planner/_layouts.py``, ``_plan``: ``k_total``), as
    ``memguard.estimate(..., layout=..., activation_checkpointing=k)`` reports it. Each stage then
    checkpoints the first ``ceil(checkpoint_blocks / pp)`` of its blocks (all of them where it has
    fewer), which gives the plan's count back; a count no ``k`` gives is refused."""
    total = getattr(plan_or_layout, "checkpoint_blocks", 0) or 0
    if not (isinstance(total, int) and not isinstance(total, bool) and total >= 0):
        problems.append(f"the plan's checkpoint_blocks={total!r} must be an integer >= 0")
        return 0
    per_stage = -(-total // layout.pp)
    if min(per_stage * layout.pp, num_blocks) != total:
        fits = sorted({min(k * layout.pp, num_blocks) for k in range(1, num_blocks + 1)})
        problems.append(f"checkpoint_blocks={total} does not split into the same number of checkpointed blocks per "
                        f"stage over Layout(pp={layout.pp}) ({num_blocks} blocks): use one of {fits} (k blocks of "
                        f"each stage: k x pp, or every block)")
        return 0
    return per_stage


def _apply_pipeline(model: nn.Module, layout: Layout, device_type: str, plan: dict[str, Any] | None,
                    zero_stage: int, checkpoint_blocks: int = 0,
                    mp_dtype: torch.dtype | None = None) -> tuple[nn.Module, Any, Any]:
    """Cut ``model`` to this rank's stage (its first ``checkpoint_blocks`` blocks checkpointed, as the
    estimate's :func:`~memguard.estimator._pipeline.checkpoint_stage`) and lay the stage out over its data- and
    tensor-parallel ranks; the model, the ``(pp, dp_replicate, dp_shard, tp)`` mesh and the
    :class:`~memguard.guard._pipeline_step.PipelineRun` (see the module docstring, 5.)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memguard.estimator._pipeline import checkpoint_stage, split_decoder
    from memguard.guard._pipeline_step import PipelineRun

    mesh = init_device_mesh(device_type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
                            mesh_dim_names=PP_MESH_DIMS)
    rank = mesh.get_local_rank("pp")
    stage_module = split_decoder(model, rank, layout.pp)
    if checkpoint_blocks:
        checkpoint_stage(stage_module, checkpoint_blocks)  # the estimate's own checkpointing, right after the cut
    # torchtitan's order inside each stage (parallelize_llama, as the estimate's ShardedPipelineTracer lays a
    # stage out): tensor parallelism over the stage's model, then FSDP2 of its blocks and of the stage as root
    if plan is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], plan)
    if layout.dp_shard > 1:
        from memguard.estimator._fsdp2 import FSDP2Layout, shard_model

        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        blocks = list(getattr(model, model.base_model_prefix).layers)  # the stage's blocks (split_decoder kept them)
        shard_model(stage_module, FSDP2Layout(world_size=layout.dp_shard, zero_stage=zero_stage, mp_dtype=mp_dtype),
                    dp_mesh, blocks)
    stage_ranks = [sorted(int(r) for r in mesh.mesh[s].flatten().tolist()) for s in range(layout.pp)]
    rank_group = None
    if len(stage_ranks[rank]) > 1:
        from memguard.guard._tp import stage_rank_group

        # the stage's agreements (memguard.guard._pipeline_step): a gloo group per stage, each made by every
        # rank of the job (new_group's contract), in stage order
        groups = [dist.new_group(ranks, backend="gloo") for ranks in stage_ranks]
        rank_group = stage_rank_group(stage_module, stage_ranks[rank], groups[rank],
                                      data_parallel_size=layout.dp_replicate * layout.dp_shard)
    device = next((p.device for p in model.parameters()), torch.device(device_type))
    # under FSDP2's mixed precision the stage computes in param_dtype and returns that dtype: the policy casts
    # the stage's floating-point inputs to it and its outputs only to an output_dtype, which shard_model leaves
    # None (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, FSDPState._cast_forward_inputs /
    # _cast_output_dtype); the hidden states between stages, and their gradients, are then 16-bit while the
    # sharded parameters stay fp32 (PipelineRun._dtype says why the receive buffers must match)
    activation_dtype = mp_dtype if layout.dp_shard > 1 else None
    run = PipelineRun(model, stage_module, rank=rank, stages=layout.pp, schedule=layout.pp_schedule,
                      microbatches=layout.pp_microbatches or layout.pp, device=device,
                      group=mesh.get_group("pp"), stage_ranks=stage_ranks, rank_group=rank_group,
                      data_parallel_size=layout.dp_replicate * layout.dp_shard, activation_dtype=activation_dtype)
    return model, mesh, run


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor]) -> float:
    """One training step of a model :func:`apply` laid out in pipeline stages; the batch's loss, on every rank.

    Every rank passes its data-parallel replica's batch (a mapping with ``input_ids`` and ``labels``;
    the same on every rank without ``dp_shard``): the first stage reads the ids, the last computes the
    model's loss on the labels; the loss returned is the global batch's. The schedule runs the
    micro-batches forward and backward, the optimizer steps and the gradients are set to None. On
    an out-of-memory error on any rank, every rank logs it and runs the same batch again with twice
    the micro-batches (:mod:`memguard.guard._pipeline_step`).

    Raises:
        ConfigError: ``model`` was not laid out in pipeline stages by :func:`apply`, or the batch is not
            one the schedule can split.
        OOMRecoveryError: an OOM when the micro-batch cannot be halved further.
        PeerFailedError: another rank failed with an error that is not an OOM (that rank raises its
            own).
    """
    applied = layout_of(model)
    if applied is None or applied.pipeline is None:
        raise ConfigError("parallel.step runs models laid out in pipeline stages: call "
                          "apply(model, Layout(pp=...)) first and pass the model it returned")
    return applied.pipeline.step(optimizer, batch)


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def apply(model: nn.Module, plan_or_layout: Any, *, tp_plan: Mapping[str, Any] | None = None,
          device: str | None = None, batch: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """Lay ``model`` out over the ranks as the layout says (see the module docstring); the model.

    Call it on every rank, after ``torch.distributed.init_process_group``, before building the
    optimizer.

    Args:
        model: a plain ``nn.Module`` on its device.
        plan_or_layout: a :class:`memguard.Layout`, or a plan whose ``.layout`` is one (its
            ``zero_stage`` is then FSDP2's sharding level, its ``precision`` FSDP2's mixed precision,
            its ``checkpoint_blocks`` the blocks checkpointed before sharding).
        tp_plan: the tensor-parallel plan ``{module name pattern: style}`` (a torch
            ``ParallelStyle`` or one of :data:`memguard.estimator._layout.STYLE_NAMES`); overrides the
            layout's ``tp_plan``. Pass the same to :func:`memguard.estimate` (as ``Layout(tp_plan=...)``).
        device: the mesh's device type (``"cpu"``, ``"cuda"``); default: the model's parameters'.
        batch: under pipeline stages, a batch of the shape the job trains on (``input_ids`` and
            ``labels``): the ``PipelineStage`` and schedule are built now, for its micro-batch shape,
            instead of on the first :func:`step`. Ignored without pipeline stages.

    Returns:
        ``model``, laid out in place (tensor-parallel ``DTensor`` parameters, an ``FSDPModule``, or cut
        to this rank's pipeline stage: train that with :func:`step`), or a
        ``DistributedDataParallel`` wrapping it for data-parallel replicas alone.

    Raises:
        ConfigError: every problem at once: not a layout, no process group, a world size that is
            not the layout's product, a layout the estimate refuses (a model that is not a decoder it
            can cut, DDP over tensor-parallel shards or over pipeline stages), autocast precisions
            under pipeline stages,
            heads or sharded features that tp does not divide, a plan that matches no module, a model
            already laid out.
    """
    problems, layout, plan, source = problems_of(model, plan_or_layout, tp_plan=tp_plan)
    if problems:
        raise ConfigError(problems)
    assert layout is not None
    from torch.distributed.device_mesh import init_device_mesh

    precision = getattr(plan_or_layout, "precision", "32-true") or "32-true"
    if layout.pp > 1:
        if precision in _TRUE:
            model.to(_TRUE[precision])  # *-true: the weights themselves are 16-bit
        stage_ckpt = _stage_checkpoint_blocks(plan_or_layout, layout, len(getattr(
            model, model.base_model_prefix).layers), [])  # checked by problems_of
        zero_stage = (getattr(plan_or_layout, "zero_stage", 0) or 3) if layout.dp_shard > 1 else 0
        out, mesh, run = _apply_pipeline(model, layout, _device_type(model, device), plan, zero_stage,
                                         checkpoint_blocks=stage_ckpt, mp_dtype=_MIXED.get(precision))
        if batch is not None:
            run.build_for(batch)
        _APPLIED[out] = AppliedLayout(layout=dataclasses.replace(layout, tp_plan=plan), mesh=mesh,
                                      tp_plan_source=source, zero_stage=zero_stage, precision=precision,
                                      pipeline=run)
        return out
    mesh = init_device_mesh(_device_type(model, device), (layout.dp_replicate, layout.dp_shard, layout.tp),
                            mesh_dim_names=MESH_DIMS)
    if precision in _TRUE:
        model.to(_TRUE[precision])  # *-true: the weights themselves are 16-bit
    blocks = int(getattr(plan_or_layout, "checkpoint_blocks", 0) or 0)
    if blocks:
        from memguard.estimator._blocks import apply_activation_checkpointing, find_container

        container = find_container(model)
        if container is None:
            raise ConfigError("the plan checkpoints activations, but memguard found no repeated blocks in the model; "
                              "plan with activation_checkpointing=False")
        apply_activation_checkpointing(model, blocks, list(container.children()))
    if plan is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], plan)
    zero_stage = 0
    out: nn.Module = model
    if layout.dp_shard > 1:
        from memguard.estimator._fsdp2 import FSDP2Layout, shard_model

        zero_stage = getattr(plan_or_layout, "zero_stage", 0) or 3  # FSDP2's default: reshard_after_forward
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        shard_model(model, FSDP2Layout(world_size=layout.dp_shard, zero_stage=zero_stage,
                                       mp_dtype=_MIXED.get(precision),
                                       offload=bool(getattr(plan_or_layout, "offload_optimizer", False))), dp_mesh)
    elif layout.dp_replicate > 1:
        out = nn.parallel.DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group())
    _APPLIED[out] = AppliedLayout(layout=dataclasses.replace(layout, tp_plan=plan), mesh=mesh, tp_plan_source=source,
                                  zero_stage=zero_stage, precision=precision)
    return out


def _layout_or_raise(plan_or_layout: Any, what: str) -> Layout:
    problems: list[str] = []
    layout = _layout_from(plan_or_layout, problems)
    if layout is not None:
        check_layout(layout, zero_stage=0, world_size=1, strategy=None, problems=problems)
        if layout.pp > 1:
            problems.append(f"{what} has no pipeline stages: Layout(pp={layout.pp}) cannot be run there; drop pp")
    if problems:
        raise ConfigError(problems)
    assert layout is not None
    return layout


def lightning_strategy_kwargs(plan_or_layout: Any) -> dict[str, int]:
    """The keywords of Lightning's ``ModelParallelStrategy`` for a layout (or a plan's ``.layout``).

    ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size)`` (Lightning 2.6,
    ``lightning/pytorch/strategies/model_parallel.py``) builds a 2-D mesh
    ``("data_parallel", "tensor_parallel")`` (``lightning/fabric/strategies/model_parallel.py``,
    ``_setup_device_mesh``) on which the LightningModule's ``configure_model`` applies TP and FSDP2
    itself: ``dp_shard`` is its data-parallel size, ``tp`` its tensor-parallel size.

    Raises:
        ConfigError: not a layout, pipeline stages, or data-parallel replicas (its data-parallel
            dimension is FSDP2's: no HSDP or DDP dimension).
    """
    layout = _layout_or_raise(plan_or_layout, "Lightning's ModelParallelStrategy")
    if layout.dp_replicate > 1:
        raise ConfigError(f"Lightning's ModelParallelStrategy shards over its data-parallel dimension (FSDP2) and has "
                          f"no replica dimension: Layout(dp_replicate={layout.dp_replicate}) cannot be run there; use "
                          f"dp_shard={layout.dp_replicate * layout.dp_shard}")
    return {"data_parallel_size": layout.dp_shard, "tensor_parallel_size": layout.tp}


def accelerate_parallelism_kwargs(plan_or_layout: Any) -> dict[str, int]:
    """The keywords of Accelerate's ``ParallelismConfig`` for a layout (or a plan's ``.layout``).

    ``ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size, cp_size)`` (Accelerate 1.15,
    ``accelerate/parallelism_config.py``: "inspired by torchtitan's ParallelDims", the same
    dimensions as :class:`memguard.Layout`), given to ``Accelerator(parallelism_config=...)``.

    Raises:
        ConfigError: not a layout, or pipeline stages (Accelerate has no pipeline dimension there).
    """
    layout = _layout_or_raise(plan_or_layout, "Accelerate's ParallelismConfig")
    return {"dp_replicate_size": layout.dp_replicate, "dp_shard_size": layout.dp_shard, "tp_size": layout.tp}
