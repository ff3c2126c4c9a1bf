"""The peak memory of an evaluation step: ``memguard.estimate(..., train=False)``.

An evaluation step runs the model forward once under ``torch.no_grad()`` (or
``torch.inference_mode()``, which allocates the same tensors) and keeps what it returned, the
logits a metric needs, until the step ends. Nothing is saved for a backward, so each layer's
activations die as soon as the next layer has consumed them: the peak is the resident state, the
batch, the widest layer's live activations and temporaries, and the outputs (for a language model
the logits, ``batch x seq x vocab``, are often the largest of these).

What is resident depends on where the evaluation runs, so it is an argument:

* ``optimizer_state=False`` (default): parameters and buffers only, an evaluation script or an
  evaluation after training with the optimizer gone;
* ``optimizer_state=True``: the optimizer's state stays allocated, as in a validation loop inside a
  training run (Adam's moments live from the first step to the end of training);
* ``grads_present=True``: the gradients are allocated too. After
  ``optimizer.zero_grad(set_to_none=True)``, the default of ``torch.optim`` since 2.0, of
  ``memguard.step``, Lightning and the HF ``Trainer``, they are not, so this is off by default.

The trace is :func:`memguard.estimator._trace.trace_step` with ``TraceSpec(train=False)``, and the
trace is turned into an :class:`~memguard.Estimate` by the same device model as a training step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from memguard.batch import first_dim
from memguard.errors import ConfigError
from memguard.estimator._pricing import estimate_from_trace
from memguard.estimator._result import Estimate
from memguard.estimator._targets import Target, check_common, target_cpu, target_gpu, unwrap_model
from memguard.estimator._trace import trace_step
from memguard.estimator._tracing import TraceRequest, trace_spec
from memguard.vocab import Device, Precision

#: The note every evaluation estimate carries, so that a printed estimate says what it measured.
EVAL_NOTE = "evaluation step: one forward under no_grad, outputs kept; no backward, no optimizer step"


def _eval_problems(*, zero_stage: Any, optimizer_state: Any, grads_present: Any, keep_outputs: Any,
                   activation_checkpointing: Any, grad_accum_steps: Any, offload_optimizer: Any,
                   optimizer: Any) -> list[str]:
    out = []
    if zero_stage not in (0, None):
        out.append(f"zero_stage={zero_stage!r}: evaluation estimates model data-parallel ranks without ZeRO "
                   "(zero_stage=0); estimate the training step for ZeRO, or drop zero_stage")
    for name, value in (("optimizer_state", optimizer_state), ("grads_present", grads_present),
                        ("keep_outputs", keep_outputs), ("offload_optimizer", offload_optimizer)):
        if not isinstance(value, bool):
            out.append(f"{name}={value!r} must be True or False")
    if activation_checkpointing not in (0, False):
        out.append("activation_checkpointing changes nothing under no_grad (nothing is saved for a backward); "
                   "drop it for train=False")
    if grad_accum_steps != 1:
        out.append(f"grad_accum_steps={grad_accum_steps!r} has no meaning for an evaluation step; to count "
                   "gradients left allocated during evaluation pass grads_present=True")
    if optimizer is not None and optimizer_state is False:
        out.append("optimizer= is only used with optimizer_state=True (its state resident during evaluation); "
                   "pass optimizer_state=True or drop optimizer")
    return out


def eval_trace(model: nn.Module, batch: Any, request: TraceRequest, *,
               fn: Callable[[nn.Module, Any], Any] | None = None, optimizer: Any = None,
               optimizer_state: bool = False):
    """Trace one evaluation step (arguments already validated); see :func:`estimate_eval`.

    Args:
        model, batch, fn, optimizer, optimizer_state: as for :func:`estimate_eval`.
        request: the device, precision, kernel models, ``grads_present``, ``keep_outputs`` and
            ``count_flops`` (a :class:`~memguard.estimator._tracing.TraceRequest` without
            checkpointing, cut-down blocks or FSDP2: an evaluation step has no backward).

    Returns:
        A :class:`~memguard.estimator._trace.Trace` whose only phase is ``"forward"``.

    Raises:
        ConfigError: the model or ``fn`` cannot be called with the batch.
    """
    spec = dataclasses.replace(trace_spec(request), train=False, optimizer_state=optimizer_state)
    # Fake CUDA tensors cannot run backward without a GPU, but an evaluation step has none; the CPU
    # fakes with CUDA's autocast and kernels emulated are used everywhere for one code path.
    return trace_step(model, batch, spec, optimizer=optimizer, loss_fn=fn)


@dataclass(frozen=True)
class EvalOptions:
    """Where an evaluation step runs and what stays resident during it (:func:`estimate_eval`).

    Attributes:
        device, precision, world_size, gpu, cpu: the target, as for :func:`memguard.estimate`.
        torch_version, cuda_version, cudnn_version: the CUDA target's stack, as for :func:`memguard.estimate`.
            ``*-mixed`` runs the forward under autocast; ``*-true`` casts the weights.
        optimizer_state: the optimizer's state is allocated during evaluation (validation inside
            a training run). Default False: parameters and buffers only.
        grads_present: the gradients are allocated during evaluation (a loop whose ``zero_grad``
            does not set them to None). Default False.
        keep_outputs: the previous step's outputs are still live during this forward, as in
            ``for b in loader: out = model(**b)`` where ``out`` is rebound only when the forward
            returns. False: the loop drops them first (``metric.update(out); del out``, or
            Lightning's and the HF ``Trainer``'s evaluation loops, which hand them on).
        zero_stage, activation_checkpointing, grad_accum_steps, offload_optimizer: accepted so
            that :func:`memguard.estimate` can pass its arguments through; only their defaults
            are valid for an evaluation step (see :func:`estimate_eval`'s Raises).
    """

    device: Device = "cuda"
    precision: Precision = "32-true"
    world_size: int = 1
    gpu: str | None = None
    cpu: Any = None
    torch_version: str | None = None
    cuda_version: str | None = None
    cudnn_version: Any = None
    optimizer_state: bool = False
    grads_present: bool = False
    keep_outputs: bool = False
    zero_stage: int = 0
    activation_checkpointing: int | bool = 0
    grad_accum_steps: int = 1
    offload_optimizer: bool = False


def estimate_eval(
    model: nn.Module,
    batch: Any,
    options: EvalOptions = EvalOptions(),
    *,
    fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: Any = None,
) -> Estimate:
    """Predict the peak memory of one evaluation step (``memguard.estimate(..., train=False)``).

    Args:
        model: the model, on any device (``meta`` included); never moved, mutated or allocated.
        batch: one evaluation micro-batch (see :mod:`memguard.batch`).
        options: the target and what is resident (:class:`EvalOptions`).
        fn: ``fn(model, batch) -> outputs`` run under ``no_grad``; everything it returns is kept
            until the step ends. None calls the model with the batch and keeps its whole output
            (a transformers ``ModelOutput`` with its loss and logits).
        optimizer: with ``options.optimizer_state``, the optimizer whose state is resident (an
            instance or ``params -> Optimizer``; None means AdamW).

    Returns:
        An :class:`~memguard.Estimate` whose ``peak_phase`` is ``"forward"``, whose ``grads`` and
        ``optimizer`` entries are 0 unless asked for, and whose ``notes`` begin with
        :data:`EVAL_NOTE`.

    Raises:
        ConfigError: invalid arguments (all listed at once), ZeRO (``zero_stage >= 1``),
            checkpointing, accumulation or offload asked for an evaluation step, or a model/``fn``
            that cannot be traced.

    Known limitations:
        On the CUDA target the device model reserves the cuBLAS workspaces of a training step
        (two handles: the forward's thread and autograd's). Inside a training run both exist
        (cuBLAS keeps a handle's workspace once made), but a standalone evaluation makes only the
        forward thread's, so there the prediction is high by one workspace (8 MiB, 32 MiB on
        Hopper) until the device model takes a handle count. Loops that accumulate outputs over many steps on the device (the HF
        ``Trainer``'s prediction loop without ``eval_accumulation_steps``) hold more than one
        step's outputs; that growth is not modelled.
    """
    o = options
    device, precision, world_size, grads_present = o.device, o.precision, o.world_size, o.grads_present
    problems: list[str] = []
    check_common(precision=precision, zero_stage=0, world_size=world_size, device=device, problems=problems)
    problems.extend(_eval_problems(zero_stage=o.zero_stage, optimizer_state=o.optimizer_state,
                                   grads_present=grads_present, keep_outputs=o.keep_outputs,
                                   activation_checkpointing=o.activation_checkpointing,
                                   grad_accum_steps=o.grad_accum_steps, offload_optimizer=o.offload_optimizer,
                                   optimizer=optimizer))
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    else:
        model = unwrap_model(model)
    micro = first_dim(batch)
    if micro is None:
        problems.append("batch must be a tensor or a mapping/tuple/list holding at least one tensor with a batch "
                        f"dimension, got {type(batch).__name__}")
    if fn is not None and not callable(fn):
        problems.append(f"fn must be a callable(model, batch) -> outputs, got {type(fn).__name__}")
    spec = target_gpu(device, o.gpu, problems, torch_version=o.torch_version, cuda_version=o.cuda_version,
                      cudnn_version=o.cudnn_version)
    cpu_target = target_cpu(device, o.cpu, problems)
    if problems:
        raise ConfigError(problems)
    request = TraceRequest(device=device, precision=precision, grads_present=grads_present,
                           keep_outputs=o.keep_outputs, gpu=spec, cpu=cpu_target)
    trace = eval_trace(model, batch, request, fn=fn, optimizer=optimizer, optimizer_state=o.optimizer_state)
    target = Target(device=device, precision=precision, world_size=world_size, gpu=spec)
    est, _ = estimate_from_trace(trace, target, micro_batch_size=int(micro or 0))
    return _with_ddp_buckets(dataclasses.replace(est, notes=(EVAL_NOTE, *est.notes)), trace, world_size, grads_present)


def _with_ddp_buckets(est: Estimate, trace: Any, world_size: int, grads_present: bool) -> Estimate:
    """Add DDP's gradient buckets, which exist for as long as the DDP wrapper does (allocated when it
    is built: torch/csrc/distributed/c10d/reducer.cpp, ``Reducer::initialize_buckets``), so they are
    resident during evaluation too. The training device model adds them from the traced gradients;
    an evaluation trace has none unless ``grads_present``, when :func:`~memguard.estimator._pricing.estimate_from_trace` already added them."""
    if world_size <= 1 or grads_present:
        return est
    from memguard.estimator._cuda import ROUND_LARGE
    from memguard.vocab import round_up

    buckets = int(trace.trainable_param_bytes)  # DDP docs: buckets as large as all gradients
    # a constant buffer is its own segment on CUDA, rounded as the device model rounds constant buffers
    added = round_up(buckets, ROUND_LARGE) if est.device == "cuda" else buckets
    breakdown = dict(est.breakdown)
    breakdown["grads"] = breakdown.get("grads", 0) + buckets
    if est.device == "cuda":
        breakdown["allocator_overhead"] = breakdown.get("allocator_overhead", 0) + added - buckets
    return dataclasses.replace(est, peak_bytes=est.peak_bytes + added, peak_upper_bytes=est.peak_upper_bytes + added,
                               breakdown=breakdown,
                               allocated_peak_bytes=est.allocated_peak_bytes + buckets,
                               model_state_bytes=est.model_state_bytes + buckets)
