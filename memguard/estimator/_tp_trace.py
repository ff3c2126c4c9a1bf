"""Tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``), traced for real.

As :mod:`memguard.estimator._fsdp2_trace` runs FSDP2 itself, this runs PyTorch's tensor parallelism
itself on the fake copy: ``parallelize_module(copy, tp_mesh, plan)`` over a fake process group
(:func:`~memguard.estimator._layout.fake_mesh`), then, with ``dp_shard > 1``, ``fully_shard`` of each
repeated block and the root over the data-parallel dimension of the same 2-D mesh
(:func:`~memguard.estimator._fsdp2.shard_model`; torchtitan's ``parallelize_llama`` applies TP, then
FSDP2, in the same order). The trace then holds rank 0's own allocations:

* the parameters the plan shards, as ``DTensor`` s whose local shards are ``1/tp`` of them
  (``ColwiseParallel._partition_linear_fn``: ``Shard(0)`` of the weight, i.e. output features;
  ``RowwiseParallel``: ``Shard(1)``, input features; ``torch/distributed/tensor/parallel/style.py``),
  their gradients and the optimizer's state, built by the real optimizer on the DTensors; the
  parameters it does not shard (embeddings, norms, the head under transformers' plans) whole;
* the activations as the sharded modules make them: a colwise Linear's local output holds
  ``1/tp`` of the features (so attention runs on ``heads/tp`` heads), a rowwise Linear's partial
  output is all-reduced (``_c10d_functional.all_reduce``: a new output tensor) before the
  residual add; under ``SequenceParallel`` the norms run on ``1/tp`` of the sequence and the
  collectives become all-gathers and reduce-scatters, whatever the plan says;
* backward's collectives (the colwise input's gradient all-reduced, the sequence-parallel
  all-gathers' reduce-scatters) with their output buffers.

The recorder is FSDP2's :class:`~memguard.estimator._fsdp2_trace.ShardedRecorder` (DTensors
unwrapped to their local shards, storage resizes recorded), so FSDP2 x TP traces both at once.

Known limitations:
    A module whose ``forward`` reshapes a colwise output with its configured head count (rather
    than ``-1``, as transformers' attention does) fails under tensor parallelism for real too; the
    trace reports it as a ConfigError from the call. Rank 0 is traced: the plan's shards are
    checked to divide evenly (:func:`~memguard.estimator._layout.check_model_fits`), so every
    tensor-parallel rank holds the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Iterator

import torch
from torch import nn

from memguard.errors import ConfigError
from memguard.estimator._fsdp2 import FSDP2Layout, shard_model
from memguard.estimator._fsdp2_trace import FSDP2Tracer
from memguard.estimator._trace import Trace, TraceSpec, quiet_fake_tensor_log


def trace_tp_step(model: nn.Module, batch: Any, spec: TraceSpec, *, tp: int, plan: dict[str, Any] | None,
                  fsdp: FSDP2Layout | None, replicate: int = 1, optimizer=None, loss_fn=None) -> Trace:
    """Trace one steady-state step of rank 0 of a tensor-parallel (optionally FSDP2 x TP) job.

    Args:
        model, batch, optimizer, loss_fn: as for :func:`memguard.estimator._trace.trace_step`.
        spec: the :class:`~memguard.estimator._trace.TraceSpec` (under FSDP2 without autocast: its
            policy casts).
        tp: the tensor-parallel degree.
        plan: ``parallelize_module``'s plan (styles made: :func:`~memguard.estimator._layout.resolve_tp_plan`),
            or None (``tp == 1``: HSDP only).
        fsdp: the FSDP2 sharding over ``fsdp.world_size`` data-parallel ranks, or None (TP only).
        replicate: data-parallel replicas (HSDP: ``fully_shard`` over the ``(dp_replicate, dp_shard)`` mesh).

    Returns:
        A :class:`~memguard.estimator._trace.Trace` of one rank's allocations.

    Raises:
        ConfigError: the model, batch or loss cannot be traced, or the plan cannot be applied.
    """
    from memguard.estimator._layout import fake_mesh

    dp = fsdp.world_size if fsdp is not None else 1
    layout = fsdp if fsdp is not None else FSDP2Layout(world_size=1, zero_stage=3,
                                                       backend="gloo" if spec.cpu_target is not None else "nccl")
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with quiet_fake_tensor_log(), fake_mesh((replicate, dp, tp), ("dp_replicate", "dp_shard", "tp")) as mesh:
            return TPTracer(model, batch, optimizer, loss_fn, spec, layout, mesh, plan=plan,
                            fsdp=fsdp is not None).run()
    finally:
        if gc_was_enabled:
            gc.enable()


class TPTracer(FSDP2Tracer):
    """:class:`~memguard.estimator._fsdp2_trace.FSDP2Tracer` whose copy is first parallelized with
    ``parallelize_module`` over the mesh's ``"tp"`` dimension, then (``fsdp=True``) sharded with
    ``fully_shard`` over its ``"dp_shard"`` dimension (with ``"dp_replicate"`` as well when that is
    larger than 1: HSDP).

    Args:
        model, batch, optimizer, loss_fn, spec, layout: as for the FSDP2 tracer (``layout`` is the
            FSDP2 sharding; without ``fsdp`` only its backend is read).
        mesh: the 3-D ``DeviceMesh`` ``("dp_replicate", "dp_shard", "tp")`` of the fake process group.
        plan: ``parallelize_module``'s plan, or None (no tensor parallelism).
        fsdp: shard with FSDP2 after tensor parallelism.
    """

    def __init__(self, model, batch, optimizer, loss_fn, spec, layout, mesh, *, plan, fsdp: bool) -> None:
        self.plan, self.fsdp = plan, fsdp
        super().__init__(model, batch, optimizer, loss_fn, spec, layout, mesh)

    def start_state(self) -> None:
        if self.fsdp:
            super().start_state()
        else:  # plain gradients (DTensors where the plan sharded the parameter)
            for p in self.trainable:
                p.grad = torch.zeros_like(p)

    def prepare_model(self, fmodel: nn.Module, originals: dict[int, Any], blocks: list[nn.Module]) -> dict[int, Any]:
        """Parallelize the copy (then shard it under FSDP2); return the user's parameter of each new one.

        Raises:
            ConfigError: ``parallelize_module`` or ``fully_shard`` refuses the model.
        """
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.mesh  # sub-meshes made outside the fake mode (their rank tensors stay real)
        dp_mesh = mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]
        tp_mesh = mesh["tp"]
        with self.mode:
            try:
                if self.plan is not None:
                    parallelize_module(fmodel, tp_mesh, self.plan)
            except Exception as exc:  # noqa: BLE001 - a plan torch refuses is the user's problem
                raise ConfigError(f"parallelize_module could not apply the tensor-parallel plan: "
                                  f"{type(exc).__name__}: {exc}; pass Layout(tp_plan=...) naming nn.Linear "
                                  "(colwise/rowwise) or nn.Embedding modules") from exc
            if self.fsdp:
                try:
                    with _real_mesh_bookkeeping():
                        shard_model(self.fsdp_root(fmodel), dataclasses.replace(self.layout, offload=False), dp_mesh,
                                    blocks)
                except Exception as exc:  # noqa: BLE001 - FSDP2 refusing the model is the user's problem
                    raise ConfigError(f"FSDP2 (fully_shard) could not shard the tensor-parallel model: "
                                      f"{type(exc).__name__}: {exc}") from exc
        by_name = dict(self.model.named_parameters())
        return {id(p): by_name[name] for name, p in fmodel.named_parameters() if name in by_name}

    def fsdp_root(self, fmodel: nn.Module) -> nn.Module:
        """The module FSDP2 shards as its root (after each block): the copy itself."""
        return fmodel

    def build_optimizer(self, originals: dict[int, Any]) -> torch.optim.Optimizer:
        """The FSDP2 tracer's optimizer (its state made by one step on the DTensors): see :meth:`optimizer_step`."""
        with _mixed_foreach_refused():
            return super().build_optimizer(originals)

    def optimizer_step(self) -> None:
        """The base's step; a foreach step over a mix of DTensors and whole parameters is refused.

        Raises:
            ConfigError: the optimizer's step fails on the tensor-parallel parameters. torch.optim
                takes the foreach path on CUDA by default (``optim/optimizer.py``,
                ``_default_to_fused_or_foreach``: DTensor counts as supported), and a foreach kernel
                refuses a list mixing DTensors with plain tensors (``DTensor`` dispatch: "got mixed
                torch.Tensor and DTensor"), which a plan that leaves some parameters whole makes.
        """
        with _mixed_foreach_refused():
            super().optimizer_step()


