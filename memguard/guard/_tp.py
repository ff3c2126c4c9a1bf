"""Tensor parallelism and the guard: :func:`memguard.step` refuses a tensor-parallel model, rather than hang.

Why the guard cannot run tensor parallelism as it runs FSDP2. Tensor parallelism's collectives run
inside forward and backward, like FSDP2's, so a rank that runs out of memory in compute leaves its
peers waiting in the next one. FSDP2's are started by two methods of its param groups, which
:mod:`memguard.guard._sharded` wraps with an agreement. Tensor parallelism's are not: a ``DTensor``
redistributes (``Partial`` -> ``Replicate`` after a rowwise Linear, ``Replicate`` -> ``Partial`` for a
colwise Linear's input gradient, between ``Shard`` s under sequence parallelism) through
``torch/distributed/tensor/placement_types.py`` (``funcol.all_reduce``, ``all_gather_single``,
``reduce_scatter_single``), ``_collective_utils.py`` (``torch.ops._c10d_functional.all_to_all_single``
directly), ``parallel/loss.py`` (``loss_parallel``), ``_nonlinear_redux.py``, and ``DTensor``
dispatch itself (``_dispatch.py`` imports ``redistribute_local_tensor`` by name), in forward, in
autograd's backward and in ``clip_grad_norm_`` (torch 2.13). Wrapping those Python functions would
miss some.

The one entry point they share is the tensor-parallel dimension's ``ProcessGroup``: the functional
collectives call its virtual ``allreduce`` / ``all_gather_single`` / ``reduce_scatter_single`` /
``all_to_all_single`` (``torch/csrc/distributed/c10d/Functional.cpp``), which a Python subclass can
override (``torch/csrc/distributed/c10d/PyProcessGroup.hpp``), registered as a c10d backend
(``Backend.register_backend``) and chosen for the ``"tp"`` dimension
(``init_device_mesh(..., backend_override={"tp": name})``). A prototype of that (an agreement over
every rank before each collective of the group, then ``ProcessGroup``'s own method on a
``ProcessGroupGloo`` registered as the group's backend) recovered a real ``RLIMIT_AS`` OOM on rank
1 of 2 with the same samples and weights equal to an unsharded run, but it deadlocks now and then,
even with no OOM: the tensors the Python override receives get Python objects; when gloo's worker
thread drops the last reference to one, freeing it takes the GIL (PyObject preservation), while the
main thread holds the GIL waiting on that worker's next collective (funcol's ``wait_tensor`` op, or
``Work.wait``). Until the collectives can be guarded without handing their tensors to Python, the
guard refuses tensor-parallel models: :func:`unguarded_tensor_parallel` is checked when the first
micro-batch window opens.
"""

from __future__ import annotations

from torch import nn

from memguard.guard._sharded import fsdp_states

#: Mesh dimension names of tensor parallelism: torchtitan's, Accelerate's and memguard's (``"tp"``),
#: and Lightning's (``"tensor_parallel"``: ``lightning/fabric/strategies/model_parallel.py``, ``_setup_device_mesh``).
TP_DIM_NAMES = ("tp", "tensor_parallel")


def unguarded_tensor_parallel(module: nn.Module) -> str | None:
    """Why the guard must not run ``module``: it has tensor-parallel parameters (``DTensor`` s on a mesh with
    a :data:`TP_DIM_NAMES` dimension larger than 1, or on a mesh larger than 1 without FSDP2), whose
    collectives memguard cannot put an agreement before (see the module docstring), so an OOM on one rank
    would leave its peers waiting in one. None when the guard may run it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no tensor parallelism
        return None
    fsdp = None
    for p in module.parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        tp = next((n for n in TP_DIM_NAMES if n in names), None)
        if fsdp is None:
            fsdp = bool(fsdp_states(module))
        if (tp is not None and mesh[tp].size() > 1) or (not fsdp and mesh.size() > 1):
            return ("the model is tensor-parallel (its parameters are DTensors on a tensor-parallel mesh): memguard.step "
                    "does not recover from an OOM under tensor parallelism yet, and a rank that ran out of memory would "
                    "leave its peers waiting in tensor parallelism's next collective; train it with a plain loop and a "
                    "micro-batch that memguard.estimate(..., layout=...) says fits, or drop tensor parallelism "
                    "(Layout(dp_shard=N) alone is guarded)")
    return None
