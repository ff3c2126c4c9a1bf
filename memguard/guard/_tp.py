"""OOM recovery under tensor parallelism (TP, FSDP2 x TP): an agreement at every ParallelStyle boundary.

Why tensor parallelism needs agreements. Its collectives run inside forward and backward, like
FSDP2's (:mod:`memguard.guard._sharded`), so a rank that runs out of memory in a block's compute
leaves its peers waiting in the next one. A model laid out with ``parallelize_module`` (torch 2.13,
``torch/distributed/tensor/parallel/api.py``) starts them at the boundaries of the modules the plan
names, and only there as long as the styles hand plain tensors on (``use_local_output=True``, the
default of ``ColwiseParallel`` / ``RowwiseParallel``):

* **forward**: each style's ``input_fn`` (a forward pre-hook: ``DTensor.from_local`` and a
  ``redistribute`` to the desired input layout, e.g. the all-gather of a sequence-parallel input)
  and its ``output_fn`` (a forward hook: ``redistribute`` to the output layout, e.g. the all-reduce
  of a ``RowwiseParallel`` output, then ``to_local``). ``distribute_module``
  (``torch/distributed/tensor/_api.py``) installs them for ``ColwiseParallel`` / ``RowwiseParallel``
  (and sets ``_distribute_module_applied``); ``PrepareModuleInput`` / ``PrepareModuleOutput`` /
  ``SequenceParallel`` register them themselves (``parallel/style.py``). memguard finds them as the
  hooks whose function comes from ``torch.distributed.tensor``.
* **backward**: the same conversions' autograd nodes: ``_FromTorchTensor.backward`` (the gradient
  of a ``from_local`` input goes back to the input's placement: the all-reduce of a
  ``ColwiseParallel`` input gradient, ``Partial`` -> ``Replicate``) and ``Redistribute.backward``
  (``_redistribute.py``), and ``_ToTorchTensor.backward`` (``_api.py``).

The protocol is :mod:`memguard.guard._sharded`'s, with these boundaries in place of FSDP2's two
methods. While a guarded attempt runs (:meth:`ShardedRankGroup.armed`):

1. **Forward.** Each TP module gets a forward pre-hook and a forward hook registered with
   ``prepend=True`` (``torch/nn/modules/module.py``, ``register_forward_pre_hook``), which run
   before TP's own: each runs one agreement (the all-reduce MAX of ``world_size + 1`` int32 values
   of :meth:`ShardedRankGroup.agree`) and marks the rank *inside* that boundary. A pre-hook and a
   forward hook appended after TP's mark it outside again. The appended ones also find the
   backward's boundaries: the tensors TP's ``input_fn`` handed to the module and the tensors its
   ``output_fn`` returned.
2. **Backward.** On each of those tensors, memguard walks its autograd graph back through TP's
   conversion nodes (``_FromTorchTensorBackward``, ``RedistributeBackward``,
   ``_ToTorchTensorBackward``) and registers on each a pre-hook (``Node.register_prehook``) that
   runs an agreement and marks the rank inside, and a hook (``Node.register_hook``) that runs after
   the node and marks it outside. The nodes' collectives run between the two.
3. **A failure in compute** (between boundaries) is recovered as under FSDP2: the failing rank
   reports at the end of the attempt, its peers meet that report at their next agreement and leave
   forward/backward with :class:`PeerAbort`; every collective issued before was issued by every rank.
   Every rank drops the attempt's partial gradients (and, under FSDP2 x TP, resets FSDP2's per-step
   state), the retry is logged, the micro-batch halved and the same samples run again.
4. **A failure inside a boundary** (after its agreement passed: TP's ``redistribute`` could not
   allocate its output, or a conversion node's backward failed) leaves the peers inside a collective
   this rank never joins. The error then leaves forward/backward with the rank still marked inside;
   :meth:`TensorParallelRankGroup.armed` sees the mark and stops every rank as
   :meth:`ShardedRankGroup.stop` does: the failing rank records its error in the store and aborts
   the process groups, its peers' collectives fail and every rank raises the same
   :class:`memguard.OOMRecoveryError` (read from the store; a :class:`memguard.PeerFailedError` on a
   rank that reads it only after the store's host, rank 0, has exited). That is the worst case: the
   job must be restarted with a smaller micro-batch; it does not hang as long as the processes that
   raised exit. (Measured with gloo on torch 2.13: aborting a ``ProcessGroupGloo`` fails this rank's
   own pending work but leaves its connections open, so a peer blocked in a collective with it is
   released when the failing process exits, not at the abort; a rank that catches the error and goes
   on keeps its peers waiting until it exits. Under FSDP2 x TP the ranks that share no group with
   the failing rank are released in turn, as the ranks between them exit.) A boundary's mark
   covers TP's hook and any hook registered after it on the same module, e.g. FSDP2's pre-forward
   hook on a block that is also a ``PrepareModuleInput`` target: an OOM there stops every rank too,
   where it might have been recovered.

The agreements run on a gloo group of their own over every rank of the model's mesh (TP ranks,
and under FSDP2 x TP the data-parallel shards too), created with ``torch.distributed.new_group``:
a plain ``all_reduce`` on the host, never an override of the tensor-parallel ``ProcessGroup``. (An
earlier prototype that overrode the ``ProcessGroup``'s collectives in Python, registered as a c10d
backend, deadlocked now and then: the tensors handed to the Python override got Python objects, and
gloo's worker thread needed the GIL to free them while the main thread held it waiting on that
worker.) Under FSDP2 x TP the same group wraps FSDP2's param-group methods as
:class:`ShardedRankGroup` does: every rank runs one sequence of agreements, FSDP2's and TP's.

Cost. Per micro-batch, two agreements per TP module in forward and one per conversion node in
backward (two for a ``ColwiseParallel`` Linear, three for a ``RowwiseParallel`` one), plus FSDP2's
under FSDP2 x TP, plus one that ends the attempt: for the 2-layer Llama of
``tests/guard/tp_worker.py`` (14 TP Linears) 427 agreements in 3 steps of 2 micro-batches on 2 gloo
ranks, about 71 per micro-batch, each a host all-reduce of 3 int32 values. Measured there
(``tp_worker.py`` with ``time_steps``: 32 samples of 64 tokens in 2 micro-batches, medians of 9
interleaved steps, 2 gloo ranks on a shared, busy 2-core CPU host): 142 agreements per step, a
step of 0.87 s against 0.57 s with the same agreements skipped (+53%, about 2 ms per agreement).
A model this small computes little between boundaries; the cost weighs less as the blocks grow.
Not every boundary communicates (a ``ColwiseParallel`` input's ``from_local`` of a ``Replicate``
tensor, a ``to_local``'s backward): skipping those, as the layouts say the same on every rank,
would drop most of them; memguard agrees at all of them for now.

What stays unguarded (:func:`unguarded_tensor_parallel` refuses those it can see):
    DTensor parameters that ``parallelize_module`` did not lay out (no ParallelStyle hook found:
    the guard cannot tell where their collectives run); DTensor parameters on a mesh larger than 1
    outside FSDP2 and TP (DDP over tensor-parallel shards, a replicated DTensor mesh); HSDP x TP
    (FSDP2 over a 2-D data-parallel mesh, refused as under FSDP2 alone); front-ends that do not
    install the TP agreements (the Lightning, Trainer and Accelerate adapters: only
    :func:`memguard.step` after :func:`memguard.prepare` does; ``memguard.evaluate`` runs a TP model's
    forwards under the agreements of the group :func:`memguard.prepare` installed, and a TP model that
    was not prepared unguarded, as before). It cannot see: collectives that
    DTensor dispatch starts between two boundaries, which only happens when a style keeps DTensor
    outputs (``use_local_output=False``) and later ops need another placement; ``loss_parallel``
    (``parallel/loss.py``); and the collectives of ``clip_grad_norm_`` over DTensor gradients
    (``max_grad_norm=``), which run in the optimizer step, outside an attempt, as under FSDP2.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from memguard.guard._sharded import (
    PeerAbort,
    ShardedRankGroup,
    ShardingStopped,
    _fsdp_state_of,
    _param_groups,
    drop_partial_grads,
    fsdp_states,
)

#: Mesh dimension names of tensor parallelism: torchtitan's, Accelerate's and memguard's (``"tp"``),
#: and Lightning's (``"tensor_parallel"``: ``lightning/fabric/strategies/model_parallel.py``, ``_setup_device_mesh``).
TP_DIM_NAMES = ("tp", "tensor_parallel")

#: The autograd nodes of DTensor's conversions (torch 2.13, ``torch/distributed/tensor/_api.py``:
#: ``_FromTorchTensor``, ``_ToTorchTensor``; ``_redistribute.py``: ``Redistribute``), whose backward
#: may run a collective.
_TP_NODES = ("_FromTorchTensorBackward", "RedistributeBackward", "_ToTorchTensorBackward")

_STORE_PREFIX = "memguard/tp/stopped/"
_MARK = "memguard_tp_boundary"  # an autograd node's metadata key: its agreement is registered

#: Models whose TP boundaries carry the agreements of a :class:`TensorParallelRankGroup`.
_GUARDED: "weakref.WeakKeyDictionary[nn.Module, TensorParallelRankGroup]" = weakref.WeakKeyDictionary()


def _is_tp_hook(fn: Any) -> bool:
    """Whether a module hook was installed by tensor parallelism (``torch.distributed.tensor``)."""
    fn = getattr(fn, "func", fn)  # a functools.partial
    return str(getattr(fn, "__module__", "") or "").startswith("torch.distributed.tensor")


def tp_modules(model: nn.Module) -> list[tuple[str, nn.Module, bool, bool]]:
    """``(name, module, has_input_fn, has_output_fn)`` of every module with a tensor-parallel hook."""
    out = []
    for name, m in model.named_modules():
        pre = any(_is_tp_hook(h) for h in m._forward_pre_hooks.values())
        post = any(_is_tp_hook(h) for h in m._forward_hooks.values())
        if pre or post:
            out.append((name, m, pre, post))
    return out


def _dtensor_params(module: nn.Module) -> list[Any]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no tensor parallelism
        return []
    return [p for p in module.parameters() if isinstance(p, DTensor)]


def _tp_size(mesh: Any) -> int:
    names = tuple(mesh.mesh_dim_names or ())
    tp = next((n for n in TP_DIM_NAMES if n in names), None)
    return mesh[tp].size() if tp is not None else 1


def tensor_parallel_problem(module: nn.Module) -> str | None:
    """Why :class:`TensorParallelRankGroup` cannot guard ``module``'s tensor parallelism, or None when it can
    (or when the model has no tensor parallelism: then :func:`is_tensor_parallel` is False)."""
    params = _dtensor_params(module)
    if not params:
        return None
    fsdp = bool(fsdp_states(module))
    meshes = {id(p.device_mesh): p.device_mesh for p in params}
    tp = any(_tp_size(m) > 1 for m in meshes.values())
    if not tp:
        if fsdp or all(m.size() == 1 for m in meshes.values()):
            return None  # FSDP2 alone: memguard.guard._sharded guards it
        return ("the model's parameters are DTensors on a mesh of more than one rank, neither FSDP2 nor tensor "
                "parallelism: memguard cannot tell where their collectives run, and a rank that ran out of memory "
                "would leave its peers waiting in one; lay the model out with "
                "memguard.integrations.parallel.apply(model, Layout(dp_shard=..., tp=...))")
    if not tp_modules(module):
        return ("the model has tensor-parallel parameters (DTensors on a tensor-parallel mesh) but no module carries "
                "a ParallelStyle's hooks (parallelize_module installs them): memguard cannot find where their "
                "collectives run, and a rank that ran out of memory would leave its peers waiting in one; lay the "
                "model out with parallelize_module (memguard.integrations.parallel.apply(model, Layout(tp=...)))")
    if not fsdp:
        sizes = {id(m): m.size() for m in meshes.values()}
        roots = [getattr(m, "_get_root_mesh", lambda m=m: m)() for m in meshes.values()]
        if any(r.size() > max(sizes.values()) for r in roots):
            return ("the model is tensor-parallel on a mesh that also has data-parallel ranks, without FSDP2 "
                    "(DDP over tensor-parallel shards, or replicas the model does not know of): memguard's "
                    "tensor-parallel agreements cover the tensor-parallel ranks only; shard the data-parallel "
                    "dimension with FSDP2 (memguard.integrations.parallel.apply(model, Layout(dp_shard=N, tp=M))) "
                    "or train with a plain loop")
    if fsdp:
        groups = _param_groups(fsdp_states(module))
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, HSDPMeshInfo

        if any(isinstance(pg.mesh_info, (DDPMeshInfo, HSDPMeshInfo)) for pg in groups):
            return ("the model is sharded with FSDP2 over a 2-D data-parallel mesh (HSDP) on top of tensor "
                    "parallelism: memguard recovers from an OOM under FSDP2 x TP over one data-parallel dimension "
                    "only; use Layout(dp_shard=N, tp=M) without dp_replicate")
    return None


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether ``module`` has parameters on a tensor-parallel mesh dimension larger than 1."""
    return any(_tp_size(p.device_mesh) > 1 for p in _dtensor_params(module))


