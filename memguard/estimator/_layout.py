"""Parallel layouts: :class:`Layout` (data-parallel replicas and shards, tensor and pipeline
parallel degrees), its checks, the tensor-parallel plan it traces with, and the per-rank estimate.

A layout is the mesh a job runs on, in torchtitan's order of mesh dimensions
(``torchtitan/distributed/parallel_dims.py``: ``pp, dp_replicate, dp_shard, tp``); rank
``r`` of the world sits at ``r = ((pp_i * dp_replicate + rep_i) * dp_shard + shard_i) * tp + tp_i``,
and ``Estimate.rank_peak_bytes`` lists the ranks in that order.

How each degree is estimated:

* ``dp_replicate > 1`` alone is DDP over that many ranks (the existing DDP estimate);
* ``dp_shard > 1`` alone is FSDP2 over that many ranks (:mod:`memguard.estimator._fsdp2`);
* ``dp_replicate > 1`` with ``dp_shard > 1`` is HSDP: ``fully_shard`` over the 2-D
  ``(dp_replicate, dp_shard)`` mesh (``_fsdp_api.py``: a 2-D mesh replicates over its first
  dimension and shards over its second), traced as FSDP2 x TP is below;
* ``tp > 1`` traces rank 0 of a real ``parallelize_module`` step over a fake process group
  (:mod:`memguard.estimator._tp_trace`); with ``dp_shard > 1`` as well, the tensor-parallel copy is
  then sharded with ``fully_shard`` over the data-parallel dimensions of the
  ``(dp_replicate, dp_shard, tp)`` mesh (FSDP2 x TP, or HSDP x TP, as torchtitan's
  ``parallelize_llama`` applies TP first, then FSDP2); DDP over tensor-parallel shards
  (``dp_replicate`` and ``tp`` without ``dp_shard``) is refused;
* ``pp > 1`` traces each pipeline stage under the real ``GPipe`` or ``1F1B`` schedule over a fake
  process group (:mod:`memguard.estimator._pipeline`); the stages' peaks differ. Under
  ``Interleaved1F1B`` or ``ZBVZeroBubble`` each pipeline rank holds ``pp_stages_per_rank`` virtual
  stages (loop or V layout) and its stages are traced together under that schedule, pipeline stages
  alone (no ``dp_shard`` or ``tp`` inside them yet). With ``tp`` and/or
  ``dp_shard`` as well, the stage is laid out over the ``(pp, dp_replicate, dp_shard, tp)`` mesh
  first (TP, then FSDP2 with the stage as root, as torchtitan does) and the first rank of each
  stage is traced; DDP over stages (``dp_replicate`` without ``dp_shard``) is refused.

The tensor-parallel plan (:func:`resolve_tp_plan`): ``Layout(tp_plan=...)`` if given, else the
model config's ``base_model_tp_plan`` (transformers' own plan: decoder projections colwise and
rowwise, embeddings, norms and the head replicated), else a plan found by name in the repeated
blocks (:data:`COLWISE_NAMES`, :data:`ROWWISE_NAMES`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from torch import nn

from memguard.errors import ConfigError

#: Pipeline schedules by their names in ``torch.distributed.pipelining.schedules`` (torch 2.13).
PP_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")

#: Linear layers of a repeated block sharded column-wise (output features) by the default plan, by
#: the last part of their name: attention's query/key/value projections and the MLP's input
#: projections of Llama-style (``q_proj``, ``gate_proj``, ``up_proj``) and GPT-style blocks
#: (``query``/``key``/``value``, ``fc_in``, ``c_fc``, ``fc1``). The Megatron-LM split (Shoeybi et
#: al. 2019, arXiv 1909.08053, section 3): the first GEMM of each pair column-parallel.
COLWISE_NAMES: frozenset[str] = frozenset({
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "wq", "wk", "wv",
    "gate_proj", "up_proj", "w1", "w3", "fc_in", "c_fc", "fc1",
})
#: Linear layers sharded row-wise (input features), each followed by an all-reduce: attention's
#: output projection and the MLP's output projection (the second GEMM of each Megatron pair).
ROWWISE_NAMES: frozenset[str] = frozenset({
    "o_proj", "out_proj", "o", "wo", "down_proj", "w2", "fc_out", "c_proj", "fc2",
})

#: transformers' plan style names (``transformers/integrations/tensor_parallel.py``, 5.x) that map
#: onto torch's own styles, and the plain names memguard accepts in ``Layout(tp_plan=...)``.
STYLE_NAMES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                                "embedding_rowwise", "sequence_parallel", "replicate")


@dataclass(frozen=True)
class Layout:
    """How a job is laid out over ranks: data-parallel replicas and shards, tensor and pipeline
    parallel degrees. The world size is their product.

    Attributes:
        dp_replicate: data-parallel replicas (DDP when alone).
        dp_shard: data-parallel shards (FSDP2 ``fully_shard``; its sharding level is the
            estimate's ``zero_stage``, 3 by default).
        tp: tensor-parallel degree (``parallelize_module`` with ColwiseParallel/RowwiseParallel).
        pp: pipeline stages, one per rank (with FSDP2 and/or TP inside each stage; not with DDP alone).
        pp_schedule: a name of :data:`PP_SCHEDULES`.
        pp_microbatches: micro-batches the schedule splits one replica's batch into (None: ``pp``).
        pp_stages_per_rank: virtual pipeline stages each rank holds (the decoder cut into
            ``pp * pp_stages_per_rank`` stages): 1 under ``GPipe`` and ``1F1B``, 2 under ``ZBVZeroBubble``,
            2 or more under ``Interleaved1F1B``; None: 1 for the single-stage schedules, 2 for the others
            (torchtitan's default, ``torchtitan/distributed/pipeline_parallel.py``: ``stages_per_rank = 1 if
            is_single_stage_schedule else 2``).
        tp_plan: the tensor-parallel plan, ``{module name pattern: style}`` as
            ``parallelize_module`` takes it (``*`` matches one name part), a style being a torch
            ``ParallelStyle`` or one of :data:`STYLE_NAMES`; None: the model config's
            ``base_model_tp_plan``, else the plan found by name (:func:`resolve_tp_plan`). Not part
            of the layout's equality or hash (a plan's styles are not comparable values).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    tp_plan: Mapping[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def world_size(self) -> int:
        """The number of ranks: ``dp_replicate * dp_shard * tp * pp``."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    def describe(self) -> str:
        """One phrase, e.g. ``"dp_shard=2 x tp=2 (4 ranks)"``."""
        parts = [f"{name}={getattr(self, name)}" for name in ("pp", "dp_replicate", "dp_shard", "tp")
                 if getattr(self, name) != 1]
        return (" x ".join(parts) or "1 rank") + f" ({self.world_size} ranks)"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_layout(layout: Any, *, zero_stage: Any, world_size: Any, strategy: Any, problems: list[str]) -> None:
    """Append a sentence to ``problems`` for each invalid degree of ``layout`` and each keyword that
    conflicts with it (the model-dependent checks are :func:`check_model_fits`)."""
    if not isinstance(layout, Layout):
        problems.append(f"layout must be a memguard.Layout, got {type(layout).__name__}: pass "
                        "layout=memguard.Layout(dp_shard=..., tp=..., pp=...)")
        return
    degrees_ok = True
    for name in ("dp_replicate", "dp_shard", "tp", "pp"):
        value = getattr(layout, name)
        if not (_is_int(value) and value >= 1):
            problems.append(f"Layout({name}={value!r}) must be an integer >= 1")
            degrees_ok = False
    if layout.pp_schedule not in PP_SCHEDULES:
        problems.append(f"Layout(pp_schedule={layout.pp_schedule!r}) is not one of {', '.join(map(repr, PP_SCHEDULES))}")
    if layout.pp_microbatches is not None and not (_is_int(layout.pp_microbatches) and layout.pp_microbatches >= 1):
        problems.append(f"Layout(pp_microbatches={layout.pp_microbatches!r}) must be an integer >= 1 or None")
    if layout.tp_plan is not None and not isinstance(layout.tp_plan, Mapping):
        problems.append(f"Layout(tp_plan=...) must be a mapping {{module name pattern: style}}, got "
                        f"{type(layout.tp_plan).__name__}")
    if not degrees_ok:
        return
    if layout.pp > 1:
        from memguard.estimator._pipeline import MULTI_STAGE_SCHEDULES, SINGLE_STAGE_SCHEDULES

        if layout.dp_replicate > 1 and layout.dp_shard == 1:
            problems.append(f"Layout(pp={layout.pp}, dp_replicate={layout.dp_replicate}) (DDP over pipeline stages) "
                            f"is not estimated yet: shard the data-parallel dimension instead (dp_shard="
                            f"{layout.dp_replicate}), or add dp_shard for HSDP")
        if layout.pp_schedule in MULTI_STAGE_SCHEDULES and (layout.dp_shard > 1 or layout.tp > 1):
            problems.append(f"Layout(pp_schedule={layout.pp_schedule!r}) with dp_shard or tp inside the stages is not "
                            f"estimated yet: use {' or '.join(map(repr, SINGLE_STAGE_SCHEDULES))} with them, or "
                            "pipeline stages alone (dp_shard=1, tp=1)")
        _check_multi_stage(layout, problems)
        micro = layout.pp_microbatches or layout.pp
        if layout.pp_schedule == "1F1B" and _is_int(micro) and micro < layout.pp:
            # Schedule1F1B refuses it (schedules.py, Schedule1F1B.__init__)
            problems.append(f"Layout(pp_microbatches={micro}) must be >= pp={layout.pp} under 1F1B: use "
                            f"pp_microbatches={layout.pp} or more, or pp_schedule='GPipe'")
    if layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.tp > 1:
        problems.append(f"Layout(dp_replicate={layout.dp_replicate}, tp={layout.tp}) (DDP over tensor-parallel "
                        "shards) is not estimated yet: shard the data-parallel dimension instead (dp_shard with tp, "
                        "or dp_replicate with dp_shard and tp: HSDP x TP)")
    if world_size != 1 and world_size != layout.world_size:
        problems.append(f"world_size={world_size!r} conflicts with the layout's {layout.world_size} ranks: drop "
                        "world_size= (the layout sets it)")
    if strategy == "deepspeed":
        problems.append("strategy='deepspeed' does not take a layout: drop layout= (ZeRO over world_size ranks), "
                        "or drop strategy= (the layout's dp_shard is FSDP2)")
    elif strategy == "ddp" and layout.dp_shard > 1:
        problems.append(f"strategy='ddp' conflicts with Layout(dp_shard={layout.dp_shard}) (FSDP2): drop "
                        "strategy=, or use dp_replicate for DDP")
    elif strategy == "fsdp2" and layout.dp_shard == 1:
        problems.append("strategy='fsdp2' needs Layout(dp_shard=N) with N > 1 (the FSDP2 dimension): set "
                        "dp_shard, or drop strategy=")
    if _is_int(zero_stage) and zero_stage >= 1 and layout.dp_shard == 1:
        problems.append(f"zero_stage={zero_stage} shards over the layout's dp_shard dimension, which is 1: set "
                        "Layout(dp_shard=N) with N > 1, or pass zero_stage=0")


def stages_per_rank(layout: Layout) -> int:
    """The virtual pipeline stages each rank holds: ``Layout.pp_stages_per_rank``, or its default (1 under
    the single-stage schedules, 2 under the others)."""
    from memguard.estimator._pipeline import MULTI_STAGE_SCHEDULES

    if layout.pp_stages_per_rank is not None:
        return layout.pp_stages_per_rank
    return 2 if layout.pp_schedule in MULTI_STAGE_SCHEDULES else 1


def _check_multi_stage(layout: Layout, problems: list[str]) -> None:
    """``pp_stages_per_rank`` and ``pp_microbatches`` against what the schedule takes (``pp > 1``)."""
    from memguard.estimator._pipeline import SINGLE_STAGE_SCHEDULES

    sched, given = layout.pp_schedule, layout.pp_stages_per_rank
    if given is not None and not (_is_int(given) and given >= 1):
        problems.append(f"Layout(pp_stages_per_rank={given!r}) must be an integer >= 1 or None")
        return
    if sched in SINGLE_STAGE_SCHEDULES and given not in (None, 1):
        problems.append(f"Layout(pp_stages_per_rank={given}) needs a multi-stage schedule: {sched!r} runs one stage "
                        "per rank; use pp_schedule='Interleaved1F1B' (2 or more per rank) or 'ZBVZeroBubble' (2), "
                        "or drop pp_stages_per_rank")
    elif sched == "ZBVZeroBubble" and given not in (None, 2):
        # schedules.py, ScheduleZBVZeroBubble.__init__: "ZBV requires exactly 2 stages per rank"
        problems.append(f"Layout(pp_stages_per_rank={given}) under ZBVZeroBubble: the V schedule takes exactly 2 "
                        "stages per rank; use pp_stages_per_rank=2 (or None), or pp_schedule='Interleaved1F1B'")
    elif sched == "Interleaved1F1B" and given is not None and given < 2:
        # torchtitan/distributed/pipeline_parallel.py refuses a multi-stage schedule with one stage per rank
        # ("Multi-stage schedule requires at least 2 stages per rank"): with one it is 1F1B
        problems.append(f"Layout(pp_stages_per_rank={given}) under Interleaved1F1B: interleaving takes 2 or more "
                        "stages per rank; use pp_stages_per_rank=2 or more, or pp_schedule='1F1B'")
    micro = layout.pp_microbatches or layout.pp
    if sched == "Interleaved1F1B" and _is_int(micro):
        # schedules.py, ScheduleInterleaved1F1B.__init__: number_of_rounds = max(1, n_microbatches //
        # pp_group_size), and n_microbatches must be a multiple of it
        rounds = max(1, micro // layout.pp)
        if micro % rounds:
            ok = [m for m in range(1, 4 * layout.pp + 1) if m % max(1, m // layout.pp) == 0]
            problems.append(f"Layout(pp_microbatches={micro}) under Interleaved1F1B with pp={layout.pp}: torch's "
                            f"schedule needs a multiple of max(1, pp_microbatches // pp) = {rounds}; use one of "
                            f"{', '.join(map(str, ok))}, or any multiple of pp={layout.pp}")


def _config_sizes(model: nn.Module) -> dict[str, int]:
    """The sizes tensor parallelism splits, read from a transformers config (both naming styles)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return {}
    names = {
        "num_attention_heads": ("num_attention_heads", "n_head"),
        "num_key_value_heads": ("num_key_value_heads",),
        "hidden_size": ("hidden_size", "n_embd"),
        "intermediate_size": ("intermediate_size", "n_inner"),
    }
    out = {}
    for key, options in names.items():
        for name in options:
            value = getattr(cfg, name, None)
            if _is_int(value):
                out[key] = value
                break
    return out


def check_model_fits(model: nn.Module, layout: Layout, plan: Mapping[str, Any] | None, problems: list[str]) -> None:
    """The model-dependent checks: under ``tp > 1`` the config's heads, key/value heads, hidden and
    intermediate sizes divide by ``tp``, and so does the sharded dimension of every Linear the plan
    shards (output features colwise, input features rowwise)."""
    if layout.tp > 1:
        for key, value in _config_sizes(model).items():
            if value % layout.tp:
                divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
                problems.append(f"Layout(tp={layout.tp}) must divide the config's {key}={value}: use tp in "
                                f"{divisors}")
        if plan is not None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            for name, module in model.named_modules():
                style = _style_for(plan, name)
                if style is None or not isinstance(module, nn.Linear):
                    continue
                if isinstance(style, ColwiseParallel) and module.out_features % layout.tp:
                    problems.append(f"{name} has {module.out_features} output features, which tp={layout.tp} "
                                    "does not divide (ColwiseParallel shards them)")
                elif isinstance(style, RowwiseParallel) and module.in_features % layout.tp:
                    problems.append(f"{name} has {module.in_features} input features, which tp={layout.tp} "
                                    "does not divide (RowwiseParallel shards them)")


def _style_for(plan: Mapping[str, Any], name: str) -> Any:
    """The style ``parallelize_module`` applies to module ``name`` (patterns matched per name part)."""
    parts = name.split(".")
    for pattern, style in plan.items():
        pp = pattern.split(".")
        if len(pp) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pp)):
            return style
    return None