@contextlib.contextmanager
def _mixed_foreach_refused() -> Iterator[None]:
    """Turn a foreach optimizer step over DTensors mixed with plain tensors into a ConfigError
    (see :meth:`TPTracer.optimizer_step`)."""
    try:
        yield
    except RuntimeError as exc:
        if "mixed torch.Tensor and DTensor" not in str(exc):
            raise
        raise ConfigError(
            "the optimizer's step fails on this tensor-parallel model: its foreach kernels get the "
            "plan's DTensor parameters mixed with the parameters left whole (embeddings, norms, head), as "
            "torch.optim's default foreach path on CUDA would for real; pass optimizer=lambda params: "
            "torch.optim.AdamW(params, foreach=False), or a plan that makes every parameter a DTensor, or add "
            "Layout(dp_shard=N) (FSDP2 makes every parameter a DTensor)"
        ) from exc


@contextlib.contextmanager
def _real_mesh_bookkeeping() -> Iterator[None]:
    """Run ``DeviceMesh._concatenate`` outside the fake mode: FSDP2 over a tensor-parallel parameter
    joins the data-parallel and tensor-parallel meshes (``_fsdp_param.py``, ``_init_sharding_spec_tp``),
    and the new mesh finds this rank's coordinates with ``nonzero`` on its rank tensor
    (``device_mesh.py``, ``_compute_coordinates_from_mesh``), a real tensor of rank numbers that the
    fake mode would turn into a fake one whose ``nonzero`` has no size."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original
