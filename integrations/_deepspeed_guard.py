"""OOM recovery inside a DeepSpeed engine that cannot hang: an agreement before every collective.

Why the agreement at the end of an attempt is not enough. A DeepSpeed engine starts collectives
*inside* forward and backward (DeepSpeed 0.19.8): without ZeRO and under ZeRO-1 it reduces the
gradients in the backward of the accumulation boundary (``DeepSpeedEngine._backward_epilogue`` ->
``allreduce_gradients`` -> ``buffered_allreduce_fallback`` or
``DeepSpeedZeroOptimizer.reduce_gradients``), ZeRO-2 reduces full gradient buckets from its
gradient hooks in every backward (``stage_1_and_2.py``: ``reduce_independent_p_g_buckets_and_remove_grads``
-> ``reduce_ipg_grads`` -> ``average_tensor``), ZeRO-3 all-gathers each module's parameters in
its forward and backward pre-hooks (``partitioned_param_coordinator.py``:
``PartitionedParameterCoordinator.fetch_sub_module`` -> ``__all_gather_params``, the all-gather in
``partition_parameters.py``) and reduce-scatters gradient buckets from its hooks
(``stage3.py``: ``__reduce_and_partition_ipg_grads``), and ``engine.step()`` all-reduces the
overflow flag and the gradient norm and all-gathers the updated partitions. A rank that runs out of
memory in compute leaves forward/backward, while its peers wait in the next collective. Measured
with the per-collective agreements skipped (``benchmarks/recovery_sharded.py``, control runs): under
ZeRO-1 and ZeRO-2 both ranks wait until the process group's timeout (90 s there, 30 minutes by
default); under ZeRO-3 the failed rank's agreement meets the peer's parameter all-gather and gloo
aborts the process (SIGABRT).

The protocol (every rank runs the same program, so every rank starts DeepSpeed's collectives in the
same order; this is :mod:`memguard.guard._sharded`'s protocol for FSDP2, with DeepSpeed's entry points):

1. **An agreement before every DeepSpeed collective.** Every collective DeepSpeed's runtime starts
   goes through the communication backend object ``deepspeed.comm.comm.cdb`` (the module-level
   functions of ``deepspeed/comm/comm.py`` call ``cdb.all_reduce``, ``cdb.reduce_scatter_tensor``,
   ``cdb.all_gather_into_tensor``, ...; ``runtime/zero/*.py`` and ``runtime/engine.py`` call no
   ``torch.distributed`` collective directly). :meth:`DeepSpeedRankGroup.install` wraps those
   methods on that instance, so every entry point above (bucket reduction, parameter fetch, the
   stage-3 reduce-scatter, the boundary all-reduce, the step's overflow/norm all-reduces and
   all-gathers) is covered without relying on private method names. While a guarded attempt runs,
   each call first runs one agreement: an all-reduce (MAX) of ``world_size + 1`` int32 values, on
   a gloo group of the same ranks, with ``torch.distributed`` directly (not through the wrapper).
   A collective called from inside another (a backend falling back to a simpler one) agrees once.
2. **A rank that fails in compute reports at once.** An OOM in a module's compute, in DeepSpeed's
   own buffers between collectives (the ZeRO-1/2 bucket and partition buffers, the ZeRO-3 all-gather
   output: all allocated before the collective is called) propagates out of forward/backward to the
   window (:mod:`memguard.guard._window`), which gives the memory back and agrees with "OOM". The
   peers meet it in the agreement before their next collective and raise
   :class:`~memguard.guard._sharded.PeerAbort` there, which leaves their forward/backward too.
3. **Reset, halve, re-run.** Every rank resets the engine's step state (:func:`reset_engine`):
   ZeRO-1/2's IPG buckets, partly reduced gradients, ``averaged_gradients``, the partition
   bookkeeping and ``micro_step_id``; ZeRO-3's gathered and in-flight parameters, the parameter
   coordinator's trace and step state, the module stack of its forward hooks, its IPG buckets and
   gradient partitions' ``micro_step_id`` (so the next micro-batch copies instead of adding); the
   optimizer's backward-hook state; the engine's counters (``micro_steps``, ``global_steps``,
   ``global_samples``, the unmanaged backward count) and its accumulation boundary. The window
   halves the micro-batch and runs the same samples again.
4. **What cannot be made safe fails the same way on every rank, fast.** An error *inside* a
   collective after the agreement passed (measured: the flat output copy inside a ZeRO-3
   ``all_gather_into_tensor``, and gloo's own buffer in an ``all_reduce``, ``std::bad_alloc``; an
   async collective's failure surfaces in its handle's ``wait()``, which is wrapped too) leaves the
   peers inside a collective this rank will never finish: the failing rank writes the error to the
   process group's store and aborts its process groups, and every rank raises the same
   :class:`memguard.OOMRecoveryError` (:meth:`ShardedRankGroup.stop`). An OOM in ``engine.step()``
   (the optimizer update: its memory does not depend on the micro-batch) is agreed on and every rank
   raises :class:`memguard.OOMRecoveryError`; a peer's partition may already be updated then, so the
   job must restart from a checkpoint.

Accumulation. With DeepSpeed's own (managed) accumulation, :meth:`DeepSpeedRankGroup.before_micro_batch`
sets the engine's boundary (``engine.set_gradient_accumulation_boundary``) to True for the last
micro-batch of the window only, whatever the number of micro-batches after a halving, and
``engine.step()`` runs once per window. With ``"managed_gradient_accumulation": false`` the
engine's boundary is ``step()`` itself and nothing is set.

Cost per step. Each agreement is one all-reduce of ``world_size + 1`` int32 values; a step makes
one per DeepSpeed collective plus one per micro-batch attempt and one around ``engine.step()``.
Measured with ``python benchmarks/recovery_sharded.py --time-steps 25`` (2 gloo ranks sharing a busy
2-core CPU host, DeepSpeed 0.19.8, the worker's 16-1024-1 MLP, 64 samples per rank in 4
micro-batches of 16, medians of 25 interleaved steps with the per-collective agreements and with
them skipped): ZeRO-1 5 agreements per step at 1.6 ms each, a step of 0.192 s against 0.182 s
(+5.5%); ZeRO-2 8 at 3.3 ms, 0.329 s against 0.304 s (+8.3%); ZeRO-3 15 at 2.8 ms, 0.261 s against
0.290 s; ZeRO-2 with ``managed_gradient_accumulation: false`` 8 at 0.9 ms, 0.353 s against 0.358 s.
The differences are within this host's noise (others' jobs share its cores: -10% to +8%); the
agreements' own time bounds the cost at 8, 27, 41 and 7 ms per step there. The agreements run on
the host between DeepSpeed's collectives and keep the ranks in step at each one (which DeepSpeed's
synchronous collectives mostly impose anyway); under NCCL they run on a gloo group, a host round
trip each with no device synchronisation. Not measured on GPUs here: with shorter compute per
collective the same round trips weigh more, and a model with many small ZeRO-3 parameters makes
one agreement per all-gather.

Precision. ZeRO-1/2/3 with fp16/bf16 where DeepSpeed uses its ZeRO optimizers
(``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``: their gradient copies are the
buckets, partitions and ``grad_accum`` attributes that :func:`reset_engine` clears; the fp16 loss
scaler and overflow flags change only in ``step()``, which a failed attempt never reached) are guarded.
DeepSpeed's ``FP16_Optimizer``/``BF16_Optimizer`` wrappers (ZeRO-0 with fp16/bf16, ZeRO-1 with bf16
and fp32 gradient accumulation) keep fp32 gradient copies of their own that nothing here resets:
they are refused (:func:`engine_problems`).

Known limitations:
    The agreements cover the collectives DeepSpeed starts through ``deepspeed.comm``; a collective the
    training code starts itself (a metric all-reduced in the loss function) is not covered and can
    still hang when a peer fails before it. The protocol needs every rank to start DeepSpeed's
    collectives in the same order (data parallelism; pipeline parallelism is refused). Verified on CPU
    with gloo (fp32 ZeRO-0/1/2/3, bf16 ZeRO-2/3); not on GPUs, not with NCCL, not with fp16, tensor
    or sequence parallelism, MoE, or activation checkpointing inside ZeRO-3. The reset reaches into
    DeepSpeed 0.19.8's private state (named above, each with its file): another DeepSpeed version may
    keep more, so check it again when upgrading (the tests in ``tests/integrations/test_deepspeed.py``
    do). An OOM in the optimizer update is not retried.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from memguard.errors import ConfigError, OOMRecoveryError, PeerFailedError
from memguard.guard._distributed import ERROR, OK, OOM
from memguard.guard._oom import free_memory, is_oom_error, oom_summary, release_exception
from memguard.guard._sharded import PeerAbort, ShardedRankGroup, ShardingStopped

logger = logging.getLogger("memguard")

# The collective methods of DeepSpeed's communication backend (deepspeed/comm/torch.py, TorchBackend,
# DeepSpeed 0.19.8) that deepspeed/comm/comm.py's functions call; point-to-point calls (pipeline
# parallelism) are not listed: a pipeline engine is refused.
_COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                "broadcast", "broadcast_object_list", "all_gather", "all_gather_into_tensor", "all_gather_base",
                "all_gather_coalesced", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single",
                "all_to_all", "gather", "scatter", "barrier", "monitored_barrier")

_INITIAL_MICRO_STEP_ID = -1  # deepspeed/runtime/zero/stage_1_and_2.py: INITIAL_MICRO_STEP_ID (DeepSpeed 0.19.8)


def _backend() -> Any:
    from deepspeed.comm import comm as ds_comm

    return ds_comm.cdb


@dataclass
class _Snapshot:
    """The engine's counters at the start of a window (restored on a reset)."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    unmanaged_backward_count: int = 0
    boundary: Any = None
    fwd_stack_len: int = 0


