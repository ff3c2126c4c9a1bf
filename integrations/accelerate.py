"""Hugging Face Accelerate: run a plan with the Accelerator's own accumulation, precision and backward.

::

    from accelerate import Accelerator
    from memguard.integrations.accelerate import accelerator_kwargs, prepare, step

    plan = memguard.plan(model, example_batch, global_batch_size=256, budget_bytes=8 << 30, device="cpu")
    accelerator = Accelerator(**accelerator_kwargs(plan))   # mixed precision, accumulation, cpu
    model, optimizer = prepare(accelerator, model, optimizer, plan=plan)
    loader = accelerator.prepare(DataLoader(dataset, batch_size=plan.micro_batch_size))
    for batch in loader:
        loss = step(accelerator, model, optimizer, batch, loss_fn)   # steps every k-th batch

:func:`step` is called once per dataloader batch, as in Accelerate's own gradient-accumulation
loop, and does what that loop does: it enters ``accelerator.accumulate(model)``, runs the forward
and loss under ``accelerator.autocast()``, calls ``accelerator.backward`` (which divides by the
accumulation steps and scales the loss for ``fp16``), and, when ``accelerator.sync_gradients``
says the accumulation is complete, steps and zeroes the prepared optimizer (which unscales and
skips on overflow through the Accelerator's GradScaler).

What memguard adds, through the guard core (:class:`memguard.guard._core.Guard`, whose OOM engine
is :class:`memguard.guard._window.MicroBatchWindow`): each batch is split
into micro-batches of the plan's size (weighted by their share of samples, so the gradient is
unchanged); on an out-of-memory error the micro-batch is halved and every batch of the current
optimizer step so far is run again from its first sample, losing and repeating no sample. Under
DDP (``accelerate launch`` on several processes) the micro-batches run on the module inside the
DDP wrapper, every rank reports its outcome in one small all-reduce after each batch, so all ranks
retry together, and the gradients are averaged by memguard once per optimizer step
(:mod:`memguard.guard._distributed`), after every rank has finished. Under FSDP2
(``FullyShardedDataParallelPlugin(fsdp_version=2)``, as :func:`accelerator_kwargs` builds it) the
micro-batches run through the model ``accelerator.prepare`` sharded, with an agreement of the
ranks before each FSDP2 all-gather and reduce-scatter (:mod:`memguard.guard._sharded`,
:mod:`memguard.guard._fsdp2_frameworks`): a rank that runs out of memory in compute reports at
once, its peers leave forward/backward at their next FSDP2 collective instead of waiting in it,
every rank resets FSDP2's per-step state, halves and replays the same samples. Gradients are
FSDP2's to reduce-scatter (and Accelerate's ``no_sync`` to hold back when accumulating). Under
FSDP1 (``fsdp_version=1``, with ``use_orig_params=True``) the same protocol runs before FSDP1's
all-gathers and reduce-scatters (:mod:`memguard.guard._fsdp1`), the micro-batches going through the
``FullyShardedDataParallel`` wrapper ``accelerator.prepare`` returns. Under FSDP memguard plans
before the model is sharded: give :func:`prepare` ``plan=`` or ``example_batch=`` (it then calls
``accelerator.prepare`` itself). Under Accelerate's DeepSpeed plugin (ZeRO-1 to 3, as
:func:`accelerator_kwargs` builds it from a DeepSpeed plan) :func:`prepare` lets ``accelerator.prepare``
build the engine and arms an agreement before every DeepSpeed collective
(:mod:`memguard.integrations._deepspeed_guard`); :func:`step` then does what ``accelerator.backward`` does there
(``DeepSpeedEngineWrapper.backward``, ``accelerate/utils/deepspeed.py``: ``engine.backward``, and
``engine.step()`` when ``sync_gradients``) one micro-batch at a time, each weighted by its share of the
step's samples (``scale_wrt_gas=False``), the window's last micro-batch the engine's accumulation
boundary and ``engine.step()`` once per optimizer step; on an OOM on any rank every rank leaves
forward/backward at its next DeepSpeed collective, resets the engine's step state, halves the
micro-batch and replays the same samples.

Without ``plan=`` or ``example_batch=``, :func:`prepare` plans on the first :func:`step`, from its
batch: the plan is constrained to the Accelerator's precision (``"no"`` -> the model's dtype,
``"fp16"`` -> ``16-mixed``, ``"bf16"`` -> ``bf16-mixed``), its world size and device, and the
global batch defaults to the batch's size x ``gradient_accumulation_steps`` x processes. The
dataloader's batch size and the Accelerator's accumulation stay as they are; the plan's
micro-batch is the size each batch is split into (a plan larger than the batch uses whole
batches). With ``plan=``, the Accelerator must have been built with :func:`accelerator_kwargs`.
The plan summary, on the first :func:`step`, says what runs: the plan's micro-batch within each
dataloader batch, and the Accelerator's own accumulation.

Known limitations:
    :func:`prepare` and :func:`step` guard single-process, DDP, FSDP2, FSDP1 and DeepSpeed Accelerators
    (FSDP1 with ``use_orig_params=True``, without ``cpu_offload``; DeepSpeed without ZeRO offload,
    ZenFlow or pipeline parallelism, and fp16/bf16 only under ZeRO-2/3: the engines
    :func:`memguard.integrations._deepspeed_guard.engine_problems` can reset after an OOM; the others are refused with
    the reason). Under DeepSpeed the plan is the DeepSpeed config's (:func:`prepare` does not plan, and
    clipping is the config's ``gradient_clipping``), an OOM in ``engine.step()`` stops every rank with the
    same :class:`memguard.OOMRecoveryError` (the optimizer update does not shrink with the micro-batch), and
    Accelerate 1.15 on a host without GPUs counts one process under DeepSpeed (``PartialState._prepare_backend``
    picks no backend; with ``cpu=True`` it ignores the plugin), so its dataloader is not sharded by rank
    there. :func:`evaluate` runs under one process, DDP, FSDP2, FSDP1 (``use_orig_params`` True or False) and
    DeepSpeed (ZeRO-0 to 3); under FSDP2, FSDP1 and ZeRO-3, whose forwards all-gather parameters, every rank must
    call it at once and the ranks split together (:mod:`memguard.guard._evaluate_sharded`; ZeRO-3 with
    ``offload_param`` is refused there), under DDP and ZeRO-0/1/2 each rank splits alone. An out-of-memory error
    inside FSDP's or DeepSpeed's own collectives stops every rank with the same
    :class:`memguard.OOMRecoveryError` (see :mod:`memguard.guard._sharded`), and HSDP (a 2-D mesh)
    (and FSDP1's HYBRID_SHARD) is refused, in training and in evaluation. Of a plan's layout
    (:func:`accelerator_kwargs`' ``parallelism_config``) :func:`step` guards FSDP2 over ``dp_shard``; a
    tensor-parallel model it refuses (:mod:`memguard.guard._tp`), and pipeline stages Accelerate does not
    run. Accelerate 1.15 runs an FSDP plugin only on GPUs and other accelerators, not on CPU processes
    (``AcceleratorState.__init__`` in ``accelerate/state.py`` leaves MULTI_CPU alone). XLA and Megatron-LM
    Accelerators are not supported. Gradient
    clipping must be asked of :func:`prepare` (``max_grad_norm=``, ``clip_grad_value=``), since the
    optimizer steps inside :func:`step`. The loss function runs once per micro-batch (and again on
    a replay). Under DDP, gradient communication does not overlap the backward passes and DDP communication hooks
    are not used; the loss function must not start collectives of its own.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memguard.batch import LossFn, batch_size, call_model, map_tensors
from memguard.errors import ConfigError
from memguard.guard._core import Guard, GuardStatus, guard_of, register
from memguard.guard._distributed import rank_group_of
from memguard.guard._evaluate import evaluate as memguard_evaluate
from memguard.guard._fsdp1 import is_fsdp1_model
from memguard.guard._fsdp2_frameworks import is_fsdp2
from memguard.guard._options import Constraints, GuardOptions, clipping, option_problems, plan_problems, wrapper_problems
from memguard.guard._window import DEFAULT_MAX_RETRIES
from memguard.integrations import require
from memguard.planner.api import Plan

__all__ = ["accelerator_kwargs", "prepare", "step", "evaluate", "status"]

logger = logging.getLogger("memguard")

# Lightning's precision names -> Accelerate's mixed_precision ("*-true" casts the model instead).
_MIXED = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "16-true": "no", "bf16-true": "no"}
_TRUE_DTYPES = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}
# Options taken from the Accelerator and the model instead of from the user.
_FROM_ACCELERATOR = ("world_size", "device", "optimizer", "loss_fn", "batch")
_FIX_PLAN = "build it with Accelerator(**accelerator_kwargs(plan))"
_HOW_TO_PREPARE = ("call model, optimizer = memguard.integrations.accelerate.prepare(accelerator, model, optimizer) "
                   "first and pass the model it returns")


def _constraints(accelerator: Any = None, module: nn.Module | None = None, *, accumulation: bool = True,
                 fsdp2: bool = False) -> Constraints:
    """What the Accelerator fixes: its precision, processes and (for a given plan) accumulation; under FSDP2
    the precision of its plugin's mixed-precision policy and FSDP2's sharding levels."""
    allowed = _allowed_precisions(accelerator, module) if accelerator is not None and module is not None else ()
    extra: dict[str, Any] = {}
    if fsdp2 and accelerator is not None:
        policy = getattr(accelerator.state.fsdp_plugin, "mixed_precision_policy", None)
        param_dtype = getattr(policy, "param_dtype", None)
        if param_dtype in (torch.bfloat16, torch.float16):
            allowed = ("bf16-mixed",) if param_dtype == torch.bfloat16 else ("16-mixed",)
        raf = getattr(accelerator.state.fsdp_plugin, "reshard_after_forward", True)
        if raf is None:  # an FSDP1 plugin not set up by a launcher keeps its ShardingStrategy in sharding_strategy
            raf = getattr(accelerator.state.fsdp_plugin, "sharding_strategy", None)
        if isinstance(raf, bool):  # FSDP2
            stages: tuple[int, ...] = (3,) if raf else (2, 1)
            planned = "fsdp2"
        else:  # FSDP1: a ShardingStrategy, estimated as FSDP1 itself (memguard.estimator._fsdp1)
            stages = {"FULL_SHARD": (3,), "SHARD_GRAD_OP": (2,)}.get(str(getattr(raf, "name", raf)).upper(), (3, 2))
            planned = "fsdp1"
        extra = {"strategies": (planned,), "zero_stages": stages}
    return Constraints(
        source="the Accelerator", taken=_FROM_ACCELERATOR,
        precisions=allowed or None,
        world_size=accelerator.num_processes if accelerator is not None else None,
        grad_accum_steps=accelerator.gradient_accumulation_steps if accelerator is not None and accumulation else None,
        fix_plan=_FIX_PLAN, fix_precision="build the Accelerator with that precision (accelerator_kwargs)",
        precision_role="weights", **extra,
    )


# FSDP2's mixed precision for the plan's precision: 16-bit all-gathered parameters, fp32 gradient reduction
# (torch.distributed.fsdp.MixedPrecisionPolicy; the FSDP2 estimate's convention).
_FSDP2_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# Accelerate's mixed_precision under FSDP2: bf16 runs on the policy alone (no autocast, which Accelerate
# adds whenever mixed_precision is not "no", accelerator.py prepare_model); fp16 needs Accelerate's
# sharded GradScaler, which only mixed_precision="fp16" creates.
_FSDP2_MIXED = {"32-true": "no", "bf16-mixed": "no", "16-mixed": "fp16", "bf16-true": "no", "16-true": "no"}
# DeepSpeed runs the precision from its config; Accelerate's mixed_precision must name the same one.
_DEEPSPEED_MIXED = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator(...)`` that run ``plan``.

    Always ``mixed_precision`` and the accumulation; ``cpu=True`` for a CPU plan. Build the
    dataloader with ``batch_size=plan.micro_batch_size``. By the plan's strategy:

    * ``"ddp"`` (or one process): ``mixed_precision`` ``"no"`` / ``"fp16"`` / ``"bf16"`` (``"*-true"``
      plans use ``"no"`` and :func:`prepare` casts the model) and ``gradient_accumulation_steps``.
      Run it with :func:`prepare` and :func:`step` (which recover from out-of-memory errors).
    * ``"fsdp2"``: ``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
      reshard_after_forward=zero_stage == 3, ...)`` wrapping each of the plan's repeated blocks
      (``transformer_cls_names_to_wrap=[plan.block_class]``) and then the root, with
      ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` for ``"bf16-mixed"`` /
      ``"16-mixed"`` (``mixed_precision="no"`` for bf16, so Accelerate adds no autocast; ``"fp16"``
      for fp16, for Accelerate's sharded GradScaler), ``cpu_offload`` for an offloading plan and
      ``activation_checkpointing`` when the plan checkpoints; and a ``gradient_accumulation_plugin``
      whose ``sync_each_batch`` is True for stages 2 and 3 (gradients reduce-scattered after every
      micro-batch, so they stay sharded) and False for stage 1 (synchronised on the last one).
    * ``"deepspeed"``: ``deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=to_config(plan))``
      (:func:`memguard.integrations.deepspeed.to_config`), ``gradient_accumulation_steps`` and the
      ``mixed_precision`` that names the config's precision.

    Under FSDP2 and DeepSpeed, :func:`prepare` (with the plan) and :func:`step` run it and recover from
    out-of-memory errors. A DeepSpeed plan gets no ``cpu=True``: Accelerate 1.15 ignores the DeepSpeed plugin
    then (``AcceleratorState.__init__``, accelerate/state.py); DeepSpeed picks its own accelerator
    (``DS_ACCELERATOR=cpu`` on a host without GPUs).

    A plan with a layout (``memguard.plan(..., world_size=N, gpus_per_node=K)``, ``plan.layout``) also gets
    ``parallelism_config=ParallelismConfig(dp_replicate_size, dp_shard_size, tp_size)`` of the layout
    (:func:`memguard.integrations.parallel.accelerate_parallelism_kwargs`; ``accelerate/parallelism_config.py``,
    1.15), on whose device mesh (``accelerator.torch_device_mesh``) Accelerate shards the dataloader by
    data-parallel rank (a tensor-parallel group's ranks get the same batches: ``prepare_data_loader``,
    ``accelerate/data_loader.py``) and, for ``dp_shard > 1`` (an ``"fsdp2"`` plan: the plugin above),
    ``fully_shard`` s over ``dp_shard`` (with ``dp_replicate``: HSDP; ``fsdp2_prepare_model``,
    ``accelerate/utils/fsdp_utils.py``). Tensor parallelism without ``dp_shard`` gets no FSDP plugin
    (``ParallelismConfig._validate_accelerator`` refuses one with ``dp_shard`` and ``cp`` both 1); DDP replicas
    alone get no ``ParallelismConfig`` (whose docstring calls ``dp_replicate`` alone invalid: Accelerate's DDP over
    the processes is that run). Accelerate does not apply tensor parallelism: ``Accelerator.prepare``
    (``_prepare_tp``) skips a model without ``DTensor`` parameters with a warning, and without FSDP2
    ``_prepare_one`` raises unless ``accelerate.utils.get_model_tp_size(model)`` (``model.tp_size``, else
    ``model.config.distributed_config.tp_size``) is the layout's ``tp``. Give it a tensor-parallel model: a
    transformers model loaded so (``from_pretrained(..., tp_plan="auto")``, as that error says; transformers 5:
    ``distributed_config=DistributedConfig(tp_size=tp)``), or a plain one after
    ``parallelize_module(model, accelerator.torch_device_mesh["tp"], tp_plan)`` (the plan
    :func:`memguard.estimator._layout.resolve_tp_plan` gives the estimate) and ``model.tp_size = tp``. With
    ``dp_shard`` too, ``_prepare_tp`` makes the parameters left plain replicated ``DTensor`` s with transformers'
    ``ReplicateParallel``, which transformers 5.24 no longer has (``accelerator.prepare`` raises ImportError):
    such a layout is a ConfigError then. :func:`prepare` and :func:`step` guard a ``dp_shard`` layout; HSDP
    and tensor-parallel models they refuse (see the module docstring): run those with ``accelerator.prepare``
    and your own loop at the plan's micro-batch. On CPU
    Accelerate 1.15 refuses every ``ParallelismConfig`` over several processes
    (``_validate_accelerator``: only FSDP2, GPU-like ``MULTI_*`` and DeepSpeed Accelerators take one, and
    ``AcceleratorState`` runs no FSDP plugin on MULTI_CPU).

    Raises:
        ConfigError: ``plan`` is not a Plan, or it has no Accelerate equivalent (``"16-true"`` under
            DeepSpeed; ``"*-true"`` or optimizer offload beyond what FSDP2 runs; a layout with pipeline
            stages, tensor parallelism over replicas alone, FSDP2 x TP without transformers'
            ``ReplicateParallel``, or a strategy that is not its own); every problem listed.
        MissingDependencyError: Accelerate is not installed (FSDP2 and DeepSpeed plans build its plugins,
            layouts its ``ParallelismConfig``).

    Known limitations:
        FSDP2's ``activation_checkpointing`` checkpoints every wrapped block; a plan that checkpoints
        only some of them is run with more recomputation than planned (and less memory). Without a
        ``plan.block_class`` the plugin wraps the root only (Accelerate's ``NO_WRAP``), which gathers
        every parameter at once: more memory than the per-block estimate.
    """
    if not isinstance(plan, Plan):
        raise ConfigError(f"accelerator_kwargs needs a memguard.Plan, got {type(plan).__name__}")
    layout = _layout_kwargs(plan)
    strategy = plan.strategy
    if strategy == "fsdp2":
        return {**_fsdp2_kwargs(plan), **layout}
    if strategy == "deepspeed":
        return _deepspeed_kwargs(plan)
    problems = plan_problems(plan, _constraints())
    if strategy != "ddp":
        problems.append(f"the plan's strategy {strategy!r} has no Accelerate equivalent here")
    if problems:
        raise ConfigError(problems)
    kwargs: dict[str, Any] = {"mixed_precision": _MIXED[plan.precision],
                              "gradient_accumulation_steps": plan.grad_accum_steps}
    if plan.device == "cpu":
        kwargs["cpu"] = True
    return {**kwargs, **layout}


