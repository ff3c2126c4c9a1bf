"""accelerator_kwargs of a plan with a layout: Accelerate's ParallelismConfig, the FSDP2 plugin where it needs
one, and a ConfigError for each layout Accelerate 1.15 cannot run.

The first tests run in this process on hand-made plans (as the planner builds them: strategy ``"fsdp2"`` with
``dp_shard > 1``, else ``"ddp"``) and on one real ``memguard.plan(..., gpus_per_node=2)`` of a tiny Llama; each
produced config is also checked with Accelerate's own ``ParallelismConfig._validate_accelerator`` against a
2..8-process GPU Accelerator stand-in. The last test runs ``accelerate_layout_worker.py`` on 2 CPU processes
(gloo): ``Accelerator(**accelerator_kwargs(plan))`` with ``Layout(dp_shard=2)`` shards a small model over the
config's mesh and trains 2 optimizer steps through memguard's prepare/step (about 15 s).

No tensor-parallel run: Accelerate 1.15 does not run a ``ParallelismConfig`` on CPU processes
(``_validate_accelerator`` takes one only for FSDP2, GPU-like ``MULTI_*`` and DeepSpeed Accelerators, and
``AcceleratorState`` never makes a CPU Accelerator FSDP2), and tensor parallelism alone must not have an FSDP2
plugin (the validation's "no dimension for FSDP to shard" refusal, tested below), so on CPU it has no way in.
FSDP2 x TP does get in with the worker's FSDP2-on-CPU patch (4 gloo ranks), but ``accelerator.prepare`` of a
tensor-parallel model then fails importing transformers' ``ReplicateParallel``, which transformers 5.24 lacks:
accelerator_kwargs refuses that layout then (tested below).
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import memguard
from memguard import ConfigError, Estimate, Layout, Plan
from memguard.integrations.accelerate import accelerator_kwargs

accelerate = pytest.importorskip("accelerate")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402 - after the importorskip
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

WORKER = Path(__file__).with_name("accelerate_layout_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _plan(layout: Layout | None, *, strategy: str | None = None, micro: int = 4, accum: int = 2,
          device: str = "cuda", world: int | None = None) -> Plan:
    """A hand-made plan of ``layout``, with the strategy the layout planner gives it
    (memguard/planner/_layouts.py, ``_plan``: FSDP2 at level 3 when dp_shard > 1, else DDP)."""
    if strategy is None:
        strategy = "fsdp2" if layout is not None and layout.dp_shard > 1 else "ddp"
    world = world if world is not None else layout.world_size if layout is not None else 1
    dp = layout.dp_replicate * layout.dp_shard if layout is not None else world
    pipeline = (layout.pp_microbatches or layout.pp) if layout is not None and layout.pp > 1 else 1
    stage = 0 if strategy == "ddp" else 3
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 10}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1 << 20, device=device, precision="bf16-mixed", zero_stage=stage,
                   world_size=world, gpu=None, micro_batch_size=micro)
    return Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=world,
                global_batch_size=micro * accum * pipeline * dp, precision="bf16-mixed", activation_checkpointing=False,
                zero_stage=stage, strategy=strategy, block_class="LlamaDecoderLayer", budget_bytes=1 << 30,
                estimate=est, device=device, layout=layout)


def _gpu_accelerator(num_processes: int, fsdp2: bool) -> SimpleNamespace:
    """What ``ParallelismConfig._validate_accelerator`` (accelerate/parallelism_config.py, 1.15) reads of an
    Accelerator: that of a launch of ``num_processes`` GPU processes, FSDP2 when it has the plugin (what
    ``AcceleratorState.__init__`` makes of an ``fsdp_plugin`` on GPUs)."""
    return SimpleNamespace(multi_device=True, num_processes=num_processes, is_fsdp2=fsdp2, is_main_process=True,
                           distributed_type=DistributedType.FSDP if fsdp2 else DistributedType.MULTI_GPU)


def _sizes(pc: ParallelismConfig) -> tuple[int, ...]:
    return pc.dp_replicate_size, pc.dp_shard_size, pc.tp_size, pc.cp_size, pc.sp_size


# -------------------------------------------------------------------------------------------------
# in process


def _replicate_parallel() -> bool:
    """Whether transformers has what Accelerate's FSDP2 x TP path imports (see below)."""
    try:
        import transformers.integrations.tensor_parallel as tp
    except ImportError:
        return False
    return hasattr(tp, "ReplicateParallel")


_FSDP2_X_TP = [
    (Layout(dp_shard=4, tp=2), (1, 4, 2, 1, 1), True),  # FSDP2 x TP
    (Layout(dp_replicate=2, dp_shard=2, tp=2), (2, 2, 2, 1, 1), True),  # HSDP x TP
]