def prepared_tensor_parallel_group(module: nn.Module) -> "TensorParallelRankGroup | None":
    """The installed :class:`TensorParallelRankGroup` of a tensor-parallel model :func:`memguard.prepare` laid
    its agreements on (``memguard.evaluate`` runs its forwards under it), or None."""
    try:
        group = _GUARDED.get(module)
    except TypeError:  # not weakly referenceable: cannot have been prepared
        return None
    return group if group is not None and group._installed else None


def unguarded_tensor_parallel(module: nn.Module) -> str | None:
    """Why the guard must not run ``module``: its DTensor collectives carry no memguard agreement, so an OOM on
    one rank would leave its peers waiting in one (see the module docstring for what stays unguarded). None when
    the guard may run it: no DTensor parameters on a mesh larger than 1, FSDP2 alone, or a tensor-parallel model
    prepared with :func:`memguard.prepare` (its :class:`TensorParallelRankGroup` is installed)."""
    if prepared_tensor_parallel_group(module) is not None:
        return None
    problem = tensor_parallel_problem(module)
    if problem is not None:
        return problem
    if is_tensor_parallel(module):
        return ("the model is tensor-parallel, and this front-end does not put memguard's agreements before tensor "
                "parallelism's collectives (only memguard.prepare + memguard.step does): a rank that ran out of "
                "memory would leave its peers waiting in one; train it with memguard.prepare(model, optimizer, ...) "
                "and memguard.step, or with a plain loop and a micro-batch that memguard.estimate(..., layout=...) "
                "says fits")
    return None