@dataclass(eq=False)
class DeepSpeedRankGroup(ShardedRankGroup):
    """The ranks of a DeepSpeed engine as the guard uses them (see the module docstring).

    Attributes:
        engine: the ``DeepSpeedEngine``.
        backend: DeepSpeed's communication backend object whose collectives are wrapped.
        skip_agreements: run DeepSpeed's collectives without the agreement (for measuring its cost only:
            an OOM is then not recoverable).
    """

    engine: Any = None
    backend: Any = None
    skip_agreements: bool = False
    framework: str = "DeepSpeed"
    restart_advice: str = ("Restart the job with more headroom: a smaller train_micro_batch_size_per_gpu, activation "
                           "checkpointing, or smaller ZeRO buffers (reduce_bucket_size, stage3_prefetch_bucket_size, "
                           "stage3_max_live_parameters)")
    store_prefix: str = "memguard/deepspeed/stopped/"
    snapshot: _Snapshot = field(default_factory=_Snapshot)
    _depth: int = 0
    _fwd_stack_len: int = 0

    # ---------------------------------------------------------------------------------- installation

    def install(self) -> None:
        """Wrap the backend's collective methods with the agreement (idempotent)."""
        if self._installed or self.backend is None:
            return
        for name in _COLLECTIVES:
            original = getattr(self.backend, name, None)
            if original is None:
                continue
            if getattr(original, "__memguard_group__", None) is not None:  # another engine's wrapper
                original = original.__wrapped__
            setattr(self.backend, name, self._guarded(original, name))
        self._installed = True

    def _guarded(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:  # type: ignore[override]
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self._armed or self.world_size == 1 or self._depth > 0 or self.skip_agreements:
                return original(*args, **kwargs)
            self._boundary()
            self._depth += 1
            try:
                work = original(*args, **kwargs)
            except (PeerAbort, ShardingStopped):
                raise
            except Exception as exc:  # inside the collective: a peer may already wait in it
                raise self._stopped(exc, name) from exc
            finally:
                self._depth -= 1
            if work is not None and callable(getattr(work, "wait", None)):
                return _GuardedWork(work, self, name)  # an async collective fails in its wait()
            return work
        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__memguard_group__ = self  # type: ignore[attr-defined]
        return call

    def _stopped(self, exc: BaseException, name: str) -> ShardingStopped:
        """The :class:`ShardingStopped` for an error inside collective ``name`` (a peer's, or this rank's)."""
        if self.peer_stopped():  # the collective failed because a peer tore the groups down
            return ShardingStopped(self.stopped_error(exc))
        return ShardingStopped(self.stop(exc, f"DeepSpeed's {name} (deepspeed.comm)"))

    def uninstall(self) -> None:
        """Undo :meth:`install` (only the wrappers this group installed)."""
        for name in _COLLECTIVES:
            current = self.backend.__dict__.get(name) if self.backend is not None else None
            if current is not None and getattr(current, "__memguard_group__", None) is self:
                del self.backend.__dict__[name]
        self._installed = False

    @contextlib.contextmanager
    def armed(self, n_max: int, micro_batch_size: int = 0) -> Iterator[None]:
        """As :meth:`ShardedRankGroup.armed`, with this group's wrappers installed on the backend.

        Several engines in one process share DeepSpeed's backend object: the wrappers of the engine
        whose attempt runs are put in place for its duration.
        """
        self.install_current()
        self._fwd_stack_len = _fwd_stack_len()
        with super().armed(n_max, micro_batch_size):
            yield

    def install_current(self) -> None:
        """Make this group's wrappers the ones on the backend (another engine's may be there)."""
        current = self.backend.__dict__.get(_COLLECTIVES[0]) if self.backend is not None else None
        if current is None or getattr(current, "__memguard_group__", None) is not self:
            self._installed = False
            self.install()

    # ---------------------------------------------------------------------------------- micro-batches

    def start_window(self) -> None:
        """Remember the engine's counters at the start of an optimizer step's window."""
        self.snapshot = snapshot_engine(self.engine)

    def before_micro_batch(self, last: bool) -> None:
        """Under DeepSpeed's own accumulation, make only the window's last micro-batch the boundary."""
        if self.engine.managed_gradient_accumulation():
            self.engine.set_gradient_accumulation_boundary(bool(last))

    def reset(self, params: Any = ()) -> None:
        """Reset the engine's step state after a failed attempt, on every rank (see the module docstring)."""
        self._armed = False
        reset_engine(self.engine, self.snapshot)
        for p in params:
            p.grad = None

    def reset_forward_state(self) -> None:
        """After a failed forward-only attempt (an evaluation micro-batch), on every rank: under ZeRO-3 every
        gathered or in-flight parameter back to its partition and the parameter coordinator's trace and step
        state reset (:func:`_reset_stage3_parameters`); gradients, buckets and the engine's counters are left
        alone (an evaluation makes none). ZeRO-0/1/2 forwards gather nothing: there is nothing to reset."""
        self._armed = False
        engine = self.engine
        if engine.zero_optimization_stage() == 3:
            _reset_stage3_parameters(engine.optimizer, engine.module, self._fwd_stack_len)


class _GuardedWork:
    """An async collective's handle whose ``wait()`` failure stops every rank as a synchronous one does.

    gloo runs an async collective on its worker threads and reports their errors (an output buffer
    that cannot be allocated, a peer that tore the groups down) from ``wait()``, which DeepSpeed calls
    later (ZeRO-3: ``AllGatherHandle.wait`` in ``partition_parameters.py``), outside the wrapper.
    """

    def __init__(self, work: Any, group: DeepSpeedRankGroup, name: str) -> None:
        self._work = work
        self._group = group
        self._name = name

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        except (PeerAbort, ShardingStopped):
            raise
        except Exception as exc:
            raise self._group._stopped(exc, self._name) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def snapshot_engine(engine: Any) -> _Snapshot:
    """The counters :func:`reset_engine` restores."""
    return _Snapshot(micro_steps=engine.micro_steps, global_steps=engine.global_steps,
                     global_samples=engine.global_samples,
                     unmanaged_backward_count=getattr(engine, "_unmanaged_backward_count", 0),
                     boundary=engine._is_gradient_accumulation_boundary, fwd_stack_len=_fwd_stack_len())


def _fwd_stack_len() -> int:
    """The depth of ZeRO-3's stack of modules inside their forward (``parameter_offload.FWD_MODULE_STACK``)."""
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:  # pragma: no cover - DeepSpeed without ZeRO-3
        return 0
    return len(parameter_offload.FWD_MODULE_STACK)


def reset_engine(engine: Any, snap: _Snapshot) -> None:
    """Put ``engine`` back in the state of the start of the window ``snap`` was taken at, gradients dropped.

    Every rank must call it after the same failed attempt (it starts no collective). What is reset,
    with where DeepSpeed 0.19.8 keeps it, is listed in the module docstring.
    """
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    # drop the gradients first: stage3.py's zero_grad calls record_stream on a remaining gradient, which a
    # CPU tensor does not support
    for p in engine.module.parameters():
        p.grad = None
    if stage == 3:
        _reset_stage3(engine, opt, snap)
    elif stage in (1, 2):
        _reset_stage12(opt)
    hooks = getattr(opt, "_backward_hook_state", None)  # runtime/base_optimizer.py: BackwardHookStateManager
    if hooks is not None:
        hooks.backward_active_depth = 0
        hooks.remaining_grad_acc_hooks = 0
        hooks.reset_for_new_step()
    for p in engine.module.parameters():
        p.grad = None
        if hasattr(p, "grad_accum"):  # ZeRO-1/2's accumulation attribute (use_grad_accum_attribute)
            p.grad_accum = None
    # runtime/engine.py, DeepSpeedEngine: counters that backward()/step() advance
    engine._running_engine_step = False
    engine.micro_steps = snap.micro_steps
    engine.global_steps = snap.global_steps
    engine.global_samples = snap.global_samples
    if hasattr(engine, "_unmanaged_backward_count"):
        engine._unmanaged_backward_count = snap.unmanaged_backward_count
    engine._is_gradient_accumulation_boundary = snap.boundary
    if hasattr(opt, "set_gradient_accumulation_boundary"):
        opt.set_gradient_accumulation_boundary(True if snap.boundary is None else bool(snap.boundary))


def _reset_stage12(opt: Any) -> None:
    """DeepSpeedZeroOptimizer (runtime/zero/stage_1_and_2.py): buckets, partial reductions, partitions."""
    opt.zero_grad(set_to_none=True)  # param.grad and param.grad_accum
    for bucket in opt.ipg_buckets.values():  # IPGBucket.clear: params, grads, element count, events
        bucket.clear()
    opt._release_ipg_buffers()  # bucket buffers, grads_in_partition, ready_for_gradients = False
    opt.extra_large_param_to_reduce.clear()
    for i in range(len(opt.params_already_reduced)):
        opt.params_already_reduced[i] = False
    for pending in opt.previous_reduced_grads.values():
        pending.clear()
    opt.reset_partition_gradient_structures()  # is_partition_reduced, remaining/is_grad_computed
    for i in list(opt.averaged_gradients):
        opt.averaged_gradients[i] = None
    for i in list(opt.all_grad_tensors):
        opt.all_grad_tensors[i] = None
    opt.micro_step_id = _INITIAL_MICRO_STEP_ID  # as DeepSpeedZeroOptimizer.step leaves it


def _reset_stage3(engine: Any, opt: Any, snap: _Snapshot) -> None:
    """DeepSpeedZeroOptimizer_Stage3 (runtime/zero/stage3.py) and its parameter coordinator."""
    _reset_stage3_parameters(opt, engine.module, snap.fwd_stack_len)
    for bucket in opt.ipg_buckets.values():  # IPGBucketZ3.clear_params: keeps the reusable buffer
        bucket.clear_params()
    for k in opt.params_already_reduced:
        opt.params_already_reduced[k] = False
    opt.param_reduce_events.clear()
    if hasattr(opt, "_offload_boundary_param_ids"):
        opt._offload_boundary_param_ids = set()
    opt.averaged_gradients = {}
    opt.zero_grad(set_to_none=True)  # micro_step_id = 0: the next micro-batch copies into the partitions


def _reset_stage3_parameters(opt: Any, module: Any, fwd_stack_len: int) -> None:
    """ZeRO-3's parameters after an aborted pass: every gathered or in-flight parameter back to its partition,
    the parameter coordinator's trace and step state reset (runtime/zero/partitioned_param_coordinator.py), the
    module stack of its forward hooks cut back to ``fwd_stack_len`` (runtime/zero/parameter_offload.py)."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    coord = opt.parameter_offload.get_param_coordinator()
    mangled = "_PartitionedParameterCoordinator__"
    # in-flight all-gathers were started by every rank (each after an agreement): wait, then release
    coord._clean_inflight_param_registry()
    # the aborted pass leaves a partial trace: record a new one from the next forward
    setattr(coord, mangled + "trace_mode", ZeRoTraceMode.INVALID)
    coord._clear_trace_structures()
    getattr(coord, mangled + "active_backward_submodules").clear()
    getattr(coord, mangled + "ongoing_fetch_events").clear()
    for m in module.modules():
        if hasattr(m, "ds_grads_remaining"):
            m.ds_grads_remaining = 0
        recompute = getattr(m, "ds_recompute_parameters", None)
        if recompute is not None:
            recompute.clear()
    for p in module.parameters():
        if hasattr(p, "ds_active_sub_modules"):
            p.ds_active_sub_modules.clear()
        # partition_parameters.py, all_gather_coalesced: marked INFLIGHT (its buffer perhaps allocated) before
        # the all-gather starts; an abort at the agreement before it leaves no handle to wait for. Mark it
        # gathered so that the release below frees that buffer (_partition_param: free_param).
        if getattr(p, "ds_status", None) == ZeroParamStatus.INFLIGHT:
            p.ds_status = ZeroParamStatus.AVAILABLE
    coord.release_and_reset_all(module)  # every gathered parameter back to its partition
    setattr(coord, mangled + "n_available_params", 0)
    setattr(coord, mangled + "step_id", 0)
    del parameter_offload.FWD_MODULE_STACK[fwd_stack_len:]  # modules whose post-forward hook never ran


# --------------------------------------------------------------------------------------------------
# the engines that can be guarded


def is_engine(obj: Any) -> bool:
    """Whether ``obj`` looks like a DeepSpeed engine of DeepSpeed >= 0.19 (what ``deepspeed.initialize`` returns)."""
    return getattr(obj, "managed_gradient_accumulation", None) is not None and hasattr(obj, "optimizer")


def engine_problems(engine: Any, *, evaluation: bool = False) -> list[str]:
    """Why an OOM in ``engine`` cannot be recovered from (empty when it can); each says what to do.

    With ``evaluation``, for forward-only attempts (:func:`eval_rank_group`): only what the forward's reset
    (:meth:`DeepSpeedRankGroup.reset_forward_state`) does not cover.
    """
    if not is_engine(engine):
        return [f"memguard needs a DeepSpeed engine (from deepspeed.initialize) of DeepSpeed >= 0.19, got "
                f"{type(engine).__name__}"]
    problems = []
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    if getattr(engine, "pipeline_parallelism", False):
        problems.append("pipeline-parallel engines send activations point to point, which the agreement does not "
                        "cover; memguard recovers from OOM in data-parallel engines only")
    if evaluation:
        if stage == 3 and getattr(engine, "zero_offload_param", lambda: None)():
            problems.append("ZeRO-3 parameter offload (offload_param) fetches parameters from host or NVMe memory, "
                            "which memguard's reset after an OOM in evaluation is not verified with; drop "
                            "offload_param, or evaluate with DeepSpeed's own loop and a smaller eval batch")
        return problems
    if stage >= 1 and (engine.zero_cpu_offload() or getattr(engine, "zero_offload_param", lambda: None)()):
        problems.append("ZeRO offload (offload_optimizer/offload_param) keeps host-side gradient copies memguard does "
                        "not reset; drop the offload block for OOM recovery")
    if getattr(engine, "zenflow", False):
        problems.append("ZenFlow keeps selective gradient state memguard does not reset; turn it off for OOM recovery")
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        try:
            from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

            zero_opt = isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))
        except ImportError:  # pragma: no cover
            zero_opt = False
        if not zero_opt:
            problems.append(f"this fp16/bf16 engine's optimizer is DeepSpeed's {type(opt).__name__}, which keeps fp32 "
                            "gradient copies of its own that memguard cannot reset after an OOM; use ZeRO stage 2 or 3 "
                            "for fp16/bf16 (DeepSpeed then uses its ZeRO optimizer), or train in fp32")
    return problems


def _agreement_group(group: Any) -> Any:
    """A gloo group over the ranks of ``group`` (``group`` itself when it is gloo): host-side agreements."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo")


