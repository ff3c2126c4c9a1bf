"""The :class:`Plan`: a frozen, serialisable, explainable training configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from memguard.errors import ConfigError
from memguard.estimator._result import Estimate
from memguard.vocab import format_bytes

#: Bumped whenever a field changes meaning; ``from_dict`` refuses other versions.
PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """How to run one optimizer step of ``global_batch_size`` samples within a memory budget.

    Invariant: ``micro_batch_size * grad_accum_steps * world_size == global_batch_size``.

    Attributes:
        micro_batch_size: samples per forward/backward on one rank.
        grad_accum_steps: micro-batches accumulated per optimizer step on one rank.
        world_size: data-parallel ranks.
        global_batch_size: samples per optimizer step over all ranks.
        precision: Lightning's precision name (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``).
        activation_checkpointing: True when some repeated blocks are checkpointed.
        checkpoint_blocks: how many of the model's repeated blocks are checkpointed (the first
            ones, in module order); 0 when ``activation_checkpointing`` is False.
        zero_stage: the sharding level 0-3: DeepSpeed's ZeRO stage (0 = plain DDP or a single
            device), or under FSDP2 3 = ``reshard_after_forward=True``, 2 = ``False``, 1 = ``False``
            with gradient sync on the last micro-batch only.
        offload_optimizer: optimizer states live in host memory (ZeRO-Offload).
        device: ``"cuda"`` or ``"cpu"``.
        gpu: catalog name of the target GPU, or None.
        budget_bytes: the memory the plan must fit in, per rank, before headroom.
        headroom: fraction of ``budget_bytes`` kept free as a safety margin.
        estimate: the verified estimate of the chosen configuration.
        throughput: predicted samples per second (relative units of the cost model).
        reasons: per knob, one sentence on why it was chosen.
        block_class: the class name of the repeated block used for checkpointing, if any.
        hidden_size: the model's hidden size when memguard could read it (for DeepSpeed bucket
            sizes), else None.
        strategy: ``"ddp"`` (also a single device), ``"deepspeed"`` or ``"fsdp2"``. Dicts written
            before this field existed load as ``"deepspeed"`` when their ``zero_stage >= 1``, else
            ``"ddp"``.
        notes: operational advice, one sentence each (how to run the plan), shown by :meth:`explain`.
        layout: the parallel layout (a :class:`memguard.Layout`) when the plan was searched over layouts
            (``memguard.plan(..., gpus_per_node=K)``), else None (``world_size`` data-parallel ranks).
            With a layout, ``world_size`` is every rank (``layout.world_size``) and the invariant is
            ``micro_batch_size * grad_accum_steps * pipeline micro-batches * data-parallel degree ==
            global_batch_size`` (:attr:`data_parallel_size`).
        layout_report: the layouts the search tried, one line each: why each lost (does not fit,
            slower) and the winner's cost terms; shown by :meth:`explain`.
    """

    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    global_batch_size: int
    precision: str
    activation_checkpointing: bool
    zero_stage: int
    budget_bytes: int
    estimate: Estimate
    checkpoint_blocks: int = 0
    offload_optimizer: bool = False
    device: str = "cuda"
    gpu: str | None = None
    headroom: float = 0.0
    throughput: float = 0.0
    reasons: Mapping[str, str] = field(default_factory=dict)
    block_class: str | None = None
    hidden_size: int | None = None
    strategy: str = ""
    notes: tuple[str, ...] = ()
    layout: Any = None
    layout_report: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))
        object.__setattr__(self, "notes", tuple(self.notes))  # a JSON round trip gives a list
        object.__setattr__(self, "layout_report", tuple(self.layout_report))
        if isinstance(self.layout, Mapping):  # from a dict
            from memguard.estimator._layout import Layout

            object.__setattr__(self, "layout", Layout(**dict(self.layout)))
        if not self.strategy:  # older dicts, or built by hand: the meaning zero_stage had before
            object.__setattr__(self, "strategy", "deepspeed" if self.zero_stage >= 1 else "ddp")
        if self.strategy not in ("ddp", "deepspeed", "fsdp2", "fsdp1"):
            raise ConfigError(f"plan strategy {self.strategy!r} is not one of 'ddp', 'deepspeed', 'fsdp2', 'fsdp1'")
        if self.strategy == "fsdp1" and self.zero_stage not in (2, 3):
            raise ConfigError(f"plan is inconsistent: strategy 'fsdp1' with zero_stage {self.zero_stage} (FSDP1 plans "
                              "run 3 = FULL_SHARD or 2 = SHARD_GRAD_OP); build plans with memguard.plan()")
        if (self.strategy == "ddp") != (self.zero_stage == 0):
            raise ConfigError(
                f"plan is inconsistent: strategy {self.strategy!r} with zero_stage {self.zero_stage} ('ddp' runs "
                "zero_stage 0; 'deepspeed' and 'fsdp2' run 1-3); build plans with memguard.plan()")
        if self.layout is not None:
            self._check_layout()
        elif self.micro_batch_size * self.grad_accum_steps * self.world_size != self.global_batch_size:
            raise ConfigError(
                f"plan is inconsistent: micro_batch_size {self.micro_batch_size} x grad_accum_steps "
                f"{self.grad_accum_steps} x world_size {self.world_size} != global_batch_size "
                f"{self.global_batch_size}; build plans with memguard.plan() or fix the numbers"
            )

    def _check_layout(self) -> None:
        from memguard.estimator._layout import Layout

        lay = self.layout
        if not isinstance(lay, Layout):
            raise ConfigError(f"plan layout must be a memguard.Layout, got {type(lay).__name__}")
        if lay.world_size != self.world_size:
            raise ConfigError(f"plan is inconsistent: world_size {self.world_size} but the layout has {lay.world_size} "
                              "ranks; build plans with memguard.plan()")
        pipeline_micro = (lay.pp_microbatches or lay.pp) if lay.pp > 1 else 1
        samples = self.micro_batch_size * self.grad_accum_steps * pipeline_micro
        if samples * self.data_parallel_size != self.global_batch_size:
            raise ConfigError(
                f"plan is inconsistent: {samples} samples per replica x {self.data_parallel_size} data-parallel "
                f"replicas != global_batch_size {self.global_batch_size}; build plans with memguard.plan()")

    @property
    def data_parallel_size(self) -> int:
        """Ranks that hold different samples: ``dp_replicate * dp_shard`` of the layout, else ``world_size``."""
        if self.layout is None:
            return self.world_size
        return self.layout.dp_replicate * self.layout.dp_shard

    @property
    def usable_bytes(self) -> int:
        """``budget_bytes`` less the headroom: what the estimate must stay under."""
        return int(self.budget_bytes * (1.0 - self.headroom))

    def replace(self, **changes: Any) -> "Plan":
        """A copy with some fields changed (the invariant is checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` inverts it exactly."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["estimate"] = self.estimate.to_dict()
        d["reasons"] = dict(self.reasons)
        d["notes"] = list(self.notes)
        d["layout_report"] = list(self.layout_report)
        if self.layout is not None:
            if self.layout.tp_plan is not None:
                raise ConfigError("a plan whose Layout has a custom tp_plan cannot be written as a dict (its styles "
                                  "are Python objects): rebuild the layout after loading")
            d["layout"] = {k: getattr(self.layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule",
                                                                "pp_microbatches", "pp_stages_per_rank")}
        d["format_version"] = PLAN_FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        """Rebuild a plan written by :meth:`to_dict`.

        Raises:
            ConfigError: the dict is not a plan of this format version.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(f"Plan.from_dict needs a mapping, got {type(d).__name__}")
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise ConfigError(
                f"plan format version {version} is not supported (this memguard writes "
                f"{PLAN_FORMAT_VERSION}); plan again with memguard.plan()"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in ("micro_batch_size", "grad_accum_steps", "world_size", "global_batch_size",
                                     "precision", "activation_checkpointing", "zero_stage", "budget_bytes",
                                     "estimate") if n not in d)
        if missing:
            raise ConfigError(f"plan dict lacks {', '.join(missing)}; pass what Plan.to_dict() wrote")
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs["estimate"] = Estimate.from_dict(d["estimate"])
        return cls(**kwargs)

    def explain(self) -> str:
        """A readable account of the plan: the numbers, the breakdown, and why each knob."""
        e = self.estimate
        target = f"{self.world_size} x {self.gpu or self.device}"
        world_word = "data-parallel replicas" if self.layout is not None else "world"
        dp = self.data_parallel_size
        ckpt = f"{self.checkpoint_blocks} blocks" + (f" of {self.block_class}" if self.block_class else "") \
            if self.activation_checkpointing else "off"
        if str(self.reasons.get("mode", "")).startswith("evaluation"):  # memguard.plan(..., train=False)
            head = (f"memguard evaluation plan for {target}: at most {self.micro_batch_size} samples per forward "
                    "on each rank")
        else:
            head = (f"memguard plan for {target}: global batch {self.global_batch_size} = micro-batch "
                    f"{self.micro_batch_size} x accumulation {self.grad_accum_steps}"
                    + (f" x {self.layout.pp_microbatches} pipeline micro-batches" if self.layout is not None
                       and self.layout.pp > 1 else "") + f" x {world_word} {dp}")
        lines = [
            head,
            f"  precision                 {self.precision}",
            f"  activation checkpointing  {ckpt}",
            f"  strategy                  {self._strategy_line()}",
            *([f"  layout                    {self._layout_line()}"] if self.layout is not None else []),
            f"  ZeRO stage                {self.zero_stage}" + (" (optimizer offloaded to CPU)" if self.offload_optimizer else "")
            + (" (FSDP2's sharding level)" if self.strategy == "fsdp2" else ""),
            f"  predicted peak            {format_bytes(e.peak_bytes)} of {format_bytes(self.usable_bytes)} usable "
            f"({format_bytes(self.budget_bytes)} budget, {100 * self.headroom:.0f}% headroom)"
            + (f" + {format_bytes(e.context_bytes)} CUDA context" if e.context_bytes else ""),
            *([f"  upper bound               {format_bytes(e.peak_upper_bytes)} with the unmodelled kernel "
               "workspaces (what the plan was sized on)"] if e.peak_upper_bytes > e.peak_bytes else []),
            "",
            "Breakdown at the peak:",
            e.table(),
        ]
        if self.reasons:
            lines += ["", "Why:"]
            lines += [f"  {k}: {v}" for k, v in self.reasons.items()]
        if self.layout_report:
            lines += ["", "Layouts considered (best configuration of each):"]
            lines += [f"  - {r}" for r in self.layout_report]
        if self.notes:
            lines += ["", "Notes:"]
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)

    def _layout_line(self) -> str:
        lay = self.layout
        line = lay.describe()
        if lay.pp > 1:
            line += f", {lay.pp_schedule} schedule, {lay.pp_microbatches or lay.pp} micro-batches"
        if self.estimate.rank_peak_bytes and len(set(self.estimate.rank_peak_bytes)) > 1:
            peaks = self.estimate.rank_peak_bytes
            line += f"; rank peaks {format_bytes(min(peaks))} to {format_bytes(max(peaks))}"
        return line

    def _strategy_line(self) -> str:
        if self.strategy == "fsdp1":
            return f"FSDP1 (FullyShardedDataParallel), {'FULL_SHARD' if self.zero_stage == 3 else 'SHARD_GRAD_OP'}"
        if self.strategy == "fsdp2":
            what = {3: "reshard_after_forward=True", 2: "reshard_after_forward=False",
                    1: "reshard_after_forward=False, gradient sync on the last micro-batch"}.get(self.zero_stage, "")
            line = f"FSDP2, sharding level {self.zero_stage} ({what})"
            return line + (" with CPUOffloadPolicy" if self.offload_optimizer else "")
        if self.strategy == "deepspeed":
            return f"DeepSpeed ZeRO stage {self.zero_stage}" + (
                " (optimizer offloaded to CPU)" if self.offload_optimizer else "")
        return "DDP" if self.world_size > 1 else "one device"

    def __str__(self) -> str:
        return self.explain()