@pytest.mark.parametrize("layout, sizes, plugin", [
    (Layout(dp_shard=2), (1, 2, 1, 1, 1), True),  # FSDP2
    (Layout(tp=2), (1, 1, 2, 1, 1), False),  # TP alone: no FSDP2 plugin (Accelerate refuses one, below)
    (Layout(dp_replicate=2, dp_shard=2), (2, 2, 1, 1, 1), True),  # HSDP
    *(_FSDP2_X_TP if _replicate_parallel() else []),
])
def test_a_layout_becomes_accelerates_parallelism_config(layout: Layout, sizes: tuple, plugin: bool) -> None:
    plan = _plan(layout)
    kw = accelerator_kwargs(plan)
    pc = kw.pop("parallelism_config")
    assert isinstance(pc, ParallelismConfig) and _sizes(pc) == sizes and pc.total_size == layout.world_size
    # everything else is what the same plan without a layout gets (its strategy's precision, accumulation, plugin)
    same = accelerator_kwargs(_plan(None, strategy=plan.strategy, world=plan.data_parallel_size))
    assert kw.keys() == same.keys() and ("fsdp_plugin" in kw) == plugin
    if plugin:
        fsdp = kw["fsdp_plugin"]
        assert isinstance(fsdp, FullyShardedDataParallelPlugin) and fsdp.fsdp_version == 2
        assert fsdp.reshard_after_forward is True and fsdp.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    else:
        assert kw == {"mixed_precision": "bf16", "gradient_accumulation_steps": 2}
    # Accelerate's own check of the config against a GPU launch of the layout's ranks passes
    pc._validate_accelerator(_gpu_accelerator(layout.world_size, fsdp2=plugin))


@pytest.mark.parametrize("layout", [lay for lay, _, _ in _FSDP2_X_TP])
def test_fsdp2_x_tp_needs_the_transformers_class_accelerate_imports(layout: Layout) -> None:
    # Accelerator._prepare_tp (accelerator.py, 1.15) under FSDP2 makes the parameters tensor parallelism left plain
    # replicated DTensors with transformers' ReplicateParallel, imported there; transformers 5.24 has none, and
    # accelerator.prepare of a tensor-parallel model then raises ImportError
    from accelerate import Accelerator

    assert "from transformers.integrations.tensor_parallel import ReplicateParallel" in inspect.getsource(
        Accelerator._prepare_tp)
    if _replicate_parallel():
        pc = accelerator_kwargs(_plan(layout))["parallelism_config"]
        assert (pc.dp_shard_size, pc.tp_size) == (layout.dp_shard, layout.tp)
    else:
        with pytest.raises(ConfigError, match=r"transformers' ReplicateParallel .* install a transformers that has it, "
                                              r"plan again without gpus_per_node="):
            accelerator_kwargs(_plan(layout))


def test_tensor_parallelism_alone_must_not_get_an_fsdp2_plugin() -> None:
    # what the plugin's absence avoids: Accelerate refuses FSDP2 with neither dp_shard nor cp to shard over
    pc = accelerator_kwargs(_plan(Layout(tp=2)))["parallelism_config"]
    with pytest.raises(ValueError, match="no dimension for FSDP to shard across"):
        pc._validate_accelerator(_gpu_accelerator(2, fsdp2=True))


def test_replicas_alone_get_accelerates_plain_ddp() -> None:
    # ParallelismConfig's docstring calls dp_replicate alone invalid ("use DistributedDataParallelKwargs"), and
    # on CPU processes _validate_accelerator refuses it: the plan gets the kwargs of plain DDP over 4 processes
    plan = _plan(Layout(dp_replicate=4), device="cpu")
    assert accelerator_kwargs(plan) == accelerator_kwargs(_plan(None, world=4, device="cpu")) == {
        "mixed_precision": "bf16", "gradient_accumulation_steps": 2, "cpu": True}


def test_the_config_ignores_accelerates_environment_for_dimensions_the_layout_lacks(monkeypatch) -> None:
    # accelerate launch may export PARALLELISM_CONFIG_*; ParallelismConfig.__post_init__ reads them for sizes not given
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert _sizes(accelerator_kwargs(_plan(Layout(dp_shard=2)))["parallelism_config"]) == (1, 2, 1, 1, 1)