def make_style(style: Any, where: str, problems: list[str]) -> Any:
    """A torch ``ParallelStyle`` for a plan entry: a style instance as it is, a name of
    :data:`STYLE_NAMES` as transformers means it (``transformers/integrations/tensor_parallel.py``:
    ``colwise_gather_output`` gathers the output, ``rowwise_split_input`` takes a replicated input,
    ``embedding_rowwise`` shards an embedding's rows and all-reduces its output), ``"replicate"``
    as no entry (None)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, ParallelStyle):
        return style
    made = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(),
        "replicate": lambda: None,
    }.get(style)
    if made is None:
        problems.append(f"tensor-parallel plan entry {where!r}: style {style!r} is not a torch ParallelStyle nor "
                        f"one of {', '.join(map(repr, STYLE_NAMES))}")
        return None
    return made()


def _prefixed(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' ``base_model_tp_plan`` names modules of the base model: prefix them with the
    head model's ``base_model_prefix`` (``model.`` for ``LlamaForCausalLM``) where that is a child."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module) and getattr(model, prefix) is not model:
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)


def default_plan_by_name(model: nn.Module) -> dict[str, str]:
    """The plan found by name: in each repeated block (:func:`~memguard.estimator._blocks.find_container`),
    ``nn.Linear`` layers named as in :data:`COLWISE_NAMES` colwise and :data:`ROWWISE_NAMES` rowwise;
    everything else (embeddings, norms, the head) replicated."""
    from memguard.estimator._blocks import find_container

    container = find_container(model)
    if container is None:
        return {}
    cname = next(n for n, m in model.named_modules() if m is container)
    plan: dict[str, str] = {}
    for name, module in container.named_modules():
        if not isinstance(module, nn.Linear) or not name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLWISE_NAMES or leaf in ROWWISE_NAMES:
            first, _, rest = name.partition(".")
            if first.isdigit():
                key = f"{cname}.*.{rest}" if cname else f"*.{rest}"
                plan[key] = "colwise" if leaf in COLWISE_NAMES else "rowwise"
    return plan


def resolve_tp_plan(model: nn.Module, layout: Layout, problems: list[str]) -> tuple[dict[str, Any] | None, str]:
    """The plan ``parallelize_module`` is given (styles made, replicated entries dropped) and where
    it came from: ``Layout(tp_plan=...)``, the config's ``base_model_tp_plan``, or by name."""
    if layout.tp_plan is not None:
        raw, source = dict(layout.tp_plan), "Layout(tp_plan=...)"
    else:
        cfg_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
        if cfg_plan:
            raw, source = _prefixed(model, cfg_plan), "the config's base_model_tp_plan"
        else:
            raw, source = default_plan_by_name(model), "Linear layers found by name in the repeated blocks"
    plan = {}
    for key, style in raw.items():
        made = make_style(style, key, problems)
        if made is not None:
            plan[key] = made
    if not plan and not problems:
        problems.append("tensor parallelism found nothing to shard in this model (no base_model_tp_plan in its "
                        "config, no Linear named q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj/... in "
                        "its repeated blocks): pass Layout(tp_plan={'layers.*.attn.q': 'colwise', ...})")
        return None, source
    names = [n for n, _ in model.named_modules()]
    unmatched = [k for k in plan if not any(_style_for({k: 1}, n) for n in names)]
    if unmatched:
        problems.append(f"tensor-parallel plan entries {unmatched} ({source}) match no module of the model: "
                        "name modules as model.named_modules() does, with * for one name part")
    return plan, source


