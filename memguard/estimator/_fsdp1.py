"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): one rank's training step, traced for real.

FSDP1 is what Lightning's ``FSDPStrategy``, Accelerate's and the HF Trainer's FSDP plugin (its default
``fsdp_version=1``) and the FSDP-QLoRA recipes run. It is not FSDP2: each unit flattens its
parameters into one ``FlatParameter`` (``_flat_param.py``, ``FlatParamHandle.flatten_tensors_into_flat_param``)
and all-gathers into that unit's padded unsharded flat parameter, whose views are the module's
parameters (``FlatParamHandle._all_gather_flat_param``: on CPU ``dist.all_gather`` into
``torch.chunk`` views of it, else ``all_gather_into_tensor``), where FSDP2 gathers into a separate
buffer and copies out per parameter; its ``MixedPrecision`` keeps a low-precision copy of the shard
(``_use_low_precision_shard``: ``flat_param._mp_shard``) and, as Lightning and Accelerate configure it,
reduces the gradients in 16 bits (``reduce_dtype``), where memguard's FSDP2 reduces in fp32.

As for FSDP2 (:mod:`memguard.estimator._fsdp2`), memguard runs FSDP1 itself on the fake model over a
fake process group of the planned world size: the traced copy is wrapped exactly as :func:`wrap_model`
wraps a model (each repeated block of :func:`memguard.estimator._blocks.find_container` its own unit,
``ModuleWrapPolicy``, as Lightning's ``auto_wrap_policy={Block}`` and Accelerate's
``TRANSFORMER_BASED_WRAP`` of ``_no_split_modules`` do; the root unit the rest), so the trace holds
FSDP1's own allocations for rank 0: the sharded flat parameters (padded to a multiple of the world
size: ``FlatParamHandle._get_shard``), each unit's padded unsharded flat parameter allocated by
``_alloc_storage`` and freed by ``_free_storage`` (``untyped_storage().resize_``, recorded as for
FSDP2), the root's kept unsharded from forward to backward (``_runtime_utils.py``,
``_post_forward_reshard``: ``not state._is_root``), the backward's prefetch of the next unit
(``BackwardPrefetch.BACKWARD_PRE``, the default: ``_prefetch_handle``), the reduce-scatter's padded
input and new shard (``_get_reduce_scatter_tensors``) and the sharded gradient
(``_post_reduce_grad_callback``), and under ``MixedPrecision`` the low-precision shard and the
16-bit reduction (``_reduce_grad``: ``_cast_grad_to_param_dtype``).

``sharding_strategy``: ``FULL_SHARD`` (memguard's ``zero_stage=3``), ``SHARD_GRAD_OP`` (2: the
unsharded flat parameter kept from forward to backward, ``_should_free_in_backward``) and
``NO_SHARD`` (0: nothing sharded, the gradients all-reduced, ``_reduce_grad_no_shard``).

``limit_all_gathers`` (``_limiter_utils.py``, ``_FreeEventQueue``: at most 2 all-gathers in flight
ahead of the frees) binds only where the CPU thread runs ahead of the device; the trace is in issue
order with each free where the CPU issues it, which is what the limiter enforces up to its 2 in
flight, so both settings trace alike (said in ``Estimate.notes`` when it is False).

Known limitations:
    ``CPUOffload`` and the hybrid strategies (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``) are not
    modelled (refused). ``forward_prefetch=True`` is traced as FSDP1 runs it (the next unit's
    all-gather issued in the pre-forward). Rank 0 is traced: with uneven sharding it holds the
    largest shard. The units are the repeated blocks and the root: a job wrapping other modules
    (another ``auto_wrap_policy``) is estimated as this one. No autocast is traced: on CUDA
    Lightning's ``FSDPPrecision`` adds ``torch.autocast("cuda")`` around the ``MixedPrecision`` step
    (``lightning/fabric/plugins/precision/fsdp.py``, ``forward_context``), whose fp32 ops (softmax,
    norms, losses) then save fp32 outputs; not modelled, nor checked on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from memguard.errors import ConfigError

#: memguard's sharding level of each FSDP1 ``ShardingStrategy`` it models.
SHARDING_OF_STAGE = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 0: "NO_SHARD"}
STAGE_OF_SHARDING = {v: k for k, v in SHARDING_OF_STAGE.items()}

FSDP1_NOTE = ("FSDP1: sharding_strategy={sharding}, use_orig_params={orig}, MixedPrecision(param_dtype={param}, "
              "reduce_dtype={reduce}, buffer_dtype={buffer}); rank 0 of {world} traced with FullyShardedDataParallel "
              "itself")
LIMITER_NOTE = ("FSDP1 limit_all_gathers=False: traced in issue order like the default rate limiter; on a GPU the "
                "CPU thread may run further ahead and hold more all-gathered units than this estimate")