@pytest.mark.parametrize("plan, messages", [
    # Accelerate has no pipeline dimension
    (lambda: _plan(Layout(pp=2)), ["layout pp=2 (2 ranks) has 2 pipeline stages",
                                   "run the stages with torch.distributed.pipelining, or plan again with "
                                   "gpus_per_node=world_size"]),
    # ParallelismConfig.__post_init__ refuses TP with replicas alone
    (lambda: _plan(Layout(dp_replicate=2, tp=2)), ["refuses tensor parallelism over replicas alone "
                                                   "(dp_replicate=2 x tp=2 (4 ranks)): use Layout(dp_shard=2, tp=2)"]),
    # both at once
    (lambda: _plan(Layout(dp_replicate=2, tp=2, pp=2)), ["pipeline stages", "use Layout(dp_shard=2, tp=2)"]),
    # a strategy that is not the layout's (memguard.plan never makes these)
    (lambda: _plan(Layout(tp=2), strategy="fsdp2"), ["strategy 'fsdp2' conflicts with its layout tp=2 (2 ranks)"]),
    (lambda: _plan(Layout(dp_shard=2), strategy="ddp"), ["strategy 'ddp' conflicts with its layout dp_shard=2"]),
    (lambda: _plan(Layout(dp_shard=2), strategy="deepspeed"), ["a DeepSpeed plan does not take a layout"]),
])
def test_what_accelerate_cannot_run_is_a_config_error(plan, messages: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        accelerator_kwargs(plan())
    for m in messages:
        assert m in str(info.value), str(info.value)


def test_accelerate_itself_refuses_tensor_parallelism_over_replicas_alone() -> None:
    # the refusal above is Accelerate's (parallelism_config.py, __post_init__)
    with pytest.raises(ValueError, match="cannot be used with pure data parallelism"):
        ParallelismConfig(dp_replicate_size=2, tp_size=2)


def test_a_real_layout_plan_gets_its_layouts_config() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 32, dtype=torch.long)
    plan = memguard.plan(model, {"input_ids": ids, "labels": ids}, global_batch_size=8, device="cpu",
                         budget_bytes=1 << 30, world_size=2, gpus_per_node=2, precision="32-true",
                         activation_checkpointing=False, optimizer=lambda p: torch.optim.AdamW(p, foreach=False))
    lay = plan.layout
    assert isinstance(lay, Layout) and lay.world_size == 2 and lay.pp == 1  # one node: no pipeline stages
    assert plan.block_class == "LlamaDecoderLayer"  # so an FSDP2 plugin wraps each block, as the estimate shards
    kw = accelerator_kwargs(plan)
    assert kw["mixed_precision"] == "no" and kw["cpu"] is True
    if lay.dp_shard == lay.tp == 1:  # DDP replicas: Accelerate's plain DDP
        assert "parallelism_config" not in kw and "fsdp_plugin" not in kw
    else:
        pc = kw["parallelism_config"]
        assert _sizes(pc) == (lay.dp_replicate, lay.dp_shard, lay.tp, 1, 1)
        assert ("fsdp_plugin" in kw) == (lay.dp_shard > 1) == (plan.strategy == "fsdp2")
        pc._validate_accelerator(_gpu_accelerator(2, fsdp2="fsdp_plugin" in kw))


# -------------------------------------------------------------------------------------------------
# 2 CPU processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks under torchrun, as the other workers")
def test_a_dp_shard_layout_trains_under_accelerate_on_two_ranks(tmp_path: Path) -> None:
    # Layout(dp_shard=2): a micro-batch of 8, 2 accumulated, 2 ranks -> 32 samples per optimizer step, 2 steps
    cfg = {"out": str(tmp_path), "steps": 2, "batch": 8, "accumulate": 2, "seq": 8}
    env = dict(os.environ, MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(WORKER), json.dumps(cfg)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the Accelerate run did not finish within {TIMEOUT_S} s: the ranks hung")
    assert proc.returncode == 0, out[-3000:]
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2))
    for r in (r0, r1):
        assert r["error"] is None, r["error"]
        assert r["config"] == [1, 2, 1, 1, 1]  # ParallelismConfig(dp_shard_size=2)
        # unpatched, Accelerate 1.15 refuses it on CPU processes (the FSDP plugin ignored, the state MULTI_CPU)
        assert "ParallelismConfig is only compatible" in r["unpatched"] and "MULTI_CPU" in r["unpatched"]
        assert r["distributed_type"] == "FSDP" and r["is_fsdp2"] and r["num_processes"] == 2
        assert r["mesh"] == [["dp_shard"], [2]]  # the config's device mesh
        # fully_shard over the config's joint FSDP dimension (ParallelismConfig.fsdp_dim_names)
        assert r["param_meshes"] == [[["dp_shard_cp"], [2]]]
        assert r["steps"] == 2 and len(r["ran"]) == 2 and len(r["losses"]) == 4
    # each step ran its 32 samples once over both ranks, each rank its own half (Accelerate's batch sharding)
    for s in range(2):
        assert sorted(r0["ran"][s] + r1["ran"][s]) == list(range(32 * s, 32 * (s + 1)))
        assert not set(r0["ran"][s]) & set(r1["ran"][s])
    w0, w1 = torch.load(tmp_path / "weights0.pt"), torch.load(tmp_path / "weights1.pt")
    ref = torch.load(tmp_path / "reference.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the reference is one process on each step's 32 samples; ~3e-7 observed, 1e-5 allowed
    assert max(((w0[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref) <= 1e-5