@contextlib.contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...], rank: int = 0) -> Iterator[Any]:
    """A fake default process group of ``prod(shape)`` ranks (this process ``rank``, 0 by default) and
    its mesh of ``shape`` with dimension ``names`` (:func:`~memguard.estimator._fsdp2.fake_world` for any
    mesh)."""
    import math

    from torch.distributed.device_mesh import init_device_mesh

    from memguard.estimator._fsdp2 import fake_world

    with fake_world(math.prod(shape), rank=rank):
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)


def rank_order(layout: Layout) -> list[tuple[int, int, int, int]]:
    """``(pp_i, rep_i, shard_i, tp_i)`` of each rank, in rank order (see the module's docstring)."""
    return [(a, b, c, d) for a in range(layout.pp) for b in range(layout.dp_replicate)
            for c in range(layout.dp_shard) for d in range(layout.tp)]


def layout_note(layout: Layout, source: str | None) -> str:
    """The note an estimate of ``layout`` carries."""
    note = f"layout {layout.describe()}: rank 0 traced"
    if layout.tp > 1:
        note += f"; tensor parallel over a fake process group with parallelize_module, plan from {source}"
    if layout.dp_shard > 1 and (layout.tp > 1 or layout.dp_replicate > 1):
        dims = "(dp_replicate, dp_shard) dimensions (HSDP)" if layout.dp_replicate > 1 else "dp_shard dimension"
        note += f"; fully_shard over the mesh's {dims}"
    return note


