"""Layouts on CPU: ``memguard.estimate(layout=...)`` against real multi-rank gloo runs, per rank.

Each case lays out a small model over ``world_size`` gloo ranks on this machine (one process per
rank, ``init_device_mesh("cpu", (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard",
"tp"))``):

* tensor parallel: ``parallelize_module(model, mesh["tp"], plan)`` with the plan memguard resolves
  (:func:`memguard.estimator._layout.resolve_tp_plan`: a Llama config's ``base_model_tp_plan``; for
  the GPT-2-shaped model below, the plan found by name: ``q_proj``/``k_proj``/``v_proj``/``c_fc``
  colwise, ``out_proj``/``c_proj`` rowwise);
* sequence parallel: the GPT-2-shaped model with :func:`sequence_parallel_plan`;
* FSDP2 x TP: the same, then ``fully_shard`` of each block and the root over ``mesh["dp_shard"]``
  (:func:`memguard.estimator._fsdp2.shard_model`, level 3), as torchtitan's ``parallelize_llama``;
* pipeline parallel: the Llama cut into ``pp`` stages (:func:`memguard.estimator._pipeline.split_decoder`),
  each rank's ``PipelineStage`` under ``ScheduleGPipe`` or ``Schedule1F1B``; only the last rank has a
  loss (the mean of its micro-batches' losses); or into ``pp * pp_stages_per_rank`` virtual stages
  (:func:`~memguard.estimator._pipeline.split_decoder_stages`), each rank's stages under
  ``ScheduleInterleaved1F1B`` (loop layout) or ``ScheduleZBVZeroBubble`` (V layout: rank 0 holds the first
  and the last stage, and the loss);
* HSDP: ``fully_shard`` over ``mesh["dp_replicate", "dp_shard"]`` (replicated over the first
  dimension, sharded over the second).

Every rank runs one warm-up step, then ``--steps`` steps under ``torch.profiler``
(``profile_memory=True``; a pipeline rank profiles its warm-up step too, not counted, see
``_pipeline_worker``); its live tensor bytes are replayed by address from the allocator events
exactly as :mod:`benchmarks.fsdp2_cpu` does (``_replay``), with every collective settled: the
``torch.distributed`` calls FSDP2 makes (:func:`benchmarks.common.settle_collectives`) and the
functional collectives DTensor makes (:func:`settle_functional_collectives`: each waited on, then a
pause), so that gloo's worker thread never drops a buffer's last reference unseen. A case's real
peak per rank is that rank's worst peak over ``--runs`` runs (fresh processes each); it is compared
with ``memguard.estimate(..., device="cpu", layout=...)``'s ``rank_peak_bytes`` for that rank. The
first step's loss of every rank is compared with a single-process step of the same model and batch.

Usage::

    python benchmarks/layouts_cpu.py                         # every case, 3 runs each
    python benchmarks/layouts_cpu.py --cases llama-tp2 --runs 3

Writes ``layouts_cpu.json`` and ``layouts_cpu.md`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # `benchmarks` from this checkout when run by path
from benchmarks.common import (  # noqa: E402
    MultiRankBenchmark,
    launch_ranks,
    merge_argument,
    merge_mode,
    settle_collectives,
)
from benchmarks.fsdp2_cpu import _PREFIX, _live_bytes, _replay, profiled_steps  # noqa: E402

_MIB = 1 << 20
_VOCAB = 2048


@dataclass(frozen=True)
class Case:
    """One configuration: model, layout degrees, batch (one data-parallel replica's)."""

    model: str  # "gpt" (GPT-2-shaped, plan by name) or "llama" (HF, base_model_tp_plan)
    tp: int
    dp_shard: int = 1
    batch: int = 4
    seq: int = 128
    sp: bool = False  # the GPT model with the sequence-parallel plan of sequence_parallel_plan()
    dp_replicate: int = 1  # > 1 with dp_shard: HSDP
    # or "bf16-mixed": forward and loss under torch.autocast("cpu", bfloat16); with dp_shard, FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) instead (what memguard's FSDP2 estimate means)
    precision: str = "32-true"
    pp: int = 1  # > 1: pipeline stages (alone), under pp_schedule with pp_microbatches micro-batches
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 4
    pp_stages_per_rank: int | None = None  # under Interleaved1F1B / ZBVZeroBubble (None: the estimate's default, 2)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def name(self) -> str:
        if self.pp > 1:
            inner = (f"-dp{self.dp_shard}" if self.dp_shard > 1 else "") + (f"-tp{self.tp}" if self.tp > 1 else "")
            per_rank = f"-v{self.pp_stages_per_rank}" if self.pp_stages_per_rank is not None else ""
            return f"{self.model}-pp{self.pp}{inner}-{self.pp_schedule.lower()}{per_rank}-mb{self.pp_microbatches}"
        return (f"{self.model}-" + (f"rep{self.dp_replicate}" if self.dp_replicate > 1 else "")
                + (f"dp{self.dp_shard}" if self.dp_shard > 1 else "") + (f"tp{self.tp}" if self.tp > 1 else "")
                + ("-sp" if self.sp else "") + ("-bf16" if self.precision == "bf16-mixed" else ""))


def all_cases() -> dict[str, Case]:
    cases = [Case("llama", 2), Case("gpt", 2), Case("gpt", 2, sp=True), Case("llama", 2, dp_shard=2),
             Case("gpt", 2, dp_shard=2), Case("gpt", 4), Case("llama", 1, dp_shard=2, dp_replicate=2),
             Case("llama", 2, precision="bf16-mixed"), Case("llama", 2, dp_shard=2, precision="bf16-mixed"),
             Case("llama", 1, pp=2, pp_schedule="GPipe"), Case("llama", 1, pp=2, pp_schedule="1F1B"),
             Case("llama", 1, pp=4, pp_schedule="1F1B", pp_microbatches=4, batch=8),
             Case("llama", 1, pp=4, pp_schedule="GPipe", pp_microbatches=4, batch=8),
             # pipeline stages laid out with FSDP2 and/or TP inside each stage (4 ranks)
             Case("llama", 1, dp_shard=2, pp=2, pp_schedule="1F1B"), Case("llama", 2, pp=2, pp_schedule="1F1B"),
             Case("llama", 1, dp_shard=2, pp=2, pp_schedule="GPipe"),
             # several virtual stages per rank: the 4 blocks cut into 2 x 2 stages, loop and V layouts
             Case("llama", 1, pp=2, pp_schedule="Interleaved1F1B"), Case("llama", 1, pp=2, pp_schedule="ZBVZeroBubble")]
    return {c.name: c for c in cases}


def build_model(name: str, device: str = "cpu"):
    """A small model (nothing downloaded), on ``device`` ("meta": no memory), seeded."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        if name == "llama":
            import transformers

            cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=_VOCAB,
                                           max_position_embeddings=256)
            return transformers.LlamaForCausalLM(cfg)
        if name == "gpt":
            return TinyGPT()
    raise ValueError(f"unknown model {name!r}")


def _tiny_gpt_classes():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.head_dim = dim // heads
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
            self.out_proj = nn.Linear(dim, dim)

        def forward(self, x):
            b, t, _ = x.shape
            # -1 heads: under tensor parallelism a rank holds heads/tp of them (as transformers reshapes)
            q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention(dim, heads)
            self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        """GPT-2-shaped: learned positions, pre-LayerNorm blocks, GELU MLP (4x), tied head."""

        def __init__(self, dim: int = 256, heads: int = 4, layers: int = 4, positions: int = 256) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(_VOCAB, dim), nn.Embedding(positions, dim)
            self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.lm_head = nn.Linear(dim, _VOCAB, bias=False)
            self.lm_head.weight = self.wte.weight
            for m in self.modules():  # GPT-2's initialisation (std 0.02; transformers' GPT2PreTrainedModel)
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, input_ids, labels):
            pos = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.wte(input_ids) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            # next-token prediction, as GPT2LMHeadModel shifts its labels
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    return GPT


def TinyGPT():  # noqa: N802 - a class made on first use (no torch at import)
    return _tiny_gpt_classes()()


def make_batch(case: Case):
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, _VOCAB, (case.batch, case.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def sequence_parallel_plan() -> dict[str, Any]:
    """A Megatron-style sequence-parallel plan for the GPT-2-shaped model (Korthikanti et al. 2022,
    arXiv 2205.05198, section 4.2.2; torchtitan's ``apply_tp`` for Llama): the residual stream and
    the LayerNorms hold 1/tp of the sequence (``SequenceParallel``), all-gathered before attention
    and the MLP (``PrepareModuleInput``, ``ColwiseParallel(input_layouts=Shard(1))``) and
    reduce-scattered after them (``RowwiseParallel(output_layouts=Shard(1))``); the final norm and
    the tied head see the whole sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def to(src, dst):
        return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(dst,), use_local_output=True)

    return {
        "h.0": to(Replicate(), Shard(1)),
        "h.*.ln_1": SequenceParallel(use_local_output=True),
        "h.*.ln_2": SequenceParallel(use_local_output=True),
        "h.*.attn": to(Shard(1), Replicate()),
        "h.*.attn.q_proj": ColwiseParallel(), "h.*.attn.k_proj": ColwiseParallel(),
        "h.*.attn.v_proj": ColwiseParallel(),
        "h.*.attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
        "h.*.c_fc": ColwiseParallel(input_layouts=Shard(1)),
        "h.*.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": to(Shard(1), Replicate()),
    }


def layout_of(case: Case):
    import memguard

    return memguard.Layout(dp_replicate=case.dp_replicate, dp_shard=case.dp_shard, tp=case.tp, pp=case.pp,
                           pp_schedule=case.pp_schedule, pp_microbatches=case.pp_microbatches,
                           pp_stages_per_rank=case.pp_stages_per_rank,
                           tp_plan=sequence_parallel_plan() if case.sp else None)


def estimate_case(case: Case) -> dict[str, Any]:
    import memguard

    t0 = time.perf_counter()
    est = memguard.estimate(build_model(case.model, "meta"), make_batch(case), device="cpu", layout=layout_of(case),
                            precision=case.precision)
    return {"peak_bytes": int(est.peak_bytes), "rank_peak_bytes": list(est.rank_peak_bytes),
            "peak_phase": est.peak_phase, "breakdown": dict(est.breakdown), "phase_peaks": dict(est.phase_peaks),
            "seconds": round(time.perf_counter() - t0, 2)}


def single_process_loss(case: Case) -> float:
    """The first step's loss of the unsharded model in one process (what every rank must match)."""
    import torch

    from memguard.batch import compute_loss

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed"):
        return float(compute_loss(build_model(case.model), make_batch(case)).detach())


# --------------------------------------------------------------------------------------------
# one rank (run in its own process)
# --------------------------------------------------------------------------------------------

_FUNCTIONAL = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
               "reduce_scatter_tensor", "all_to_all_single")


