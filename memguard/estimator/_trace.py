"""Trace one training step on fake tensors and record every storage allocation and free.

How it works: the model is deep-copied with every parameter and buffer replaced by a fake
tensor of the same shape and dtype (``FakeTensorMode``: shapes and dtypes are real, memory is
not), so the user's model is never moved, mutated or really allocated. A fresh optimizer of the
user's class runs one warm-up step on zero gradients to create its lazily built state. Then one
real step (forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``) runs under a
``TorchDispatchMode`` that sees every ATen op's outputs below autograd; each new storage is an
allocation, and a weak reference on it records the free when the last tensor using it dies.
The result is an exact, ordered list of allocations and frees of tensor storages, which the
analysis (``memguard.estimator._analysis``) turns into a peak and a breakdown.

What is traced is described by a :class:`TraceSpec` (precision, device, checkpointing, ...). The
model is called through :mod:`memguard.batch` (a mapping as ``**batch``, a tuple or list as
``*batch``), so every part of memguard reads a batch the same way. With ``keep_outputs`` a
forward hook on the model keeps its output alive, as ``out = model(**batch)`` does in a
hand-written loop, and the step starts with the previous step's output still live. With a
``cuda_target`` (the CUDA target traced on CPU fakes) forward and backward run under
:class:`~memguard.estimator._cuda_kernels.CudaKernelModel`, so functions whose CUDA kernels
allocate differently from the CPU's allocate as on CUDA.

The step is run by :class:`StepTracer` and recorded by :class:`Recorder`, public bases with
documented extension points: a strategy that runs its own code in the step subclasses them (FSDP2's
tracer and recorder in :mod:`memguard.estimator._fsdp2_trace`).

Known limitations:
    Memory that kernels allocate internally without creating a tensor (oneDNN scratchpads,
    cuDNN/cuBLAS workspaces) is invisible here; CUDA workspaces are added by the device model.
    Fake tensors hold no values: ``Tensor.item()`` answers 1.0 for floats, 1 for integers and
    False for booleans, so code whose control flow depends on tensor values may take another
    branch than it would for real. Ops whose output size depends on values (``nonzero``,
    boolean masking) cannot be traced.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memguard.batch import LossFn, compute_loss, map_tensors, tensor_leaves
from memguard.errors import ConfigError
from memguard.estimator._dtypes import built_dtypes
from memguard.estimator._cpu_kernels import CPU_RULES, CpuTarget, Replay
from memguard.estimator._cuda_kernels import CUDA_OP_RULES, UNMODELLED_OPS, CudaTarget
from memguard.estimator._fake_corrections import CORRECTIONS, unpacked_positions
from memguard.estimator._result import Category

PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad")

#: Temporaries of the optimizer step get their own category while scanning, because sharding
#: shrinks them with the optimizer state (each ZeRO rank updates only its partition); reports fold
#: them into "temporaries".
OPTIMIZER_TEMPORARIES = "optimizer_temporaries"


@dataclass(frozen=True)
class TraceSpec:
    """How one training step is traced: everything but the model, batch, optimizer and loss.

    Frozen and hashable, so a set of traces can be keyed by it (the planner's trace cache).
    :func:`memguard.estimator._tracing.trace_spec` builds the spec for a target and precision.

    Attributes:
        param_dtype: cast floating parameters, buffers and inputs to this dtype (``*-true``
            16-bit precisions), or None.
        autocast_dtype: run forward and loss under autocast to this dtype (``*-mixed``), or None.
        loss_scale: multiply the loss by a scale before backward (``GradScaler``'s extra op).
        foreach: force the optimizer's ``foreach`` flag where the user left it at None.
        device: the fake tensors' device: ``"cpu"``, or ``"cuda"`` where a GPU is present (then
            CUDA's own autocast and kernels apply, and nothing is allocated on it).
        cuda_autocast: apply CUDA's autocast op lists (emulated on CPU fakes) instead of
            ``torch.autocast(device)``.
        checkpoint_blocks: wrap this many repeated blocks in activation checkpointing.
        grads_present: start the step with every gradient already allocated (a micro-batch after
            the first under gradient accumulation).
        keep_blocks: trace a shortened model that keeps only this many of its repeated blocks
            (the planner's probes; memory is affine in the number of identical blocks).
        count_flops: count forward and backward FLOPs with ``torch.utils.flop_counter``.
        keep_outputs: the training loop keeps the model's output (``out = model(**batch)``)
            through backward, the optimizer step and the next step's forward.
        cuda_target: run forward and backward under
            :class:`~memguard.estimator._cuda_kernels.CudaKernelModel` for this GPU, so that
            functions whose CUDA kernels allocate differently from the CPU's allocate as on CUDA
            (for the CUDA target traced on CPU fakes); None traces the device's own kernels.
        train: True traces a training step. False traces an evaluation step: the model in
            ``eval()`` mode, one forward under ``torch.no_grad()`` whose result (the model's
            output, or what ``loss_fn`` returns) stays live to the end of the step, no backward and
            no optimizer step (see :func:`trace_step`).
        optimizer_state: for ``train=False``: the optimizer's state is resident during the
            evaluation (an evaluation inside a training run); False: parameters only.
        cpu_target: for the CPU target, the CPU whose kernel paths are replayed (oneDNN's reorders
            and scratchpads, ATen's im2col buffers; :mod:`memguard.estimator._cpu_kernels`); None
            records the fake kernels' outputs only (the CUDA target traced on CPU fakes).
    """

    param_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    loss_scale: bool = False
    foreach: bool | None = None
    device: str = "cpu"
    cuda_autocast: bool = False
    checkpoint_blocks: int = 0
    grads_present: bool = False
    keep_blocks: int | None = None
    count_flops: bool = False
    keep_outputs: bool = False
    cuda_target: CudaTarget | None = None
    train: bool = True
    optimizer_state: bool = False
    cpu_target: CpuTarget | None = None


@dataclass
class Trace:
    """What one traced step allocated, in order.

    Attributes:
        events: ``(handle, signed_bytes)`` in time order: ``+n`` allocates storage ``handle`` of
            ``n`` bytes, ``-n`` frees it.
        sizes: bytes of each handle (its last size).
        category: the category of each handle (a :class:`~memguard.estimator._result.Category`, or one of the
            trace's own: :data:`OPTIMIZER_TEMPORARIES`, FSDP2's).
        phase_starts: index into ``events`` where each phase of :data:`PHASES` begins.
        num_params, num_trainable_params: parameter counts (tied weights once).
        largest_layer_params: the most parameters any single module holds itself, DeepSpeed's
            "largest layer" (ZeRO-3 gathers one at a time).
        trainable_param_bytes: bytes of the trainable parameters.
        num_blocks: repeated blocks in the traced model (after any truncation).
        num_ops: non-view ATen ops run by forward and backward (the cost model's host-side term).
        flops: FLOPs of forward and backward, when counted (``count_flops=True``).
        unmodelled: for the CUDA target, what CUDA kernels of the step allocate that the trace does not
            replay (:class:`memguard.estimator._unmodelled.Unmodelled` entries, in call order).
        streams: handle -> stream id (1, 2, ...) of the storages allocated while a stream other
            than the default one was current (FSDP2's collective streams); absent: the default.
        buffer_handles: the handles of the model's buffers (category ``params``; a buffer that shares
            a parameter's storage is the parameter's and not listed).
        buffer_source_bytes: the buffers' bytes in the dtypes of the user's model (before any cast
            of a ``*-true`` precision): what an engine that leaves buffers alone holds (DeepSpeed).
        param_dtypes: the user's floating parameters as built, before any cast
            (:func:`memguard.estimator._dtypes.built_dtypes`).
    """

    events: list[tuple[int, int]] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    phase_starts: dict[str, int] = field(default_factory=dict)
    num_params: int = 0
    num_trainable_params: int = 0
    largest_layer_params: int = 0
    trainable_param_bytes: int = 0
    num_blocks: int = 0
    num_ops: int = 0
    flops: int = 0
    unmodelled: list = field(default_factory=list)
    streams: dict[int, int] = field(default_factory=dict)
    buffer_handles: list[int] = field(default_factory=list)
    buffer_source_bytes: int = 0
    param_dtypes: tuple[tuple[str, int, int], ...] = ()

    def phase_of(self, index: int) -> str:
        """The phase that event ``index`` belongs to."""
        current = PHASES[0]
        for name in PHASES:
            start = self.phase_starts.get(name)
            if start is not None and start <= index:
                current = name
        return current


def _stub_scalar(func, args):
    """A stand-in for ``Tensor.item()`` on a fake tensor, which has no data.

    Floats give 1.0 and integers 1 (safe divisors: Adafactor's parameter norm, a token count),
    booleans False (``if torch.isnan(x).any(): raise ...`` takes the ordinary path).
    """
    t = args[0]
    if t.dtype == torch.bool:
        return False
    return 1.0 if (t.is_floating_point() or t.is_complex()) else 1


class ScalarStub(TorchDispatchMode):
    """Answers ``aten._local_scalar_dense`` (``.item()``) with :func:`_stub_scalar`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return _stub_scalar(func, args)
        return func(*args, **(kwargs or {}))


class Recorder(TorchDispatchMode):
    """Records the birth (first sight as an op output) and death (weakref) of storages.

    With a ``cpu_target``, an op that has a rule in :data:`~memguard.estimator._cpu_kernels.CPU_RULES`
    also records the buffers that op's CPU kernel allocates and frees inside the call, in order
    around its outputs; with a ``cuda_target`` (the CUDA target traced on CPU fakes), likewise for
    the ATen ops of :data:`~memguard.estimator._cuda_kernels.CUDA_OP_RULES` (CUDA kernels' own buffers).
    While ``unmodelled_target`` is set (the ``cuda_target``, or the GPU path's target), the ATen ops of
    :data:`~memguard.estimator._cuda_kernels.UNMODELLED_OPS` report into ``unmodelled``.
    """

    def __init__(self, trace: Trace, cpu_target: CpuTarget | None = None, cuda_target: CudaTarget | None = None) -> None:
        super().__init__()
        self.trace = trace
        self.cpu_target = cpu_target
        self.cuda_target = cuda_target
        self.unmodelled_target = cuda_target  # who UNMODELLED_OPS' finders judge by (None: not a CUDA trace)
        self.unmodelled: list = []  # their entries, in call order
        self._by_key: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.phase = "setup"
        self.alloc_phase: list[str] = []
        self._closed = False

    def close(self) -> None:
        """Stop recording: storages of the traced copy that die after the step are not events."""
        self._closed = True

    def register(self, tensor: torch.Tensor, category: str | None) -> int | None:
        """Start tracking ``tensor``'s storage (if new); return its handle."""
        if not isinstance(tensor, torch.Tensor):
            return None
        st = tensor.untyped_storage()
        key = st._cdata
        nbytes = st.nbytes()
        handle = self._by_key.get(key)
        trace = self.trace
        if handle is None:
            handle = len(trace.sizes)
            trace.sizes.append(nbytes)
            trace.category.append(category or "")
            self.alloc_phase.append(self.phase)
            self._by_key[key] = handle
            trace.events.append((handle, nbytes))
            self._refs[handle] = weakref.ref(st, lambda _r, h=handle, k=key: self._free(h, k))
        elif nbytes != trace.sizes[handle]:  # storage resized in place (resize_, out= ops)
            trace.events.append((handle, -trace.sizes[handle]))
            trace.events.append((handle, nbytes))
            trace.sizes[handle] = nbytes
        if category and not trace.category[handle]:
            trace.category[handle] = category
        return handle

    def _free(self, handle: int, key: int) -> None:
        if self._closed:
            return
        if self._by_key.get(key) == handle:
            del self._by_key[key]
        self._refs.pop(handle, None)
        self.trace.events.append((handle, -self.trace.sizes[handle]))

    def handle_of(self, tensor: torch.Tensor) -> int | None:
        return self._by_key.get(tensor.untyped_storage()._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return _stub_scalar(func, args)  # data-dependent Python values: see Known limitations
        if self.phase in ("forward", "backward") and not getattr(func, "is_view", False):
            self.trace.num_ops += 1  # views launch no kernel
        out = func(*args, **(kwargs or {}))
        fix = CORRECTIONS.get(func)
        if fix is not None:
            out = fix(args, out)
        target: Any = self.cpu_target
        rule = CPU_RULES.get(func) if target is not None else None
        if rule is None and self.cuda_target is not None:
            target, rule = self.cuda_target, CUDA_OP_RULES.get(func)
        if rule is not None:
            replay = Replay(make=self._kernel_buffer, publish=self._register_leaves, out=out)
            rule(target, args, out, replay)
            replay.close()
        if self.unmodelled_target is not None:
            finder = UNMODELLED_OPS.get(func)
            if finder is not None:
                self.unmodelled.extend(finder(self.unmodelled_target, func, args, kwargs or {}, out))
        self._register_leaves(out)
        return out

    def _register_leaves(self, out: Any) -> None:
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.register(leaf, None)

    def _kernel_buffer(self, nbytes: int) -> torch.Tensor:
        """A fake byte buffer standing for memory a kernel allocates inside one call (registered;
        freed when the replay drops it)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.register(buffer, None)
        return buffer


def _fake_like(t: torch.Tensor, mode, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    with mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device=device)
    return out


def _cast_dtype(t: torch.Tensor, param_dtype: torch.dtype | None) -> torch.dtype | None:
    return param_dtype if (param_dtype is not None and t.is_floating_point()) else None


def _kept_modules(model: nn.Module, dropped: set[int]) -> Iterator[nn.Module]:
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in dropped:
            continue
        yield m
        stack.extend(m.children())


def _fake_model(
    model: nn.Module, mode, param_dtype, device, keep_blocks: int | None = None
) -> tuple[nn.Module, dict[int, torch.Tensor], list[nn.Module]]:
    """Deep-copy ``model`` with every parameter and buffer replaced by a fake tensor.

    With ``keep_blocks``, repeated blocks past the first ``keep_blocks`` are neither copied nor
    faked, and the copy's block container holds only the kept ones.

    Returns:
        The copy, a map from fake parameter id to the user's parameter, and the copy's blocks.
    """
    from memguard.estimator._blocks import find_container, find_blocks

    memo: dict[int, Any] = {}
    originals: dict[int, torch.Tensor] = {}
    dropped: list[str] = []
    if keep_blocks is not None:
        container = find_container(model)
        if container is not None:
            placeholder = nn.Module()
            for name, block in list(container._modules.items())[keep_blocks:]:
                memo[id(block)] = placeholder
                dropped.append(name)
    kept = list(_kept_modules(model, set(memo)))
    for module in kept:
        for p in module.parameters(recurse=False):
            if id(p) in memo:
                continue
            fake = _fake_like(p, mode, _cast_dtype(p, param_dtype), device)
            memo[id(p)] = nn.Parameter(fake, requires_grad=p.requires_grad)
            originals[id(memo[id(p)])] = p
        for b in module.buffers(recurse=False):
            if id(b) not in memo:
                memo[id(b)] = _fake_like(b, mode, _cast_dtype(b, param_dtype), device)  # as module.to(dtype)
    try:
        clone = copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - any deepcopy failure is the same user-facing problem
        raise ConfigError(
            f"memguard could not copy the model to trace it ({type(exc).__name__}: {exc}); build "
            "the model on the meta device (with torch.device('meta'): model = ...) and pass that"
        ) from exc
    if dropped:
        container = _find_container_like(clone, dropped)
        for name in dropped:
            del container._modules[name]
        blocks = list(container.children())
    else:
        blocks = find_blocks(clone)
    return clone, originals, blocks


def _find_container_like(clone: nn.Module, dropped: list[str]) -> nn.Module:
    for m in clone.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and all(n in m._modules for n in dropped):
            if all(type(m._modules[n]) is nn.Module for n in dropped):
                return m
    raise RuntimeError("memguard lost track of the block container while truncating")


def _fake_batch(batch: Any, mode, dtype, device) -> Any:
    """``batch`` with every tensor leaf replaced by a fake one (any ``Mapping``, tuple or list kept)."""

    def convert(x: torch.Tensor) -> torch.Tensor:
        target = dtype if (dtype is not None and x.is_floating_point()) else x.dtype
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=target, device=device)

    return map_tensors(batch, convert)


def _rebuild(cls, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """``cls(groups, **defaults)`` with only the defaults its constructor accepts (an AdamW's
    defaults hold ``decoupled_weight_decay``, which only Adam's constructor takes)."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return cls(groups, **defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls(groups, **defaults)
    return cls(groups, **{k: v for k, v in defaults.items() if k in params})


def make_optimizer(optimizer, params: list[nn.Parameter], originals, foreach: bool | None):
    """A new optimizer of the user's kind over the fake parameters.

    ``foreach=True`` (the CUDA target traced on CPU fakes) resolves every group left at
    ``foreach=None`` as torch.optim resolves it for CUDA tensors
    (:func:`memguard.estimator._cuda_rules.cuda_group_foreach`); False/None leave the CPU's choice."""
    from memguard.estimator._cuda_rules import cuda_group_foreach

    if optimizer is None:
        kwargs = {"foreach": foreach} if foreach is not None else {}
        return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-3, **kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        fake_of = {id(originals[id(fake)]): fake for fake in params if id(fake) in originals}
        groups = []
        for group in optimizer.param_groups:
            new = {k: v for k, v in group.items() if k != "params"}
            new["params"] = [fake_of[id(p)] for p in group["params"] if id(p) in fake_of]
            if foreach is not None and new.get("foreach", "absent") is None:
                # the CUDA target (foreach=True): the path torch.optim takes on CUDA for this group
                new["foreach"] = cuda_group_foreach(type(optimizer), group) if foreach else foreach
            groups.append(new)
        try:
            return _rebuild(type(optimizer), groups, optimizer.defaults)
        except TypeError as exc:
            raise ConfigError(
                f"memguard could not rebuild {type(optimizer).__name__} from its defaults ({exc}); pass "
                "optimizer=lambda params: YourOptimizer(params, ...) instead of an instance"
            ) from exc
    if callable(optimizer):
        opt = optimizer([p for p in params])
        if foreach:  # the CUDA target: a group left at foreach=None takes the path CUDA would
            for g in getattr(opt, "param_groups", []):
                if g.get("foreach", "absent") is None:
                    g["foreach"] = cuda_group_foreach(type(opt), g, [originals.get(id(p), p) for p in g["params"]])
        return opt
    raise ConfigError(
        f"optimizer must be a torch.optim.Optimizer, a callable(params) -> Optimizer, or None; got "
        f"{type(optimizer).__name__}"
    )


def _tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(obj)
    return (x for x in leaves if isinstance(x, torch.Tensor))


def _optimizer_state_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in opt.state.values():
        yield from _tensor_leaves(state)


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


#: Per-parameter optimizer state after one step, by (optimizer class, group hyperparameters,
#: shape, stride, dtype): every torch.optim optimizer builds each parameter's state from that
#: parameter alone, so repeated traces (the planner's probes) need not step again.
_STATE_TEMPLATES: dict[tuple, dict[str, Any]] = {}
_MAX_TEMPLATES = 4096


def _template_key(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> tuple:
    hyper = tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
    return (type(opt), hyper, tuple(p.shape), tuple(p.stride()), p.dtype)


def _warm_up(opt: torch.optim.Optimizer, trainable: list[torch.Tensor], mode) -> None:
    """Create the optimizer's lazily built state, as after a first step.

    Fast path: state templates remembered from earlier traces; else step a twin optimizer over
    meta-device twins of the parameters (meta kernels cost a fraction of fake-tensor dispatch;
    the optimizer step of a large model dominated the trace otherwise). Either way the real
    optimizer gets fake tensors of the same shapes and dtypes. Falls back to one step on fake
    zero gradients when the twin cannot be built or stepped.
    """
    wanted = {id(p) for p in trainable}
    keys = {id(p): _template_key(opt, g, p) for g in opt.param_groups for p in g["params"] if id(p) in wanted}
    try:
        if not all(k in _STATE_TEMPLATES for k in keys.values()):
            _learn_templates(opt, trainable, keys)
        by_id = {id(p): p for p in trainable}
        with mode:
            for pid, key in keys.items():
                template = _STATE_TEMPLATES[key]
                if template:
                    opt.state[by_id[pid]] = {
                        k: (torch.empty_strided(v[0], v[1], dtype=v[2], device=by_id[pid].device if v[3] else "cpu")
                            if isinstance(v, tuple) else v)
                        for k, v in template.items()
                    }
        return
    except Exception:  # noqa: BLE001 - any failure of the fast path: take the exact slow one
        opt.state.clear()
    with mode, ScalarStub():
        for p in trainable:
            p.grad = torch.zeros_like(p)
        with uncached(mode):
            opt.step()
        opt.zero_grad(set_to_none=True)


def _learn_templates(opt: torch.optim.Optimizer, trainable: list[torch.Tensor], keys: dict[int, tuple]) -> None:
    """Step a twin optimizer on meta tensors and remember each parameter's state layout."""
    twins = {
        id(p): torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta").requires_grad_()
        for p in trainable
    }
    groups = []
    for group in opt.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [twins[id(p)] for p in group["params"] if id(p) in twins]
        for flag in ("foreach", "fused"):  # the per-tensor path runs on meta; state is the same
            if flag in g:
                g[flag] = False if flag == "foreach" else None
        groups.append(g)
    twin_opt = _rebuild(type(opt), groups, opt.defaults)
    for t in twins.values():
        t.grad = torch.zeros_like(t)
    with ScalarStub():
        twin_opt.step()
    if len(_STATE_TEMPLATES) > _MAX_TEMPLATES:
        _STATE_TEMPLATES.clear()
    for pid, twin in twins.items():
        state = twin_opt.state.get(twin, {})
        _STATE_TEMPLATES[keys[pid]] = {
            k: ((tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type == "meta") if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()
        }


class _DropMetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "failed while attempting to run meta" not in str(record.msg)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Silence torch's fake-tensor traceback for a failing op: memguard reports the failure itself
    as a ConfigError (or, for the planner's cut-down probes, falls back to the whole model)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    flt = _DropMetaFailures()
    logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@contextlib.contextmanager
def uncached(mode) -> Iterator[None]:
    """Switch off the fake-tensor op cache: hashing the long tensor lists of foreach optimizer
    ops costs far more than the cache saves (measured: the optimizer step of a 291-tensor model
    spent most of its time building cache keys)."""
    old = mode.cache_enabled
    mode.cache_enabled = False
    try:
        yield
    finally:
        mode.cache_enabled = old


def _engine_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` straight into the autograd engine, so that a TorchFunctionMode stays
    active for code that runs inside backward (checkpoint recomputation); ``Tensor.backward``
    would hand the call to the mode, which is switched off while it handles a call."""
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def load_rules() -> None:
    """Register every CUDA rule in :data:`~memguard.estimator._cuda_kernels.RULES` (importing the rule
    modules registers them; repeated calls are free). A trace for the CUDA target on CPU fakes calls
    it before it turns the :class:`~memguard.estimator._cuda_kernels.CudaKernelModel` on."""
    from memguard.estimator import _cuda_attention as cuda_attention, _cuda_rules as cuda_rules  # noqa: F401 - imported for registration
    from memguard.estimator import _unmodelled as unmodelled  # noqa: F401 - registers its finders


def trace_step(
    model: nn.Module,
    batch: Any,
    spec: TraceSpec | None = None,
    *,
    optimizer=None,
    loss_fn: LossFn | None = None,
    **fields: Any,
) -> Trace:
    """Trace one steady-state training step of ``model`` on ``batch``; see the module docstring.

    With ``spec.train=False`` the step is an evaluation step instead: the copy is put in
    ``eval()`` mode (dropout off, as ``model.eval()`` does), ``loss_fn(model, batch)`` (any
    result; None calls the model) runs once under ``torch.no_grad()`` (``inference_mode``
    allocates the same tensors: it only also skips version counters and view tracking), and its
    result is kept until the step ends, as a loop that hands the logits to a metric does. The
    step starts with the parameters, buffers and batch, plus the optimizer state with
    ``optimizer_state`` and every gradient with ``grads_present`` (an evaluation inside a
    training run whose ``zero_grad`` keeps gradients); with ``keep_outputs`` the previous step's
    result is live until this forward returns (``out = model(**batch)`` rebinding ``out``).

    Args:
        model: the user's model (never moved, mutated or allocated).
        batch: one micro-batch (see :mod:`memguard.batch`).
        spec: how to trace (default: ``TraceSpec()``, fp32 on the CPU).
        optimizer: an optimizer instance, a callable ``params -> Optimizer``, or None (AdamW).
        loss_fn: ``loss_fn(model, batch) -> scalar``, or None for the model's own loss.
        **fields: :class:`TraceSpec` fields that override ``spec``'s (a shorthand for
            ``dataclasses.replace(spec, ...)``).

    Raises:
        ConfigError: the model cannot be copied, called with the batch, or gives no usable loss.
    """
    spec = dataclasses.replace(spec or TraceSpec(), **fields) if fields else (spec or TraceSpec())
    gc_was_enabled = gc.isenabled()
    gc.disable()  # frees happen at deterministic points (reference counting only)
    try:
        with quiet_fake_tensor_log():
            return StepTracer(model, batch, optimizer, loss_fn, spec).run()
    finally:
        if gc_was_enabled:
            gc.enable()


class StepTracer:
    """One traced step, in the order a training loop runs it; the base that strategies extend.

    :meth:`run` calls :meth:`setup` (the fake copy, batch and optimizer, outside the recorder),
    :meth:`start_state` (the state a micro-batch after the first starts from), then, under
    :meth:`recording`, :meth:`register` (the state that exists before the step), :meth:`forward`,
    :meth:`backward`, :meth:`optimizer_step` (or, with ``spec.train=False``, :meth:`eval_forward`),
    :meth:`categorise` and :meth:`carry_outputs` (for ``keep_outputs``).

    Extension points, for a strategy that runs its own code in the traced step (FSDP2's
    :class:`~memguard.estimator._fsdp2_trace.FSDP2Tracer`, as PyTorch's ``FSDPMemTracker``
    subclasses ``MemTracker``):

    * :meth:`make_recorder`: the :class:`Recorder` (or a subclass) the step is recorded with;
    * :meth:`prepare_model`: change the fake copy before the optimizer is built (shard it);
    * :meth:`traced_root`: the module the step calls (a wrapper around the copy, as FSDP1's);
    * :meth:`build_optimizer`: the optimizer over the fake parameters, its lazy state created;
    * :meth:`start_state`: the gradients a micro-batch after the first starts with;
    * :meth:`recording`: the context the step is recorded under (the recorder, plus any hooks);
    * :meth:`register`: the state that exists when the step starts.

    Subclasses may use the module's helpers :func:`make_optimizer`, :class:`ScalarStub`,
    :func:`uncached` and :func:`quiet_fake_tensor_log`.

    Args:
        model, batch, optimizer, loss_fn, spec: as for :func:`trace_step`.
    """

    def __init__(self, model: nn.Module, batch: Any, optimizer: Any, loss_fn: LossFn | None, spec: TraceSpec) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.model, self.batch, self.optimizer, self.loss_fn, self.spec = model, batch, optimizer, loss_fn, spec
        self.device = torch.device(spec.device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.trace = Trace()
        self.recorder = self.make_recorder()
        self.emulation = None
        self.kernel_model = None
        self.finder = None  # the CUDA target on fake CUDA tensors: collects the unmodelled kernels only
        self.flops = [contextlib.nullcontext(), contextlib.nullcontext()]  # forward, backward
        self.output: Any = None  # the model's output, kept alive with keep_outputs
        self.output_at = -1  # the event index at which the output was returned

    def make_recorder(self) -> Recorder:
        """The recorder of this step (called once, by ``__init__``, after ``self.trace`` exists)."""
        return Recorder(self.trace, self.spec.cpu_target, self.spec.cuda_target)

    def run(self) -> Trace:
        """Trace one step: training (forward, backward, optimizer step) or, with ``spec.train=False``,
        evaluation (one ``no_grad`` forward whose output is kept; see :func:`trace_step`)."""
        with _preserved_rng(), self._own_positions():
            self.setup()
            with self.mode:
                if self.spec.grads_present:
                    self.start_state()
            with self.mode, self.recording():
                self.register()
                if self.spec.train:
                    loss = self.forward()
                    self.backward(loss)
                    self.optimizer_step()
                    del loss  # a training loop keeps its loss until the step ends
                else:
                    self.output = self.eval_forward()  # what the loop keeps, whatever the model returned
                self.categorise()
                self.carry_outputs()
            self.recorder.close()
        collector = self.kernel_model if self.kernel_model is not None else self.finder
        if collector is not None:
            self.trace.unmodelled = list(collector.unmodelled)
        return self.trace

    def _own_positions(self) -> contextlib.AbstractContextManager:
        """transformers' packed-sequence check answered as on real tensors where the model makes its own
        positions: the model called with the batch itself, which holds no ``position_ids``
        (:func:`~memguard.estimator._fake_corrections.unpacked_positions`)."""
        batch = self.batch
        own = isinstance(batch, torch.Tensor) or (isinstance(batch, Mapping) and "position_ids" not in batch)
        return unpacked_positions() if self.loss_fn is None and own else contextlib.nullcontext()

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the fake copy (:meth:`prepare_model` may change it), the fake batch, the optimizer
        (:meth:`build_optimizer`) and the modes forward and backward run under."""
        from memguard.estimator._blocks import apply_activation_checkpointing

        spec, trace = self.spec, self.trace
        fmodel, originals, blocks = _fake_model(self.model, self.mode, spec.param_dtype, self.device, spec.keep_blocks)
        fmodel.train(spec.train)
        if spec.checkpoint_blocks and spec.train:  # no_grad saves nothing: checkpointing changes nothing in eval
            apply_activation_checkpointing(fmodel, spec.checkpoint_blocks, blocks)  # also drops the KV cache
        trace.num_blocks = len(blocks)
        params = list(fmodel.parameters())
        trainable = [p for p in params if p.requires_grad]
        trace.num_params = sum(p.numel() for p in params)
        trace.num_trainable_params = sum(p.numel() for p in trainable)
        trace.trainable_param_bytes = sum(p.numel() * p.element_size() for p in trainable)
        trace.param_dtypes = built_dtypes(self.model.parameters())  # before the precision's cast
        # DeepSpeed's largest layer (estimate_zero3_model_states_mem_needs_all_live): the most
        # parameters any single module holds itself
        trace.largest_layer_params = max(
            (sum(p.numel() for p in m.parameters(recurse=False)) for m in fmodel.modules()), default=0
        )
        source = dict(self.model.named_buffers())  # a kept block's buffers keep their names in the copy
        trace.buffer_source_bytes = sum(b.numel() * (source[n] if n in source else b).element_size()
                                        for n, b in fmodel.named_buffers())
        originals = self.prepare_model(fmodel, originals, blocks)
        fmodel = self.traced_root(fmodel)
        self.fmodel = fmodel
        self.params = list(fmodel.parameters())
        self.trainable = [p for p in self.params if p.requires_grad]
        self.fbatch = _fake_batch(self.batch, self.mode, spec.param_dtype, self.device)
        self.opt = None
        if spec.train or spec.optimizer_state:
            self.opt = self.build_optimizer(originals)
        if spec.count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            # one counter per pass: entering a FlopCounterMode again resets its counts
            self.flops = [FlopCounterMode(display=False), FlopCounterMode(display=False)]
        if spec.autocast_dtype and spec.cuda_autocast:
            from memguard.estimator._autocast import CudaAutocastEmulation

            self.emulation = CudaAutocastEmulation(spec.autocast_dtype)
        if spec.cuda_target is not None:
            from memguard.estimator._cuda_kernels import CudaKernelModel

            load_rules()
            self.kernel_model = CudaKernelModel(spec.cuda_target)
        elif self.device.type == "cuda":
            from memguard.estimator._unmodelled import UnmodelledFinder

            self.finder = UnmodelledFinder()
            self.recorder.unmodelled_target = self.finder.target  # fake CUDA tensors: the ATen-level finders too
        collector = self.kernel_model if self.kernel_model is not None else self.finder
        if collector is not None:  # one list, in call order, for the function- and the ATen-level finders
            collector.unmodelled = self.recorder.unmodelled

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """Change the fake copy in place before the optimizer is built (the base changes nothing).

        Args:
            fmodel: the fake copy, in train or eval mode, its blocks already checkpointed.
            originals: the user's parameter of each fake one, by ``id`` of the fake one (an
                optimizer instance's groups are rebuilt from them).
            blocks: the copy's repeated blocks (:func:`~memguard.estimator._blocks.find_blocks`).

        Returns:
            ``originals`` for the parameters ``fmodel`` holds now.
        """
        return originals

    def traced_root(self, fmodel: nn.Module) -> nn.Module:
        """The module the step calls, after :meth:`prepare_model`: ``fmodel`` itself, or a wrapper a
        strategy put around it (FSDP1's ``FullyShardedDataParallel``)."""
        return fmodel

    def build_optimizer(self, originals: dict[int, Any]) -> torch.optim.Optimizer:
        """The user's optimizer over ``self.params`` (see :func:`make_optimizer`), its lazily built
        state created as after a first step (the warm-up runs outside the fake mode: its fast path
        runs on meta)."""
        opt = make_optimizer(self.optimizer, self.params, originals, self.spec.foreach)
        _warm_up(opt, self.trainable, self.mode)
        return opt

    def start_state(self) -> None:
        """With ``spec.grads_present`` (gradient accumulation): give every trainable parameter the
        gradient a micro-batch after the first starts with (called under the fake mode)."""
        for p in self.trainable:
            p.grad = torch.zeros_like(p)

    def recording(self) -> contextlib.AbstractContextManager:
        """The context the step is recorded under: the recorder (entered inside the fake mode)."""
        return self.recorder

    # ------------------------------------------------------------------------------ register
    def register(self) -> None:
        """Record the state that exists when the step starts: parameters and buffers, optimizer
        state, gradients (under accumulation) and the batch."""
        rec = self.recorder
        param_handles = {rec.register(p, Category.PARAMS) for p in self.params}
        for b in self.fmodel.buffers():
            handle = rec.register(b, Category.PARAMS)
            if handle is not None and handle not in param_handles and handle not in self.trace.buffer_handles:
                self.trace.buffer_handles.append(handle)
        if self.opt is not None:
            for t in _optimizer_state_tensors(self.opt):
                rec.register(t, Category.OPTIMIZER)
        for p in self.trainable:
            if p.grad is not None:
                rec.register(p.grad, Category.GRADS)
        for t in tensor_leaves(self.fbatch):
            rec.register(t, Category.INPUTS)

    # ------------------------------------------------------------------------------ forward
    def _modes(self) -> contextlib.ExitStack:
        """The CUDA kernel model, then (inside it) autocast: real CUDA autocast casts a call's
        inputs before the kernel runs, so the innermost mode, which sees a call first, must be the
        autocast emulation, and its inner call must reach the kernel model."""
        stack = contextlib.ExitStack()
        try:
            if self.kernel_model is not None:
                stack.enter_context(self.kernel_model)
            elif self.finder is not None:
                stack.enter_context(self.finder)
            if self.emulation is not None:
                stack.enter_context(self.emulation)
            elif self.spec.autocast_dtype:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.spec.autocast_dtype))
        except BaseException:
            # enter_context enters at once: a mode that cannot start (CUDA autocast on a CPU-only
            # torch) must not leave the ones entered before it on the caller's mode stack
            stack.close()
            raise
        return stack

    def _keep_output(self, module: nn.Module, args: Any, output: Any) -> None:
        self.output = output
        self.output_at = len(self.trace.events)

    def forward(self) -> torch.Tensor:
        trace, spec = self.trace, self.spec
        trace.phase_starts["forward"] = len(trace.events)
        self.recorder.phase = "forward"
        hook = self.fmodel.register_forward_hook(self._keep_output) if spec.keep_outputs else None
        modes = self._modes()  # outside the try: a mode that cannot start is not the user's call failing
        try:
            with modes, self.flops[0]:
                loss = compute_loss(self.fmodel, self.fbatch, self.loss_fn)
                if self.emulation is not None:
                    self.emulation.clear_cache()  # autocast empties its cast cache on exit
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - report any failure of the user's call
            how = "loss_fn(model, batch)" if self.loss_fn else (
                "the model with the batch (mapping -> model(**batch), tuple/list -> model(*batch), "
                "tensor -> model(batch))")
            raise ConfigError(
                f"calling {how} failed while tracing: {type(exc).__name__}: {exc}. Check that the "
                "batch is what the model takes, or pass loss_fn=lambda model, batch: <scalar loss>"
            ) from exc
        finally:
            if hook is not None:
                hook.remove()
        if not loss.requires_grad:
            raise ConfigError(
                "the loss does not require grad: the model has no trainable parameters that "
                "the loss depends on; unfreeze some parameters or check loss_fn"
            )
        if spec.keep_outputs and self.output_at < 0:
            raise ConfigError(
                "keep_outputs=True but loss_fn never called the model itself (the output is captured "
                "by a forward hook on the model passed in); call model(...) in loss_fn or drop keep_outputs"
            )
        if spec.loss_scale:
            loss = loss * 65536.0  # GradScaler's default init_scale (torch.amp.GradScaler)
        return loss

    def eval_forward(self) -> Any:
        """The evaluation forward: ``loss_fn(model, batch)`` or the model's call, under ``no_grad``."""
        from memguard.batch import call_model

        trace = self.trace
        trace.phase_starts["forward"] = len(trace.events)
        self.recorder.phase = "forward"
        modes = self._modes()
        try:
            with modes, torch.no_grad(), self.flops[0]:
                result = self.loss_fn(self.fmodel, self.fbatch) if self.loss_fn else call_model(self.fmodel, self.fbatch)
                if self.emulation is not None:
                    self.emulation.clear_cache()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - report any failure of the user's call
            how = "fn(model, batch)" if self.loss_fn else (
                "the model with the batch (mapping -> model(**batch), tuple/list -> model(*batch), "
                "tensor -> model(batch))")
            raise ConfigError(
                f"calling {how} failed while tracing an evaluation step: {type(exc).__name__}: {exc}. "
                "Check that the batch is what the model takes, or pass fn=lambda model, batch: <outputs>"
            ) from exc
        if self.spec.count_flops:
            trace.flops = int(self.flops[0].get_total_flops())
        self.output_at = len(trace.events)
        return result

    # ------------------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor) -> None:
        trace, rec = self.trace, self.recorder
        trace.phase_starts["backward"] = len(trace.events)
        rec.phase = "backward"
        with self.flops[1]:
            if self.emulation is not None or self.kernel_model is not None:
                if self.emulation is not None:
                    self.emulation.caching = False
                with self._modes():  # checkpointed blocks recompute under the same modes
                    _engine_backward(loss)
            else:
                loss.backward()
        if self.spec.count_flops:
            trace.flops = int(self.flops[0].get_total_flops() + self.flops[1].get_total_flops())
        for p in self.trainable:
            h = rec.handle_of(p.grad) if p.grad is not None else None
            if h is not None:
                trace.category[h] = Category.GRADS

    # ------------------------------------------------------------------------------ optimizer
    def optimizer_step(self) -> None:
        trace, rec = self.trace, self.recorder
        trace.phase_starts["optimizer"] = len(trace.events)
        rec.phase = "optimizer"
        from memguard.estimator._cuda_rules import cuda_optimizer_step_mode  # the target torch's optimizer

        with uncached(self.mode), cuda_optimizer_step_mode(self.opt, self.spec.cuda_target):
            self.opt.step()
        for t in _optimizer_state_tensors(self.opt):
            h = rec.handle_of(t)
            if h is not None and not trace.category[h]:
                trace.category[h] = Category.OPTIMIZER
        trace.phase_starts["zero_grad"] = len(trace.events)
        rec.phase = "zero_grad"
        self.opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------ categorise
    def categorise(self) -> None:
        """Storages no earlier step named: forward's are activations, the optimizer step's are
        its temporaries, the rest (backward, zero_grad) temporaries."""
        trace, alloc_phase = self.trace, self.recorder.alloc_phase
        for h, cat in enumerate(trace.category):
            if not cat:
                phase = alloc_phase[h]
                trace.category[h] = (
                    Category.ACTIVATIONS if phase == "forward"
                    else OPTIMIZER_TEMPORARIES if phase == "optimizer" else Category.TEMPORARIES
                )

    # ------------------------------------------------------------------------------ outputs
    def carry_outputs(self) -> None:
        """With ``keep_outputs``: the storages that only the model's output keeps alive at the end
        of the step (found by dropping it and watching what is freed) are still live when the next
        step starts, and are freed only when ``out = model(...)`` rebinds the name, right after the
        next forward returns. In the steady state this step therefore starts with a copy of them
        (added just before the forward) that is freed where this step's output is returned."""
        if not self.spec.keep_outputs:
            return
        trace = self.trace
        before = len(trace.events)
        self.output = None  # the next step's rebinding of `out`
        carried = [(h, -n) for h, n in trace.events[before:] if n < 0]
        if not carried:
            return
        start, at = trace.phase_starts["forward"], self.output_at
        first = len(trace.sizes)
        allocs, frees = [], []
        for i, (h, n) in enumerate(carried):
            trace.sizes.append(n)
            trace.category.append(trace.category[h])
            allocs.append((first + i, n))
            frees.append((first + i, -n))
        trace.events[at:at] = frees
        trace.events[start:start] = allocs
        for name, index in list(trace.phase_starts.items()):
            if index >= start:
                trace.phase_starts[name] = (
                    index + len(allocs) + (len(frees) if index >= at and name != "forward" else 0)
                )