def with_ranks(est: Any, layout: Layout) -> Any:
    """``est`` with one ``rank_peak_bytes`` entry per rank of ``layout`` (its ranks are alike)."""
    return dataclasses.replace(est, rank_peak_bytes=(est.peak_bytes,) * layout.world_size)


def _versions(options: dict[str, Any]) -> dict[str, Any]:
    """The target stack keywords of :func:`memguard.estimate` (``torch_version`` ...) among ``options``."""
    return {k: options.get(k) for k in ("torch_version", "cuda_version", "cudnn_version")}


def estimate_layout(model: nn.Module, batch: Any, layout: Any, options: dict[str, Any]) -> Any:
    """``memguard.estimate(model, batch, layout=layout, **options)``: the estimate of each rank.

    ``dp_replicate`` alone is the DDP estimate over that many ranks, ``dp_shard`` alone the FSDP2
    estimate (``zero_stage`` its level, 3 when 0); with ``tp > 1`` rank 0 of the tensor-parallel
    (FSDP2 x TP) step is traced (:func:`~memguard.estimator._tp_trace.trace_tp_step`).

    Raises:
        ConfigError: an invalid layout, a keyword that conflicts with it, a model the layout does
            not divide, or what :func:`memguard.estimate` refuses (all listed at once).
    """
    from memguard.estimator.api import estimate

    options = dict(options)
    problems: list[str] = []
    zero_stage, world_size, strategy = options.get("zero_stage", 0), options.get("world_size", 1), options.get("strategy")
    check_layout(layout, zero_stage=zero_stage, world_size=world_size, strategy=strategy, problems=problems)
    if problems:
        raise ConfigError(problems)
    if options.get("train", True) is False and (layout.tp > 1 or layout.pp > 1):
        raise ConfigError(f"an evaluation step (train=False) is not estimated under Layout(tp={layout.tp}, "
                          f"pp={layout.pp}): drop layout= or estimate a training step")
    if layout.pp > 1:
        return _estimate_pp(model, batch, layout, options)
    level = zero_stage if _is_int(zero_stage) and zero_stage >= 1 else 3  # FSDP2's default: reshard_after_forward
    options["world_size"] = layout.dp_replicate * layout.dp_shard
    if layout.dp_shard > 1:
        options.update(strategy="fsdp2", zero_stage=level)
    else:
        options.update(strategy=None if strategy is None else "ddp", zero_stage=0)
    if layout.tp == 1 and (layout.dp_replicate == 1 or layout.dp_shard == 1):
        return with_ranks(estimate(model, batch, **options), layout)
    return with_ranks(_estimate_tp(model, batch, layout, options), layout)