def _layout_kwargs(plan: Plan) -> dict[str, Any]:
    """``parallelism_config`` for the plan's layout; none without a layout or for DDP replicas alone (which
    ``ParallelismConfig``'s docstring calls invalid and ``_validate_accelerator`` refuses on CPU processes;
    Accelerate's DDP over the processes is the same run)."""
    lay = plan.layout
    if lay is None:
        return {}
    problems = []
    if lay.pp > 1:
        problems.append(f"the plan's layout {lay.describe()} has {lay.pp} pipeline stages, and Accelerate 1.15 has no "
                        "pipeline dimension (ParallelismConfig has dp_replicate, dp_shard, tp, cp and sp): run the "
                        "stages with torch.distributed.pipelining, or plan again with gpus_per_node=world_size (one "
                        "node: memguard puts pipeline stages only across nodes)")
    if lay.tp > 1 and lay.dp_replicate > 1 and lay.dp_shard == 1:  # ParallelismConfig.__post_init__ raises
        problems.append(f"Accelerate's ParallelismConfig refuses tensor parallelism over replicas alone "
                        f"({lay.describe()}): use Layout(dp_shard={lay.dp_replicate}, tp={lay.tp}) (FSDP2 x TP)")
    if lay.tp > 1 and lay.dp_shard > 1 and not _has_replicate_parallel():
        problems.append(f"Accelerate 1.15 runs FSDP2 x TP ({lay.describe()}) with transformers' ReplicateParallel "
                        "(Accelerator._prepare_tp imports it from transformers.integrations.tensor_parallel), which "
                        "the installed transformers does not have, so accelerator.prepare would raise ImportError: "
                        "install a transformers that has it, plan again without gpus_per_node= (FSDP2 over every "
                        "rank), or lay the model out without Accelerate (memguard.integrations.parallel.apply)")
    if plan.strategy == "deepspeed":
        problems.append("a DeepSpeed plan does not take a layout (memguard lays out FSDP2, DDP and TP, not ZeRO): "
                        "build plans with memguard.plan()")
    elif (plan.strategy == "fsdp2") != (lay.dp_shard > 1):
        # dp_shard > 1 is FSDP2 (accelerate.utils.fsdp_utils.fsdp2_prepare_model shards over the mesh's
        # "dp_shard_cp"); ParallelismConfig._validate_accelerator refuses an FSDP2 plugin without dp_shard or cp
        problems.append(f"the plan's strategy {plan.strategy!r} conflicts with its layout {lay.describe()}: dp_shard > "
                        "1 is FSDP2 (strategy 'fsdp2'), and FSDP2 needs dp_shard > 1; build plans with memguard.plan()")
    if problems:
        raise ConfigError(problems)
    if lay.dp_shard == lay.tp == 1:
        return {}
    from memguard.integrations.parallel import accelerate_parallelism_kwargs

    acc = _accelerate()
    # cp_size and sp_size 1 unless given: else ParallelismConfig.__post_init__ reads PARALLELISM_CONFIG_CP_SIZE
    # and _SP_SIZE from the environment
    sizes = {"cp_size": 1, "sp_size": 1, **accelerate_parallelism_kwargs(lay)}
    return {"parallelism_config": acc.ParallelismConfig(**sizes)}