def settle_functional_collectives(pause_s: float) -> None:
    """Wait on every functional collective DTensor issues (``torch.distributed._functional_collectives``,
    called by ``torch/distributed/tensor/placement_types.py`` as ``funcol.all_reduce`` etc.), then
    pause, as :func:`benchmarks.common.settle_collectives` does for ``torch.distributed``'s calls."""
    import torch.distributed._functional_collectives as funcol

    def settled(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else funcol.wait_tensor(out)
            time.sleep(pause_s)
            return out

        call.__wrapped__ = fn
        return call

    for name in _FUNCTIONAL:
        fn = getattr(funcol, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(funcol, name, settled(fn))


def lay_out(case: Case, model: Any, root: Any, mesh: Any, blocks: list | None = None) -> None:
    """Tensor parallelism over ``mesh["tp"]`` with the estimate's plan, then FSDP2 of ``blocks`` (default: the
    repeated blocks) and ``root`` over the data-parallel dimensions, as the estimate lays a rank out."""
    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from memguard.estimator._fsdp2 import FSDP2Layout, shard_model
    from memguard.estimator._layout import resolve_tp_plan

    if case.tp > 1:
        problems: list[str] = []
        plan, _ = resolve_tp_plan(model, layout_of(case), problems)
        if problems:
            raise RuntimeError(problems)
        parallelize_module(model, mesh["tp"], plan)
    if case.dp_shard > 1:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if case.dp_replicate > 1 else mesh["dp_shard"]
        mp = torch.bfloat16 if case.precision == "bf16-mixed" else None
        shard_model(root, FSDP2Layout(world_size=case.dp_shard, zero_stage=3, mp_dtype=mp), dp_mesh, blocks)


def _rank_worker(case: Case, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memguard.batch import compute_loss

    torch.set_num_threads(1)
    if case.pp > 1:
        return _pipeline_worker(case, steps)
    settle_collectives(pause_s=0.02)  # FSDP2's torch.distributed calls (see benchmarks/fsdp2_cpu.py)
    settle_functional_collectives(pause_s=0.02)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (case.dp_replicate, case.dp_shard, case.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = build_model(case.model)
    model.train()
    lay_out(case, model, model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(case)
    losses: list[float] = []
    autocast = case.precision == "bf16-mixed" and case.dp_shard == 1

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = compute_loss(model, batch)
        losses.append(float(loss.detach()))
        return loss

    result = profiled_steps(model, batch, optimizer, forward, steps)
    dist.destroy_process_group()
    return {"rank": rank, **result, "first_loss": losses[0]}


def _pipeline_worker(case: Case, steps: int) -> dict[str, Any]:
    """One pipeline rank: the model cut to its stage as the estimate cuts it
    (:func:`memguard.estimator._pipeline.split_decoder`), a ``PipelineStage`` and its schedule
    (:func:`~memguard.estimator._pipeline.make_schedule`), or, under a multi-stage schedule, to its virtual
    stages (:func:`~memguard.estimator._pipeline.split_decoder_stages`, one ``PipelineStage`` each, the
    schedule over them by :func:`~memguard.estimator._pipeline.make_multi_schedule`); one warm-up step, then
    ``steps`` steps (schedule, ``optimizer.step()``, ``zero_grad``), all under the profiler, the warm-up's
    peak not counted. The baseline is the parameters and the batch; the stage's p2p receive buffers and the
    optimizer's state are made on the warm-up step, where the replay sees them allocated."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.fsdp2_cpu import _storage_bytes
    from memguard.estimator._layout import stages_per_rank
    from memguard.estimator._pipeline import (
        MULTI_STAGE_SCHEDULES,
        causal_lm_loss,
        make_multi_schedule,
        make_schedule,
        rank_stage_indices,
        run_schedule,
        schedule_stages,
        split_decoder,
        split_decoder_stages,
        stage_buffers,
    )

    inner = (case.dp_replicate, case.dp_shard, case.tp)
    if inner != (1, 1, 1):
        settle_collectives(pause_s=0.02)  # FSDP2's and TP's collectives (see _rank_worker)
        settle_functional_collectives(pause_s=0.02)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (case.pp, *inner), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    global_rank, stages = dist.get_rank(), case.pp
    rank = mesh.get_local_rank("pp")
    model = build_model(case.model)
    model.train()
    loss_fn = causal_lm_loss(model)
    batch = make_batch(case)
    micro, cfg = case.batch // case.pp_microbatches, model.config
    hidden = torch.empty(micro, case.seq, cfg.hidden_size)
    ids, logits = torch.empty(micro, case.seq, dtype=torch.long), torch.empty(micro, case.seq, cfg.vocab_size)
    dummy = lambda output, target: output.sum()  # noqa: E731 - a schedule without a loss runs no backward
    if case.pp_schedule in MULTI_STAGE_SCHEDULES:  # the estimate's cut and layout (pipeline stages alone)
        per_rank = stages_per_rank(layout_of(case))
        indices = rank_stage_indices(rank, stages, per_rank, MULTI_STAGE_SCHEDULES[case.pp_schedule])
        modules = split_decoder_stages(model, indices, stages * per_rank)
        holds_last = stages * per_rank - 1 in indices
        schedule = make_multi_schedule(modules, indices, stages * per_rank, case.pp_schedule, case.pp_microbatches,
                                       ids, hidden, logits, loss_fn if holds_last else dummy, torch.device("cpu"),
                                       group=mesh["pp"].get_group())
    else:
        stage_module = split_decoder(model, rank, stages)
        holds_last = rank == stages - 1
        # torchtitan's order per stage: TP, then FSDP2 with the stage as root
        lay_out(case, model, stage_module, mesh, list(getattr(model, model.base_model_prefix).layers))
        schedule = make_schedule(stage_module, rank, stages, case.pp_schedule, case.pp_microbatches,
                                 ids if rank == 0 else hidden, logits if holds_last else hidden,
                                 loss_fn if holds_last else dummy, torch.device("cpu"), group=mesh["pp"].get_group())
    del hidden, ids, logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []

    def step():
        with record_function(_PREFIX + "step"):
            with record_function(_PREFIX + "forward"):
                if holds_last:
                    mb_losses: list = []
                    # no outputs kept, as memguard's run_schedule and parallel.step run it
                    # the V layout's rank 0 holds the first stage as well: it feeds the ids too
                    args = (batch["input_ids"],) if any(st.is_first for st in schedule_stages(schedule)) else ()
                    schedule.step(*args, target=batch["labels"], losses=mb_losses, return_outputs=False)
                    # equal micro-batches, every label counted: the mean of their means is the batch's loss
                    losses.append(float(sum(x.detach() for x in mb_losses) / len(mb_losses)))
                else:
                    run_schedule(schedule, batch)
            with record_function(_PREFIX + "optimizer"):
                optimizer.step()
            with record_function(_PREFIX + "zero_grad"):
                optimizer.zero_grad(set_to_none=True)

    gc.collect()
    gc.disable()
    dist.barrier()

    def live(chunks: bool) -> int:
        # with return_outputs=True the last stage would keep its micro-batches' outputs until the next step
        # (stage.py, output_chunks, cleared by clear_runtime_states); with False it keeps none, and any it did
        # keep would be live at the end, not in the baseline. The receive buffers are read when counted, not
        # held: a stage fed by a stage on the same rank (the V layout's middle) gets a new input and output
        # gradient tensor every step (stage.py, set_local_fwd_input / set_local_bwd_input), and a list kept
        # here would keep the old ones alive
        fwd, grads = stage_buffers(schedule)
        kept = [t for st in schedule_stages(schedule) for t in st.output_chunks if isinstance(t, torch.Tensor)
                ] if chunks else []
        return _live_bytes(model, batch, optimizer) + _storage_bytes(fwd + grads + kept)

    # The warm-up step (the stage's receive buffers, the optimizer's state) runs under the profiler too, its
    # peak not counted: the CPU allocator reports a free to the profiler only for a block it saw allocated
    # while profiling (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter keeps sizes only then), and under
    # the multi-stage schedules a step frees blocks the previous step made (the V layout's same-rank
    # buffers; the input buffers' .grad the split backward leaves, see stage_buffers), which the replay
    # would otherwise count as live for the rest of the step.
    baseline = live(False)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps + 1):
            step()
    end = live(True)
    gc.enable()
    level, phase_peaks, step_peaks, raw_peaks, suspect = _replay(prof, baseline)
    step_peaks, raw_peaks = step_peaks[1:], raw_peaks[1:]  # without the warm-up
    suspect = [k - 1 for k in suspect if k > 0]
    peak = max([p for k, p in enumerate(step_peaks) if k not in suspect] or step_peaks)
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": global_rank, "peak_bytes": peak, "phase_peaks": phase_peaks, "step_peaks": step_peaks,
            "raw_step_peaks": raw_peaks, "suspect_steps": suspect, "baseline_bytes": baseline,
            "residual_bytes": level - end, "first_loss": losses[0] if losses else None}


def run_case(case: Case, *, steps: int, timeout: float) -> list[dict[str, Any]]:
    """One real run of ``case``: one process per rank; each rank's measurement (or an error)."""
    return launch_ranks("layouts_cpu", case, case.world_size, ["--steps", str(steps)], timeout=timeout)


# --------------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------------


def measure(case: Case, *, runs: int, steps: int, timeout: float) -> dict[str, Any]:
    per_run = [run_case(case, steps=steps, timeout=timeout) for _ in range(runs)]
    errors = [r["error"] for rs in per_run for r in rs if "error" in r]
    row: dict[str, Any] = {"case": case.name, **asdict(case), "world_size": case.world_size, "runs": per_run}
    if errors:
        row["error"] = errors[0]
        return row
    row.update(estimate=estimate_case(case), single_process_loss=single_process_loss(case))
    return summarise(row)


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    """Per rank: the worst peak over the runs (ranks whose replay closed, as in fsdp2_cpu), the
    estimate for that rank and the error; and the largest loss difference from one process."""
    per_rank = []
    for rank in range(row["world_size"]):
        ranks = [r for rs in row["runs"] for r in rs if r.get("rank") == rank]
        clean = [r for r in ranks if r["residual_bytes"] == 0] or ranks
        worst = max(r["peak_bytes"] for r in clean)
        est = row["estimate"]["rank_peak_bytes"][rank]
        per_rank.append({"rank": rank, "real_peak_bytes": worst, "real_min_peak_bytes": min(r["peak_bytes"] for r in clean),
                         "estimate_bytes": est, "error_pct": round(100 * (est - worst) / worst, 2),
                         "ranks_unclosed": len(ranks) - len(clean) if clean is not ranks else 0})
    losses = [r["first_loss"] for rs in row["runs"] for r in rs if r.get("first_loss") is not None]
    row.update(per_rank=per_rank, worst_error_pct=max((p["error_pct"] for p in per_rank), key=abs),
               loss_max_abs_diff=max(abs(x - row["single_process_loss"]) for x in losses))
    return row


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Layouts on CPU: per-rank estimate vs. real gloo runs", "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine'].get('cpu_model', '?')}, {meta['machine'].get('cpu_count')} cores, "
        f"torch {meta['machine'].get('torch')}, transformers {meta['machine'].get('transformers')}; "
        f"{meta['runs']} runs x {meta['steps']} profiled steps per case; cases done: {meta.get('cases_done', '?')}", "",
        "Real peak: a rank's worst peak of live tensor bytes over all runs (fresh processes each) and their "
        "profiled steps, replayed by address from the profiler's allocator events (`benchmarks/fsdp2_cpu.py`, "
        "`_replay`), collectives settled. Estimate: `memguard.estimate(..., device=\"cpu\", layout=...)`'s "
        "`rank_peak_bytes` for that rank. Loss: the largest difference of any rank's first-step loss from a "
        "single-process step of the same model and batch (for `-bf16` cases run under "
        "`torch.autocast(\"cpu\", bfloat16)`; a bf16 sum split over shards rounds differently, hence ~1e-4; "
        "under FSDP2 x TP the ranks use FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` "
        "instead of autocast, as memguard's FSDP2 estimate means).", "",
        "| case | ranks | rank | real worst (MiB) | real best (MiB) | estimate (MiB) | error vs worst | loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "per_rank" not in r:
            lines.append(f"| {r['case']} | {r.get('world_size', '?')} | | error: {r.get('error', '?')[:80]} | | | | |")
            continue
        for p in r["per_rank"]:
            lines.append(f"| {r['case']} | {r['world_size']} | {p['rank']} | {p['real_peak_bytes'] / _MIB:.3f} | "
                         f"{p['real_min_peak_bytes'] / _MIB:.3f} | {p['estimate_bytes'] / _MIB:.3f} | "
                         f"{p['error_pct']:+.2f}% | {r['loss_max_abs_diff']:.1e} |")
    ok = [r for r in rows if "per_rank" in r]
    if ok:
        errs = [p["error_pct"] for r in ok for p in r["per_rank"]]
        lines += ["", f"{sum(abs(e) <= 3 for e in errs)} of {len(errs)} rank estimates within 3% of the rank's worst "
                  f"real peak; worst {max(errs, key=abs):+.2f}%."]
        # a rank whose runs disagree, where the replay flagged the worst run's steps for frees it did not see
        unseen = []
        for r in ok:
            for p in r["per_rank"]:
                worst_runs = [x for run in r["runs"] for x in run
                              if x["rank"] == p["rank"] and x["peak_bytes"] == p["real_peak_bytes"]]
                if p["real_peak_bytes"] != p["real_min_peak_bytes"] == p["estimate_bytes"] and worst_runs and all(
                        x["suspect_steps"] or x["residual_bytes"] for x in worst_runs):
                    unseen.append(f"{r['case']} rank {p['rank']}")
        if unseen:
            lines += ["", f"Runs disagree on {', '.join(unseen)}: in the worst run of each, the replay flagged steps "
                      "for blocks freed unseen (`suspect_steps`, or a nonzero `residual_bytes`, in the JSON: gloo's "
                      "worker thread dropping a collective's tensor last), and the estimate equals the best run to "
                      "the byte."]
    return "\n".join(lines) + "\n"


BENCHMARK = MultiRankBenchmark(
    name="layouts_cpu", doc=__doc__, case_type=Case, cases=all_cases,
    worker=lambda case, args: _rank_worker(case, args.steps),
    measure=lambda case, args: measure(case, runs=args.runs, steps=args.steps, timeout=args.timeout),
    render_markdown=render_markdown, mode=merge_mode("layouts_cpu", all_cases),
    describe=lambda row: f"worst rank error {row['worst_error_pct']:+.2f}%", add_arguments=merge_argument("layouts_cpu"))


def main(argv: list[str] | None = None) -> int:
    return BENCHMARK.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
