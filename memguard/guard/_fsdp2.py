"""``memguard.prepare(model, optimizer, strategy="fsdp2")``: plain PyTorch training sharded with FSDP2.

What it does, on every rank (call it on every rank, after ``init_process_group``):

* A plain model is sharded with :func:`shard` (what :func:`memguard.integrations.fsdp.apply` runs)
  once the plan is known
  (given, fixed with ``micro_batch_size=``, planned now from ``example_batch=``, or planned on the
  first :func:`memguard.step`; rank 0 plans on the unsharded model and broadcasts the plan). The
  optimizer the user built over the unsharded parameters is re-pointed at the sharded ones (its
  state must still be empty), so the objects come back unchanged in type.
* A model already sharded with ``fully_shard`` at its root is accepted as it is: the plan is then
  constrained to its layout (``reshard_after_forward`` True = stage 3, else stages 2/1; its
  ``MixedPrecisionPolicy``'s precision).
* :func:`memguard.step` runs each micro-batch through the FSDP2 model with the agreement protocol
  of :mod:`memguard.guard._sharded` armed, so that an OOM on one rank is recovered on every rank
  (or, inside FSDP's own collectives, stops every rank with the same error) instead of hanging.

Precision is FSDP2's: ``*-mixed`` is a ``MixedPrecisionPolicy`` (no autocast), ``*-true`` casts the
weights before sharding. ``16-mixed`` is refused: it needs loss scaling with an inf check
all-reduced over the shards, which ``torch.amp.GradScaler`` does not do.

:func:`shard` is the layout: one ``fully_shard`` per repeated block, then the root, with the plan's
sharding level, ``MixedPrecisionPolicy``, activation checkpointing and ``CPUOffloadPolicy`` (see
:mod:`memguard.integrations.fsdp` for the table).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from memguard.errors import ConfigError
from memguard.guard._core import Guard, blocks_for, forget, register
from memguard.guard._options import Constraints, GuardOptions, model_and_optimizer, option_problems
from memguard.guard._distributed import RankGroup
from memguard.guard._sharded import fsdp_states, is_fsdp_model, sharded_rank_group
from memguard.planner.api import Plan

logger = logging.getLogger("memguard")

#: The 16-bit dtype of each precision name (Lightning's names, memguard.vocab.PRECISIONS).
PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16,
                    "16-true": torch.float16, "32-true": None}


class FSDPSetupError(ConfigError):
    """A model, plan or process group that cannot be sharded as asked (every problem listed in ``.problems``)."""


@dataclass(frozen=True)
class ShardLayout:
    """How :func:`shard_layout` shards a model: the fields of a :class:`~memguard.planner._plan.Plan` it reads.

    The guard's fixed ``micro_batch_size=`` path has no plan and shards with one of these.

    Attributes:
        zero_stage: the FSDP2 sharding level (3, 2 or 1; see :func:`stage_settings`).
        precision: the precision name (a key of :data:`PRECISION_DTYPES`).
        checkpoint_blocks: how many repeated blocks to checkpoint (0: none).
        offload_optimizer: offload parameters, gradients and optimizer states with ``CPUOffloadPolicy``.
    """

    zero_stage: int = 3
    precision: str = "32-true"
    checkpoint_blocks: int = 0
    offload_optimizer: bool = False

    @property
    def activation_checkpointing(self) -> bool:
        """Whether any block is checkpointed (as :attr:`Plan.activation_checkpointing`)."""
        return self.checkpoint_blocks > 0


def stage_settings(zero_stage: int) -> tuple[bool, bool]:
    """``(reshard_after_forward, sync_last_only)`` of an FSDP2 sharding level (3, 2 or 1).

    Raises:
        FSDPSetupError: ``zero_stage`` is not 1, 2 or 3.
    """
    # The agreed meaning of zero_stage under FSDP2 (the estimator's and the planner's).
    table = {3: (True, False), 2: (False, False), 1: (False, True)}
    if zero_stage not in table:
        raise FSDPSetupError(f"zero_stage {zero_stage} has no FSDP2 meaning (3 = reshard_after_forward=True, 2 = "
                             "False, 1 = False with gradient sync on the last micro-batch only); plan with "
                             "strategy='fsdp2'")
    return table[zero_stage]


def _problems(model: Any, plan: Any, mesh: Any) -> list[str]:
    out: list[str] = []
    if not isinstance(model, nn.Module):
        out.append(f"model must be an nn.Module, got {type(model).__name__}")
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        out.append("the model is wrapped in DistributedDataParallel; pass the plain module (FSDP2 replaces DDP)")
    elif is_fsdp_model(model):
        out.append("the model is already sharded with fully_shard; apply the plan to the unsharded model, or pass "
                   "the sharded model to memguard.prepare(..., strategy='fsdp2') as it is")
    if not isinstance(plan, Plan):
        out.append(f"plan must be a memguard.Plan, got {type(plan).__name__}; build it with memguard.plan(..., "
                   "strategy='fsdp2')")
        return out
    strategy = getattr(plan, "strategy", None)  # Plan.strategy: "ddp", "deepspeed" or "fsdp2"
    if strategy == "deepspeed":
        out.append("the plan is for DeepSpeed; turn it into a DeepSpeed config with "
                   "memguard.integrations.deepspeed.to_config, or plan with strategy='fsdp2'")
    elif plan.zero_stage not in (1, 2, 3):
        out.append(f"the plan uses ZeRO stage {plan.zero_stage} (no sharding); plan with strategy='fsdp2' (stages "
                   "1-3), or run it with DistributedDataParallel")
    if plan.precision not in PRECISION_DTYPES:
        out.append(f"the plan's precision {plan.precision!r} is not one of {', '.join(PRECISION_DTYPES)}")
    if mesh is None and not (dist.is_available() and dist.is_initialized()):
        out.append("no process group: call torch.distributed.init_process_group (on every rank) before sharding, or "
                   "pass mesh=")
    else:
        size = mesh.size() if mesh is not None else dist.get_world_size()
        if size != plan.world_size:
            out.append(f"the plan was made for {plan.world_size} ranks but the mesh has {size}; plan with "
                       f"world_size={size}")
    return out


def _device_type(model: nn.Module) -> str:
    devices = {p.device.type for p in model.parameters()} - {"meta"}
    if devices:
        return sorted(devices)[0]
    return "cuda" if torch.cuda.is_available() else "cpu"


def shard(model: nn.Module, plan: Any, *, mesh: Any = None, reshard_after_forward: bool | None = None,
          offload: bool | None = None) -> Callable[[], None]:
    """:func:`apply`, returning a function that undoes the activation checkpointing it applied.

    Raises:
        FSDPSetupError: as :func:`apply`.
    """
    problems = _problems(model, plan, mesh)
    if problems:
        raise FSDPSetupError(problems)
    return shard_layout(model, plan, mesh=mesh, reshard_after_forward=reshard_after_forward, offload=offload)


def shard_layout(model: nn.Module, layout: Plan | ShardLayout, *, mesh: Any = None,
                 reshard_after_forward: bool | None = None, offload: bool | None = None) -> Callable[[], None]:
    """Shard ``model`` as ``layout`` (a plan, or a :class:`ShardLayout`) says, without checking it.
    Returns the checkpointing's undo.

    Raises:
        FSDPSetupError: an unknown sharding level, or checkpointing on a model without repeated blocks.
    """
    plan = layout
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from memguard.estimator._blocks import apply_activation_checkpointing, find_container

    raf, _ = stage_settings(plan.zero_stage)
    if reshard_after_forward is not None:
        raf = bool(reshard_after_forward)
    if mesh is None:
        mesh = init_device_mesh(_device_type(model), (dist.get_world_size(),))
    dtype = PRECISION_DTYPES[plan.precision]
    if plan.precision.endswith("-true") and dtype is not None:
        model.to(dtype)  # bf16-true / 16-true: the weights themselves are 16-bit; FSDP2 shards them as they are
    # MixedPrecisionPolicy (torch/distributed/fsdp/_fully_shard/_fsdp_api.py): param_dtype is the dtype of the
    # all-gathered parameters and of the forward; reduce_dtype that of the gradient reduce-scatter.
    if plan.precision.endswith("-mixed"):
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    elif dtype is not None:  # *-true: parameters already 16-bit; cast float inputs to them
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    else:
        mp = MixedPrecisionPolicy()
    use_offload = plan.offload_optimizer if offload is None else bool(offload)
    off = CPUOffloadPolicy() if use_offload else OffloadPolicy()
    undo: Callable[[], None] = lambda: None
    container = find_container(model)
    blocks = list(container.children()) if container is not None else []
    if plan.activation_checkpointing and plan.checkpoint_blocks > 0:
        if not blocks:
            raise FSDPSetupError("the plan checkpoints activations, but memguard found no repeated blocks in the "
                                 "model; plan with activation_checkpointing=False")
        undo = apply_activation_checkpointing(model, plan.checkpoint_blocks, blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=mp, offload_policy=off)
    return undo




#: The precisions the FSDP2 front-end runs (16-mixed needs a sharded GradScaler; see the module docstring).
FSDP2_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def fsdp2_constraints(*, zero_stages: tuple[int, ...] = (3, 2, 1), precisions: tuple[str, ...] | None = None,
                      world_size: int | None = None) -> Constraints:
    """The :class:`Constraints` of ``memguard.prepare(..., strategy="fsdp2")``.

    FSDP2 runs sharding levels 3, 2 and 1 (ZeRO stage 0 is replication: DistributedDataParallel) and
    offloads with ``CPUOffloadPolicy``; FSDP2's ``MixedPrecisionPolicy`` runs the precision
    (``precision_role="framework"``: memguard neither casts nor autocasts).
    """
    return Constraints(source="memguard.prepare(strategy='fsdp2')", taken=("world_size", "optimizer", "loss_fn"),
                       zero_stages=zero_stages, offload_optimizer=True, precisions=precisions, strategies=("fsdp2",),
                       world_size=world_size, precision_role="framework", splits_batch=True,
                       fix_precision="pass another precision= to memguard.prepare")


def constraints_for(model: nn.Module, world_size: int) -> Constraints:
    """The constraints of an already sharded FSDP2 ``model``: its own sharding level and precision."""
    states = fsdp_states(model)
    # the blocks' groups decide (fully_shard's default keeps the root's parameters after forward)
    groups = [g for s in states[1:] for g in s._fsdp_param_groups] or [g for s in states for g in s._fsdp_param_groups]
    # FSDPParamGroup.post_forward_mesh_info is None when reshard_after_forward is False (_fsdp_param_group.py).
    reshards = {g.post_forward_mesh_info is not None for g in groups} if groups else {True}
    stages = (3,) if reshards == {True} else (2, 1)
    mp = states[0]._mp_policy if states else None
    param_dtype = getattr(mp, "param_dtype", None)
    dtypes = {p.dtype for p in model.parameters()}
    if param_dtype == torch.bfloat16 and dtypes != {torch.bfloat16}:
        precision = "bf16-mixed"
    elif param_dtype == torch.float16 and dtypes != {torch.float16}:
        precision = "16-mixed"
    elif dtypes == {torch.bfloat16}:
        precision = "bf16-true"
    elif dtypes == {torch.float16}:
        precision = "16-true"
    else:
        precision = "32-true"
    return fsdp2_constraints(zero_stages=stages, precisions=(precision,), world_size=world_size)


class FSDP2Guard(Guard):
    """A :class:`Guard` that shards the model with FSDP2 once its plan is known (see the module docstring).

    Args:
        sharded: the model was already sharded by the user.
        mesh: the mesh to shard over (None: every rank of the default group).
        (the rest as :class:`Guard`)
    """

    def __init__(self, module: nn.Module, constraints: Constraints, options: GuardOptions, *, sharded: bool,
                 mesh: Any = None, world_size: int = 1, rank_group: RankGroup | None = None) -> None:
        super().__init__(module, constraints, options, world_size=world_size, rank_group=rank_group)
        self.sharded = sharded
        self.mesh = mesh
        if sharded:
            self._install(sync_last_only=False)

    def _install(self, *, sync_last_only: bool) -> None:
        from memguard.guard._tp import tensor_parallel_rank_group

        # FSDP2 x TP: one agreement group over every rank, at FSDP2's collectives and TP's (memguard.guard._tp)
        rg = tensor_parallel_rank_group(self.module, sync_last_only=sync_last_only)
        if rg is not None:
            self.world_size = rg.data_parallel_size  # the TP ranks of a shard see the same samples
        else:
            rg = sharded_rank_group(self.module, sync_last_only=sync_last_only)
        self.rank_group = rg
        self.on_undo(rg.uninstall)

    def apply(self, plan: Plan | None, optimizer: Any, *, micro_batch_size: int | None = None,
              precision: str | None = None, activation_checkpointing: bool | int = False) -> None:
        """Shard the model as ``plan`` says (if not yet sharded), re-point the optimizer, then apply the rest.

        Raises:
            memguard.integrations.fsdp.FSDPSetupError: the model cannot be sharded as asked.
            ConfigError: the optimizer already has state (it was stepped before sharding).
        """
        layout: Plan | ShardLayout = plan if plan is not None else ShardLayout(
            precision=precision or "32-true", checkpoint_blocks=blocks_for(self.module, activation_checkpointing))
        if not self.sharded:
            module = self.module
            if optimizer is not None and len(optimizer.state) > 0:
                raise ConfigError("the optimizer already has state; memguard.prepare(..., strategy='fsdp2') shards the "
                                  "model and re-points the optimizer at the sharded parameters, which needs an "
                                  "optimizer that has not stepped yet")
            before = dict(module.named_parameters())
            undo = (shard(module, plan, mesh=self.mesh) if plan is not None
                    else shard_layout(module, layout, mesh=self.mesh))
            self.on_undo(undo)
            after = dict(module.named_parameters())
            swap = {id(p): after[name] for name, p in before.items() if name in after}
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["params"] = [swap.get(id(p), p) for p in group["params"]]
            self.sharded = True
            self._install(sync_last_only=stage_settings(layout.zero_stage)[1])
        else:
            try:
                sync_last_only = stage_settings(layout.zero_stage)[1]
            except FSDPSetupError:
                sync_last_only = False
            assert self.rank_group is not None
            self.rank_group.sync_last_only = sync_last_only  # type: ignore[attr-defined]
        # checkpointing was applied before sharding; Guard.apply leaves memguard's checkpointed blocks alone
        super().apply(plan, optimizer, micro_batch_size=micro_batch_size if plan is None else None,
                      precision=layout.precision, activation_checkpointing=activation_checkpointing)


def prepare_fsdp2(first: Any, second: Any, given: GuardOptions, *, plan: Plan | None, micro_batch_size: int | None,
                  example_batch: Any, grad_scaler: Any, mesh: Any = None) -> tuple[Any, Any]:
    """``memguard.prepare(first, second, strategy="fsdp2", ...)``: see :func:`memguard.prepare` and the module
    docstring (``given``: its guard options, unchecked).

    Raises:
        ConfigError: bad arguments (every problem listed): no process group, a DDP or DeepSpeed
            model, a plan for another world size, strategy or precision, ``grad_scaler=``.
        memguard.integrations.fsdp.FSDPSetupError: the model cannot be sharded as the plan says.
        InfeasiblePlanError: planning now (``example_batch``) found nothing that fits.
    """
    problems: list[str] = []
    model, optimizer = model_and_optimizer(first, second, problems)
    initialised = dist.is_available() and dist.is_initialized()
    if not initialised:
        problems.append("strategy='fsdp2' needs a process group: call torch.distributed.init_process_group on every "
                        "rank first")
    world = dist.get_world_size() if initialised else 1
    already = model is not None and is_fsdp_model(model)
    if model is not None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            problems.append("the model is wrapped in DistributedDataParallel; pass the plain module with "
                            "strategy='fsdp2' (FSDP2 replaces DDP)")
        elif any(c.__name__ in ("FullyShardedDataParallel", "DeepSpeedEngine") for c in type(model).__mro__):
            problems.append(f"{type(model).__name__} is not an FSDP2 model; pass the plain module (memguard shards "
                            "it with fully_shard) or one sharded with fully_shard")
        elif already and not isinstance(model, _fsdp_module_type()):
            problems.append("the model has fully_shard-ed submodules but its root is not sharded; call fully_shard on "
                            "the root too, or pass the unsharded model")
    if grad_scaler is not None:
        problems.append("grad_scaler= is for 16-mixed, which strategy='fsdp2' does not run; use bf16-mixed")
    constraints = constraints_for(model, world) if already else fsdp2_constraints(world_size=world)
    options = dict(given.plan_options)
    if plan is None and micro_batch_size is None and constraints.precisions is None:
        options.setdefault("precision", list(FSDP2_PRECISIONS))
    wanted = options.get("precision")
    if wanted is not None and plan is None:
        bad = [p for p in (wanted if isinstance(wanted, (list, tuple)) else [wanted]) if p == "16-mixed"]
        if bad:
            problems.append("precision='16-mixed' is not run under strategy='fsdp2' (loss scaling over sharded "
                            "gradients); use 'bf16-mixed'")
    if isinstance(plan, Plan):
        strategy = getattr(plan, "strategy", None)  # Plan.strategy (when the planner records it)
        if strategy not in (None, "fsdp2"):
            problems.append(f"the plan is for strategy {strategy!r}, not 'fsdp2'; plan with strategy='fsdp2'")
        if plan.precision == "16-mixed":
            problems.append("the plan uses 16-mixed, which strategy='fsdp2' does not run; plan with "
                            "precision='bf16-mixed'")
    problems += option_problems(constraints, plan=plan, micro_batch_size=micro_batch_size,
                                example_batch=example_batch, global_batch_size=given.global_batch_size,
                                loss_fn=given.loss_fn, max_retries=given.max_retries,
                                probe_up_after=given.probe_up_after, max_grad_norm=given.max_grad_norm,
                                clip_grad_value=given.clip_grad_value, batch_dim=given.batch_dim,
                                verbose=given.verbose, plan_options=options)
    if problems:
        raise ConfigError(problems)
    if plan is None and micro_batch_size is None:
        options["strategy"] = "fsdp2"
    assert model is not None
    forget(model)
    guard = FSDP2Guard(model, constraints, dataclasses.replace(given, sync_gradients=False, plan_options=options),
                       sharded=already, mesh=mesh, world_size=world,
                       rank_group=None if already else _planning_group(world))
    if isinstance(plan, Plan):
        guard.apply(plan, optimizer)
        guard.announce(plan, made=False)
    elif micro_batch_size is not None:
        guard.apply(None, optimizer, micro_batch_size=micro_batch_size,
                    precision=options.get("precision", constraints.precisions[0] if constraints.precisions else
                                          "32-true"),
                    activation_checkpointing=options.get("activation_checkpointing", False))
    elif example_batch is not None:
        guard.plan_and_apply(example_batch, optimizer, given.loss_fn)
    register(model, guard)
    return first, second


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _planning_group(world: int) -> RankGroup | None:
    """The default group, for rank 0's plan broadcast before the model is sharded."""
    if world <= 1:
        return None
    return RankGroup(group=None, world_size=world, rank=dist.get_rank(), src=0, device=torch.device("cpu"),
                     broadcast_buffers=False)
