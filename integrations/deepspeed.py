"""DeepSpeed: turn a :class:`memguard.Plan` into a DeepSpeed config, or fill an existing one.

``to_config(plan)`` writes a complete config for the plan; ``fill_auto(user_config, plan)``
keeps a user's config and replaces its ``"auto"`` values with what the plan determines, the way
the Hugging Face Trainer fills ``"auto"`` from its ``TrainingArguments``. Neither imports
DeepSpeed: a config is plain JSON-ready data. ``validate_config(config, world_size=N)`` checks a finished
config, with DeepSpeed's own ``deepspeed.runtime.config.DeepSpeedConfig`` where DeepSpeed is installed (it
works without a GPU). ``step(engine,
batch, loss_fn)`` runs one optimizer step of a ZeRO-0/1/2/3 engine with memguard's OOM recovery (below).

What the plan determines, and what a config must therefore agree with:

=============================================  ==================================================
key                                            value
=============================================  ==================================================
``train_micro_batch_size_per_gpu``             ``plan.micro_batch_size``
``gradient_accumulation_steps``                ``plan.grad_accum_steps``
``train_batch_size``                           ``plan.global_batch_size`` (= micro x accumulation
                                               x world, DeepSpeed's own batch rule)
``zero_optimization.stage``                    ``plan.zero_stage``
``zero_optimization.offload_optimizer.device`` ``"cpu"`` if ``plan.offload_optimizer`` else none
``fp16.enabled``                               ``plan.precision == "16-mixed"``
``bf16.enabled``                               ``plan.precision in ("bf16-mixed", "bf16-true")``
``bf16.bf16_master_weights_and_grads``,        True for ``"bf16-true"`` (no fp32 master copy),
``bf16.bf16_optimizer_states``                 else absent / False
=============================================  ==================================================

Tuning values the plan suggests but a user may change: the ZeRO bucket sizes (from the hidden
size, the rule of the Hugging Face DeepSpeed integration), the fp16 dynamic loss-scaling
settings (DeepSpeed's defaults), ``offload_optimizer.pin_memory`` and the
``activation_checkpointing`` block.

Precision mapping. ``"32-true"`` writes no fp16/bf16 block (DeepSpeed trains in fp32).
``"16-mixed"`` and ``"bf16-mixed"`` map to DeepSpeed's ``fp16`` / ``bf16`` modes, which keep
16-bit weights and gradients and an fp32 master copy in the optimizer: the ZeRO paper's mixed
precision model states (arXiv 1910.02054, 2+2+12 bytes per parameter), as memguard estimates them.
``"bf16-true"`` maps to ``bf16`` with ``bf16_master_weights_and_grads`` and
``bf16_optimizer_states`` (no fp32 copies), which DeepSpeed supports with ZeRO stages 1-3 only.
``"16-true"`` has no DeepSpeed equivalent (DeepSpeed's fp16 always scales the loss and keeps fp32
optimizer states; ``fp16_master_weights_and_grads`` needs ZeRO-Offload and still keeps fp32
moments), so it is refused with a :class:`memguard.ConfigError`.

Out-of-memory errors inside a DeepSpeed engine. ``step(engine, batch, loss_fn)`` runs one optimizer
step with memguard's OOM recovery, for ZeRO stages 0-3, with DeepSpeed's own gradient accumulation
(the default) or ``"managed_gradient_accumulation": false``. Why the end-of-step agreement that
serves DDP is not enough here, measured on CPU (DeepSpeed 0.19.8, ``DS_ACCELERATOR=cpu``, two gloo
ranks, an ``RLIMIT_AS`` cap on rank 1): the engine starts collectives inside forward and backward
(ZeRO-1 reduces in the boundary micro-batch's backward, ZeRO-2 reduces gradient buckets from its
hooks in every backward, ZeRO-3 all-gathers parameters in every module's forward and backward and
reduce-scatters gradients), so a rank that fails in compute leaves its peers waiting in the next
collective. Measured with only the end-of-step agreement (``benchmarks/recovery_sharded.py``, its
control runs): under ZeRO-1 and ZeRO-2 (either accumulation mode) both ranks wait until the process
group's timeout (90 s there, 30 minutes by default) and then fail; under ZeRO-3 the failed rank's
agreement meets the peer's parameter all-gather and gloo aborts the process (SIGABRT).

What ``step`` does instead (:mod:`memguard.integrations._deepspeed_guard`, the FSDP2 protocol of
:mod:`memguard.guard._sharded` applied to DeepSpeed's communication backend): every collective the
engine starts (through ``deepspeed.comm``) first runs a small all-reduce agreement of all ranks; a
rank that ran out of memory in forward or backward reports it there, its peers leave forward or
backward at their next collective, every rank resets the engine's step state (ZeRO-1/2 buckets and
partly reduced gradients, ZeRO-3 gathered and in-flight parameters and its parameter coordinator's
trace, the engine's counters and accumulation boundary), the micro-batch is halved and the step's
samples run again. Each retry is logged at WARNING on every rank. Measured on two gloo ranks with a
real OOM on rank 1 (``tests/integrations/test_deepspeed.py``): ZeRO-0/1/2/3, managed and
unmanaged accumulation, OOM in the forward or the backward, every rank recovers, every sample of a
step runs once in the attempt that updates the weights, and the fp32 weights equal a single-process
run on both ranks' samples within 3e-7 (relative; 3e-8 absolute); bf16 ZeRO-2/3 end within a bf16
rounding step of an uncapped bf16 run. An OOM *inside* a collective (measured: the output copy of a
ZeRO-3 all-gather) stops every rank within a second with the same :class:`memguard.OOMRecoveryError`
(the process groups are torn down; restart the job); so does an OOM in ``engine.step()``'s optimizer
update, which a smaller micro-batch would not shrink.

Refused with a :class:`memguard.ConfigError` that says what to do: pipeline-parallel engines (their
point-to-point sends are not covered), ZeRO offload and ZenFlow (host-side gradient state memguard
does not reset), and fp16/bf16 engines whose optimizer is DeepSpeed's ``FP16_Optimizer``,
``FP16_UnfusedOptimizer`` or ``BF16_Optimizer`` (fp16/bf16 without ZeRO, or bf16 ZeRO-1 with fp32
gradient accumulation): those keep fp32 gradient copies of their own. fp16/bf16 under the ZeRO
optimizers is recovered (their gradient copies are the buckets and partitions that are reset);
bf16 is verified; fp16 takes the same path (its loss scaler changes only in ``engine.step()``) but
is not exercised here: DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on
your device").

Cost when nothing fails: see :mod:`memguard.integrations._deepspeed_guard` (agreements per step and their time).
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Mapping

from memguard.errors import ConfigError
from memguard.integrations._deepspeed_check import structure_problems, validate_config
from memguard.planner.api import Plan
from memguard.vocab import PRECISIONS

__all__ = ["to_config", "fill_auto", "validate_config", "step", "evaluate", "micro_batch_size", "oom_retries", "AUTO"]

logger = logging.getLogger("memguard")

#: The placeholder value that :func:`fill_auto` replaces (the Hugging Face convention).
AUTO = "auto"


# DeepSpeed's dynamic loss-scaling defaults: DeepSpeedFP16Config in
# deepspeed/runtime/precision_config.py (loss_scale 0 = dynamic, initial scale 2**16).
_FP16_DEFAULTS: dict[str, Any] = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}

# DeepSpeed's defaults for the activation_checkpointing block: ACT_CHKPT_DEFAULT in
# deepspeed/runtime/activation_checkpointing/config.py.
_ACT_CKPT_DEFAULTS: dict[str, Any] = {
    "partition_activations": False,
    "cpu_checkpointing": False,
    "contiguous_memory_optimization": False,
    "synchronize_checkpoint_boundary": False,
    "profile": False,
}

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

Path = tuple[str, ...]


def _dotted(path: Path) -> str:
    return ".".join(path)


def _plan_problems(plan: Any) -> list[str]:
    """Why ``plan`` cannot be expressed as a DeepSpeed config (empty when it can)."""
    if not isinstance(plan, Plan):
        return [f"expected a memguard.Plan, got {type(plan).__name__}; build one with memguard.plan()"]
    problems = []
    if plan.precision not in PRECISIONS:
        problems.append(f"plan.precision {plan.precision!r} is not one of {', '.join(PRECISIONS)}")
    if plan.zero_stage not in (0, 1, 2, 3):
        problems.append(f"plan.zero_stage {plan.zero_stage!r} is not a DeepSpeed ZeRO stage (0-3)")
    if plan.precision == "16-true":
        problems.append(
            "precision '16-true' has no DeepSpeed equivalent: DeepSpeed's fp16 mode always keeps fp32 "
            "optimizer states and a loss scaler; plan with precision='16-mixed' or 'bf16-true' instead"
        )
    if plan.precision == "bf16-true" and plan.zero_stage == 0:
        problems.append(
            "precision 'bf16-true' needs ZeRO stage 1-3 under DeepSpeed (bf16_master_weights_and_grads is "
            "only supported there; without ZeRO DeepSpeed keeps an fp32 master copy the plan did not count); "
            "plan with zero_stage>=1 or precision='bf16-mixed'"
        )
    if plan.offload_optimizer and plan.zero_stage == 0:
        problems.append(
            "plan.offload_optimizer needs ZeRO stage 1-3 (DeepSpeed's offload_optimizer is part of ZeRO); "
            "plan with zero_stage>=1 or without offload"
        )
    return problems


def _required(plan: Plan) -> dict[Path, tuple[Any, Any]]:
    """Plan-determined keys: path -> (plan value, DeepSpeed's value when the key is absent).

    The absent value of a batch key is None: DeepSpeed derives a missing one from the other two.
    """
    bf16 = plan.precision in ("bf16-mixed", "bf16-true")
    req: dict[Path, tuple[Any, Any]] = {
        ("train_batch_size",): (plan.global_batch_size, None),
        ("train_micro_batch_size_per_gpu",): (plan.micro_batch_size, None),
        ("gradient_accumulation_steps",): (plan.grad_accum_steps, None),
        # DeepSpeedZeroConfig.stage defaults to 0 (deepspeed/runtime/zero/config.py)
        ("zero_optimization", "stage"): (plan.zero_stage, 0),
        # DeepSpeedZeroOffloadOptimizerConfig.device defaults to "none" (deepspeed/runtime/zero/offload_config.py)
        ("zero_optimization", "offload_optimizer", "device"): ("cpu" if plan.offload_optimizer else "none", "none"),
        # fp16 and bf16 are off unless enabled (deepspeed/runtime/precision_config.py)
        ("fp16", "enabled"): (plan.precision == "16-mixed", False),
        ("bf16", "enabled"): (bf16, False),
        ("bf16", "bf16_master_weights_and_grads"): (plan.precision == "bf16-true", False),
        ("bf16", "bf16_optimizer_states"): (plan.precision == "bf16-true", False),
    }
    return req


def _bucket_sizes(hidden: int) -> dict[Path, int]:
    """ZeRO bucket sizes from the hidden size.

    The rule of the Hugging Face DeepSpeed integration for "auto" values:
    huggingface/transformers src/transformers/integrations/deepspeed.py,
    HfTrainerDeepSpeedConfig.trainer_config_finalize.
    """
    from memguard.estimator._deepspeed_config import hf_bucket_sizes  # the rule, cited there

    return {("zero_optimization", key): value for key, value in hf_bucket_sizes(hidden).items()}


def _tuning(plan: Plan) -> dict[Path, Any]:
    """Values the plan suggests for "auto" entries that a user may otherwise set freely."""
    tun: dict[Path, Any] = {}
    if plan.hidden_size:
        tun.update(_bucket_sizes(int(plan.hidden_size)))
    tun[("zero_optimization", "offload_optimizer", "pin_memory")] = True  # DeepSpeed's default
    for k, v in _FP16_DEFAULTS.items():
        tun[("fp16", k)] = v
    for k, v in _ACT_CKPT_DEFAULTS.items():
        tun[("activation_checkpointing", k)] = v
    if plan.activation_checkpointing and plan.checkpoint_blocks:
        tun[("activation_checkpointing", "number_checkpoints")] = int(plan.checkpoint_blocks)
    return tun


def _get(cfg: Mapping[str, Any], path: Path) -> tuple[bool, Any]:
    """(found, value) of a nested key; a non-mapping on the way counts as absent."""
    node: Any = cfg
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _set(cfg: dict[str, Any], path: Path, value: Any) -> None:
    node = cfg
    for key in path[:-1]:
        nxt = node.get(key)
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None or nxt == AUTO else nxt
            if not isinstance(nxt, dict):
                raise ConfigError(f"{_dotted(path[:-1])} must be a mapping, got {nxt!r}")
            node[key] = nxt
        node = nxt
    node[path[-1]] = value


def _autos(cfg: Any, prefix: Path = ()) -> list[Path]:
    """Paths of every value equal to "auto" left in ``cfg``."""
    found: list[Path] = []
    if isinstance(cfg, Mapping):
        for k, v in cfg.items():
            found += _autos(v, prefix + (str(k),))
    elif isinstance(cfg, list):
        for i, v in enumerate(cfg):
            found += _autos(v, prefix + (str(i),))
    elif isinstance(cfg, str) and cfg == AUTO:
        found.append(prefix)
    return found


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, bool):
        return isinstance(value, bool) and value is want
    if isinstance(want, str):
        return isinstance(value, str) and value.lower() == want
    if isinstance(want, int):
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value == want
    return value == want


def _bf16_alias(cfg: dict[str, Any]) -> None:
    """DeepSpeed also reads the old name "bfloat16" when "bf16" is absent; normalise to "bf16"."""
    if "bf16" not in cfg and "bfloat16" in cfg:
        cfg["bf16"] = cfg.pop("bfloat16")


def _resolve(cfg: dict[str, Any], plan: Plan, *, source: str) -> tuple[list[str], list[Path]]:
    """Fill ``cfg`` in place from the plan; return (conflicts, filled paths)."""
    _bf16_alias(cfg)
    conflicts: list[str] = []
    filled: list[Path] = []
    for path, (want, absent) in _required(plan).items():
        # a missing key, or a null parent such as "offload_optimizer": null, counts as absent
        found, value = _get(cfg, path)
        if not found:
            if absent is None or not _same(absent, want):
                _set(cfg, path, want)
                filled.append(path)
            continue
        if isinstance(value, str) and value == AUTO:
            _set(cfg, path, want)
            filled.append(path)
            continue
        if not _same(value, want):
            hint = f"set it to {want!r} or {AUTO!r}"
            if path[0] in _BATCH_KEYS:
                hint += (
                    f" (the plan's batch is micro-batch {plan.micro_batch_size} x accumulation "
                    f"{plan.grad_accum_steps} x world {plan.world_size} = {plan.global_batch_size}; "
                    "to change it, plan again with other options)"
                )
            else:
                hint += ", or plan again with that setting fixed"
            conflicts.append(f"{source} {_dotted(path)} is {value!r} but the plan needs {want!r}: {hint}")
    for path, value in _tuning(plan).items():
        found, current = _get(cfg, path)
        if found and isinstance(current, str) and current == AUTO:
            _set(cfg, path, value)
            filled.append(path)
    return conflicts, filled


def to_config(plan: Plan, **overrides: Any) -> dict[str, Any]:
    """A complete DeepSpeed config for ``plan``.

    The config holds the batch triple (``train_batch_size == train_micro_batch_size_per_gpu *
    gradient_accumulation_steps * world_size``), ``zero_optimization`` (stage; ``offload_optimizer``
    ``{"device": "cpu", "pin_memory": true}`` when the plan offloads; for stages 1-3
    ``reduce_bucket_size`` and for stage 3 ``stage3_prefetch_bucket_size`` and
    ``stage3_param_persistence_threshold`` from ``plan.hidden_size`` by the Hugging Face rule, or
    DeepSpeed's defaults when the hidden size is unknown), the ``fp16`` / ``bf16`` block of the
    precision (see the module docstring) and, when the plan checkpoints activations, an
    ``activation_checkpointing`` block. Nothing else (no optimizer, scheduler or clipping) unless
    given in ``overrides``.

    Args:
        plan: the plan to express.
        **overrides: top-level config keys, deep-merged into the result (a nested mapping updates
            the nested mapping key by key; any other value replaces), e.g.
            ``to_config(plan, gradient_clipping=1.0, zero_optimization={"overlap_comm": True})``.
            A plan-determined value (see the module docstring) may be repeated or given as
            ``"auto"`` but not changed.

    Returns:
        A new JSON-ready dict.

    Raises:
        ConfigError: the plan has no DeepSpeed equivalent (``"16-true"``; ``"bf16-true"`` or
            optimizer offload without ZeRO), ``overrides`` contradict the plan (a different
            micro-batch, accumulation, global batch, stage, offload or precision), or the result is not
            a config DeepSpeed could read (a section that is not a mapping, a ZeRO stage outside 0-3:
            :func:`validate_config`'s structural check); every problem is listed.

    Known limitations:
        DeepSpeed's ``activation_checkpointing`` block only configures
        ``deepspeed.checkpointing.checkpoint``; it does not checkpoint anything by itself. The
        plan's checkpointing must still be applied to the model (memguard does it in
        ``prepare``; with the HF Trainer use ``gradient_checkpointing``). The ``"bf16-true"``
        mapping with optimizer offload needs DeepSpeed's CPU Adam with bf16 states, which
        DeepSpeed builds itself only when the config has an ``optimizer`` section.
    """
    problems = _plan_problems(plan)
    if problems:
        raise ConfigError(problems)

    cfg: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
    }
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.hidden_size and plan.zero_stage >= 1:
        buckets = _bucket_sizes(int(plan.hidden_size))
        zero["reduce_bucket_size"] = buckets[("zero_optimization", "reduce_bucket_size")]
        if plan.zero_stage == 3:
            for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
                zero[key] = buckets[("zero_optimization", key)]
    cfg["zero_optimization"] = zero
    if plan.precision == "16-mixed":
        cfg["fp16"] = {"enabled": True, **_FP16_DEFAULTS}
    elif plan.precision == "bf16-mixed":
        cfg["bf16"] = {"enabled": True}
    elif plan.precision == "bf16-true":
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    if plan.activation_checkpointing:
        cfg["activation_checkpointing"] = dict(_ACT_CKPT_DEFAULTS)
        if plan.checkpoint_blocks:
            cfg["activation_checkpointing"]["number_checkpoints"] = int(plan.checkpoint_blocks)

    _deep_merge(cfg, overrides)
    conflicts, _ = _resolve(cfg, plan, source="override")
    conflicts = conflicts or structure_problems(cfg, world_size=plan.world_size)  # the plan's word first
    if conflicts:
        raise ConfigError(conflicts)
    leftover = _autos(cfg)
    if leftover:
        logger.info("memguard: DeepSpeed config keeps 'auto' at %s", ", ".join(map(_dotted, leftover)))
    return cfg


def _plain(value: Any) -> Any:
    """``value`` with every nested mapping turned into a dict (a JSON-ready copy)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Merge ``extra`` into ``base``: nested mappings key by key, anything else replaces."""
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = _plain(value)


def fill_auto(user_config: Mapping[str, Any], plan: Plan, *, strict: bool = False) -> dict[str, Any]:
    """A copy of ``user_config`` with every ``"auto"`` value the plan determines filled in.

    Rules:

    * A plan-determined key (see the module docstring) that is ``"auto"`` gets the plan's value;
      one that is absent is added when DeepSpeed's default for it would differ from the plan (an
      absent batch key is always added, so the result holds the whole triple); one set explicitly
      must equal the plan's value, otherwise it is a conflict.
    * A tuning key that is ``"auto"`` (ZeRO bucket sizes when ``plan.hidden_size`` is known, fp16
      loss-scaling settings, ``offload_optimizer.pin_memory``, the ``activation_checkpointing``
      settings) gets the plan's suggestion; explicit tuning values are kept as they are.
    * ``"auto"`` values memguard cannot determine (optimizer and scheduler parameters,
      ``gradient_clipping``, bucket sizes without a hidden size, ...) are left as ``"auto"`` and
      logged at warning level: the Hugging Face Trainer fills those from its
      ``TrainingArguments``. DeepSpeed itself does not understand ``"auto"``: inside its
      validated sections (``zero_optimization``, ``fp16``, ``bf16``, ...) it silently drops the
      value and uses its default (deepspeed/runtime/config_utils.py, DeepSpeedConfigModel), and
      elsewhere it fails or keeps the string (``gradient_clipping``). Pass ``strict=True`` when
      the config goes to ``deepspeed.initialize`` directly: leftovers are then an error.

    Args:
        user_config: a DeepSpeed config dict; not modified. The old name ``"bfloat16"`` for the
            ``"bf16"`` block is accepted and renamed to ``"bf16"``.
        plan: the plan that decides the values.
        strict: raise instead of keeping ``"auto"`` values memguard cannot fill.

    Returns:
        A new dict.

    Raises:
        ConfigError: ``user_config`` is not a mapping; the plan has no DeepSpeed equivalent; user
            values contradict the plan; or, with ``strict=True``, ``"auto"`` values are left.
            Every problem is listed in one error.
    """
    if not isinstance(user_config, Mapping):
        raise ConfigError(
            f"fill_auto needs the DeepSpeed config as a dict, got {type(user_config).__name__}; "
            "load a JSON file with json.load first"
        )
    problems = _plan_problems(plan)
    if problems:
        raise ConfigError(problems)
    cfg = _plain(user_config)
    conflicts, filled = _resolve(cfg, plan, source="user config")
    leftover = _autos(cfg)
    if strict and leftover:
        conflicts.append(
            f"'auto' left at {', '.join(map(_dotted, leftover))}: memguard's plan does not determine "
            "these; set them explicitly (or let the Hugging Face Trainer fill them)"
        )
    if conflicts:
        raise ConfigError(conflicts)
    if filled:
        logger.info("memguard: filled DeepSpeed config keys %s from the plan", ", ".join(map(_dotted, filled)))
    if leftover:
        logger.warning(
            "memguard: DeepSpeed config keeps 'auto' at %s (not determined by the plan; the HF Trainer "
            "fills these, plain deepspeed.initialize does not)",
            ", ".join(map(_dotted, leftover)),
        )
    return cfg


# --------------------------------------------------------------------------------------------------
# OOM recovery inside a DeepSpeed engine (memguard.integrations._deepspeed_guard: an agreement before every collective)

# One micro-batch window per engine, kept as long as the engine lives.
_WINDOWS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def step(engine: Any, batch: Any, loss_fn: Any = None, *, max_retries: int | None = None) -> float:
    """One optimizer step of a DeepSpeed engine on ``batch``, recovering from out-of-memory errors.

    ``batch`` is this rank's samples of the whole optimizer step (``train_micro_batch_size_per_gpu
    x gradient_accumulation_steps`` of them, or any number): it is split into micro-batches of the
    current size (first the config's micro-batch), each runs ``loss_fn(engine, micro)`` and
    ``engine.backward`` of its loss weighted by its share of the samples (``scale_wrt_gas=False``);
    then ``engine.step()`` updates the weights. Every DeepSpeed collective in between (ZeRO-1/2
    gradient reduction, ZeRO-3 parameter all-gathers and gradient reduce-scatters, the step's
    all-reduces) runs after a small agreement of all ranks (:mod:`memguard.integrations._deepspeed_guard`). On an
    OOM on any rank in forward or backward, every rank leaves at its next collective, resets the
    engine's step state, halves the micro-batch and runs the step's samples again from the first; the
    halved micro-batch is kept for later steps. Each retry is logged at WARNING on every rank.

    Under DeepSpeed's own gradient accumulation (the default) memguard makes the window's last
    micro-batch the accumulation boundary (``engine.set_gradient_accumulation_boundary``) and calls
    ``engine.step()`` once per window; with ``"managed_gradient_accumulation": false`` the engine
    reduces in ``engine.step()`` (ZeRO-0/1) or per backward (ZeRO-2/3) as it does by itself.

    Args:
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize`` (ZeRO stage 0-3).
        batch: this rank's samples for the step: a tensor or a dict/tuple/list of tensors, samples in dim 0.
        loss_fn: ``loss_fn(engine, micro_batch) -> mean loss``; default: call the engine with the
            batch and use ``output.loss`` or a scalar output (as :func:`memguard.step`).
        max_retries: at most this many halvings within one step (default: the guard's).

    Returns:
        The step's mean loss over ``batch``.

    Raises:
        ConfigError: the engine cannot be guarded (every reason listed: pipeline parallelism, ZeRO
            offload, ZenFlow, fp16/bf16 under DeepSpeed's FP16/BF16 optimizer wrappers), or the
            batch cannot be split.
        OOMRecoveryError: out of memory at micro-batch 1 or after ``max_retries`` halvings; an OOM
            inside a collective (every rank raises the same error and the process groups are torn
            down); an OOM in the optimizer update (every rank; restart from a checkpoint).
        PeerFailedError: another rank failed with an error that is not an OOM.

    Known limitations:
        ``loss_fn`` runs once per micro-batch and again on a replay; it must not start collectives of
        its own. Under managed accumulation ``engine.micro_steps`` advances once per optimizer step
        (memguard calls ``engine.step()`` once per window), and the engine counts
        ``global_samples`` from its config's batch. An OOM inside ``engine.step()`` is not retried:
        a smaller micro-batch does not shrink the optimizer's memory.
    """
    from memguard.batch import compute_loss
    from memguard.integrations._deepspeed_guard import (
        agreed_engine_step,
        engine_backward,
        engine_problems,
        engine_rank_group,
        engine_window,
        open_engine_window,
    )
    from memguard.guard._window import DEFAULT_MAX_RETRIES

    problems = engine_problems(engine)
    retries = DEFAULT_MAX_RETRIES if max_retries is None else max_retries
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        problems.append(f"max_retries must be an int >= 0, got {max_retries!r}")
    if loss_fn is not None and not callable(loss_fn):
        problems.append("loss_fn must be callable as loss_fn(engine, batch) -> mean loss")
    if problems:
        raise ConfigError(problems)
    window = _WINDOWS.get(engine)
    if window is None:
        window = _WINDOWS[engine] = engine_window(engine, max_retries=retries)
    window.max_retries = retries
    rg = engine_rank_group(engine)
    open_engine_window(engine, window)
    try:
        loss = window.run(batch, lambda micro: compute_loss(engine, micro, loss_fn), engine_backward(engine),
                          last=True)
    finally:
        window.finish()
    agreed_engine_step(rg, micro_batch_size=window.micro_batch_size)
    return float(loss)


def evaluate(engine: Any, batch: Any, fn: Any = None, **options: Any) -> Any:
    """:func:`memguard.evaluate` for a DeepSpeed engine: ``fn(engine, micro_batch)`` (default: the engine called
    with the batch) on micro-batches that halve on an OOM, the results joined as if unsplit.

    Under ZeRO-3 every forward all-gathers parameters from every rank, so every rank must call this at once
    (each with its own batch, of any size): the ranks split together, an OOM on one halves the micro-batch on
    all (logged on each), and an OOM inside an all-gather stops every rank with the same
    :class:`~memguard.OOMRecoveryError` (:mod:`memguard.guard._evaluate_sharded`). Under ZeRO-0/1/2 the forward
    starts no collective and each rank splits alone. ``options`` are :func:`memguard.evaluate`'s.

    Raises:
        memguard.ConfigError: ``engine`` is not a DeepSpeed engine, or ZeRO-3 parameter offload.
    """
    from memguard.guard._evaluate import evaluate as memguard_evaluate
    from memguard.integrations._deepspeed_guard import is_engine

    if not is_engine(engine):
        raise ConfigError(f"evaluate() needs a DeepSpeed engine (the first value deepspeed.initialize returns), got "
                          f"{type(engine).__name__}; for any other model call memguard.evaluate")
    return memguard_evaluate(engine, batch, fn, **options)


def micro_batch_size(engine: Any) -> int | None:
    """The micro-batch :func:`step` uses next for ``engine`` (None before its first step)."""
    window = _WINDOWS.get(engine)
    return window.micro_batch_size if window is not None else None


def oom_retries(engine: Any) -> int:
    """Halvings of the micro-batch so far in :func:`step` for ``engine``."""
    window = _WINDOWS.get(engine)
    return window.oom_retries if window is not None else 0