def deepspeed_rank_group(engine: Any, *, evaluation: bool = False) -> DeepSpeedRankGroup:
    """The :class:`DeepSpeedRankGroup` of ``engine``. Every rank must call it (it may create a gloo group).

    The agreement runs over every rank of the default process group: with pure data parallelism those
    are the engine's data-parallel ranks, and every rank starts DeepSpeed's collectives in the same order.

    Raises:
        memguard.ConfigError: the engine cannot be guarded (every reason listed), or
            ``torch.distributed`` is not initialised.
    """
    problems = engine_problems(engine, evaluation=evaluation)
    if not (dist.is_available() and dist.is_initialized()):
        problems.append("torch.distributed is not initialised; build the engine with deepspeed.initialize (which "
                        "initialises it) before memguard's step")
    if problems:
        raise ConfigError(problems)
    world = dist.group.WORLD
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store: peers raise a PeerFailedError without the failing rank's details
        store = None
    rg = DeepSpeedRankGroup(group=_agreement_group(world), world_size=dist.get_world_size(), rank=dist.get_rank(),
                            src=0, device=torch.device("cpu"), broadcast_buffers=False, engine=engine,
                            backend=_backend(), store=store)
    rg.install()
    return rg


# One rank group per engine, kept as long as the engine lives.
_GROUPS: "weakref.WeakKeyDictionary[Any, DeepSpeedRankGroup]" = weakref.WeakKeyDictionary()


