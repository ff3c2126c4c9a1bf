"""PowerSGD gradient compression under DDP: its memory per bucket, added to a traced step.

Everything here is read from torch 2.13's ``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``
(``PowerSGDState`` and ``powerSGD_hook``) and, for the buckets the hook sees, from
``torch/nn/parallel/distributed.py`` and ``torch/csrc/distributed/c10d/reducer.cpp``.

**Buckets.** With the default ``bucket_cap_mb`` DDP builds one bucket for everything in the first
iteration (``_BucketCapacityConfig.compute_bucket_size_limits``: ``[sys.maxsize]`` unless
``find_unused_parameters``) and rebuilds the buckets after it in the order the gradients became
ready (``Reducer::rebuild_buckets``), with limits ``[_DEFAULT_FIRST_BUCKET_BYTES (1 MiB),
bucket_cap_mb (25 MiB)]``; that is why ``PowerSGDState`` demands ``start_powerSGD_iter > 1`` with
error feedback or warm start. The steady state (the estimate's) has the rebuilt buckets. memguard
takes the ready order to be the reverse of ``model.parameters()`` (the order DDP itself assumes
before it has seen a backward: "reverse list of buckets because we want to approximate the order in
which their gradients are produced") and cuts it with torch's own
``dist._compute_bucket_assignment_by_size`` (which also separates dtypes).

**Per bucket** of ``L`` gradient elements of ``b`` bytes, each gradient viewed as an ``n x m``
matrix (``tensor.view(tensor.shape[0], -1)``) with rank ``r = min(n, m, matrix_approximation_rank)``,
compressed when ``(n + m) * r * min_compression_rate < n * m`` (``_should_compress``); ``P`` and ``Q``
the sums of ``n * r`` and ``m * r`` over the compressed ones, ``U`` the elements of the others:

* persistent (live through the optimizer step and the next forward; ``Estimate.breakdown["powersgd_state"]``): the error-feedback buffer
  ``state.error_dict[bucket]`` (``L``, with ``use_error_feedback``), and with ``warm_start`` the
  ``p_memory_dict``/``q_memory_dict`` buffers (``P`` and ``Q``);
* transient, while the hook runs on the ready bucket (in ``temporaries``): the copy ``input_tensor_cp =
  input_tensor.detach().clone()`` (``L``, with error feedback), ``uncompressed_tensors_memory =
  torch.cat(...)`` (``U``: the buffer the uncompressed tensors are all-reduced in, held by the
  collective's future), P and Q when they are not kept (no ``warm_start``: allocated each call and
  cleared at its end), and at the end ``state.error_dict[bucket] = input_tensor_cp - input_tensor``
  (a new ``L`` allocated while the old error buffer, the copy and ``U`` are still live). The P and Q
  all-reduces and the ``bmm(..., out=)`` products run in the P/Q buffers themselves (gloo all-reduces
  a CPU tensor in place), so the hook's peak above the persistent state is ``2L + U`` with error
  feedback and warm start, ``2L + U + P + Q`` with error feedback alone, ``U (+ P + Q)`` without it.
  Gram-Schmidt's temporaries (``torch.norm`` of one column, ``col * rest`` for ranks 2) are smaller
  than the final ``L`` and come before it; without error feedback they sit on top of ``U`` and are
  not counted (12 bytes per rank-1 column, measured).

**The planner** (``memguard.plan(gradient_compression="powersgd")``) adds the same memory to every
whole-model trace it verifies a candidate with (``TraceSession.with_compression``) and restricts
the search to plain DDP (``zero_stage=0``); its probe model, which ranks candidates before they are
verified, leaves PowerSGD out, so on a tight budget more candidates may be verified. It never picks
compression itself: the compression is lossy, and its cost model (``memguard/planner/_cost.py``)
charges a DDP all-reduce 2Ψ whatever the hook.

The DDP buckets themselves (as large as all gradients) are added by
:func:`memguard.estimator._sharding.model_state_factors`; PowerSGD changes nothing there.

Known limitations:
    Each bucket's transient is placed where that bucket's gradients are complete in the traced
    backward (gradient bytes counted in allocation order), after the frees that follow, one bucket at a time: the CPU run with
    settled collectives completes each bucket's hook before the next bucket is ready; with
    asynchronous collectives (NCCL) the hooks of several buckets can be in flight at once, and their
    transients can add up. ``matrix_approximation_rank > 2`` in fp32 runs ``torch.linalg.qr``, whose
    LAPACK/cuSOLVER workspace is not counted. ``batch_tensors_with_same_shape=True`` (which stacks
    same-shaped gradients) is not modelled and refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from memguard.errors import ConfigError


#: The breakdown key of PowerSGD's persistent state (error feedback, warm-start P and Q), per rank.
STATE = "powersgd_state"
#: DDP's default bucket cap (torch/nn/parallel/distributed.py, ``_DEFAULT_BUCKET_CAP_MB``).
DEFAULT_BUCKET_CAP_MB = 25
#: DDP's first bucket with the default cap (torch.distributed ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB).
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class PowerSGDOptions:
    """The ``PowerSGDState`` hyperparameters memguard models and applies, with torch 2.13's defaults
    (``PowerSGDState.__init__``), plus DDP's ``bucket_cap_mb``.

    Attributes:
        matrix_approximation_rank: rank of the low-rank approximation (default 1).
        start_powerSGD_iter: plain all-reduce before this iteration (default 1000); the estimate is
            the steady state after it. Must be > 1 with error feedback or warm start.
        min_compression_rate: a gradient is compressed only if it saves this factor (default 2).
        use_error_feedback: keep the compression error per bucket (default True).
        warm_start: keep P and Q between iterations (default True).
        orthogonalization_epsilon: Gram-Schmidt's epsilon (default 0).
        random_seed: seed of the initial Q (default 0).
        bucket_cap_mb: DDP's ``bucket_cap_mb``; None = DDP's default (25 MiB, the first bucket 1 MiB).
    """

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1_000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0
    random_seed: int = 0
    bucket_cap_mb: float | None = None

    def problems(self) -> list[str]:
        """What is wrong with these options (empty when nothing is), as ``ConfigError`` lines."""
        out = []
        r = self.matrix_approximation_rank
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
            out.append(f"PowerSGD matrix_approximation_rank={r!r} must be an integer >= 1")
        s = self.start_powerSGD_iter
        if not (isinstance(s, int) and not isinstance(s, bool)):
            out.append(f"PowerSGD start_powerSGD_iter={s!r} must be an integer")
        elif (self.use_error_feedback or self.warm_start) and s <= 1:
            # PowerSGDState.__init__ raises ValueError for this (DDP rebuilds its buckets after iteration 1)
            out.append(f"PowerSGD start_powerSGD_iter={s} must be > 1 with use_error_feedback or warm_start "
                       "(DDP rebuilds its buckets after the first iteration); pass 2 or more")
        if not (isinstance(self.min_compression_rate, (int, float)) and self.min_compression_rate > 0):
            out.append(f"PowerSGD min_compression_rate={self.min_compression_rate!r} must be a number > 0")
        cap = self.bucket_cap_mb
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):
            out.append(f"bucket_cap_mb={cap!r} must be a number > 0 or None (DDP's default 25)")
        return out

    def state(self, process_group: Any = None) -> Any:
        """A ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`` with these options."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        return PowerSGDState(
            process_group, matrix_approximation_rank=self.matrix_approximation_rank,
            start_powerSGD_iter=self.start_powerSGD_iter, min_compression_rate=self.min_compression_rate,
            use_error_feedback=self.use_error_feedback, warm_start=self.warm_start,
            orthogonalization_epsilon=self.orthogonalization_epsilon, random_seed=self.random_seed,
        )

    def bucket_limits(self) -> list[int]:
        """DDP's rebuilt bucket limits in bytes: ``[1 MiB, 25 MiB]`` by default, ``[cap]`` with a
        ``bucket_cap_mb`` given (``_BucketCapacityConfig.create``: the small first bucket only with the default)."""
        if self.bucket_cap_mb is None:
            return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * 1024 * 1024]
        return [int(self.bucket_cap_mb * 1024 * 1024)]  # distributed.py: int(bucket_cap_mb * _MB_TO_BYTES)


