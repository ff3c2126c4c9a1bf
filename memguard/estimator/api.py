"""``memguard.estimate``: the peak memory of one training step, without a GPU.

:func:`estimate` checks the arguments and resolves the target (:mod:`memguard.estimator._targets`),
traces one step on fake tensors (:mod:`memguard.estimator._tracing`) and prices the trace on the
target (:mod:`memguard.estimator._pricing`); ``train=False`` hands over to
:mod:`memguard.estimator._eval_step`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from memguard.batch import first_dim
from memguard.errors import ConfigError
from memguard.estimator._eval_step import EvalOptions, estimate_eval
from memguard.estimator._pricing import estimate_from_trace
from memguard.estimator._result import Estimate
from memguard.estimator._targets import (
    Target,
    check_common,
    check_strategy,
    resolve_strategy,
    target_cpu,
    target_gpu,
    traced_precision,
    unwrap_model,
)
from memguard.estimator._tracing import TraceRequest, fsdp1_layout, fsdp2_layout, run_trace
from memguard.vocab import ALL_BLOCKS, Device, Precision

__all__ = ["estimate"]


def estimate(
    model: nn.Module,
    batch: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    device: Device = "cuda",
    precision: Precision = "32-true",
    zero_stage: int = 0,
    world_size: int = 1,
    gpu: str | None = None,
    activation_checkpointing: int | bool = 0,
    grad_accum_steps: int = 1,
    offload_optimizer: bool = False,
    keep_outputs: bool = False,
    train: bool = True,
    strategy: str | None = None,
    cpu: str | None = None,
    torch_version: str | None = None,
    cuda_version: str | None = None,
    cudnn_version: str | int | None = None,
    layout: Any = None,
    deepspeed_config: Any = None,
    gradient_compression: str | None = None,
    powersgd: Any = None,
    fsdp1_options: Any = None,
) -> Estimate:
    """Predict the peak memory of one steady-state training step (or, with ``train=False``, evaluation step).

    The step is forward, loss, backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``,
    traced on fake tensors: the model is never moved, mutated or really allocated, and the global
    RNG state is left as it was. Build large models on the ``meta`` device.

    Args:
        model: the model, on any device (``meta`` included). A DDP wrapper is unwrapped.
        batch: one example micro-batch: a tensor, or any nesting of mappings (``dict``, HF's
            ``BatchEncoding``), tuples and lists of tensors, batch dim 0 (see :mod:`memguard.batch`).
        optimizer: an optimizer instance (its class and hyperparameters are reused), a callable
            ``params -> Optimizer``, or None for ``torch.optim.AdamW``.
        loss_fn: ``loss_fn(model, batch) -> scalar``; None calls the model with the batch and uses
            ``output.loss`` or a scalar output.
        device: the target, ``"cuda"`` or ``"cpu"``.
        precision: Lightning's names: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``.
        zero_stage: the sharding level 0-3. Under DeepSpeed (``strategy=None`` or ``"deepspeed"``) the
            ZeRO stage: model states per rank follow DeepSpeed's estimators. Under ``"fsdp2"``:
            3 = ``reshard_after_forward=True``, 2 = ``False``, 1 = ``False`` with gradient sync only
            on the last micro-batch.
        world_size: data-parallel ranks (DDP gradient buckets are added when > 1 without ZeRO).
        gpu: a catalog name (see ``memguard.estimator.gpus``) for the CUDA target's constants;
            None uses the current device if there is one, else generic constants.
        activation_checkpointing: checkpoint this many of the model's repeated blocks (True: all).
        grad_accum_steps: > 1 means gradients are already allocated when a micro-batch starts.
        offload_optimizer: ZeRO-Offload: optimizer state lives in host memory. Under ``"fsdp2"``:
            ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer state on the host).
        keep_outputs: model a hand-written loop ``out = model(**batch); out.loss.backward();
            opt.step()`` whose output object stays alive through backward, the optimizer step and
            the next step's forward (on a GPT-2-style language model the logits add about a sixth
            to the peak). False models ``memguard.step``, Lightning and the HF ``Trainer``, which
            drop the output once they have the loss. The output is whatever the model (the module
            passed in) returns, captured with a forward hook, so any ``loss_fn`` works.
        train: True (default) estimates a training step. False estimates an evaluation step: the
            model in ``eval()`` mode, one forward under ``no_grad`` whose outputs are kept (the logits
            a metric needs), no backward or optimizer step; ``loss_fn`` is then
            ``fn(model, batch) -> outputs``, an ``optimizer`` means its state is resident during
            evaluation (validation inside a training run; None: parameters only), and gradients are
            not resident (``zero_grad(set_to_none=True)``). See :mod:`memguard.estimator._eval_step`.
        strategy: None (today's meaning: DDP, or DeepSpeed when ``zero_stage >= 1``), ``"ddp"``,
            ``"deepspeed"`` or ``"fsdp2"``. ``"fsdp2"`` traces rank 0 of a real FSDP2 step
            (``fully_shard`` on each repeated block, then the root) over a fake process group of
            ``world_size`` ranks (:mod:`memguard.estimator._fsdp2`); there ``*-mixed`` precisions mean
            ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` with no autocast
            (said in ``Estimate.notes``). ``"fsdp1"`` traces rank 0 of a real FSDP1 step
            (``FullyShardedDataParallel``, each repeated block its own unit; what Lightning's
            ``FSDPStrategy`` and Accelerate's/the Trainer's FSDP plugin v1 run) the same way
            (:mod:`memguard.estimator._fsdp1`): ``zero_stage`` 3 = ``FULL_SHARD``, 2 = ``SHARD_GRAD_OP``,
            0 = ``NO_SHARD``; 16-bit precisions mean ``MixedPrecision`` with param, reduce and buffer
            dtype 16-bit (as Lightning and Accelerate set it), no autocast.
        cpu: for ``device="cpu"``, the CPU whose kernel paths are modelled: None or ``"host"``
            (this process's CPU at the instruction-set level its oneDNN runs, ``ONEDNN_MAX_CPU_ISA``
            included), or a level such as ``"avx2"``, ``"avx512_core"``, ``"avx512_core_bf16"``,
            ``"avx512_core_fp16"``, ``"avx512_core_amx"`` (see :mod:`memguard.estimator._cpu_kernels`:
            16-bit matmuls and convolutions take oneDNN, with its reorders and scratchpads, only
            where the CPU supports the type).
        torch_version: for ``device="cuda"``, the torch release of the training machine, e.g.
            ``"2.5.1"`` (2.0 to 2.13 are modelled): the kernel rules, workspaces and allocator options
            that changed between releases follow it. None = the installed torch.
        cuda_version: the CUDA toolkit of that torch build, e.g. ``"12.4"`` (``torch.version.cuda``;
            11.7 to 13.2). None = the one of that release's default PyPI wheel.
        cudnn_version: its cuDNN, ``"9.10.2"`` or ``torch.backends.cudnn.version()``'s ``91002``
            (8.5 to 9.x); decides whether SDPA prefers cuDNN attention. None = the default wheel's.
        layout: a :class:`memguard.Layout` (data-parallel replicas and shards, tensor and pipeline
            parallel degrees), or None. ``batch`` is then one data-parallel replica's micro-batch;
            ``world_size`` is the layout's; ``dp_shard`` is FSDP2 (``zero_stage`` its level, 3 by
            default), ``dp_replicate`` DDP, ``tp`` a real ``parallelize_module`` step traced over a
            fake process group (see :mod:`memguard.estimator._layout`); ``rank_peak_bytes`` holds
            each rank's peak.
        deepspeed_config: a DeepSpeed config (dict or JSON path) the run uses: its ZeRO stage, precision,
            batch triple, offload and buckets set the estimate ("auto" filled as the HF integration fills
            it; a keyword that contradicts it is a ConfigError; :mod:`memguard.estimator._deepspeed_config`).
        gradient_compression: None, or ``"powersgd"``: DDP with torch's ``powerSGD_hook``
            (``world_size > 1``, ``zero_stage=0``, no FSDP2). Adds the hook's per-bucket memory: the
            error-feedback buffers and warm-start P/Q matrices (persistent: ``breakdown["powersgd_state"]``) and the hook's
            clone, uncompressed all-reduce buffer and new error buffer while it runs (``temporaries``);
            the steady state after ``start_powerSGD_iter`` (see :mod:`memguard.estimator._powersgd`).
        powersgd: the hook's options: a dict of ``PowerSGDState``'s keywords (see
            :class:`memguard.estimator._powersgd.PowerSGDOptions`; ``bucket_cap_mb`` too), or an
            int (``matrix_approximation_rank``); None = ``PowerSGDState``'s defaults (rank 1).

        fsdp1_options: under ``strategy="fsdp1"``, FSDP1's own options as a dict: ``use_orig_params``
            (default True, as Lightning's ``FSDPStrategy`` sets it), ``limit_all_gathers`` (True),
            ``backward_prefetch`` (``"BACKWARD_PRE"``), ``forward_prefetch`` (False), and
            ``mixed_precision`` (a ``torch.distributed.fsdp.MixedPrecision`` or a dict of its
            ``param_dtype``/``reduce_dtype``/``buffer_dtype``) or those dtypes as keys of their own.

    Returns:
        An :class:`~memguard.Estimate`.

    Raises:
        ConfigError: invalid arguments (all listed at once), or a model/batch/loss that cannot be
            traced (the message says which call failed and how to pass ``loss_fn``); under
            ``"fsdp2"`` also a model FSDP2 cannot shard, or a default process group that exists
            already (plan before ``init_process_group``); an invalid ``layout``, one that conflicts
            with ``world_size``/``zero_stage``/``strategy``, or one the model's sizes do not divide.

    Known limitations:
        On a machine without a GPU the CUDA target is traced on CPU fake tensors: autocast
        follows CUDA's op lists through memguard's emulation, functions with a rule in the CUDA
        kernel model (:mod:`memguard.estimator._cuda_kernels`) allocate what CUDA's kernels
        allocate for the target GPU, other functions allocate what the CPU's kernels allocate,
        and kernel-internal workspaces other than cuBLAS's are not counted. The CUDA estimate
        reads ``PYTORCH_CUDA_ALLOC_CONF`` and ``CUBLAS_WORKSPACE_CONFIG`` from the environment
        (see ``Estimate.notes``).
    """
    if layout is not None and deepspeed_config is not None:
        raise ConfigError("layout= and deepspeed_config= cannot be combined: a layout is estimated with FSDP2 and "
                          "tensor/pipeline parallelism, a DeepSpeed config with ZeRO; drop one of them")
    if layout is not None and (gradient_compression is not None or powersgd is not None):
        raise ConfigError("gradient_compression= is not modelled under a layout=: PowerSGD is estimated for plain "
                          "DDP (world_size=N, zero_stage=0); drop layout= or gradient_compression=")
    if layout is not None and (strategy == "fsdp1" or fsdp1_options is not None):
        raise ConfigError("strategy='fsdp1' cannot be combined with layout=: a layout's data-parallel shards are FSDP2; "
                          "drop layout= (FSDP1 over world_size ranks) or use strategy='fsdp2'")
    if layout is not None:
        from memguard.estimator._layout import estimate_layout

        return estimate_layout(model, batch, layout, dict(
            optimizer=optimizer, loss_fn=loss_fn, device=device, precision=precision, zero_stage=zero_stage,
            world_size=world_size, gpu=gpu, activation_checkpointing=activation_checkpointing,
            grad_accum_steps=grad_accum_steps, offload_optimizer=offload_optimizer, keep_outputs=keep_outputs,
            train=train, strategy=strategy, cpu=cpu, torch_version=torch_version, cuda_version=cuda_version,
            cudnn_version=cudnn_version))
    zero_config = zero_precision = None
    if deepspeed_config is not None:
        from memguard.estimator._deepspeed_config import read_deepspeed_config

        ds = read_deepspeed_config(deepspeed_config, model=model, batch_size=first_dim(batch), zero_stage=zero_stage,
                                   precision=precision, world_size=world_size, grad_accum_steps=grad_accum_steps,
                                   offload_optimizer=offload_optimizer, strategy=strategy, device=device)
        zero_stage, precision, world_size, grad_accum_steps, offload_optimizer, zero_config = (
            ds.zero_stage, ds.precision, ds.world_size, ds.grad_accum_steps, ds.offload_optimizer, ds.config)
        zero_precision = ds.zero_precision
    if train is False:
        if gradient_compression is not None or powersgd is not None:
            raise ConfigError("gradient_compression= is not modelled for an evaluation step (train=False): an "
                              "evaluation has no gradient all-reduce; drop gradient_compression= and powersgd=")
        if strategy not in (None, "ddp"):
            raise ConfigError(f"strategy={strategy!r} is not modelled for an evaluation step (train=False): "
                              "evaluation is estimated unsharded; drop strategy=")

        options = EvalOptions(
            device=device, precision=precision, world_size=world_size, gpu=gpu, cpu=cpu,
            optimizer_state=optimizer is not None, keep_outputs=keep_outputs, zero_stage=zero_stage,
            activation_checkpointing=activation_checkpointing, grad_accum_steps=grad_accum_steps,
            offload_optimizer=offload_optimizer, torch_version=torch_version, cuda_version=cuda_version,
            cudnn_version=cudnn_version,
        )
        return estimate_eval(model, batch, options, fn=loss_fn, optimizer=optimizer)
    problems: list[str] = []
    if train is not True:
        problems.append(f"train={train!r} must be True (a training step) or False (an evaluation step)")
    check_common(precision=precision, zero_stage=zero_stage, world_size=world_size, device=device, problems=problems)
    if not isinstance(model, nn.Module):
        problems.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = unwrap_model(model)
    micro = first_dim(batch)
    if micro is None:
        problems.append(
            "batch must be a tensor or a mapping/tuple/list holding at least one tensor with a batch "
            f"dimension, got {type(batch).__name__}"
        )
    if not isinstance(keep_outputs, bool):
        problems.append(f"keep_outputs={keep_outputs!r} must be True or False")
    if isinstance(model, nn.Module) and not any(p.requires_grad for p in model.parameters()):
        problems.append("the model has no trainable parameters (every parameter has requires_grad=False)")
    if not (isinstance(grad_accum_steps, int) and grad_accum_steps >= 1):
        problems.append(f"grad_accum_steps={grad_accum_steps!r} must be an integer >= 1")
    check_strategy(strategy=strategy, zero_stage=zero_stage, offload_optimizer=offload_optimizer, problems=problems)
    from memguard.estimator._powersgd import check_ddp, resolve_options

    try:
        compression = resolve_options(gradient_compression, powersgd)
    except ConfigError as e:
        compression = None
        problems.extend(e.problems)
    check_ddp(gradient_compression if compression is None else compression, world_size=world_size,
              zero_stage=zero_stage, strategy=strategy, problems=problems)
    if fsdp1_options is not None and strategy != "fsdp1":
        problems.append("fsdp1_options= is read under strategy='fsdp1' only: pass strategy='fsdp1' or drop it")
    from memguard.estimator._fsdp1 import check_options

    check_options(fsdp1_options, problems)
    spec = target_gpu(device, gpu, problems, torch_version=torch_version, cuda_version=cuda_version,
                      cudnn_version=cudnn_version)
    cpu_target = target_cpu(device, cpu, problems)
    if problems:
        raise ConfigError(problems)

    blocks = activation_checkpointing
    if blocks is True:
        blocks = ALL_BLOCKS
    strategy = resolve_strategy(strategy, zero_stage)
    request = TraceRequest(
        device=device, precision=(precision if zero_precision is not None and zero_precision.autocast  # torch_autocast
                                  else traced_precision(precision, zero_stage, strategy)),
        checkpoint_blocks=int(blocks or 0), grads_present=grad_accum_steps > 1, keep_outputs=keep_outputs,
        gpu=spec, cpu=cpu_target,
        fsdp2=fsdp2_layout(strategy, precision, zero_stage, world_size, offload_optimizer, device),
        fsdp1=fsdp1_layout(strategy, precision, zero_stage, world_size, device, fsdp1_options),
    )
    trace = run_trace(model, batch, request, optimizer=optimizer, loss_fn=loss_fn)
    if compression is not None:
        from memguard.estimator._powersgd import add_powersgd, grad_dtype_of, note, powersgd_buckets

        compressed_buckets = powersgd_buckets(model, compression, grad_dtype_of(precision))
        trace = add_powersgd(trace, compressed_buckets, compression)
    from memguard.estimator._blocks import find_blocks

    checkpointed = min(int(blocks or 0), len(find_blocks(model)))
    target = Target(device=device, precision=precision, zero_stage=zero_stage, world_size=world_size, gpu=spec,
                    strategy=strategy, offload_optimizer=offload_optimizer)
    est, _ = estimate_from_trace(trace, target, micro_batch_size=int(micro or 0), checkpointed=checkpointed,
                                 zero_config=zero_config, zero_precision=zero_precision)
    if zero_precision is not None and zero_precision.notes:
        est = dataclasses.replace(est, notes=(*est.notes, *zero_precision.notes))
    if compression is not None:
        est = dataclasses.replace(est, notes=(*est.notes, note(compression, compressed_buckets)))
    if request.fsdp1 is not None:
        from memguard.estimator._fsdp1 import notes_of

        est = dataclasses.replace(est, notes=(*est.notes, *notes_of(request.fsdp1, unwrap_model(model))))
    return est