def _has_replicate_parallel() -> bool:
    """Whether Accelerate's FSDP2 x TP path can run: ``Accelerator._prepare_tp`` (accelerator.py, 1.15) imports
    ``ReplicateParallel`` from ``transformers.integrations.tensor_parallel`` (transformers 5.24 has none)
    to make the parameters tensor parallelism left plain replicated ``DTensor`` s before ``fully_shard``."""
    try:
        import transformers.integrations.tensor_parallel as tp
    except ImportError:
        return False
    return hasattr(tp, "ReplicateParallel")


def _fsdp2_kwargs(plan: Plan) -> dict[str, Any]:
    """:func:`accelerator_kwargs` of an FSDP2 plan."""
    problems = []
    if plan.zero_stage not in (1, 2, 3):
        problems.append(f"an FSDP2 plan shards at level 1-3, not zero_stage {plan.zero_stage}; plan again")
    if plan.precision not in _FSDP2_MIXED:
        problems.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(_FSDP2_MIXED)}")
    if problems:
        raise ConfigError(problems)
    utils = require("accelerate.utils", "accelerate", "accelerate")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fsdp: dict[str, Any] = {"fsdp_version": 2, "reshard_after_forward": plan.zero_stage == 3,
                            "cpu_offload": bool(plan.offload_optimizer),
                            "activation_checkpointing": bool(plan.activation_checkpointing)}
    if plan.precision in _FSDP2_PARAM_DTYPES:
        fsdp["mixed_precision_policy"] = MixedPrecisionPolicy(param_dtype=_FSDP2_PARAM_DTYPES[plan.precision],
                                                              reduce_dtype=torch.float32)
    if plan.block_class:
        fsdp["auto_wrap_policy"] = "transformer_based_wrap"
        fsdp["transformer_cls_names_to_wrap"] = [plan.block_class]
    else:
        fsdp["auto_wrap_policy"] = "no_wrap"
    kwargs: dict[str, Any] = {
        "mixed_precision": _FSDP2_MIXED[plan.precision],
        "fsdp_plugin": utils.FullyShardedDataParallelPlugin(**fsdp),
        # stage 1 under FSDP2: gradients synchronised on the last micro-batch only (Accelerate's no_sync)
        "gradient_accumulation_plugin": utils.GradientAccumulationPlugin(
            num_steps=plan.grad_accum_steps, sync_each_batch=plan.zero_stage >= 2),
    }
    if plan.device == "cpu":
        kwargs["cpu"] = True
    return kwargs