def resolve_options(gradient_compression: Any, powersgd: Any) -> PowerSGDOptions | None:
    """The :class:`PowerSGDOptions` that ``gradient_compression=`` / ``powersgd=`` ask for (None: no compression).

    ``powersgd`` may be a :class:`PowerSGDOptions`, a mapping of its fields, or an int (the rank).

    Raises:
        ConfigError: an unknown compression, unknown option names or bad values (all listed).
    """
    if gradient_compression is None:
        if powersgd is not None:
            raise ConfigError("powersgd= was given without gradient_compression='powersgd'; pass both")
        return None
    if gradient_compression != "powersgd":
        raise ConfigError(f"gradient_compression={gradient_compression!r} is not known: pass None or 'powersgd'")
    if powersgd is None:
        opts = PowerSGDOptions()
    elif isinstance(powersgd, PowerSGDOptions):
        opts = powersgd
    elif isinstance(powersgd, int) and not isinstance(powersgd, bool):
        opts = PowerSGDOptions(matrix_approximation_rank=powersgd)
    elif isinstance(powersgd, dict):
        names = {f.name for f in dataclasses.fields(PowerSGDOptions)}
        unknown = sorted(set(powersgd) - names)
        if unknown:
            raise ConfigError([f"powersgd option {k!r} is not known (known: {', '.join(sorted(names))})"
                               for k in unknown])
        opts = PowerSGDOptions(**powersgd)
    else:
        raise ConfigError(f"powersgd={powersgd!r} must be a dict of PowerSGD options (PowerSGDState keywords, bucket_cap_mb), "
                          "or an int (the matrix_approximation_rank)")
    problems = opts.problems()
    if problems:
        raise ConfigError(problems)
    return opts