def _estimate_tp(model: nn.Module, batch: Any, layout: Layout, options: dict[str, Any]) -> Any:
    """Trace and price rank 0 of a tensor-parallel (optionally FSDP2 or HSDP x TP) or HSDP training step."""
    from memguard.batch import first_dim
    from memguard.estimator._blocks import find_blocks
    from memguard.estimator._fsdp2 import fsdp2_factors
    from memguard.estimator._pricing import _estimate_from_factors
    from memguard.estimator._sharding import ShardFactors
    from memguard.estimator._targets import (
        Target,
        check_common,
        check_strategy,
        target_cpu,
        target_gpu,
        traced_precision,
        unwrap_model,
    )
    from memguard.estimator._tp_trace import trace_tp_step
    from memguard.estimator._tracing import TraceRequest, fsdp2_layout, trace_spec
    from memguard.vocab import ALL_BLOCKS

    device, precision = options.get("device", "cuda"), options.get("precision", "32-true")
    zero_stage, strategy = options["zero_stage"], options["strategy"]
    offload = options.get("offload_optimizer", False)
    blocks = options.get("activation_checkpointing", 0)
    accum = options.get("grad_accum_steps", 1)
    problems: list[str] = []
    check_common(precision=precision, zero_stage=zero_stage, world_size=layout.world_size, device=device,
                 problems=problems)
    check_strategy(strategy=strategy, zero_stage=zero_stage, offload_optimizer=offload, problems=problems)
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        raise ConfigError(problems)
    model = unwrap_model(model)
    micro = first_dim(batch)
    if micro is None:
        problems.append("batch must be a tensor or a mapping/tuple/list holding at least one tensor with a batch "
                        f"dimension, got {type(batch).__name__}")
    if not (_is_int(accum) and accum >= 1):
        problems.append(f"grad_accum_steps={accum!r} must be an integer >= 1")
    spec_gpu = target_gpu(device, options.get("gpu"), problems, **_versions(options))
    cpu_target = target_cpu(device, options.get("cpu"), problems)
    plan, source = resolve_tp_plan(model, layout, problems) if layout.tp > 1 else (None, None)
    check_model_fits(model, layout, plan, problems)
    if problems:
        raise ConfigError(problems)
    if blocks is True:
        blocks = ALL_BLOCKS
    fsdp = fsdp2_layout(strategy, precision, zero_stage, layout.dp_shard, offload, device) if layout.dp_shard > 1 else None
    request = TraceRequest(device=device, precision=traced_precision(precision, zero_stage, strategy),
                           checkpoint_blocks=int(blocks or 0), grads_present=accum > 1,
                           keep_outputs=bool(options.get("keep_outputs", False)), gpu=spec_gpu, cpu=cpu_target)
    spec = trace_spec(request)
    if fsdp is not None and fsdp.mp_dtype is not None:  # FSDP2's policy casts; no autocast (as run_trace)
        spec = dataclasses.replace(spec, autocast_dtype=None, cuda_autocast=False)
    trace = trace_tp_step(model, batch, spec, tp=layout.tp, plan=plan, fsdp=fsdp, replicate=layout.dp_replicate,
                          optimizer=options.get("optimizer"), loss_fn=options.get("loss_fn"))
    factors = fsdp2_factors(offload) if fsdp is not None else ShardFactors()
    target = Target(device=device, precision=precision, zero_stage=zero_stage, world_size=layout.world_size,
                    gpu=spec_gpu, strategy=strategy or "ddp", offload_optimizer=offload).resolved()
    est, _ = _estimate_from_factors(trace, factors, target, micro_batch_size=int(micro or 0),
                                    checkpointed=min(int(blocks or 0), len(find_blocks(model))), limit_bytes=None)
    return dataclasses.replace(est, notes=est.notes + (layout_note(layout, source),))