_OPTION_KEYS = ("use_orig_params", "limit_all_gathers", "param_dtype", "reduce_dtype", "buffer_dtype",
                "backward_prefetch", "forward_prefetch", "mixed_precision")
_PREFETCH = (None, "BACKWARD_PRE", "BACKWARD_POST")


@dataclass(frozen=True)
class FSDP1Layout:
    """How the traced copy is wrapped in FSDP1 (what :func:`wrap_model` does).

    Attributes:
        world_size: ranks of the (fake) process group.
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"`` or ``"NO_SHARD"``.
        use_orig_params: FSDP1's ``use_orig_params`` (the optimizer then steps the original
            parameters, views into the sharded flat parameter; else the flat parameters).
        limit_all_gathers: FSDP1's rate limiter (see the module docstring).
        param_dtype, reduce_dtype, buffer_dtype: ``MixedPrecision``'s dtypes, None each for none.
        backward_prefetch: ``"BACKWARD_PRE"`` (FSDP1's default), ``"BACKWARD_POST"`` or None.
        forward_prefetch: FSDP1's ``forward_prefetch``.
        backend: ``"gloo"`` (the CPU target, whose collectives copy through temporaries) or ``"nccl"``.
    """

    world_size: int
    sharding_strategy: str = "FULL_SHARD"
    use_orig_params: bool = True
    limit_all_gathers: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    backward_prefetch: str | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    backend: str = "nccl"

    @property
    def zero_stage(self) -> int:
        """memguard's sharding level of the strategy (:data:`STAGE_OF_SHARDING`)."""
        return STAGE_OF_SHARDING[self.sharding_strategy]

    def mixed_precision(self) -> Any:
        """FSDP1's ``MixedPrecision`` of these dtypes, or None when none is set."""
        from torch.distributed.fsdp import MixedPrecision

        if self.param_dtype is None and self.reduce_dtype is None and self.buffer_dtype is None:
            return None
        return MixedPrecision(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                              buffer_dtype=self.buffer_dtype)

    def note(self) -> str:
        def name(d):
            return str(d).replace("torch.", "") if d is not None else None

        return FSDP1_NOTE.format(sharding=self.sharding_strategy, orig=self.use_orig_params, param=name(self.param_dtype),
                                 reduce=name(self.reduce_dtype), buffer=name(self.buffer_dtype), world=self.world_size)


def fsdp1_layout(precision_dtype: torch.dtype | None, zero_stage: int, world_size: int, device: str,
                 options: Mapping[str, Any] | None = None) -> FSDP1Layout:
    """The :class:`FSDP1Layout` of an estimate: ``zero_stage`` 3/2/0 is FULL_SHARD/SHARD_GRAD_OP/NO_SHARD; a
    ``*-mixed`` precision (``precision_dtype`` its 16-bit dtype) is ``MixedPrecision`` with param, reduce and
    buffer dtype all 16-bit, as Lightning's ``FSDPPrecision.mixed_precision_config`` and Accelerate's
    ``FullyShardedDataParallelPlugin.set_mixed_precision`` build it; ``options`` (:func:`check_options`) override.
    """
    kw: dict[str, Any] = dict(param_dtype=precision_dtype, reduce_dtype=precision_dtype, buffer_dtype=precision_dtype)
    for key, value in dict(options or {}).items():
        if key == "mixed_precision":
            kw.update(_mp_dtypes(value))
        else:
            kw[key] = value
    if "backward_prefetch" in kw:  # a torch BackwardPrefetch member, or its name
        kw["backward_prefetch"] = getattr(kw["backward_prefetch"], "name", kw["backward_prefetch"])
    return FSDP1Layout(world_size=world_size, sharding_strategy=SHARDING_OF_STAGE[zero_stage],
                       backend="gloo" if device == "cpu" else "nccl", **kw)


ADAPTER_UNITS_NOTE = ("FSDP1 units: each trainable leaf module (a LoRA adapter's lora_A/lora_B) its own unit as well as "
                      "each block, as peft's fsdp_auto_wrap_policy wraps them (the HF Trainer and Accelerate set it "
                      "for a PEFT model; FSDP1 refuses a unit of frozen and trainable parameters without "
                      "use_orig_params)")


def notes_of(layout: FSDP1Layout, model: nn.Module | None = None) -> tuple[str, ...]:
    """What an FSDP1 estimate assumed (``Estimate.notes``)."""
    adapters = (ADAPTER_UNITS_NOTE,) if model is not None and wraps_trainable_leaves(model, layout) else ()
    return (layout.note(),) + adapters + (() if layout.limit_all_gathers else (LIMITER_NOTE,))


def _trainable_leaf(module: nn.Module) -> bool:
    """peft's ``lambda_policy_fn`` (peft/utils/other.py, ``fsdp_auto_wrap_policy``): a module without
    children whose ``weight`` requires grad."""
    weight = getattr(module, "weight", None)
    return next(module.children(), None) is None and weight is not None and bool(weight.requires_grad)