def engine_rank_group(engine: Any) -> DeepSpeedRankGroup:
    """``engine``'s :class:`DeepSpeedRankGroup`, made on the first call (every rank must make that call).

    Raises:
        memguard.ConfigError: as :func:`deepspeed_rank_group`.
    """
    rg = _GROUPS.get(engine)
    if rg is None:
        rg = _GROUPS[engine] = deepspeed_rank_group(engine)
    return rg


def eval_rank_group(model: Any) -> DeepSpeedRankGroup | None:
    """The rank group :func:`memguard.evaluate` runs a DeepSpeed engine's forwards under, or None.

    A ZeRO-3 engine all-gathers each module's parameters in its forward (the coordinator's
    ``fetch_sub_module``), so the ranks split their evaluation batches together: the engine's group (that of
    ``integrations.deepspeed.step`` or a framework adapter, else made now; every rank must make the first
    call). ZeRO-0/1/2 forwards start no DeepSpeed collective: None, each rank splits alone.

    Raises:
        memguard.ConfigError: ``model`` is a module whose parameters ZeRO-3 partitions but not its engine,
            or the engine cannot be guarded in evaluation (:func:`engine_problems`).
    """
    if not is_engine(model):
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError(f"memguard.evaluate was given a {type(model).__name__} whose parameters DeepSpeed ZeRO-3 "
                              "partitions, not its engine; pass the engine (the first value deepspeed.initialize "
                              "returned): its forward gathers the parameters, and memguard guards those gathers")
        return None
    if model.zero_optimization_stage() < 3:
        return None
    rg = _GROUPS.get(model)
    if rg is None:
        rg = _GROUPS[model] = deepspeed_rank_group(model, evaluation=True)
    else:
        problems = engine_problems(model, evaluation=True)
        if problems:
            raise ConfigError(problems)
    return rg if rg.world_size > 1 else None