def _estimate_pp(model: nn.Module, batch: Any, layout: Layout, options: dict[str, Any]) -> Any:
    """Trace and price every pipeline rank (:func:`~memguard.estimator._pipeline.trace_pipeline_rank`);
    the estimate is the highest rank's, with every rank's peak in ``rank_peak_bytes``.

    ``activation_checkpointing=k`` checkpoints the first ``k`` blocks of each stage (True: all of them), as
    the layout planner counts checkpointed blocks per stage
    (:func:`~memguard.estimator._pipeline.checkpoint_stage`); the estimate's ``activation_checkpointing`` is
    then the blocks checkpointed over all stages, as a layout plan's ``checkpoint_blocks``."""
    from collections.abc import Mapping as _Mapping

    from memguard.batch import first_dim
    from memguard.estimator._pipeline import decoder_parts, not_a_decoder, stage_bounds, trace_pipeline_rank
    from memguard.estimator._pricing import _estimate_from_factors
    from memguard.estimator._sharding import ShardFactors
    from memguard.estimator._targets import Target, check_common, target_cpu, target_gpu, unwrap_model
    from memguard.estimator._tracing import TraceRequest, trace_spec

    from memguard.estimator._fsdp2 import fsdp2_factors
    from memguard.estimator._targets import traced_precision
    from memguard.estimator._tracing import fsdp2_layout
    from memguard.vocab import ALL_BLOCKS

    device, precision = options.get("device", "cuda"), options.get("precision", "32-true")
    problems: list[str] = []
    zero_stage = options.get("zero_stage", 0)
    level = (zero_stage if _is_int(zero_stage) and zero_stage >= 1 else 3) if layout.dp_shard > 1 else 0
    check_common(precision=precision, zero_stage=level, world_size=layout.world_size, device=device, problems=problems)
    model = unwrap_model(model)
    parts = decoder_parts(model) if isinstance(model, nn.Module) else None
    micro = layout.pp_microbatches or layout.pp
    per_rank = stages_per_rank(layout)
    if parts is None:
        problems.append(not_a_decoder(model))
    elif len(parts[1]) < layout.pp * per_rank:
        if per_rank == 1:
            problems.append(f"Layout(pp={layout.pp}) needs at least {layout.pp} blocks, the model has "
                            f"{len(parts[1])}: use pp <= {len(parts[1])}")
        else:  # every virtual stage needs a block (stage_bounds splits them evenly)
            problems.append(f"Layout(pp={layout.pp}) under {layout.pp_schedule} with {per_rank} stages per rank needs "
                            f"at least {layout.pp * per_rank} blocks, the model has {len(parts[1])}: use pp * "
                            f"pp_stages_per_rank <= {len(parts[1])}, or pp_schedule='1F1B'")
    if not (isinstance(batch, _Mapping) and "input_ids" in batch and "labels" in batch):
        problems.append("under Layout(pp=...) the batch must be a mapping with 'input_ids' and 'labels' (the first "
                        "stage reads the ids, the last computes the model's loss on the labels)")
    else:
        rows = first_dim(batch)
        if rows is not None and rows % micro:
            problems.append(f"the batch's {rows} rows do not split into pp_microbatches={micro}: use a batch that "
                            f"is a multiple of {micro}, or set pp_microbatches to a divisor of {rows}")
    if options.get("loss_fn") is not None:
        problems.append("under Layout(pp=...) the last stage computes the model's own loss: drop loss_fn")
    checkpoint = options.get("activation_checkpointing", 0)
    if not (isinstance(checkpoint, bool) or (_is_int(checkpoint) and checkpoint >= 0)):
        problems.append(f"activation_checkpointing={checkpoint!r} must be True (every block), False or an integer "
                        ">= 0 (under Layout(pp=...): the first that many blocks of each stage)")
        checkpoint = 0
    for name, default in (("grad_accum_steps", 1), ("keep_outputs", False), ("offload_optimizer", False)):
        if options.get(name, default) not in (default, False, 0):
            problems.append(f"{name}={options[name]!r} is not estimated under Layout(pp=...) yet: drop it")
    if per_rank > 1 and options.get("activation_checkpointing", 0) not in (0, False, None):
        problems.append(f"activation_checkpointing is not estimated under Layout(pp_schedule={layout.pp_schedule!r}) "
                        f"(several stages per rank) yet: drop it, or use pp_schedule='1F1B' or 'GPipe'")
    spec_gpu = target_gpu(device, options.get("gpu"), problems, **_versions(options))
    cpu_target = target_cpu(device, options.get("cpu"), problems)
    if problems:
        raise ConfigError(problems)
    plan, source = resolve_tp_plan(model, layout, problems) if layout.tp > 1 else (None, None)
    if parts is not None:
        check_model_fits(model, layout, plan, problems)
    if problems:
        raise ConfigError(problems)
    strategy = "fsdp2" if layout.dp_shard > 1 else None
    fsdp = fsdp2_layout(strategy, precision, level, layout.dp_shard, False, device) if strategy else None
    spec = trace_spec(TraceRequest(device=device, precision=traced_precision(precision, level, strategy),
                                   gpu=spec_gpu, cpu=cpu_target))
    if fsdp is not None and fsdp.mp_dtype is not None:  # FSDP2's policy casts; no autocast (as run_trace)
        spec = dataclasses.replace(spec, autocast_dtype=None, cuda_autocast=False)
    target = Target(device=device, precision=precision, zero_stage=level, world_size=layout.world_size, gpu=spec_gpu,
                    strategy=strategy or "ddp").resolved()
    factors = fsdp2_factors(False) if fsdp is not None else ShardFactors()
    # activation_checkpointing=k: the first k blocks of each stage (checkpoint_stage, as the layout planner
    # counts them per stage); the spec's own checkpoint_blocks (the whole model's first blocks) stays 0
    stage_ckpt = ALL_BLOCKS if checkpoint is True else int(checkpoint or 0)
    stage_blocks = [hi - lo for lo, hi in (stage_bounds(len(parts[1]), layout.pp, s) for s in range(layout.pp))]
    estimates = []
    for rank in range(layout.pp):
        trace = trace_pipeline_rank(model, batch, spec, rank=rank, stages=layout.pp, schedule=layout.pp_schedule,
                                    microbatches=micro, optimizer=options.get("optimizer"),
                                    inner=(layout.dp_replicate, layout.dp_shard, layout.tp), plan=plan, fsdp=fsdp,
                                    stages_per_rank=per_rank, checkpoint_blocks=stage_ckpt)
        est, _ = _estimate_from_factors(trace, factors, target, micro_batch_size=int(first_dim(batch) or 0),
                                        checkpointed=min(stage_ckpt, stage_blocks[rank]), limit_bytes=None)
        estimates.append(est)
    stage_peaks = tuple(e.peak_bytes for e in estimates)
    per_stage = layout.world_size // layout.pp  # rank order: pp outermost (rank_order)
    peaks = tuple(stage_peaks[r // per_stage] for r in range(layout.world_size))
    worst_stage = stage_peaks.index(max(stage_peaks))
    worst = estimates[worst_stage]
    inner = ""
    if per_stage > 1:
        inner = f"; within each stage its first rank traced (the stage's {per_stage} ranks hold the same)"
        if layout.tp > 1:
            inner += f", tensor parallel with parallelize_module, plan from {source}"
        if fsdp is not None:
            inner += (", fully_shard of each block and of the stage as FSDP2's root, so the schedule keeps the "
                      "stage's parameters unsharded and its gradients unsynchronised until the last micro-batch")
    checkpointed = sum(min(stage_ckpt, n) for n in stage_blocks)
    if checkpointed:
        inner += (f"; the first {min(stage_ckpt, max(stage_blocks))} blocks of each stage checkpointed "
                  f"({checkpointed} of the model's {len(parts[1])})")
    stages = (f", {per_rank} virtual stages per rank ({layout.pp * per_rank} in all)" if per_rank > 1 else "")
    note = (f"layout {layout.describe()}: each pipeline stage traced under torch.distributed.pipelining's "
            f"{layout.pp_schedule} schedule with {micro} micro-batches{stages} over a fake process group{inner}; the "
            f"breakdown is {'pipeline rank' if per_rank > 1 else 'stage'} {worst_stage}'s; its forward phase holds "
            "the whole schedule, backward included")
    # activation_checkpointing: the blocks checkpointed over all stages, as a layout plan's checkpoint_blocks
    return dataclasses.replace(worst, rank_peak_bytes=peaks, notes=worst.notes + (note,),
                               activation_checkpointing=checkpointed)