def _deepspeed_kwargs(plan: Plan) -> dict[str, Any]:
    """:func:`accelerator_kwargs` of a DeepSpeed plan."""
    from memguard.integrations.deepspeed import to_config

    config = to_config(plan)  # ConfigError lists what DeepSpeed cannot run
    utils = require("accelerate.utils", "accelerate", "accelerate")
    kwargs: dict[str, Any] = {
        "mixed_precision": _DEEPSPEED_MIXED[plan.precision],
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "deepspeed_plugin": utils.DeepSpeedPlugin(hf_ds_config=config),
    }
    # No cpu=True for a CPU plan: Accelerate 1.15 then ignores the DeepSpeed plugin (AcceleratorState.__init__ in
    # accelerate/state.py takes the DeepSpeed branch only when not cpu); DeepSpeed picks its own accelerator
    # (DS_ACCELERATOR=cpu on a host without GPUs).
    return kwargs


def _accelerate() -> Any:
    return require("accelerate", "accelerate", "accelerate")


def _allowed_precisions(accelerator: Any, module: nn.Module) -> tuple[str, ...]:
    """The precisions this Accelerator runs: its mixed precision, or for ``"no"`` the ``*-true`` ones."""
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp == "fp16":
        return ("16-mixed",)
    if mp == "bf16":
        return ("bf16-mixed",)
    if mp == "no":
        first = next((p for p in module.parameters() if p.is_floating_point()), None)
        current = _TRUE_DTYPES.get(first.dtype, "32-true") if first is not None else "32-true"
        return (current,) + tuple(p for p in ("32-true", "bf16-true", "16-true") if p != current)
    return ()