def wraps_trainable_leaves(model: nn.Module, layout: FSDP1Layout) -> bool:
    """Whether :func:`wrap_model` gives each trainable leaf module its own unit, as peft's
    ``fsdp_auto_wrap_policy`` does: for a PEFT model (transformers/distributed/fsdp.py,
    ``update_fsdp_plugin_peft``, sets it as the Accelerate plugin's policy for every PEFT model the HF
    Trainer shards; Answer.AI's FSDP-QLoRA ``train.py`` builds the same policy), and for any model of
    frozen and trainable parameters under ``use_orig_params=False``, which FSDP1 cannot wrap otherwise
    (``_init_utils.py``: a unit's flat parameter needs one ``requires_grad``)."""
    flags = {p.requires_grad for p in model.parameters()}
    if flags != {True, False}:
        return False
    return hasattr(model, "peft_config") or not layout.use_orig_params


def _mp_dtypes(value: Any) -> dict[str, Any]:
    if value is None:
        return dict(param_dtype=None, reduce_dtype=None, buffer_dtype=None)
    get = value.get if isinstance(value, Mapping) else (lambda k: getattr(value, k, None))
    return {k: get(k) for k in ("param_dtype", "reduce_dtype", "buffer_dtype")}


def check_options(options: Any, problems: list[str]) -> None:
    """Append a sentence to ``problems`` for each invalid entry of ``fsdp1_options`` (a mapping of
    :data:`_OPTION_KEYS`; ``mixed_precision`` a torch ``MixedPrecision`` or a mapping of its dtypes)."""
    if options is None:
        return
    if not isinstance(options, Mapping):
        problems.append(f"fsdp1_options must be a dict, got {type(options).__name__}")
        return
    for key, value in options.items():
        if key not in _OPTION_KEYS:
            problems.append(f"fsdp1_options[{key!r}] is not an FSDP1 option memguard models: drop it (the ones it "
                            f"reads: {', '.join(_OPTION_KEYS)})")
        elif key in ("use_orig_params", "limit_all_gathers", "forward_prefetch") and not isinstance(value, bool):
            problems.append(f"fsdp1_options[{key!r}]={value!r} must be True or False")
        elif key in ("param_dtype", "reduce_dtype", "buffer_dtype") and not (
                value is None or isinstance(value, torch.dtype)):
            problems.append(f"fsdp1_options[{key!r}]={value!r} must be a torch.dtype or None")
        elif key == "backward_prefetch" and getattr(value, "name", value) not in _PREFETCH:
            problems.append(f"fsdp1_options['backward_prefetch']={value!r} must be None, 'BACKWARD_PRE' or "
                            "'BACKWARD_POST'")


def wrap_model(model: nn.Module, layout: FSDP1Layout, blocks: list[nn.Module] | None = None,
               device: torch.device | None = None) -> nn.Module:
    """``model`` wrapped in ``FullyShardedDataParallel`` with each repeated block (``blocks``, default:
    the children of :func:`~memguard.estimator._blocks.find_container`) its own unit (``ModuleWrapPolicy``
    of their classes), the root the rest, as the layout says; where :func:`wraps_trainable_leaves`, each
    trainable leaf module (a LoRA adapter) is a unit of its own too, as peft's policy makes it.

    Raises:
        ConfigError: FSDP1 refuses the model.
    """
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from memguard.estimator._blocks import find_container

    if blocks is None:
        container = find_container(model)
        blocks = list(container.children()) if container is not None else []
    policy = ModuleWrapPolicy({type(b) for b in blocks}) if blocks else None
    if wraps_trainable_leaves(model, layout):
        # peft's fsdp_auto_wrap_policy: _or_policy of its lambda policy (trainable leaves) and a
        # transformer_auto_wrap_policy of the block classes
        import functools

        from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

        policies = [functools.partial(lambda_auto_wrap_policy, lambda_fn=_trainable_leaf)]
        if blocks:
            policies.append(functools.partial(transformer_auto_wrap_policy,
                                              transformer_layer_cls={type(b) for b in blocks}))
        policy = functools.partial(_or_policy, policies=policies)
    prefetch = getattr(BackwardPrefetch, layout.backward_prefetch) if layout.backward_prefetch else None
    try:
        return FullyShardedDataParallel(
            model, auto_wrap_policy=policy, mixed_precision=layout.mixed_precision(),
            sharding_strategy=getattr(ShardingStrategy, layout.sharding_strategy), use_orig_params=layout.use_orig_params,
            limit_all_gathers=layout.limit_all_gathers, backward_prefetch=prefetch,
            forward_prefetch=layout.forward_prefetch, device_id=device or torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - FSDP1 refusing the model is the user's problem
        raise ConfigError(f"FSDP1 (FullyShardedDataParallel) could not wrap the model: {type(exc).__name__}: {exc}; "
                          "check the model against FSDP1's requirements or estimate with strategy='fsdp2'") from exc