# --------------------------------------------------------------------------------------------------
# what memguard.integrations.deepspeed.step and framework adapters run


def engine_window(engine: Any, *, micro_batch_size: int | None = None, **options: Any) -> Any:
    """A :class:`~memguard.guard._window.MicroBatchWindow` whose attempts run under ``engine``'s agreements.

    The recipe for a loop that owns its batches (``memguard.integrations.deepspeed.step``, or a
    framework adapter that can hand one optimizer step's batches to memguard), on every rank::

        window = engine_window(engine)                     # once; every rank
        open_engine_window(engine, window)                 # at each optimizer step
        loss = window.run(batch, lambda micro: loss_fn(engine, micro), engine_backward(engine), last=True)
        window.finish()
        agreed_engine_step(engine_rank_group(engine), micro_batch_size=window.micro_batch_size)

    Args:
        engine: the ``DeepSpeedEngine``.
        micro_batch_size: the micro-batch to start from (default: the engine's
            ``train_micro_batch_size_per_gpu``).
        **options: more :class:`MicroBatchWindow` options (``max_retries``, ``plan``, ``precision``, ``on_halve``).

    Raises:
        memguard.ConfigError: as :func:`deepspeed_rank_group`.
    """
    from memguard.guard._window import MicroBatchWindow

    mbs = int(engine.train_micro_batch_size_per_gpu()) if micro_batch_size is None else micro_batch_size
    return MicroBatchWindow(mbs, rank_group=engine_rank_group(engine), **options)


