"""Trace one training step on fake tensors and record every storage allocation and free.

How it works: the model is deep-copied with every parameter and buffer replaced by a fake
tensor of the same shape and dtype (``FakeTensorMode``: shapes and dtypes are real, memory is
not), so the user's model is never moved, mutated or really allocated. A fresh optimizer of the
user's class runs one warm-up step on zero gradients to create its lazily built state. Then one
real step (forward, loss, backward, optimizer step, ``zero_grad(set_to_none=True)``) runs under a
``TorchDispatchMode`` that sees every ATen op's outputs below autograd; each new storage is an
allocation, and a weak reference on it records the free when the last tensor using it dies.
The result is an exact, ordered list of allocations and frees of tensor storages, which the
analysis (``memguard.estimator.analysis``) turns into a peak and a breakdown.

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
import gc
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memguard.errors import ConfigError
from memguard.estimator.kernels import CORRECTIONS

__all__ = ["Trace", "trace_step", "default_loss", "PHASES", "OPTIMIZER_TEMPORARIES"]

PHASES = ("setup", "forward", "backward", "optimizer", "zero_grad")

#: Temporaries of the optimizer step get their own category while scanning, because sharding
#: shrinks them with the optimizer state (each ZeRO rank updates only its partition); reports fold
#: them into "temporaries".
OPTIMIZER_TEMPORARIES = "optimizer_temporaries"


@dataclass
class Trace:
    """What one traced step allocated, in order.

    Attributes:
        events: ``(handle, signed_bytes)`` in time order: ``+n`` allocates storage ``handle`` of
            ``n`` bytes, ``-n`` frees it.
        sizes: bytes of each handle (its last size).
        category: the category of each handle (see ``memguard.estimator.result.CATEGORIES``).
        phase_starts: index into ``events`` where each phase of :data:`PHASES` begins.
        num_params, num_trainable_params: parameter counts (tied weights once).
        largest_layer_params: the most parameters any single module holds itself, DeepSpeed's
            "largest layer" (ZeRO-3 gathers one at a time).
        trainable_param_bytes: bytes of the trainable parameters.
        num_blocks: repeated blocks in the traced model (after any truncation).
        num_ops: non-view ATen ops run by forward and backward (the cost model's host-side term).
        flops: FLOPs of forward and backward, when counted (``count_flops=True``).
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


class _ScalarStub(TorchDispatchMode):
    """Answers ``aten._local_scalar_dense`` (``.item()``) with :func:`_stub_scalar`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return _stub_scalar(func, args)
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records the birth (first sight as an op output) and death (weakref) of storages."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace
        self._by_key: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.phase = "setup"
        self.alloc_phase: list[str] = []

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
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.register(leaf, None)
        return out


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call ``model`` with ``batch`` (dict -> ``**batch``, tuple/list -> ``*batch``, else the
    batch itself) and return ``output.loss`` if present, else the output if it is a scalar.

    Raises:
        ConfigError: the output has no loss and is not a scalar.
    """
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if loss is None:
        raise ConfigError(
            f"the model returned {type(out).__name__}, which has no .loss and is not a scalar; "
            "pass loss_fn=lambda model, batch: <scalar loss> (for example "
            "lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))"
        )
    return loss


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
    from memguard.estimator.blocks import _find_container, find_blocks

    memo: dict[int, Any] = {}
    originals: dict[int, torch.Tensor] = {}
    dropped: list[str] = []
    if keep_blocks is not None:
        container = _find_container(model)
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
    def convert(x):
        if isinstance(x, torch.Tensor):
            target = dtype if (dtype is not None and x.is_floating_point()) else x.dtype
            with mode:
                return torch.empty_strided(x.shape, x.stride(), dtype=target, device=device)
        return x

    return tree_map(convert, batch)


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


def _make_optimizer(optimizer, params: list[nn.Parameter], originals, foreach: bool | None):
    """A new optimizer of the user's kind over the fake parameters."""
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
                new["foreach"] = foreach
            groups.append(new)
        try:
            return _rebuild(type(optimizer), groups, optimizer.defaults)
        except TypeError as exc:
            raise ConfigError(
                f"memguard could not rebuild {type(optimizer).__name__} from its defaults ({exc}); pass "
                "optimizer=lambda params: YourOptimizer(params, ...) instead of an instance"
            ) from exc
    if callable(optimizer):
        return optimizer([p for p in params])
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
    with mode, _ScalarStub():
        for p in trainable:
            p.grad = torch.zeros_like(p)
        with _uncached(mode):
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
    with _ScalarStub():
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
def _quiet_fake_tensor_log() -> Iterator[None]:
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
def _uncached(mode) -> Iterator[None]:
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


def trace_step(
    model: nn.Module,
    batch: Any,
    *,
    optimizer=None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    param_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_scale: bool = False,
    foreach: bool | None = None,
    checkpoint_blocks: int = 0,
    grads_present: bool = False,
    cuda_autocast: bool = False,
    keep_blocks: int | None = None,
    count_flops: bool = False,
    device: str = "cpu",
) -> Trace:
    """Trace one steady-state training step of ``model`` on ``batch``; see the module docstring.

    Args:
        param_dtype: cast floating parameters and inputs to this dtype (``*-true`` precisions).
        autocast_dtype: run forward and loss under ``torch.autocast("cpu", autocast_dtype)``.
        loss_scale: multiply the loss by a scale before backward (GradScaler's extra op).
        foreach: force the optimizer's ``foreach`` flag where the user left it at None.
        checkpoint_blocks: wrap this many repeated blocks in activation checkpointing.
        grads_present: start the step with every gradient already allocated (a micro-batch
            after the first under gradient accumulation).
        cuda_autocast: apply CUDA's autocast op lists (emulated) instead of the CPU's.
        keep_blocks: trace a shortened model that keeps only this many of its repeated blocks
            (the planner's cheap probes; memory is affine in the number of identical blocks).
        count_flops: count forward and backward FLOPs with ``torch.utils.flop_counter``.
        device: the fake tensors' device: ``"cpu"``, or ``"cuda"`` where a GPU is present (then
            CUDA's own autocast and kernel choices apply, and nothing is allocated on it).

    Raises:
        ConfigError: the model cannot be copied, called with the batch, or gives no usable loss.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # frees happen at deterministic points (reference counting only)
    try:
        with _quiet_fake_tensor_log():
            return _trace_step(model, batch, optimizer, loss_fn, param_dtype, autocast_dtype, loss_scale, foreach,
                               checkpoint_blocks, grads_present, cuda_autocast, keep_blocks, count_flops, device)
    finally:
        if gc_was_enabled:
            gc.enable()


def _trace_step(model, batch, optimizer, loss_fn, param_dtype, autocast_dtype, loss_scale, foreach,
                checkpoint_blocks, grads_present, cuda_autocast, keep_blocks, count_flops, device_type) -> Trace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memguard.estimator.blocks import apply_activation_checkpointing

    device = torch.device(device_type)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    trace = Trace()
    with _preserved_rng():
        fmodel, originals, blocks = _fake_model(model, mode, param_dtype, device, keep_blocks)
        fmodel.train()
        if checkpoint_blocks:
            apply_activation_checkpointing(fmodel, checkpoint_blocks, blocks)
        trace.num_blocks = len(blocks)
        params = list(fmodel.parameters())
        trainable = [p for p in params if p.requires_grad]
        trace.num_params = sum(p.numel() for p in params)
        trace.num_trainable_params = sum(p.numel() for p in trainable)
        trace.trainable_param_bytes = sum(p.numel() * p.element_size() for p in trainable)
        # DeepSpeed's largest layer (estimate_zero3_model_states_mem_needs_all_live): the most
        # parameters any single module holds itself
        trace.largest_layer_params = max(
            (sum(p.numel() for p in m.parameters(recurse=False)) for m in fmodel.modules()), default=0
        )
        fbatch = _fake_batch(batch, mode, param_dtype, device)
        opt = _make_optimizer(optimizer, params, originals, foreach)
        call = loss_fn or default_loss
        _warm_up(opt, trainable, mode)  # outside the fake mode: its fast path runs on meta

        with mode:
            if grads_present:
                for p in trainable:
                    p.grad = torch.zeros_like(p)

            recorder = _Recorder(trace)
            flop_counter = backward_flops = contextlib.nullcontext()
            if count_flops:
                from torch.utils.flop_counter import FlopCounterMode

                # one counter per pass: entering a FlopCounterMode again resets its counts
                flop_counter = FlopCounterMode(display=False)
                backward_flops = FlopCounterMode(display=False)
            with recorder:
                for p in params:
                    recorder.register(p, "params")
                for b in fmodel.buffers():
                    recorder.register(b, "params")
                for t in _optimizer_state_tensors(opt):
                    recorder.register(t, "optimizer")
                for p in trainable:
                    if p.grad is not None:
                        recorder.register(p.grad, "grads")
                for t in _tensor_leaves(fbatch):
                    recorder.register(t, "inputs")
                trace.phase_starts["forward"] = len(trace.events)
                recorder.phase = "forward"
                emulation = None
                if autocast_dtype and cuda_autocast:
                    from memguard.estimator.autocast import CudaAutocastEmulation

                    emulation = CudaAutocastEmulation(autocast_dtype)
                    ctx = emulation
                elif autocast_dtype:
                    ctx = torch.autocast(device.type, dtype=autocast_dtype)
                else:
                    ctx = contextlib.nullcontext()
                try:
                    with flop_counter, ctx:
                        loss = call(fmodel, fbatch)
                        if emulation is not None:
                            emulation.clear_cache()  # autocast empties its cast cache on exit
                except ConfigError:
                    raise
                except Exception as exc:  # noqa: BLE001 - report any failure of the user's call
                    how = "loss_fn(model, batch)" if loss_fn else "the model with the batch (dict -> model(**batch), tuple -> model(*batch), tensor -> model(batch))"
                    raise ConfigError(
                        f"calling {how} failed while tracing: {type(exc).__name__}: {exc}. Check that the "
                        "batch is what the model takes, or pass loss_fn=lambda model, batch: <scalar loss>"
                    ) from exc
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise ConfigError(
                        f"the loss must be a scalar tensor, got {shape}; make loss_fn return the mean "
                        "loss over the micro-batch (e.g. loss.mean())"
                    )
                if not loss.requires_grad:
                    raise ConfigError(
                        "the loss does not require grad: the model has no trainable parameters that "
                        "the loss depends on; unfreeze some parameters or check loss_fn"
                    )
                if loss_scale:
                    loss = loss * 65536.0  # GradScaler's default init_scale (torch.amp.GradScaler)
                trace.phase_starts["backward"] = len(trace.events)
                recorder.phase = "backward"
                with backward_flops:
                    if emulation is not None:
                        emulation.caching = False
                        with emulation:  # checkpointed blocks recompute under the same policy
                            _engine_backward(loss)
                    else:
                        loss.backward()
                if count_flops:
                    trace.flops = int(flop_counter.get_total_flops() + backward_flops.get_total_flops())
                grad_handles = {recorder.handle_of(p.grad) for p in trainable if p.grad is not None}
                for h in grad_handles:
                    if h is not None:
                        trace.category[h] = "grads"
                trace.phase_starts["optimizer"] = len(trace.events)
                recorder.phase = "optimizer"
                with _uncached(mode):
                    opt.step()
                for t in _optimizer_state_tensors(opt):
                    h = recorder.handle_of(t)
                    if h is not None and not trace.category[h]:
                        trace.category[h] = "optimizer"
                trace.phase_starts["zero_grad"] = len(trace.events)
                recorder.phase = "zero_grad"
                opt.zero_grad(set_to_none=True)
                del loss  # a training loop keeps its loss until the next step replaces it
                for h, cat in enumerate(trace.category):
                    if not cat:
                        phase = recorder.alloc_phase[h]
                        trace.category[h] = (
                            "activations" if phase == "forward"
                            else OPTIMIZER_TEMPORARIES if phase == "optimizer" else "temporaries"
                        )
    return trace