def check_ddp(options: Any, *, world_size: int, zero_stage: int, strategy: str | None,
              problems: list[str]) -> None:
    """PowerSGD is a DDP communication hook: it needs more than one rank and no ZeRO/FSDP sharding.

    ``options``: the resolved options, or anything not None when compression is asked for."""
    if options is None:
        return
    if not (isinstance(world_size, int) and world_size > 1):
        problems.append(f"gradient_compression='powersgd' needs DistributedDataParallel over world_size > 1 "
                        f"(got world_size={world_size!r}); drop gradient_compression or raise world_size")
    if strategy not in (None, "ddp") or zero_stage:
        problems.append(f"gradient_compression='powersgd' is a DistributedDataParallel comm hook and does not "
                        f"combine with strategy={strategy!r}, zero_stage={zero_stage!r}; use zero_stage=0 "
                        "(plain DDP) or drop gradient_compression")


@dataclass(frozen=True)
class BucketMemory:
    """PowerSGD's memory for one DDP bucket (elements; multiply by ``item`` for bytes).

    Attributes:
        numel: the bucket's gradient elements ``L``.
        item: bytes per element (the gradients' dtype).
        p_numel, q_numel: ``P`` and ``Q``, summed over the compressed gradients.
        uncompressed_numel: ``U``, the elements all-reduced without compression.
        compressed: how many of the bucket's gradients are compressed.
    """

    numel: int
    item: int
    p_numel: int
    q_numel: int
    uncompressed_numel: int
    compressed: int

    def persistent_bytes(self, o: PowerSGDOptions) -> int:
        """``error_dict`` (error feedback) + ``p_memory_dict``/``q_memory_dict`` (warm start)."""
        n = (self.numel if o.use_error_feedback else 0) + (self.p_numel + self.q_numel if o.warm_start else 0)
        return n * self.item

    def transient_bytes(self, o: PowerSGDOptions) -> int:
        """The hook's peak above the persistent state: the clone and the new error buffer (error feedback),
        the uncompressed tensors' buffer, P and Q when not kept (see the module docstring)."""
        n = self.uncompressed_numel + (2 * self.numel if o.use_error_feedback else 0)
        if not o.warm_start:
            n += self.p_numel + self.q_numel
        return n * self.item


def bucket_memory(shapes: Sequence[tuple[int, ...]], item: int, options: PowerSGDOptions) -> BucketMemory:
    """PowerSGD's sizes for one bucket holding gradients of these shapes (powerSGD_hook, torch 2.13)."""
    p = q = u = k = total = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel
        if len(shape) == 0:  # a 0-d gradient: tensor.view(tensor.shape[0], -1) fails in the hook itself
            raise ConfigError("a 0-d trainable parameter cannot go through powerSGD_hook (it views each gradient "
                              "as shape[0] x -1); make it 1-d or drop gradient_compression")
        n = int(shape[0])
        m = numel // n if n else 0
        r = min(n, m, options.matrix_approximation_rank)  # powerSGD_hook: min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * options.min_compression_rate < n * m:  # _should_compress
            p += n * r
            q += m * r
            k += 1
        else:
            u += numel
    return BucketMemory(numel=total, item=item, p_numel=p, q_numel=q, uncompressed_numel=u, compressed=k)


def ddp_buckets(params: Sequence[torch.Tensor], options: PowerSGDOptions) -> list[list[int]]:
    """DDP's rebuilt buckets over the trainable ``params`` (indices into it), in ready order.

    The ready order is taken to be the reverse of ``params`` (see the module docstring); the cut is
    torch's own ``dist._compute_bucket_assignment_by_size`` with the rebuilt limits.
    """
    import torch.distributed as dist

    order = list(range(len(params)))[::-1]
    probes = [torch.empty(tuple(params[i].shape), dtype=params[i].dtype, device="meta") for i in order]
    groups, _ = dist._compute_bucket_assignment_by_size(probes, options.bucket_limits(), [False] * len(probes))
    return [[order[j] for j in g] for g in groups]


