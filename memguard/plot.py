"""Pictures of a plan: memory against micro-batch size, and where the memory of the plan goes.

``memory_curves`` predicts the peak per rank at every micro-batch the plan could have chosen
(the divisors of the per-rank batch), for each precision with no checkpointing and with every
repeated block checkpointed, with the planner's own probe model: the same 1- and 2-block probe
traces ``memguard.plan`` solves with, so the curves cost no trace that planning did not already
make (a precision planning skipped is traced here). ``plot_plan`` draws those curves with the
budget lines and the chosen plan, beside a stacked bar of the plan's verified breakdown.
``plot_estimate`` draws the bar alone.

matplotlib is an optional extra (``pip install 'memguard[plot]'``), imported only when a plot
is drawn; pyplot is never imported, so no global backend or figure state is touched.

Known limitations:
    The curves are the planner's predictions (affine in the number of blocks, linear in the
    micro-batch), not a full trace at each point; only the plan's own point is verified. The
    plan's ZeRO stage, world size and offload are held fixed along the curves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from memguard.errors import MissingDependencyError
from memguard.estimator._result import CATEGORIES, Estimate
from memguard.planner.api import Plan
from memguard.vocab import PRECISIONS, GiB, KiB, MiB, TiB, default_precisions, format_bytes

__all__ = ["MemoryCurve", "memory_curves", "plot_plan", "plot_estimate", "require_matplotlib", "FIGSIZE", "DPI"]

#: Size of :func:`plot_plan`'s figure in inches, and the resolution: 1200 x 500 pixels.
FIGSIZE = (12.0, 5.0)
#: Size of :func:`plot_estimate`'s figure in inches: 600 x 500 pixels.
FIGSIZE_SINGLE = (6.0, 5.0)
DPI = 100

_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))


def _unit(reference: float) -> tuple[str, float]:
    """The largest binary unit in which ``reference`` bytes is at least 1 (axes read 1-1023)."""
    for name, size in _UNITS:
        if reference >= size:
            return name, float(size)
    return "B", 1.0


# One colour per breakdown category (matplotlib's "tab10" palette, in CATEGORIES order).
_CATEGORY_COLORS = dict(zip(CATEGORIES, (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#7f7f7f", "#bcbd22",
)))
_SHORT_NAMES = {"allocator_overhead": "allocator"}
# One colour per precision (matplotlib's "tab10" palette, in PRECISIONS order).
_PRECISION_COLORS = dict(zip(PRECISIONS, ("#1f77b4", "#2ca02c", "#ff7f0e", "#8c564b", "#9467bd")))


def require_matplotlib() -> Any:
    """Import matplotlib, or raise :class:`MissingDependencyError` with the ``pip install`` line.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure  # noqa: F401  (the part memguard draws with)
    except ImportError as exc:
        raise MissingDependencyError("matplotlib", "plot") from exc
    return matplotlib


@dataclass(frozen=True)
class MemoryCurve:
    """Predicted peak per rank against micro-batch size for one precision and checkpointing.

    Attributes:
        precision: Lightning's precision name.
        checkpoint_blocks: repeated blocks checkpointed (0 = none).
        num_blocks: repeated blocks the model has.
        micro_batch_sizes: the x values (divisors of the per-rank batch).
        peak_bytes: predicted peak per rank at each micro-batch.
    """

    precision: str
    checkpoint_blocks: int
    num_blocks: int
    micro_batch_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]

    @property
    def label(self) -> str:
        if self.checkpoint_blocks == 0:
            ckpt = "no checkpointing"
        elif self.checkpoint_blocks >= self.num_blocks:
            ckpt = "all blocks checkpointed"
        else:
            ckpt = f"{self.checkpoint_blocks}/{self.num_blocks} blocks checkpointed"
        return f"{self.precision}, {ckpt}"


