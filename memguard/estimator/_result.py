"""The :class:`Estimate` result, and the :class:`Category` of memory its breakdown is keyed by."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from memguard.vocab import format_bytes

class Category(str, enum.Enum):
    """A category of memory, as an :class:`Estimate`'s breakdown reports it (a ``str`` Enum, as
    PyTorch's ``torch/distributed/_tools/mem_tracker.py`` names its ``_MemRefType``).

    Members equal their values (``Category.PARAMS == "params"``, with the same hash), so a trace
    may record members and a breakdown may be read with plain strings; an :class:`Estimate`'s
    breakdown keys are always the plain values, so that ``to_dict`` and JSON read as before. The
    first six are live tensor bytes; the last two exist only for the CUDA target.
    """

    #: parameters and buffers (under FSDP2 also its all-gathered, unsharded parameters)
    PARAMS = "params"
    #: gradients (DDP's gradient buckets included)
    GRADS = "grads"
    #: optimizer state (Adam's moments, the step counters)
    OPTIMIZER = "optimizer"
    #: tensors the forward creates (what autograd saves for backward, and the outputs)
    ACTIVATIONS = "activations"
    #: short-lived buffers of backward, the optimizer step and ``zero_grad``
    TEMPORARIES = "temporaries"
    #: the batch
    INPUTS = "inputs"
    #: bytes the caching allocator holds beyond live tensors at the peak (CUDA only)
    ALLOCATOR_OVERHEAD = "allocator_overhead"
    #: cuBLAS/cuBLASLt workspaces (CUDA only)
    WORKSPACE = "workspace"

    def __str__(self) -> str:
        return self.value


#: Categories of a breakdown, in display order (the values of :class:`Category`).
CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)


def _plain(key: Any) -> Any:
    """A breakdown key as a plain ``str`` (a :class:`Category`'s value)."""
    return key.value if isinstance(key, Category) else key


@dataclass(frozen=True)
class Estimate:
    """Predicted memory of one steady-state training step.

    Attributes:
        peak_bytes: peak of one step on the target. CPU: live tensor bytes. CUDA: bytes reserved
            by the caching allocator plus workspaces, CUDA context excluded.
        breakdown: bytes per category at the moment of the peak; the values sum to
            ``peak_bytes``. Keys: the values of :class:`Category` (:data:`CATEGORIES`), plain strings.
        context_bytes: CUDA context and library handles (0 on ``"cpu"``).
        peak_phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"zero_grad"``.
        allocated_peak_bytes: peak of live tensor bytes (``torch.cuda.max_memory_allocated``'s
            counterpart); equals ``peak_bytes`` on CPU.
        device, precision, zero_stage, world_size, gpu: the target that was estimated.
        micro_batch_size: size of dim 0 of the batch that was traced.
        activation_checkpointing: number of blocks memguard wrapped in checkpointing (0 = none
            added by memguard; checkpointing the model already had is always honoured).
        offload_optimizer: optimizer states counted on the host, not the device.
        num_params, num_trainable_params: parameter counts (tied weights counted once).
        model_state_bytes: params + grads + optimizer bytes per rank, the quantity DeepSpeed's
            estimators report.
        phase_peaks: the peak of live tensor bytes inside each phase.
        notes: environment settings the CUDA prediction read (``PYTORCH_CUDA_ALLOC_CONF``,
            ``CUBLAS_WORKSPACE_CONFIG``) or found set but does not model, and what a strategy's
            options meant (FSDP2's mixed-precision policy and sharding level), one sentence each.
        strategy: ``"ddp"``, ``"deepspeed"`` or ``"fsdp2"``: how the model states were sharded
            (``zero_stage`` is that strategy's sharding level). Dicts written before this field
            existed load as DDP, or DeepSpeed when their ``zero_stage >= 1``.
        peak_upper_bytes: ``peak_bytes`` plus the most that the CUDA kernels the model has no rule for
            can add while they run (CUB temporary storage, kernels' own scratch: each named in
            ``notes`` with its bound; :func:`memguard.estimator._unmodelled.upper_bound` says how the
            bound composes: the largest one's new allocator segments on top of the peak). Equals
            ``peak_bytes`` on CPU and where nothing unmodelled ran; dicts written before this field
            existed load with ``peak_bytes``. It bounds the step only when ``unbounded_workspaces``
            is empty. The planner plans on it.
        unbounded_workspaces: the unmodelled mechanisms that have no bound from the shapes (cuDNN's
            RNN workspaces, sized by cuDNN at run time), each with its call; not in ``peak_upper_bytes``.
        rank_peak_bytes: the peak of each rank, in the rank order of
            :mod:`memguard.estimator._layout` (pipeline stages differ); ``peak_bytes`` is their
            maximum. An estimate without a ``layout=`` holds ``(peak_bytes,)``: its ranks are alike.
    """

    peak_bytes: int
    breakdown: Mapping[str, int]
    context_bytes: int
    peak_phase: str
    allocated_peak_bytes: int
    device: str
    precision: str
    zero_stage: int
    world_size: int
    gpu: str | None
    micro_batch_size: int
    activation_checkpointing: int = 0
    offload_optimizer: bool = False
    num_params: int = 0
    num_trainable_params: int = 0
    model_state_bytes: int = 0
    phase_peaks: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    strategy: str = ""
    peak_upper_bytes: int = 0
    unbounded_workspaces: tuple[str, ...] = ()
    rank_peak_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ranks = tuple(int(p) for p in self.rank_peak_bytes)  # a JSON round trip gives a list
        if len(ranks) <= 1:  # ranks alike (a replace() of peak_bytes carries the old single entry)
            ranks = (int(self.peak_bytes),)
        object.__setattr__(self, "rank_peak_bytes", ranks)
        if max(ranks) != self.peak_bytes:
            raise ValueError(f"peak_bytes={self.peak_bytes} must be max(rank_peak_bytes)={max(ranks)}")
        if not self.strategy:  # older dicts: today's meaning of zero_stage
            object.__setattr__(self, "strategy", "deepspeed" if self.zero_stage >= 1 else "ddp")
        object.__setattr__(self, "breakdown", MappingProxyType({_plain(k): v for k, v in self.breakdown.items()}))
        object.__setattr__(self, "phase_peaks", MappingProxyType(dict(self.phase_peaks)))
        object.__setattr__(self, "notes", tuple(self.notes))  # a JSON round trip gives a list
        object.__setattr__(self, "unbounded_workspaces", tuple(self.unbounded_workspaces))
        if self.peak_upper_bytes < self.peak_bytes:  # older dicts (0): nothing unmodelled was counted
            object.__setattr__(self, "peak_upper_bytes", self.peak_bytes)

    @property
    def total_bytes(self) -> int:
        """``peak_bytes + context_bytes``: what ``nvidia-smi`` would show for the process."""
        return self.peak_bytes + self.context_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` inverts it."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["breakdown"] = dict(self.breakdown)
        d["phase_peaks"] = dict(self.phase_peaks)
        d["notes"] = list(self.notes)
        d["unbounded_workspaces"] = list(self.unbounded_workspaces)
        d["rank_peak_bytes"] = list(self.rank_peak_bytes)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Estimate":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def table(self) -> str:
        """The breakdown as a small aligned table."""
        rows = [(k, v) for k in CATEGORIES if (v := self.breakdown.get(k, 0))]
        rows += [(k, v) for k, v in self.breakdown.items() if k not in CATEGORIES and v]
        width = max([len(k) for k, _ in rows] + [len("peak")])
        lines = [f"  {k:<{width}}  {format_bytes(v):>11}  {100 * v / max(self.peak_bytes, 1):5.1f}%" for k, v in rows]
        lines.append(f"  {'peak':<{width}}  {format_bytes(self.peak_bytes):>11}  (during {self.peak_phase})")
        if self.peak_upper_bytes > self.peak_bytes:
            lines.append(f"  {'upper':<{width}}  {format_bytes(self.peak_upper_bytes):>11}  (with the unmodelled "
                         "workspaces in the notes)")
        if self.context_bytes:
            lines.append(f"  {'+ context':<{width}}  {format_bytes(self.context_bytes):>11}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _sharding(self) -> str:
        if self.strategy == "fsdp2":
            return f"FSDP2 level {self.zero_stage}"
        return f"ZeRO-{self.zero_stage}"

    def __str__(self) -> str:
        target = self.gpu or self.device
        head = (
            f"Estimate: {format_bytes(self.peak_bytes)} peak on {target}, micro-batch {self.micro_batch_size}, "
            f"{self.precision}, {self._sharding()} x {self.world_size}"
        )
        return head + "\n" + self.table()