def prepare(
    accelerator: Any,
    first: Any,
    second: Any,
    *,
    plan: Plan | None = None,
    example_batch: Any = None,
    global_batch_size: int | None = None,
    loss_fn: LossFn | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    max_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    verbose: bool = True,
    **plan_options: Any,
) -> tuple[Any, Any]:
    """Apply a plan to a model and optimizer and prepare them with the Accelerator.

    A ``"*-true"`` plan casts the model first; then ``accelerator.prepare(model, optimizer)`` runs,
    unless the optimizer is already an Accelerate optimizer (both were prepared already). The plan
    is ``plan=``, or made now from ``example_batch=`` (under DDP rank 0 plans and broadcasts), or
    made on the first :func:`step` (see the module docstring); its activation checkpointing is
    applied to the model's repeated blocks.

    Args:
        accelerator: an ``accelerate.Accelerator`` (single process, DDP over processes, FSDP2, FSDP1 or
            DeepSpeed; under DeepSpeed give ``plan=`` or nothing: the config's micro-batch is the start).
        first, second: the model and its optimizer, in either order; returned prepared, in the same order.
        plan: a :class:`memguard.Plan` to apply; the Accelerator must match it (:func:`accelerator_kwargs`).
        example_batch: a batch like this rank's dataloader batches, to plan now (under FSDP2 this or
            ``plan`` is required: memguard plans on the model before it is sharded).
        global_batch_size: samples per optimizer step over all ranks, for planning (default: the
            batch's size x ``gradient_accumulation_steps`` x processes).
        loss_fn: ``loss_fn(model, batch) -> mean loss``, the default for :func:`step`; None calls the
            model with the batch and takes ``output.loss`` (as :func:`memguard.step`).
        max_retries: at most this many halvings within one optimizer step.
        max_grad_norm: clip the accumulated gradients' total norm to this once per optimizer step
            (unscaled first through ``accelerator.unscale_gradients`` under ``fp16``); None or 0 does not
            clip. The norm before clipping is ``status(model).grad_norm``.
        clip_grad_value: clip every gradient element to ``[-v, v]`` once per optimizer step (after
            ``max_grad_norm``); None or 0 does not clip.
        verbose: show the plan summary on the first :func:`step` (``MEMGUARD_QUIET=1`` silences it too).
        **plan_options: options for :func:`memguard.plan` (``budget_bytes``, ``gpu``, ``headroom``,
            ``activation_checkpointing``, ``precision`` if it is the Accelerator's, ...).

    Returns:
        ``(model, optimizer)`` as ``accelerator.prepare`` returns them, in the order given.

    Raises:
        MissingDependencyError: accelerate is not installed.
        ConfigError: bad arguments (all listed), an Accelerator that is not single-process, DDP or
            FSDP, one whose precision or accumulation differs from the plan's, FSDP without
            ``plan`` or ``example_batch``, FSDP1 without ``use_orig_params`` or with ``cpu_offload``;
            under DeepSpeed planning or clipping options, a plan that is not the config's, or an engine
            memguard cannot reset after an OOM (ZeRO offload, ZenFlow, pipeline parallelism, fp16/bf16 below
            ZeRO-2).
        InfeasiblePlanError: planning now found nothing that fits.
        PeerFailedError: under DDP, planning now failed on rank 0 with an error that is not memguard's.
    """
    acc = _accelerate()
    problems: list[str] = []
    if not isinstance(accelerator, acc.Accelerator):
        problems.append(f"the first argument must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    pair = (first, second)
    models = [x for x in pair if isinstance(x, nn.Module)]
    optimizers = [x for x in pair if isinstance(x, (torch.optim.Optimizer, acc.optimizer.AcceleratedOptimizer))]
    if len(models) != 1 or len(optimizers) != 1:
        problems.append("prepare takes the accelerator, then the model (an nn.Module) and its optimizer, in either "
                        f"order; got {type(first).__name__} and {type(second).__name__}")
    if problems:
        raise ConfigError(problems)
    model, optimizer = models[0], optimizers[0]
    dtype = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if dtype == "DEEPSPEED":
        return _prepare_deepspeed(accelerator, first, second, model, optimizer, plan=plan, example_batch=example_batch,
                                  global_batch_size=global_batch_size, loss_fn=loss_fn, max_retries=max_retries,
                                  max_grad_norm=max_grad_norm, clip_grad_value=clip_grad_value,
                                  plan_options=plan_options)
    fsdp2 = dtype == "FSDP" and bool(getattr(accelerator, "is_fsdp2", False))
    fsdp1 = dtype == "FSDP" and not fsdp2
    if fsdp1:
        plugin = accelerator.state.fsdp_plugin
        if not getattr(plugin, "use_orig_params", False):
            problems.append("under FSDP1 build the plugin with use_orig_params=True: memguard prepares the model and "
                            "the optimizer you built on its parameters together, and FSDP1 without it replaces them "
                            "with flat parameters the optimizer does not hold")
        if getattr(getattr(plugin, "cpu_offload", None), "offload_params", False):
            problems.append("FSDP1's cpu_offload copies gradients to the host asynchronously, which memguard's reset "
                            "after an OOM does not wait for; drop cpu_offload from the FSDP plugin")
    if dtype not in ("NO", "FSDP") and not dtype.startswith("MULTI_"):
        problems.append(f"Accelerator with distributed_type {dtype} is not supported: memguard's Accelerate hooks "
                        "run one process, DDP, FSDP2, FSDP1 or DeepSpeed")
    if fsdp1 and is_fsdp1_model(model):
        problems.append("under FSDP1 pass the model before accelerator.prepare wraps it: memguard plans on the "
                        "unwrapped model and prepares it itself")
    elif not fsdp2 or not is_fsdp2(model):  # FSDP2: a model accelerator.prepare already sharded is accepted
        problems += wrapper_problems(model)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    constraints = _constraints(accelerator, inner, fsdp2=fsdp2 or fsdp1)
    if constraints.precisions is None:
        problems.append(f"the Accelerator's mixed_precision {accelerator.mixed_precision!r} is not one memguard plans "
                        "for; use 'no', 'fp16' or 'bf16'")
    problems += option_problems(constraints, plan=plan, example_batch=example_batch,
                                global_batch_size=global_batch_size, loss_fn=loss_fn, max_retries=max_retries,
                                max_grad_norm=max_grad_norm, clip_grad_value=clip_grad_value, verbose=verbose,
                                plan_options=plan_options)
    if problems:
        raise ConfigError(problems)

    already = isinstance(optimizer, acc.optimizer.AcceleratedOptimizer)
    raw_optimizer = optimizer.optimizer if already else optimizer
    # The accumulation is the Accelerator's own; a plan memguard makes only splits its batches.
    options = GuardOptions(loss_fn=loss_fn, max_retries=max_retries, max_grad_norm=max_grad_norm,
                           clip_grad_value=clip_grad_value, verbose=verbose, global_batch_size=global_batch_size,
                           plan_options=plan_options, sync_gradients=not (fsdp2 or fsdp1))
    if fsdp2 or fsdp1:
        model, optimizer = _prepare_sharded(accelerator, model, optimizer, already, options, plan, example_batch,
                                            version=2 if fsdp2 else 1)
        return (model, optimizer) if isinstance(first, nn.Module) else (optimizer, model)
    guard = Guard(inner, _constraints(accelerator, inner, accumulation=False), options,
                  world_size=accelerator.num_processes)
    # "*-true": cast the model now (as memguard.prepare does), before Accelerate wraps it in DDP.
    guard.set_precision(plan.precision if isinstance(plan, Plan) else constraints.precisions[0], raw_optimizer,
                        wrapped=isinstance(model, nn.parallel.DistributedDataParallel))
    if not already:
        prepared = accelerator.prepare(model, optimizer)
        model, optimizer = prepared[0], prepared[1]
    guard.rank_group = rank_group_of(model)
    guard.input_device = accelerator.device
    guard.grad_scaler = getattr(accelerator, "scaler", None)
    if isinstance(plan, Plan):
        guard.apply(plan, raw_optimizer)
    elif example_batch is not None:  # under DDP rank 0 plans and broadcasts: free memory differs between ranks
        guard.plan_and_apply(example_batch, raw_optimizer, accumulation=accelerator.gradient_accumulation_steps,
                             announce=False)  # the first step says what runs (see _announce)
    register(model, guard)
    return (model, optimizer) if isinstance(first, nn.Module) else (optimizer, model)


def _prepare_sharded(accelerator: Any, model: nn.Module, optimizer: Any, already: bool, options: GuardOptions,
                     plan: Plan | None, example_batch: Any, *, version: int) -> tuple[Any, Any]:
    """:func:`prepare` under FSDP2 (``version=2``) or FSDP1. memguard plans (from ``example_batch``) or
    checks and applies ``plan`` on the unsharded model, within what the plugin fixes (its ``reshard_after_forward`` and mixed-precision policy);
    then ``accelerator.prepare`` shards it (``fsdp2_prepare_model`` in ``accelerate/utils/fsdp_utils.py``,
    1.15: ``fully_shard`` of each auto-wrapped module, then the root, the optimizer re-pointed at the sharded
    parameters), and memguard arms FSDP2's agreement protocol on every FSDP2 group
    (:func:`memguard.guard._fsdp2_frameworks.framework_rank_group`). Under FSDP1 ``accelerator.prepare``
    wraps the model in ``FullyShardedDataParallel`` (a new module): memguard's guard then runs the
    micro-batches through that wrapper, whose forward is FSDP1's root, with the agreement of
    :mod:`memguard.guard._fsdp1` before each FSDP1 collective.

    Raises:
        ConfigError: neither ``plan`` nor ``example_batch`` (memguard cannot trace a sharded model to plan on
            the first step), or a model that is already sharded without a ``plan``.
    """
    from memguard.guard._fsdp2 import _planning_group
    from memguard.guard._fsdp2_frameworks import framework_rank_group

    if plan is None and (example_batch is None or already):
        raise ConfigError(f"under FSDP{version} pass plan= (or example_batch=, with the model and optimizer not yet "
                          "prepared) to memguard.integrations.accelerate.prepare: memguard plans on the unsharded model, before "
                          "accelerator.prepare shards it, and cannot trace a sharded one on the first step")
    raw_optimizer = optimizer.optimizer if already else optimizer
    world = accelerator.num_processes
    guard = Guard(model, _constraints(accelerator, model, accumulation=False, fsdp2=True), options,
                  world_size=world, rank_group=_planning_group(world))
    guard.input_device = accelerator.device
    if isinstance(plan, Plan):
        guard.apply(plan, raw_optimizer)
    else:  # rank 0 plans on the unsharded model and broadcasts
        guard.plan_and_apply(example_batch, raw_optimizer, accumulation=accelerator.gradient_accumulation_steps,
                             announce=False)  # the first step says what runs (see _announce)
    if not already:
        model, optimizer = accelerator.prepare(model, optimizer)
        # fully_shard shards in place (an FSDPModule), and Accelerate returns that module
        if version == 2 and model is not guard.module:
            raise ConfigError("accelerator.prepare returned another module than the one memguard planned for; prepare "
                              "the model with memguard.integrations.accelerate.prepare only")
    if version == 1:
        from memguard.guard._fsdp1 import fsdp1_rank_group

        planned = guard
        # the micro-batches go through FSDP1's root wrapper; the plan was made and applied on the module inside it
        guard = Guard(model, planned.constraints, options, world_size=world, rank_group=fsdp1_rank_group(model))
        guard.input_device = accelerator.device
        assert planned.plan is not None
        # checkpointing is already applied inside the wrapper (planned._undo undoes it)
        guard.apply(None, raw_optimizer, micro_batch_size=planned.plan.micro_batch_size,
                    precision=planned.plan.precision, activation_checkpointing=False)
        guard.plan, guard.plan_made = planned.plan, planned.plan_made
        guard._undo = planned._undo + guard._undo
        planned._undo = []
        rg = guard.rank_group
    else:
        rg = framework_rank_group(model)
    guard.rank_group = rg
    if rg is not None:
        guard.on_undo(rg.uninstall)
    guard.grad_scaler = getattr(accelerator, "scaler", None)
    register(model, guard)
    return model, optimizer


@dataclass
class _DeepSpeedRun:
    """What :func:`step` needs for a DeepSpeed engine ``accelerator.prepare`` built: its micro-batch window (whose
    attempts run under :mod:`memguard.integrations._deepspeed_guard`'s agreements), the default loss and the plan."""

    engine: Any
    window: Any
    loss_fn: LossFn | None
    plan: Plan | None
    planned_micro_batch_size: int
    world_size: int
    steps: int = 0


# One run per DeepSpeed engine prepared by prepare(), kept as long as the engine lives.
_DEEPSPEED: "weakref.WeakKeyDictionary[Any, _DeepSpeedRun]" = weakref.WeakKeyDictionary()


def _prepare_deepspeed(accelerator: Any, first: Any, second: Any, model: nn.Module, optimizer: Any, *,
                       plan: Plan | None, example_batch: Any, global_batch_size: int | None, loss_fn: LossFn | None,
                       max_retries: int, max_grad_norm: float | None, clip_grad_value: float | None,
                       plan_options: dict[str, Any]) -> tuple[Any, Any]:
    """:func:`prepare` under Accelerate's DeepSpeed plugin: ``accelerator.prepare`` builds the engine
    (``Accelerator._prepare_deepspeed`` in ``accelerate/accelerator.py``, 1.15: ``deepspeed.initialize`` with the
    plugin's config, the model returned as the ``DeepSpeedEngine``, the optimizer as a
    ``DeepSpeedOptimizerWrapper`` whose ``step``/``zero_grad`` do nothing), and memguard arms its agreement before
    every DeepSpeed collective on it (:func:`memguard.integrations._deepspeed_guard.engine_rank_group`). The plan is the
    DeepSpeed config's (``accelerator_kwargs(plan)`` wrote it there): memguard does not plan again.

    Raises:
        ConfigError: planning options (``example_batch``, ``global_batch_size``, plan options), clipping options
            (DeepSpeed clips with its config's ``gradient_clipping``), a plan that is not the config's, or an
            engine memguard cannot reset after an OOM (:func:`memguard.integrations._deepspeed_guard.engine_problems`); every
            problem listed.
    """
    from memguard.integrations._deepspeed_guard import engine_problems, engine_rank_group, engine_window

    acc = _accelerate()
    problems: list[str] = []
    asked = [name for name, value in (("example_batch", example_batch), ("global_batch_size", global_batch_size))
             if value is not None] + sorted(plan_options)
    if asked:
        problems.append(f"under DeepSpeed memguard does not plan in prepare (got {', '.join(asked)}): the plan is the "
                        "DeepSpeed config's; plan with memguard.plan(..., zero_stage=...) and build the Accelerator "
                        "with Accelerator(**accelerator_kwargs(plan)), then pass plan=plan")
    if clipping(max_grad_norm) is not None or clipping(clip_grad_value) is not None:
        problems.append("under DeepSpeed the engine clips gradients in engine.step(): set gradient_clipping in the "
                        "DeepSpeed config (to_config(plan, gradient_clipping=...)) instead of max_grad_norm/"
                        "clip_grad_value")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        problems.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if loss_fn is not None and not callable(loss_fn):
        problems.append("loss_fn must be callable as loss_fn(model, batch) -> mean loss")
    if plan is not None and not isinstance(plan, Plan):
        problems.append(f"plan must be a memguard.Plan, got {type(plan).__name__}")
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    config_micro = ds_config.get("train_micro_batch_size_per_gpu")
    if isinstance(plan, Plan):
        if plan.strategy != "deepspeed":
            problems.append(f"the plan's strategy is {plan.strategy!r}, but the Accelerator runs DeepSpeed; "
                            f"{_FIX_PLAN}")
        if isinstance(config_micro, int) and config_micro != plan.micro_batch_size:
            problems.append(f"the DeepSpeed config's train_micro_batch_size_per_gpu is {config_micro}, the plan's "
                            f"micro-batch {plan.micro_batch_size}; {_FIX_PLAN}")
        if plan.grad_accum_steps != accelerator.gradient_accumulation_steps:
            problems.append(f"the Accelerator accumulates {accelerator.gradient_accumulation_steps} batches, the plan "
                            f"{plan.grad_accum_steps}; {_FIX_PLAN}")
    if problems:
        raise ConfigError(problems)
    if not isinstance(optimizer, acc.optimizer.AcceleratedOptimizer):
        prepared = accelerator.prepare(first, second)
        model, optimizer = (prepared if isinstance(first, nn.Module) else prepared[::-1])
    engine = accelerator.deepspeed_engine_wrapped.engine if accelerator.deepspeed_engine_wrapped else None
    if engine is None or model is not engine:
        raise ConfigError("under DeepSpeed pass memguard.integrations.accelerate.prepare the model and optimizer "
                          "before accelerator.prepare, or the pair accelerator.prepare returned")
    problems = engine_problems(engine)
    if problems:
        raise ConfigError(problems)
    micro = plan.micro_batch_size if isinstance(plan, Plan) else int(engine.train_micro_batch_size_per_gpu())
    window = engine_window(engine, micro_batch_size=micro, max_retries=max_retries, plan=plan,
                           precision=plan.precision if isinstance(plan, Plan) else None)
    engine_rank_group(engine)  # every rank arms it now, together
    _DEEPSPEED[engine] = _DeepSpeedRun(engine, window, loss_fn, plan, micro, torch.distributed.get_world_size())
    return (model, optimizer) if isinstance(first, nn.Module) else (optimizer, model)


def _deepspeed_step(run: _DeepSpeedRun, accelerator: Any, batch: Any, loss_fn: LossFn | None) -> float:
    """:func:`step` of a DeepSpeed engine: what ``accelerator.backward`` does there
    (``DeepSpeedEngineWrapper.backward`` in ``accelerate/utils/deepspeed.py``, 1.15: set the accumulation
    boundary from ``sync_gradients``, ``engine.backward(loss)``, and ``engine.step()`` when it is True), with
    every attempt under memguard's agreements: the batch runs in micro-batches weighted by their share of the
    optimizer step's samples (``engine.backward(..., scale_wrt_gas=False)``), the window's last micro-batch is
    the engine's accumulation boundary, and ``engine.step()`` runs once per optimizer step, agreed
    (:func:`memguard.integrations._deepspeed_guard.agreed_engine_step`). On an OOM on any rank every rank resets the engine,
    halves the micro-batch and replays every batch of the step so far."""
    from memguard.batch import compute_loss
    from memguard.integrations._deepspeed_guard import agreed_engine_step, engine_backward, engine_rank_group, open_engine_window

    engine, window = run.engine, run.window
    device = accelerator.device
    batch = map_tensors(batch, lambda t: t if t.device == device else t.to(device))

    def loss_of(micro: Any) -> torch.Tensor:
        with accelerator.autocast():
            return compute_loss(engine, micro, loss_fn)

    with accelerator.accumulate(engine):
        if not window.is_open:
            open_engine_window(engine, window)
        last = bool(accelerator.sync_gradients)
        try:
            # the Accelerator's k batches each weigh 1/k, as accelerator.backward's division by k (DeepSpeed's own
            # gradient-accumulation scaling is what scale_wrt_gas=False leaves out)
            loss = window.run(batch, loss_of, engine_backward(engine),
                              weight=1.0 / accelerator.gradient_accumulation_steps, last=last)
        except BaseException:
            window.finish()
            raise
        if last:
            window.finish()
            agreed_engine_step(engine_rank_group(engine), micro_batch_size=window.micro_batch_size)
            run.steps += 1
    return float(loss)


def step(accelerator: Any, model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None) -> float:
    """Forward and backward one dataloader batch, and step the optimizer when the accumulation is complete.

    Args:
        accelerator: the Accelerator given to :func:`prepare`.
        model: the model :func:`prepare` returned.
        optimizer: the optimizer :func:`prepare` returned.
        batch: this rank's dataloader batch (a tensor or a dict/tuple/list of tensors, samples in
            dim 0); tensors are moved to ``accelerator.device`` if they are elsewhere.
        loss_fn: ``loss_fn(module, micro_batch) -> mean loss`` (it gets the module inside any DDP
            wrapper; under DeepSpeed the engine, whose forward runs ZeRO-3's parameter gathering);
            default: the one given to :func:`prepare`, else the model's ``.loss``.

    Returns:
        This rank's mean loss over ``batch``, as a float.

    Raises:
        ConfigError: the model was not prepared by :func:`prepare`, the batch cannot be split, or no
            loss can be found.
        OOMRecoveryError: an OOM at micro-batch 1, after ``max_retries`` halvings, or in the optimizer step;
            under FSDP and DeepSpeed, an OOM inside a collective (every rank raises the same error).
        PeerFailedError: under DDP, FSDP or DeepSpeed, another rank failed with an error that is not an OOM.
    """
    run = _DEEPSPEED.get(model)
    if run is not None:
        return _deepspeed_step(run, accelerator, batch, loss_fn if loss_fn is not None else run.loss_fn)
    guard = guard_of(model, _HOW_TO_PREPARE)
    loss_fn = loss_fn if loss_fn is not None else guard.options.loss_fn
    raw = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    if guard.micro_batch_size is None:
        guard.plan_and_apply(batch, raw, loss_fn, accumulation=accelerator.gradient_accumulation_steps,
                             announce=False)
    if guard.window is None:
        # The dataloader's batch is the most one forward can take: a larger planned micro-batch uses whole batches.
        guard.limit_micro_batch(batch_size(batch))
        if accelerator.is_main_process and guard.plan is not None:
            _announce(guard, accelerator, batch_size(batch))
    loss_of = guard.loss_of(loss_fn, autocast=accelerator.autocast)
    with accelerator.accumulate(model):
        if guard.window is None or not guard.window.is_open:
            guard.open_window(model, [raw])
        last = bool(accelerator.sync_gradients)
        loss = guard.run(batch, loss_of, accelerator.backward, model=model, last=last)
        if last:
            guard.optimizer_step(optimizer.step, lambda: optimizer.zero_grad(set_to_none=True),
                                 unscale=accelerator.unscale_gradients)
    return float(loss)


def evaluate(accelerator: Any, model: nn.Module, batch: Any, fn: Any = None, **options: Any) -> Any:
    """Evaluate one batch without running out of memory; the result is the unsplit batch's.

    :func:`memguard.evaluate` for an Accelerate loop, as the Lightning callback guards
    ``validation_step``: the batch's tensors are moved to ``accelerator.device`` if they are elsewhere, and
    ``fn(module, micro_batch)`` (default: call the module with the batch) runs under
    ``accelerator.autocast()`` and ``torch.no_grad()`` with the module in ``eval()`` mode, on the module
    inside any DDP or ``torch.compile`` wrapper (no DDP hooks, no collectives, no recompilation for the
    split's sizes). Under FSDP2 it is the ``fully_shard``-ed root ``accelerator.prepare`` returned, under FSDP1
    the ``FullyShardedDataParallel`` wrapper, under DeepSpeed the engine: their forwards all-gather parameters
    (ZeRO-3's; ZeRO-0/1/2 forwards start no collective and each rank splits alone, as under DDP), so under
    FSDP2, FSDP1 and ZeRO-3 every rank must call this at once, and the ranks split together
    (:mod:`memguard.guard._evaluate_sharded`: the same micro-batch offsets on every rank, a rank whose batch is
    shorter running padding forwards whose results are discarded; an OOM on one rank halves the micro-batch on
    all, logged on each). A batch that runs out of memory is split in micro-batches, halving from the one that
    failed (logged at WARNING); the results are joined as :func:`memguard.evaluate` joins them (per-sample
    outputs in one tensor, built in host memory when the device has no room; mean losses weighted by samples,
    or ``weight_fn``). The evaluation's micro-batch is its own: it never changes the training micro-batch
    of :func:`step`. Gather across ranks afterwards as usual
    (``accelerator.gather_for_metrics(result)``): every rank calls it once per batch, however its batch
    was split::

        model.eval()
        for batch in accelerator.prepare(val_loader):
            out = evaluate(accelerator, model, batch)            # a ModelOutput, say
            preds = accelerator.gather_for_metrics(out.logits.argmax(-1))

    Args:
        accelerator: an ``accelerate.Accelerator`` (one process, DDP over processes, FSDP2, FSDP1 or DeepSpeed;
            under FSDP and ZeRO-3 every rank must call this at once, each with its own batch of any size; the
            ranks agree on the micro-batch, run the same forwards and halve together on an OOM on any of them).
        model: the model, as ``accelerator.prepare`` (or :func:`prepare`) returned it (under DeepSpeed the
            engine, which ``fn`` then gets), or not prepared.
        batch: one evaluation batch of this rank (see :mod:`memguard.batch`).
        fn: ``fn(module, micro_batch) -> result``; None calls the module with the batch. For
            outputs too large to keep, return only what the metric needs (the loss).
        **options: :func:`memguard.evaluate`'s keyword arguments: ``micro_batch_size``, ``plan``,
            ``weight_fn``, ``combine``, ``inference_mode``, ``eval_mode``, ``max_retries``.

    Returns:
        The merged result (see :func:`memguard.evaluate`).

    Raises:
        MissingDependencyError: accelerate is not installed.
        ConfigError: bad arguments (all listed); an Accelerator of another distributed type (XLA,
            Megatron-LM); HSDP (FSDP2's 2-D mesh, FSDP1's HYBRID_SHARD), FSDP1's CPU offload or ZeRO-3
            ``offload_param``; under ZeRO-3, the engine's module instead of the engine.
        PeerFailedError: under FSDP or ZeRO-3, a peer failed with an error that is not an OOM.
        OOMRecoveryError: a single sample does not fit, ``max_retries`` was exceeded, or the joined
            outputs fit nowhere (the message names the loss-only ``fn``); under FSDP or ZeRO-3, an OOM inside
            an all-gather (every rank raises the same error).
    """
    acc = _accelerate()
    problems: list[str] = []
    if not isinstance(accelerator, acc.Accelerator):
        problems.append(f"the first argument must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if fn is not None and not callable(fn):
        problems.append(f"fn must be a callable(module, batch) -> result, got {type(fn).__name__}")
    allowed = ("micro_batch_size", "plan", "weight_fn", "combine", "inference_mode", "eval_mode", "max_retries")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        problems.append(f"evaluate() got unknown option(s) {', '.join(unknown)}; it takes {', '.join(allowed)}")
    if not problems:
        kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if kind not in ("NO", "FSDP", "DEEPSPEED") and not kind.startswith("MULTI_"):
            problems.append(f"an Accelerator with distributed_type {kind} is not one memguard evaluates under (one "
                            "process, DDP, FSDP2, FSDP1 or DeepSpeed); evaluate with Accelerate's own loop and a batch "
                            "that fits")
    if problems:
        raise ConfigError(problems)
    # What accelerator.prepare returns is what memguard.evaluate is given, and it finds the rank group the forwards
    # run under (memguard.guard._evaluate_sharded.eval_rank_group): under FSDP2 the module fully_shard made the root
    # (fsdp2_prepare_model in accelerate/utils/fsdp_utils.py applies fully_shard in place and returns the model),
    # under FSDP1 the FullyShardedDataParallel wrapper (accelerator.py, prepare_model), under DeepSpeed the engine
    # (accelerator.py, _prepare_deepspeed: the first value of deepspeed.initialize). Their forwards all-gather
    # parameters (ZeRO-3's; ZeRO-0/1/2 forwards start no collective, each rank splits alone): every rank splits
    # together. HSDP, FSDP1's CPU offload and ZeRO-3 parameter offload are refused there, each with the reason.
    module = _unwrapped(model)
    device = accelerator.device
    batch = map_tensors(batch, lambda t: t if t.device == device else t.to(device))

    def run(inner: nn.Module, micro: Any) -> Any:
        with accelerator.autocast():
            return fn(inner, micro) if fn is not None else call_model(inner, micro)

    return memguard_evaluate(module, batch, run, **options)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile`` wrappers (what ``accelerator.unwrap_model`` returns for them,
    without its imports, e.g. DeepSpeed's engine, which need memory an evaluation that runs out of it lacks).
    FSDP1's wrapper and DeepSpeed's engine are kept, unlike ``unwrap_model``: their forwards gather the parameters
    the inner module holds only shards of."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch._dynamo's OptimizedModule
            model = model._orig_mod
        else:
            return model


def _announce(guard: Guard, accelerator: Any, batch: int) -> None:
    """The plan summary, saying what runs: the plan's micro-batch within each dataloader batch, and the
    Accelerator's own accumulation (which is what the optimizer step accumulates, whatever the plan's
    numbers)."""
    plan = guard.plan
    assert plan is not None and guard.micro_batch_size is not None
    micro, accum, world = guard.micro_batch_size, accelerator.gradient_accumulation_steps, accelerator.num_processes
    splits = -(-batch // micro)
    runs = (f"micro-batch {micro} ({splits} per dataloader batch of {batch}) x accumulation {accum} (the "
            f"Accelerator's) x world {world} = {batch * accum * world} samples per optimizer step")
    overrides = ([f"each dataloader batch of {batch} runs as {splits} micro-batches of {micro} (the same gradient)"]
                 if splits > 1 else [])
    guard.announce(plan, runs=runs, overrides=overrides)
    logger.debug("the plan memguard runs:\n%s", plan.explain())


def status(model: nn.Module) -> GuardStatus:
    """What memguard currently does for ``model`` (as :func:`prepare` returned it).

    Raises:
        ConfigError: the model was not prepared by :func:`prepare`.
    """
    run = _DEEPSPEED.get(model)
    if run is not None:
        w = run.window
        return GuardStatus(micro_batch_size=w.micro_batch_size, planned_micro_batch_size=run.planned_micro_batch_size,
                           precision=run.plan.precision if run.plan is not None else None, plan=run.plan,
                           grad_scaler=None, world_size=run.world_size, steps=run.steps, oom_retries=w.oom_retries)
    return guard_of(model, _HOW_TO_PREPARE).status()