def memory_curves(
    model: Any,
    batch: Any,
    plan: Plan,
    *,
    optimizer: Any = None,
    loss_fn: Callable | None = None,
    precisions: Sequence[str] | None = None,
    make_batch: Callable[[int], Any] | None = None,
    planner: Any = None,
    keep_outputs: bool = False,
) -> list[MemoryCurve]:
    """The planner's predicted peak at every candidate micro-batch of ``plan``.

    One curve per precision with no checkpointing and with all blocks checkpointed (the model's
    repeated blocks, as the planner finds them), plus the plan's own partial checkpointing when
    it has one. ZeRO stage, world size and offload are the plan's.

    Args:
        model, batch, optimizer, loss_fn, make_batch: as given to :func:`memguard.plan`.
        plan: the plan (or an infeasible plan's ``closest``).
        precisions: the precisions to draw; default: those :func:`memguard.plan` considers by
            default for the plan's target, plus the plan's own.
        planner: the :class:`memguard.planner._session.TraceSession` that made the plan, to reuse its
            traces; a new one traces the probes again.
        keep_outputs: as given to :func:`memguard.plan` (used when ``planner`` is None).

    Returns:
        The curves, the plan's precision first.

    Raises:
        ConfigError: the plan names a GPU that is not in the catalog.
    """
    from memguard.estimator.gpus import GENERIC, get_gpu
    from memguard.planner.api import TraceSession, divisors

    if planner is None:
        planner = TraceSession(model, batch, optimizer=optimizer, loss_fn=loss_fn, device=plan.device,
                               make_batch=make_batch, keep_outputs=keep_outputs)
    spec = None
    if plan.device == "cuda":
        spec = get_gpu(plan.gpu) if plan.gpu else GENERIC
    chosen = list(precisions) if precisions else list(default_precisions(plan.device, spec))
    if plan.precision not in chosen:
        chosen.insert(0, plan.precision)
    chosen.sort(key=lambda p: p != plan.precision)
    if spec is not None and plan.device == "cuda" and not spec.bf16:
        chosen = [p for p in chosen if not p.startswith("bf16") or p == plan.precision]

    local = plan.global_batch_size // plan.world_size
    sizes = divisors(local)
    n = planner.num_blocks
    curves: list[MemoryCurve] = []
    for p in chosen:
        probe = planner.probe_model(p, zero_stage=plan.zero_stage, world_size=plan.world_size, spec=spec,
                                    offload=plan.offload_optimizer, checkpointing=n >= 1)
        ks = [0] + ([n] if n >= 1 else [])
        if p == plan.precision and 0 < plan.checkpoint_blocks < n:
            ks.insert(1, plan.checkpoint_blocks)
        for k in ks:
            ys = tuple(probe.predict(m, k, local // m) for m in sizes)
            curves.append(MemoryCurve(p, k, n, tuple(sizes), ys))
    return curves


def _new_figure(size: tuple[float, float]):
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=DPI)


def _check_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        from memguard.errors import ConfigError

        raise ConfigError(f"cannot write the plot to {path!r}: the folder {parent!r} does not exist; create it first")
    return path


def _draw_breakdown(ax, est: Estimate, *, budget_bytes: int | None, usable_bytes: int | None, title: str) -> None:
    unit, scale = _unit(max(est.peak_bytes, budget_bytes or 0))
    bottom = 0.0
    total = max(est.peak_bytes, 1)
    rows = [(k, est.breakdown.get(k, 0)) for k in CATEGORIES if est.breakdown.get(k, 0) > 0]
    rows += [(k, v) for k, v in est.breakdown.items() if k not in CATEGORIES and v > 0]
    for name, value in rows:
        height = value / scale
        ax.bar([0], [height], bottom=[bottom], width=0.7, color=_CATEGORY_COLORS.get(name, "#17becf"),
               label=f"{name}: {format_bytes(value)}")
        if value / total > 0.05:  # label only segments tall enough to hold the text
            short = _SHORT_NAMES.get(name, name)
            ax.text(0, bottom + height / 2, f"{short}\n{format_bytes(value)}", ha="center", va="center", fontsize=8,
                    color="white")
        bottom += height
    top = bottom
    if usable_bytes:
        ax.axhline(usable_bytes / scale, color="#d62728", linewidth=1.5, label=f"usable: {format_bytes(usable_bytes)}")
        top = max(top, usable_bytes / scale)
    if budget_bytes and budget_bytes != usable_bytes:
        ax.axhline(budget_bytes / scale, color="#d62728", linestyle="--", linewidth=1,
                   label=f"budget: {format_bytes(budget_bytes)}")
        top = max(top, budget_bytes / scale)
    ax.set_ylim(0, top * 1.08 if top > 0 else 1)
    ax.set_xlim(-0.6, 1.6)
    ax.set_xticks([0])
    label = f"peak {format_bytes(est.peak_bytes)}\n(during {est.peak_phase})"
    if est.context_bytes:
        label += f"\n+ {format_bytes(est.context_bytes)} CUDA context, outside the budget"
    ax.set_xticklabels([label], fontsize=8)
    ax.set_ylabel(f"{unit} per rank")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", fontsize=7, framealpha=0.9)


def plot_plan(plan: Plan, path: str | os.PathLike, *, curves: Sequence[MemoryCurve] = (), title: str | None = None,
              fits: bool = True) -> str:
    """Draw ``curves`` with the budget lines and the plan, and the plan's stacked breakdown.

    The figure is :data:`FIGSIZE` at :data:`DPI` (1200 x 500 pixels); the format follows the
    file's suffix (``.png``, ``.svg``, ``.pdf``).

    Args:
        plan: the plan to mark (its verified estimate is the marked point and the bar).
        path: the file to write.
        curves: from :func:`memory_curves`; none draws the plan's point alone.
        title: the figure's title (e.g. the model).
        fits: False to label the plan as the closest one that does not fit.

    Returns:
        The path written.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        ConfigError: the file's folder does not exist.
    """
    path = _check_path(path)
    fig = _new_figure(FIGSIZE)
    ax, bar = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    unit, scale = _unit(max(plan.budget_bytes, plan.estimate.peak_bytes))
    usable = plan.usable_bytes / scale
    budget = plan.budget_bytes / scale
    ymax = 0.0
    for c in curves:
        style = "-" if c.checkpoint_blocks == 0 else ("--" if c.checkpoint_blocks >= c.num_blocks else ":")
        ys = [b / scale for b in c.peak_bytes]
        ymax = max([ymax] + ys)
        ax.plot(c.micro_batch_sizes, ys, linestyle=style, marker="o", markersize=3, linewidth=1.5,
                color=_PRECISION_COLORS.get(c.precision, "#17becf"), label=c.label)
    ax.axhline(usable, color="#d62728", linewidth=1.5, label=f"usable ({plan.headroom:.0%} headroom kept)")
    ax.axhline(budget, color="#d62728", linestyle="--", linewidth=1, label="budget")
    peak = plan.estimate.peak_bytes / scale
    marker_label = ("plan" if fits else "closest (does not fit)") + f": micro-batch {plan.micro_batch_size}"
    ax.plot([plan.micro_batch_size], [peak], marker="*", markersize=16, color="black", linestyle="none",
            label=marker_label, zorder=5)
    # Keep the budget readable: curves far above it are clipped at 1.6x the budget.
    top = max(budget * 1.1, min(max(ymax, peak) * 1.1, budget * 1.6)) if budget > 0 else max(ymax, peak) * 1.1
    ax.set_ylim(0, top or 1)
    xs = sorted({m for c in curves for m in c.micro_batch_sizes} | {plan.micro_batch_size})
    if len(xs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs], fontsize=8)
    ax.set_xlabel("micro-batch size (samples per rank per forward/backward)")
    ax.set_ylabel(f"predicted peak, {unit} per rank")
    target = f"{plan.world_size} x {plan.gpu or plan.device}, ZeRO-{plan.zero_stage}" + (
        ", optimizer offloaded" if plan.offload_optimizer else "")
    ax.set_title(f"Peak memory against micro-batch ({target}, global batch {plan.global_batch_size})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=7, framealpha=0.9)
    ckpt = f"{plan.checkpoint_blocks} blocks ckpt" if plan.activation_checkpointing else "no ckpt"
    _draw_breakdown(bar, plan.estimate, budget_bytes=plan.budget_bytes, usable_bytes=plan.usable_bytes,
                    title=f"{'Plan' if fits else 'Closest plan'}: {plan.micro_batch_size} x {plan.grad_accum_steps}, "
                          f"{plan.precision}, {ckpt}")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_estimate(estimate: Estimate, path: str | os.PathLike, *, budget_bytes: int | None = None,
                  usable_bytes: int | None = None, title: str | None = None) -> str:
    """Draw the stacked breakdown of ``estimate`` with optional budget lines.

    The figure is :data:`FIGSIZE_SINGLE` at :data:`DPI` (600 x 500 pixels).

    Returns:
        The path written.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        ConfigError: the file's folder does not exist.
    """
    path = _check_path(path)
    fig = _new_figure(FIGSIZE_SINGLE)
    ax = fig.subplots(1, 1)
    head = (f"{estimate.gpu or estimate.device}, micro-batch {estimate.micro_batch_size}, {estimate.precision}, "
            f"ZeRO-{estimate.zero_stage} x {estimate.world_size}")
    _draw_breakdown(ax, estimate, budget_bytes=budget_bytes, usable_bytes=usable_bytes, title=head)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path
