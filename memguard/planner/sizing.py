"""GPU sizing: which catalog GPUs, and how many of each, fit a training job.

One :class:`~memguard.planner.search.Planner` is shared by every GPU and world size asked
about, because a trace depends on neither: the probes are traced once, and each verification
trace is reused wherever the same micro-batch and checkpointing come up again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from torch import nn

from memguard.errors import ConfigError, InfeasiblePlanError
from memguard.planner.plan import Plan
from memguard.planner.request import PlanRequest
from memguard.planner.search import Planner, plan_request

__all__ = ["GpuFit", "fit_gpus"]


@dataclass(frozen=True)
class GpuFit:
    """The fewest GPUs of one kind that fit the job, and the plan for them.

    Attributes:
        gpu: catalog name.
        count: the world size that fits, or None when none up to ``max_gpus`` does.
        plan: the plan at that world size, or None.
        reason: why it does not fit, when it does not.
    """

    gpu: str
    count: int | None
    plan: Plan | None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "count": self.count, "plan": self.plan.to_dict() if self.plan else None,
                "reason": self.reason}


def fit_gpus(
    model: nn.Module,
    batch: Any,
    *,
    global_batch_size: int,
    gpus: Iterable[str] | None = None,
    max_gpus: int = 64,
    optimizer: Any = None,
    loss_fn: Callable | None = None,
    make_batch: Callable[[int], Any] | None = None,
    **plan_options: Any,
) -> list[GpuFit]:
    """For each GPU, the smallest power-of-two world size (dividing the global batch) that fits.

    Args:
        gpus: catalog names (default: the whole catalog).
        max_gpus: the largest world size tried.
        plan_options: other :func:`memguard.plan` options (precision, zero_stage, headroom, ...).

    Returns:
        One :class:`GpuFit` per GPU, cheapest-looking first (fewest GPUs, then least memory).

    Raises:
        ConfigError: bad arguments (unknown GPU names, options ``plan`` refuses).
    """
    from memguard.estimator.gpus import GPUS, get_gpu

    forbidden = {"gpu", "world_size", "budget_bytes", "device"} & set(plan_options)
    if forbidden:
        raise ConfigError(f"fit_gpus chooses {', '.join(sorted(forbidden))} itself; drop them")
    names: Sequence[str] = [get_gpu(g).name for g in gpus] if gpus is not None else [
        g.name for g in GPUS.values() if g.memory_bytes
    ]
    first = names[0] if names else None
    request = PlanRequest.from_options(global_batch_size=global_batch_size, optimizer=optimizer, loss_fn=loss_fn,
                                       make_batch=make_batch, device="cuda", gpu=first, **plan_options)
    request.check()
    planner = Planner.for_request(model, batch, request)
    sizes = [n for n in (2**i for i in range(0, 31)) if n <= max_gpus and global_batch_size % n == 0]
    fits: list[GpuFit] = []
    for name in names:
        last = ""
        for n in sizes:
            try:
                p = plan_request(model, batch, dataclasses.replace(request, gpu=name, world_size=n), planner=planner)
            except InfeasiblePlanError as exc:
                last = str(exc).splitlines()[0]
                continue
            fits.append(GpuFit(name, n, p))
            break
        else:
            fits.append(GpuFit(name, None, None, last or f"no world size up to {max_gpus} divides the global batch"))
    fits.sort(key=lambda f: (f.count is None, f.count or 0, get_gpu(f.gpu).memory_bytes))
    return fits