@dataclass(eq=False)
class TensorParallelRankGroup(ShardedRankGroup):
    """The ranks of a tensor-parallel model (TP, or FSDP2 x TP) as the guard uses them (see the module docstring).

    Attributes:
        modules: the TP modules, ``(name, module, has_input_fn, has_output_fn)``.
        data_parallel_size: ranks that see different samples (1 under TP alone; FSDP2's shards under FSDP2 x TP).
    """

    modules: list = field(default_factory=list)
    data_parallel_size: int = 1
    framework: str = "tensor parallelism"
    restart_advice: str = "Restart the job with a smaller micro_batch_size (or activation checkpointing, or more ranks)"
    store_prefix: str = _STORE_PREFIX
    _inside: Any = None
    _handles: list = field(default_factory=list)

    # ---------------------------------------------------------------------------------- attempts

    @contextlib.contextmanager
    def armed(self, n_max: int, micro_batch_size: int = 0) -> Iterator[None]:
        """:meth:`ShardedRankGroup.armed`, and a failure inside a TP boundary stops every rank (see the module
        docstring, point 4).

        Raises:
            ShardingStopped: an error left forward/backward while this rank was inside a TP boundary.
        """
        self._inside = None
        with super().armed(n_max, micro_batch_size):
            try:
                yield
            except (PeerAbort, ShardingStopped):
                self._inside = None
                raise
            except Exception as exc:
                where, self._inside = self._inside, None
                if where is None:  # in compute, between boundaries: recoverable
                    raise
                if self.peer_stopped():  # the collective failed because a peer tore the groups down
                    raise ShardingStopped(self.stopped_error(exc)) from exc
                raise ShardingStopped(self.stop(exc, where)) from exc

    def _enter(self, where: str) -> None:
        """One boundary: agree (a peer's failure raises :class:`PeerAbort`), then mark this rank inside."""
        if not self._armed or self.world_size == 1:
            return
        self._boundary()
        self._inside = where

    def _leave(self) -> None:
        self._inside = None

    # ---------------------------------------------------------------------------------- installation

    def install(self) -> None:
        """Wrap FSDP2's collective methods (under FSDP2 x TP) and hook every TP module's boundaries (idempotent)."""
        if self._installed:
            return
        super().install()
        for name, module, pre, post in self.modules:
            label = name or type(module).__name__
            if pre:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_agree(f"tensor parallelism's input redistribution of {label}"), prepend=True))
                self._handles.append(module.register_forward_pre_hook(self._pre_done(label), with_kwargs=True))
            if post:
                self._handles.append(module.register_forward_hook(
                    self._post_agree(f"tensor parallelism's output redistribution of {label}"), prepend=True))
                self._handles.append(module.register_forward_hook(self._post_done(label)))
        if self.model is not None:
            _GUARDED[self.model] = self

    def uninstall(self) -> None:
        """Undo :meth:`install`."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        super().uninstall()
        if self.model is not None and _GUARDED.get(self.model) is self:
            del _GUARDED[self.model]

    def _pre_agree(self, where: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._enter(where)
        return hook

    def _post_agree(self, where: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._enter(where)
        return hook

    def _pre_done(self, label: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self._leave()
            if self._armed and self.world_size > 1:
                self._watch_backward((args, kwargs), f"the backward of tensor parallelism's input redistribution of "
                                                     f"{label}")
        return hook

    def _post_done(self, label: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._leave()
            if self._armed and self.world_size > 1:
                self._watch_backward(output, f"the backward of tensor parallelism's output redistribution of {label}")
        return hook

    def _watch_backward(self, tree: Any, where: str) -> None:
        """An agreement before each TP conversion node behind the tensors of ``tree`` (see the module docstring)."""
        for t in _tensors(tree):
            if not t.requires_grad or t.grad_fn is None:
                continue
            stack = [t.grad_fn]
            while stack:
                node = stack.pop()
                if node is None or type(node).__name__ not in _TP_NODES or _MARK in node.metadata:
                    continue
                node.metadata[_MARK] = True  # one agreement per node, even when two boundaries reach it
                node.register_prehook(self._node_prehook(where))
                node.register_hook(self._node_hook)
                stack.extend(n for n, _ in node.next_functions)

    def _node_prehook(self, where: str) -> Any:
        def prehook(grad_outputs: Any) -> None:
            self._enter(where)
        return prehook

    def _node_hook(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._leave()

    # ---------------------------------------------------------------------------------- reset

    def reset(self, params: Any = ()) -> None:
        """Drop the failed attempt's partial gradients (and, under FSDP2 x TP, reset FSDP2's per-step state)."""
        self._inside = None
        if self.states:
            super().reset(params)
            return
        self._armed = False
        drop_partial_grads([], params)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)
    else:  # a ModelOutput or a dataclass: its tensor fields
        values = getattr(tree, "values", None)
        if callable(values) and hasattr(tree, "keys"):
            for x in values():
                yield from _tensors(x)


def tensor_parallel_rank_group(model: nn.Module, *, sync_last_only: bool = False) -> TensorParallelRankGroup | None:
    """The installed :class:`TensorParallelRankGroup` of a tensor-parallel ``model``, or None if it has no
    tensor parallelism.

    Every rank must call it (it creates the agreements' gloo group over the model's mesh).

    Raises:
        memguard.ConfigError: the tensor parallelism cannot be guarded (:func:`tensor_parallel_problem`).
    """
    from memguard.errors import ConfigError

    if not is_tensor_parallel(model):
        return None
    problem = tensor_parallel_problem(model)
    if problem is not None:
        raise ConfigError(problem)
    old = _GUARDED.get(model)
    if old is not None:  # preparing again
        old.uninstall()
    params = _dtensor_params(model)
    mesh = max((p.device_mesh for p in params), key=lambda m: m.size())
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    agree_group = dist.new_group(ranks, backend="gloo")  # every rank of the job calls new_group
    states = fsdp_states(model)
    root = _fsdp_state_of(model) if states else None
    if states and (root is None or not hasattr(root, "_reset_iter_state")):
        raise ConfigError("the model has fully_shard-ed submodules but its root is not sharded (or this torch has no "
                          "FSDPState._reset_iter_state); call fully_shard on the root too (torch 2.13)")
    tp = max(_tp_size(p.device_mesh) for p in params)
    return _installed_group(model, ranks, agree_group, root, states, sync_last_only=sync_last_only,
                            data_parallel_size=max(1, len(ranks) // tp))


def _installed_group(model: nn.Module, ranks: list[int], agree_group: Any, root: Any, states: list, *,
                     sync_last_only: bool, data_parallel_size: int) -> TensorParallelRankGroup:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:  # no store: peers raise a PeerFailedError without the failing rank's details
        store = None
    modules = tp_modules(model)
    what = " x ".join(w for w, on in (("FSDP2", bool(states)), ("tensor parallelism", bool(modules))) if on)
    rg = TensorParallelRankGroup(group=agree_group, world_size=len(ranks), rank=dist.get_rank(agree_group),
                                 src=ranks[0], device=torch.device("cpu"), broadcast_buffers=False, root=root,
                                 states=states, model=model, sync_last_only=sync_last_only, store=store,
                                 modules=modules, data_parallel_size=data_parallel_size,
                                 framework=what or "tensor parallelism")
    rg.install()
    return rg


def stage_rank_group(stage_module: nn.Module, ranks: list[int], agree_group: Any, *,
                     data_parallel_size: int) -> TensorParallelRankGroup:
    """The installed :class:`TensorParallelRankGroup` of one pipeline stage laid out with tensor parallelism
    and/or FSDP2 (the stage module its FSDP2 root), over ``ranks`` (the stage's ranks, global) and
    ``agree_group``, a gloo group over them that the caller made (``torch.distributed.new_group`` is a call
    every rank of the job makes with the same ranks, so the pipeline makes one per stage on every rank:
    :mod:`memguard.guard._pipeline_step`). The agreements run at FSDP2's collectives and TP's
    boundaries as for a model without stages. The group spans every data-parallel rank of the stage, so
    HSDP inside a stage would be agreed on too (FSDP2's all-reduce over the replicas runs inside the
    ``post_backward`` that is agreed before); that case is not tested on real ranks.

    Raises:
        memguard.ConfigError: the stage module has FSDP2 states but is not itself the FSDP2 root.
    """
    from memguard.errors import ConfigError

    states = fsdp_states(stage_module)
    root = _fsdp_state_of(stage_module) if states else None
    if states and (root is None or not hasattr(root, "_reset_iter_state")):
        raise ConfigError("the pipeline stage has fully_shard-ed blocks but the stage module is not sharded (or this "
                          "torch has no FSDPState._reset_iter_state); call fully_shard on the stage module too "
                          "(torch 2.13)")
    return _installed_group(stage_module, sorted(int(r) for r in ranks), agree_group, root, states,
                            sync_last_only=False, data_parallel_size=data_parallel_size)