def open_engine_window(engine: Any, window: Any) -> None:
    """Start an optimizer step's window: remember the engine's counters, drop every gradient."""
    engine_rank_group(engine).start_window()
    module = engine.module
    window.start(module, [p for p in module.parameters() if p.requires_grad])


def engine_backward(engine: Any) -> Callable[[torch.Tensor], None]:
    """The window's backward for ``engine``: ``engine.backward(loss, scale_wrt_gas=False)`` (the window
    already weights each micro-batch's loss by its share of the step's samples)."""
    def backward(weighted: torch.Tensor) -> None:
        engine.backward(weighted, scale_wrt_gas=False)
    return backward


# --------------------------------------------------------------------------------------------------
# one guarded call: for adapters that run engine.backward / engine.step themselves, one call at a time


@dataclass(frozen=True)
class Outcome:
    """The agreed outcome of :func:`guarded_attempt`, the same on every rank.

    Attributes:
        ok: every rank succeeded.
        oom_ranks: the ranks that ran out of memory (empty when ``ok``).
        detail: this rank's OOM summary, or "" (a peer's OOM is named by rank only).
        seconds: time from the start of the attempt to the agreed outcome.
    """

    ok: bool
    oom_ranks: tuple[int, ...] = ()
    detail: str = ""
    seconds: float = 0.0