def powersgd_buckets(model: torch.nn.Module, options: PowerSGDOptions, grad_dtype: torch.dtype | None = None
                     ) -> list[BucketMemory]:
    """PowerSGD's memory per DDP bucket for ``model``'s trainable parameters, in ready order.

    ``grad_dtype``: the gradients' dtype when the step casts the model (``*-true`` 16-bit); None = each
    parameter's own.
    """
    seen: set[int] = set()
    params = []
    for p in model.parameters():  # DDP's parameters: trainable, each shared one once
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p if grad_dtype is None else torch.empty(tuple(p.shape), dtype=grad_dtype, device="meta"))
    out = []
    for group in ddp_buckets(params, options):
        item = params[group[0]].element_size()
        out.append(bucket_memory([tuple(params[i].shape) for i in group], item, options))
    return out


def grad_dtype_of(precision: str) -> torch.dtype | None:
    """The gradients' dtype when the precision casts the model (``16-true``/``bf16-true``), else None."""
    return {"16-true": torch.float16, "bf16-true": torch.bfloat16}.get(precision)


def add_powersgd(trace: Any, buckets: Sequence[BucketMemory], options: PowerSGDOptions) -> Any:
    """A copy of ``trace`` with PowerSGD's memory in it.

    The persistent state is allocated before the step starts, in its own category :data:`STATE`
    (in ``grads`` its bytes would be taken for gradients, and DDP's buckets, modelled as large as all
    gradients, would grow by them); each bucket's transient (category ``temporaries``) is allocated and
    freed just after the traced backward has allocated that bucket's share of the gradient bytes (ready
    order), or at the end of backward when no gradient is allocated there (gradient accumulation).
    """
    from memguard.estimator._result import Category

    sizes, category = list(trace.sizes), list(trace.category)

    def handle(nbytes: int, cat: str) -> int:
        sizes.append(nbytes)
        category.append(cat)
        return len(sizes) - 1

    persistent = sum(b.persistent_bytes(options) for b in buckets)
    start = trace.phase_starts.get("backward", len(trace.events))
    end = trace.phase_starts.get("optimizer", len(trace.events))
    # where each bucket is ready: the event after which the backward has allocated its cumulative gradient bytes
    grad_allocs = []  # (event index, bytes) of first allocations of gradient storages in backward
    seen: set[int] = set()
    for i in range(start, end):
        h, n = trace.events[i]
        if n > 0 and trace.category[h] == Category.GRADS and h not in seen:
            seen.add(h)
            grad_allocs.append((i, n))
    inserts: dict[int, list[tuple[int, int]]] = {}
    done, k = 0, 0
    for b in buckets:
        need = done + b.numel * b.item
        at = end - 1
        while k < len(grad_allocs) and done < need:
            at, n = grad_allocs[k]
            done += n
            k += 1
        if k >= len(grad_allocs) and done < need:
            at = end - 1
        # the hook runs from the gradient's AccumulateGrad node, after the autograd node that made the
        # gradient has returned and its inputs (the incoming gradient, saved tensors) have been released
        # (torch/csrc/autograd/engine.cpp, evaluate_function: the inputs are moved into call_function):
        # past the frees, and the node's other gradients, that follow the allocation
        while at + 1 < end and (trace.events[at + 1][1] < 0 or trace.category[trace.events[at + 1][0]] == Category.GRADS):
            at += 1
        t = b.transient_bytes(options)
        if t:
            h = handle(t, Category.TEMPORARIES)
            inserts.setdefault(at, []).extend([(h, t), (h, -t)])
    events = []
    if persistent:  # before the step: in the steady state it is there from the previous step
        events.append((handle(persistent, STATE), persistent))
    position = {}
    for i, ev in enumerate(trace.events):
        position[i] = len(events)
        events.append(ev)
        events.extend(inserts.get(i, ()))
    position[len(trace.events)] = len(events)
    new_starts = {name: position[s] for name, s in trace.phase_starts.items()}
    return dataclasses.replace(trace, events=events, sizes=sizes, category=category, phase_starts=new_starts)


def note(options: PowerSGDOptions, buckets: Sequence[BucketMemory]) -> str:
    """One sentence for ``Estimate.notes``."""
    persistent = sum(b.persistent_bytes(options) for b in buckets)
    transient = max((b.transient_bytes(options) for b in buckets), default=0)
    compressed = sum(b.compressed for b in buckets)
    return (f"PowerSGD (rank {options.matrix_approximation_rank}, steady state after start_powerSGD_iter="
            f"{options.start_powerSGD_iter}): {len(buckets)} DDP buckets, {compressed} gradients compressed; "
            f"{persistent} bytes of error-feedback/P/Q state in breakdown[{STATE!r}], the hook's largest transient "
            f"{transient} bytes in temporaries")