def guarded_attempt(rg: DeepSpeedRankGroup, fn: Callable[[], Any], *, n_max: int = 0,
                    micro_batch_size: int = 0) -> Outcome:
    """Run ``fn`` (forward/backward calls, or ``engine.step()``) with the agreements armed, then agree.

    Every rank must call it with its own ``fn``, the same number of times. On an OOM on any rank,
    every rank resets the engine (:meth:`DeepSpeedRankGroup.reset`) and gets the same
    ``Outcome(ok=False, oom_ranks=...)``: the caller halves its micro-batch and runs the same samples
    again (each retry is logged here, on every rank). Call :meth:`DeepSpeedRankGroup.start_window`
    on every rank before the first attempt of an optimizer step, so that the reset knows the engine's
    counters.

    Raises:
        memguard.OOMRecoveryError: an OOM inside a collective (every rank, the same error; the process
            groups are torn down).
        memguard.PeerFailedError: a peer failed with an error that is not an OOM.
        Exception: this rank's own error that is not an OOM, unchanged (peers raise PeerFailedError).
    """
    start = time.perf_counter()
    code, failure, detail = OK, None, ""
    codes: list[int] | None = None
    try:
        with rg.armed(n_max, micro_batch_size):
            fn()
    except ShardingStopped as stopped:
        error = stopped.error
        release_exception(stopped)
        raise error  # the cause is the failing rank's own error (set by stop)
    except PeerAbort as abort:
        codes = abort.codes
        release_exception(abort)
    except Exception as exc:
        if is_oom_error(exc):
            code, detail = OOM, oom_summary(exc)
            release_exception(exc)
            free_memory()
        else:
            code, failure = ERROR, exc
    if codes is None:
        try:
            codes, _ = rg.agree(code, [n_max])
        except ShardingStopped as stopped:
            raise stopped.error from None
    if max(codes) == OK:
        return Outcome(True, seconds=time.perf_counter() - start)
    rg.reset()
    if max(codes) == ERROR:
        if failure is not None:
            raise failure
        bad = codes.index(ERROR)
        raise PeerFailedError(f"rank {bad} failed with an error that is not an out-of-memory error (see that rank's "
                              "log); this rank stops too so that no rank waits forever", rank=bad)
    failed = tuple(r for r, c in enumerate(codes) if c == OOM)
    logger.warning("DeepSpeed engine reset on every rank after an out-of-memory error on rank %s%s",
                   ", ".join(map(str, failed)), f" ({detail})" if detail else "")
    return Outcome(False, failed, detail, time.perf_counter() - start)


def agreed_engine_step(rg: DeepSpeedRankGroup, *, micro_batch_size: int = 0) -> None:
    """``engine.step()`` with the agreements armed; an OOM on any rank stops every rank the same way.

    Raises:
        memguard.OOMRecoveryError: a rank ran out of memory in the step (its memory does not depend on the
            micro-batch, so no retry would help); every rank raises it.
        memguard.PeerFailedError, Exception: as :func:`guarded_attempt`.
    """
    engine = rg.engine
    out = guarded_attempt(rg, engine.step, micro_batch_size=micro_batch_size)
    if out.ok:
        engine._is_gradient_accumulation_boundary = rg.snapshot.boundary  # the engine's own rule again
        return
    ranks = ", ".join(map(str, out.oom_ranks))
    detail = f" ({out.detail})" if out.detail else ""
    raise OOMRecoveryError(
        f"out of memory in DeepSpeed's engine.step() on rank {ranks}{detail}: the optimizer step's memory does not "
        "depend on the micro-batch, so every rank stops; a rank's partition of the weights may already be updated, so "
        "restart from the last checkpoint with more sharding (a higher ZeRO stage), optimizer offload or a 16-bit "
        "precision", micro_batch_size=micro_batch_size)
