"""memguard.integrations.accelerate: prepare/step with a real ``accelerate.Accelerator`` on CPU.

The first tests run in this process on a tiny model (a second each): the Accelerator's kwargs from
a plan, the plan checked against the Accelerator, planning on the first step constrained to the
Accelerator's precision, and weights equal to a plain full-batch loop. The last tests run
``accelerate_worker.py`` in subprocesses whose address space is capped with ``RLIMIT_AS``, so the
CPU allocator really runs out of memory inside the loop; each takes a few seconds of CPU on an
idle machine, and the timeouts only catch hangs.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memguard import ConfigError, Estimate, MissingDependencyError, Plan
from memguard.integrations.accelerate import accelerator_kwargs, evaluate, prepare, status, step
from tests.deepspeed_op import shm_op_prebuilt
from worker_common import check_samples  # this folder is on sys.path under pytest

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState  # noqa: E402 - after the importorskip

WORKER = Path(__file__).with_name("accelerate_worker.py")
EVAL_WORKER = Path(__file__).with_name("accelerate_eval_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300

N = 128
X = torch.randn(N, 8, 16, generator=torch.Generator().manual_seed(3))
Y = torch.randn(N, generator=torch.Generator().manual_seed(4))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return ((model(x).mean(dim=(1, 2)).float() - y) ** 2).mean()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state; each test builds its own Accelerator."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _plan(micro: int, accum: int, precision: str = "32-true", **kw) -> Plan:
    """A hand-made plan (the planner is not needed to test the translation)."""
    est = Estimate(peak_bytes=1 << 20, breakdown={"params": 1 << 10}, context_bytes=0, peak_phase="backward",
                   allocated_peak_bytes=1 << 20, device="cpu", precision=precision, zero_stage=0, world_size=1,
                   gpu=None, micro_batch_size=micro)
    return Plan(micro_batch_size=micro, grad_accum_steps=accum, world_size=1, global_batch_size=micro * accum,
                precision=precision, activation_checkpointing=False, zero_stage=kw.pop("zero_stage", 0),
                budget_bytes=1 << 30, estimate=est, device=kw.pop("device", "cpu"), **kw)


def _reference(model: nn.Module, global_batch: int) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(0, N, global_batch):
        loss_fn(model, (X[i:i + global_batch], Y[i:i + global_batch])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _rel(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(((sa[k] - sb[k]).norm() / sb[k].norm()).item() for k in sb)


# -------------------------------------------------------------------------------------------------
# in process


@pytest.mark.parametrize("precision, device, expected", [
    # Lightning's precision names -> Accelerate's mixed_precision; "*-true" runs without autocast
    ("32-true", "cpu", {"mixed_precision": "no", "gradient_accumulation_steps": 4, "cpu": True}),
    ("bf16-mixed", "cpu", {"mixed_precision": "bf16", "gradient_accumulation_steps": 4, "cpu": True}),
    ("16-mixed", "cuda", {"mixed_precision": "fp16", "gradient_accumulation_steps": 4}),  # cpu only for CPU plans
    ("bf16-true", "cuda", {"mixed_precision": "no", "gradient_accumulation_steps": 4}),  # prepare() casts the model
])
def test_accelerator_kwargs(precision: str, device: str, expected: dict) -> None:
    assert accelerator_kwargs(_plan(8, 4, precision, device=device)) == expected


def test_accelerator_kwargs_of_a_deepspeed_plan_builds_its_plugin() -> None:
    from accelerate.utils import DeepSpeedPlugin

    from memguard.integrations.deepspeed import to_config

    plan = _plan(8, 4, "bf16-mixed", zero_stage=2, offload_optimizer=True, device="cuda")
    kw = accelerator_kwargs(plan)
    # Accelerate's mixed_precision names the config's precision; the accumulation is the plan's
    assert (kw["mixed_precision"], kw["gradient_accumulation_steps"]) == ("bf16", 4) and "cpu" not in kw
    ds = kw["deepspeed_plugin"]
    assert isinstance(ds, DeepSpeedPlugin)
    # the plugin holds to_config(plan): stage 2 with optimizer offload, bf16, micro-batch 8 x 4
    assert ds.zero_stage == 2 and ds.gradient_accumulation_steps == 4
    # to_config's keys, plus what Accelerate adds itself (steps_per_print)
    assert {k: v for k, v in ds.hf_ds_config.config.items() if k != "steps_per_print"} == to_config(plan)
    assert ds.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds.deepspeed_config["train_micro_batch_size_per_gpu"] == 8
    with pytest.raises(ConfigError, match="16-true"):  # no DeepSpeed equivalent
        accelerator_kwargs(_plan(8, 4, "16-true", zero_stage=1))
    # a CPU DeepSpeed plan gets no cpu=True either: Accelerate 1.15 would ignore the DeepSpeed plugin with it
    # (AcceleratorState.__init__ takes its DeepSpeed branch only when not cpu)
    cpu_kw = accelerator_kwargs(_plan(8, 4, zero_stage=2))
    assert "cpu" not in cpu_kw and cpu_kw["deepspeed_plugin"].zero_stage == 2


def _fsdp2_plan(micro: int, accum: int, precision: str, **kw) -> Plan:
    import dataclasses

    if "strategy" not in {f.name for f in dataclasses.fields(Plan)}:
        pytest.skip("this Plan does not record a strategy yet")
    return _plan(micro, accum, precision, strategy="fsdp2", **kw)


@pytest.mark.parametrize("stage, precision, mixed, param_dtype, reshard, sync_each", [
    # zero_stage 3 under FSDP2 = reshard_after_forward=True; gradients reduce-scattered every micro-batch
    (3, "bf16-mixed", "no", torch.bfloat16, True, True),
    # stage 2 = parameters kept gathered between forward and backward, gradients still sharded each micro-batch
    (2, "32-true", "no", None, False, True),
    # stage 1 = stage 2 with gradient sync on the last micro-batch only; fp16 needs Accelerate's GradScaler
    (1, "16-mixed", "fp16", torch.float16, False, False),
])
def test_accelerator_kwargs_of_an_fsdp2_plan_builds_its_plugin(stage, precision, mixed, param_dtype, reshard,
                                                               sync_each) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin, GradientAccumulationPlugin

    plan = _fsdp2_plan(8, 4, precision, zero_stage=stage, block_class="Block", device="cuda")
    kw = accelerator_kwargs(plan)
    assert kw["mixed_precision"] == mixed and "gradient_accumulation_steps" not in kw
    fsdp = kw["fsdp_plugin"]
    assert isinstance(fsdp, FullyShardedDataParallelPlugin)
    assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward is reshard
    assert fsdp.transformer_cls_names_to_wrap == ["Block"]  # each repeated block, then the root
    from torch.distributed.fsdp import CPUOffloadPolicy

    # no offload: Accelerate keeps the base OffloadPolicy, not the CPU one
    assert fsdp.activation_checkpointing is False and not isinstance(fsdp.cpu_offload, CPUOffloadPolicy)
    if param_dtype is None:
        assert fsdp.mixed_precision_policy is None
    else:  # 16-bit parameters in compute, fp32 gradient reduction
        assert fsdp.mixed_precision_policy.param_dtype == param_dtype
        assert fsdp.mixed_precision_policy.reduce_dtype == torch.float32
    ga = kw["gradient_accumulation_plugin"]
    assert isinstance(ga, GradientAccumulationPlugin)
    assert (ga.num_steps, ga.sync_each_batch) == (4, sync_each)


def test_a_plan_runs_with_accelerates_accumulation_and_matches_full_batch() -> None:
    net = _net()
    initial = copy.deepcopy(net)
    plan = _plan(16, 4)
    acc = accelerate.Accelerator(**accelerator_kwargs(plan))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt, model = prepare(acc, opt, net, plan=plan, loss_fn=loss_fn)  # returned in the order given
    assert isinstance(opt, accelerate.optimizer.AcceleratedOptimizer) and isinstance(model, nn.Module)
    loader = acc.prepare(DataLoader(TensorDataset(X, Y), batch_size=plan.micro_batch_size))
    losses = [step(acc, model, opt, b) for b in loader]
    # one loss per dataloader batch; the first is the untrained model's mean loss on the first 16 samples
    assert len(losses) == 8
    assert losses[0] == pytest.approx(loss_fn(initial, (X[:16], Y[:16])).item(), rel=1e-6)
    st = status(model)
    assert (st.steps, st.micro_batch_size, st.oom_retries, st.precision) == (2, 16, 0, "32-true")
    # fp32, 64 samples per step summed in four micro-batches: ~1e-7 observed, 1e-5 allowed
    assert _rel(acc.unwrap_model(model), _reference(initial, 64)) <= 1e-5


def test_planning_on_the_first_step_splits_each_batch_and_follows_the_accelerators_precision() -> None:
    net = _net()
    initial = copy.deepcopy(net)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    # about 1.3 KiB of activations per sample: 40 kB cannot hold a 32-sample batch at once
    model, opt = prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), loss_fn=loss_fn,
                         budget_bytes=40_000)
    loader = acc.prepare(DataLoader(TensorDataset(X, Y), batch_size=32))
    for b in loader:
        step(acc, model, opt, b)
    st = status(model)
    # default global batch: 32 x 2 accumulated batches x 1 process
    assert st.plan.global_batch_size == 64 and st.plan.precision == "32-true"
    assert st.micro_batch_size == st.plan.micro_batch_size < 32 and st.steps == 2
    assert _rel(acc.unwrap_model(model), _reference(initial, 64)) <= 1e-5


def test_the_plan_is_constrained_to_bf16_when_the_accelerator_runs_bf16() -> None:
    net = _net()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model, opt = prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=loss_fn, budget_bytes=1 << 30)
    step(acc, model, opt, (X[:16], Y[:16]))
    assert status(model).plan.precision == "bf16-mixed"


def test_a_plan_that_does_not_match_the_accelerator_is_refused() -> None:
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=1)
    net = _net()
    with pytest.raises(ConfigError) as info:
        prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), plan=_plan(8, 4, "bf16-mixed"))
    text = str(info.value)
    assert "2 problems" in text and "precision 'bf16-mixed'" in text and "accumulates 4 micro-batches" in text
    with pytest.raises(ConfigError, match="the Accelerator runs '32-true'"):
        prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), precision="bf16-mixed", budget_bytes=1 << 30)


def test_bad_arguments_are_listed_at_once() -> None:
    acc = accelerate.Accelerator(cpu=True)
    net = _net()
    with pytest.raises(ConfigError) as info:
        prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), max_retries=-1, max_grad_norm=-0.5, world_size=2)
    text = str(info.value)
    assert "3 problems" in text and "max_retries" in text and "max_grad_norm" in text and "world_size" in text
    with pytest.raises(ConfigError, match="not prepared by memguard"):
        step(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), (X[:4], Y[:4]))


def test_missing_accelerate_names_the_pip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate an environment without accelerate: None in sys.modules makes the import fail.
    monkeypatch.setitem(sys.modules, "accelerate", None)
    net = _net()
    with pytest.raises(MissingDependencyError, match=r"pip install 'memguard\[accelerate\]'"):
        prepare(object(), net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_planning_from_an_example_batch_applies_checkpointing() -> None:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])

        def forward(self, x):
            return self.blocks(x)

    net = Stack()
    acc = accelerate.Accelerator(cpu=True)
    model, _ = prepare(acc, net, torch.optim.SGD(net.parameters(), lr=0.1), example_batch=(X[:32], Y[:32]),
                       loss_fn=loss_fn, budget_bytes=1 << 30, activation_checkpointing=True)
    plan = status(model).plan
    assert plan.activation_checkpointing and plan.checkpoint_blocks in (1, 2, 3)  # some of the 3 blocks
    marked = [getattr(b, "_memguard_checkpointed", False) for b in net.blocks]
    assert sum(marked) == plan.checkpoint_blocks and marked[0]


# -------------------------------------------------------------------------------------------------
# real out-of-memory errors, in subprocesses (see accelerate_worker.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_worker(tmp_path: Path, world: int = 1, worker: Path = WORKER, **cfg) -> list[dict]:
    cfg = {"out": str(tmp_path), "steps": 3, "seq": 64, "budget_mib": 20, **cfg}
    env = dict(os.environ)
    if cfg.get("deepspeed") is not None:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator and its shm comm op (tests/deepspeed_op.py)
    # One malloc arena and a fixed mmap threshold: large tensors are mmapped and unmapped when freed, so
    # the address space tracks live memory and the cap bites where the test expects (tests/guard).
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    command = [sys.executable, str(worker), json.dumps(cfg)]
    if world > 1:  # torchrun starts the ranks; the Accelerator then runs DDP over gloo
        command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
                        "127.0.0.1", "--master_port", str(_free_port())]
    # A new session, so that a hang is ended by killing every rank at once.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the Accelerate loop did not finish within {TIMEOUT_S} s: the ranks hung")
    assert proc.returncode == 0, out[-3000:]
    return [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(world)]


def _rel_sd(tmp_path: Path, rank: int = 0) -> float:
    a, b = torch.load(tmp_path / f"accelerate{rank}.pt"), torch.load(tmp_path / "reference.pt")
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


pytestmark_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")


@pytestmark_linux
def test_a_real_oom_halves_and_ends_with_the_full_batch_weights(tmp_path: Path) -> None:
    # memguard plans micro-batch 64 on the first step (1 GiB budget); from batch 1 on the process may
    # use 20 MiB more: about 1 MiB per sample at seq=64, so 64 and 32 fail and 16 fits.
    [r] = _run_worker(tmp_path, batch=64, plan="planner", accumulate=1, cap_batch=1)
    assert r["error"] is None and r.get("capped")
    msgs = [m for m in r["messages"] if m.startswith("WARNING:out of memory")]
    assert len(msgs) == 2 and all("DefaultCPUAllocator" in m for m in msgs)
    assert (r["planned"], r["micro_batch_size"], r["oom_retries"], r["steps"]) == (64, 16, 2, 3)
    check_samples(r, steps=3, per_step=64)
    # fp32, micro-batches summed in another grouping than the full batch: ~1e-7 observed, 1e-5 allowed
    assert _rel_sd(tmp_path) <= 1e-5


@pytestmark_linux
@pytest.mark.cpu_truth
def test_evaluate_halves_a_validation_batch_that_does_not_fit(tmp_path: Path) -> None:
    # the single-process run above, then a validation batch of 128 samples (about 0.5 MiB each under no_grad:
    # 64 MiB whole) under the same 20 MiB cap
    [r] = _run_worker(tmp_path, batch=64, plan="planner", accumulate=1, cap_batch=1, eval_factor=2)
    assert r["error"] is None and r.get("capped")
    e = r["eval"]
    assert e["oom_retries"] == 2 and e["micro"] == [32], e  # 128 -> 64 -> 32
    halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
    assert len(halvings) == e["oom_retries"] and all("DefaultCPUAllocator" in m for m in halvings)
    assert e["gathered"] == 128 and e["pred_max_diff"] <= 1e-5
    assert e["loss"] == pytest.approx(e["ref_loss"], rel=1e-6)
    assert e["train_micro"] == [16, 16]  # the training micro-batch (halved by training's OOMs) stays as it was


def test_evaluate_splits_under_the_accelerators_autocast_and_equals_the_whole_batch() -> None:
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    net = acc.prepare(_net())
    seen: list = []
    net[0].register_forward_hook(lambda m, a, o: seen.append((a[0].shape[0], o.dtype)))  # inside the autocast
    out = evaluate(acc, net, X, micro_batch_size=48)
    assert [n for n, _ in seen] == [48, 48, 32] and {d for _, d in seen} == {torch.bfloat16}
    assert net.training  # eval() for the call only
    with torch.no_grad(), acc.autocast():
        torch.testing.assert_close(out, net.eval()(X))
    loss = evaluate(acc, net, (X, Y), lambda m, b: loss_fn(m, b), micro_batch_size=40)
    with torch.no_grad(), acc.autocast():
        assert float(loss) == pytest.approx(float(loss_fn(net, (X, Y))), rel=1e-2)  # bf16 partial means


def test_evaluate_lists_bad_arguments() -> None:
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(ConfigError) as info:
        evaluate(object(), "model", X, fn=3, micro_batch=4)
    assert len(info.value.problems) == 4, info.value.problems
    with pytest.raises(ConfigError, match="micro_batch_size"):
        evaluate(acc, _net(), X, micro_batch_size=0)


@pytestmark_linux
def test_an_oom_in_the_second_accumulated_batch_replays_the_step(tmp_path: Path) -> None:
    # Plan 32 x 2 through accelerator_kwargs; the cap comes at batch 3, the second batch of step 2.
    [r] = _run_worker(tmp_path, batch=32, plan=[32, 2], cap_batch=3)
    assert r["error"] is None
    msgs = [m for m in r["messages"] if m.startswith("WARNING:out of memory")]
    assert len(msgs) == 1 and "retrying the 2 batches of this optimizer step so far (64 samples)" in msgs[0]
    assert (r["micro_batch_size"], r["steps"]) == (16, 3)
    check_samples(r, steps=3, per_step=64)
    # fp32; ~1e-6 observed (the replayed step sums four micro-batches), 1e-5 allowed
    assert _rel_sd(tmp_path) <= 1e-5


@pytestmark_linux
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_ddp_one_rank_runs_out_and_both_ranks_replay_together(tmp_path: Path) -> None:
    # torchrun, 2 CPU processes, 32-sample batches and 2 accumulated: memguard plans micro-batch 64 for
    # each rank's 64 samples per step (1 GiB budget), so every batch runs whole; only rank 1 is capped,
    # at its batch 3 (the second batch of the second step): 32 fails in 20 MiB, 16 fits.
    # After training each rank evaluates a 128-sample batch of its own (eval_factor=4) under the same cap: about
    # 0.5 MiB per sample under no_grad, so rank 1 fails at 128 and 64 and runs 32 at a time, rank 0 runs it whole;
    # both then gather once (no hang).
    r0, r1 = _run_worker(tmp_path, world=2, batch=32, plan="planner", accumulate=2, cap_batch=3, cap_ranks=[1],
                         eval_factor=4)
    assert r0["error"] is None and r1["error"] is None and r1.get("capped") and not r0.get("capped")
    m0 = [m for m in r0["messages"] if m.startswith("WARNING:out of memory")]
    m1 = [m for m in r1["messages"] if m.startswith("WARNING:out of memory")]
    assert len(m0) == len(m1) == 1 and "on rank 1;" in m0[0] and "DefaultCPUAllocator" in m1[0]
    assert r0["planned"] == r1["planned"] == 64
    assert r0["micro_batch_size"] == r1["micro_batch_size"] == 16 and r0["steps"] == r1["steps"] == 3
    for r in (r0, r1):
        check_samples(r, steps=3, per_step=64)
    w0, w1 = torch.load(tmp_path / "accelerate0.pt"), torch.load(tmp_path / "accelerate1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the reference is one process on the step's 128 samples; DDP averages two ranks' means of 64
    assert _rel_sd(tmp_path) <= 1e-5
    # evaluation: rank 1 split alone and logged it, rank 0 ran whole; each gathered both ranks' predictions
    e0, e1 = r0["eval"], r1["eval"]
    assert e0["oom_retries"] == 0 and (e1["oom_retries"], e1["micro"]) == (2, [32]), e1  # 128 -> 64 -> 32
    assert any("OOM in evaluation at micro-batch 128" in m for m in r1["messages"])
    assert e0["gathered"] == e1["gathered"] == 256
    for e in (e0, e1):
        assert e["pred_max_diff"] <= 1e-5 and e["loss"] == pytest.approx(e["ref_loss"], rel=1e-6)
        assert e["train_micro"] == [16, 16]  # the training micro-batch is not the evaluation's


@pytestmark_linux
@pytest.mark.parametrize("cfg, retries", [
    # memguard plans from an example batch before accelerator.prepare shards the model: micro-batch 64 for each
    # rank's 64-sample batch (1 GiB budget); rank 1 capped (20 MiB) from batch 1: 64 and 32 fail, 16 fits
    ({"batch": 64, "plan": "planner", "accumulate": 1, "cap_batch": 1, "fsdp2": True}, 2),
    # a hand-made FSDP2 plan of 32 x 2 (accelerator_kwargs builds the plugin: sync_each_batch, reshard after
    # forward, each Linear wrapped); rank 1 capped at its batch 3, the second of step 2: 32 fails, 16 fits, and
    # both ranks replay batch 2 before batch 3
    ({"batch": 32, "plan": [32, 2], "cap_batch": 3, "fsdp2": True}, 1),
    # the same two runs under FSDP1 (FullyShardedDataParallel, FULL_SHARD, each Linear wrapped, use_orig_params)
    ({"batch": 64, "plan": "planner", "accumulate": 1, "cap_batch": 1, "fsdp1": True}, 2),
    ({"batch": 32, "plan": [32, 2], "cap_batch": 3, "fsdp1": True}, 1),
])
def test_fsdp_one_rank_runs_out_and_both_ranks_replay_together(tmp_path: Path, cfg: dict, retries: int) -> None:
    # torchrun, 2 CPU processes; the Accelerator shards the model with FSDP2 (fully_shard of each Linear and the
    # root, through Accelerate's own fsdp2_prepare_model) or wraps it in FSDP1. memguard arms an agreement before
    # each FSDP all-gather and reduce-scatter, so rank 0 leaves its forward/backward when rank 1 fails in compute.
    r0, r1 = _run_worker(tmp_path, world=2, cap_ranks=[1], **cfg)
    assert r0["error"] is None and r1["error"] is None and r1.get("capped") and not r0.get("capped")
    m0 = [m for m in r0["messages"] if m.startswith("WARNING:out of memory")]
    m1 = [m for m in r1["messages"] if m.startswith("WARNING:out of memory")]
    assert len(m0) == len(m1) == retries
    assert all("on rank 1;" in m for m in m0) and all("DefaultCPUAllocator" in m for m in m1)
    assert r0["micro_batch_size"] == r1["micro_batch_size"] == 16 and r0["steps"] == r1["steps"] == 3
    assert r0["agreements"] == r1["agreements"] > 0  # the same agreements on both ranks: none left unmatched
    for r in (r0, r1):
        check_samples(r, steps=3, per_step=64)
    w0, w1 = torch.load(tmp_path / "accelerate0.pt"), torch.load(tmp_path / "accelerate1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the reference is one process on the step's 128 samples; ~3e-7 observed, 1e-5 allowed
    assert _rel_sd(tmp_path) <= 1e-5


@pytestmark_linux
@pytest.mark.parametrize("fsdp", ["fsdp2", "fsdp1"])
def test_fsdp_evaluate_splits_on_every_rank_when_one_runs_out(tmp_path: Path, fsdp: str) -> None:
    # The FSDP planner run above (rank 1 capped at 20 MiB from batch 1), then each rank evaluates a 128-sample
    # batch of its own (eval_factor=2, about 0.5 MiB per sample under no_grad) under the same cap with
    # memguard.integrations.accelerate.evaluate: rank 1 fails at 128 and 64; both ranks halve together (each
    # forward all-gathers the Linear groups, or FSDP1's units, so the ranks must run the same forwards) and run
    # 32 at a time, under the rank group memguard's training prepared.
    r0, r1 = _run_worker(tmp_path, world=2, batch=64, plan="planner", accumulate=1, cap_batch=1, cap_ranks=[1],
                         eval_factor=2, **{fsdp: True})
    assert r0["error"] is None and r1["error"] is None and r1.get("capped") and not r0.get("capped")
    e0, e1 = r0["eval"], r1["eval"]
    for r, e in ((r0, e0), (r1, e1)):
        halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
        assert len(halvings) == e["oom_retries"] == 2, (halvings, e)  # logged on both ranks
        assert "at micro-batch 128 on rank 1" in halvings[0] and "at micro-batch 64 on rank 1" in halvings[1]
        assert e["micro"] == [32], e  # the same eval micro-batch remembered on both ranks
        assert e["gathered"] == 256
        # the unsplit forward of the same sharded model after the cap is lifted
        assert e["pred_max_diff"] <= 1e-5 and e["loss"] == pytest.approx(e["ref_loss"], rel=1e-6)
        assert e["train_micro"] == [16, 16]  # the training micro-batch is not the evaluation's
    assert any("DefaultCPUAllocator" in m for m in r1["messages"] if "OOM in evaluation" in m)


# Evaluation under Accelerate's FSDP1 and DeepSpeed plugins (accelerate_eval_worker.py): rank 0 evaluates 24 samples,
# rank 1 64, rank 1 capped at 20 MiB more than it holds. The no-grad forward keeps about 0.5 MiB per sample (fc1's and
# GELU's outputs at seq=64, 1024 wide, fp32): 64 samples (32 MiB) fail, 32 fit.
_EVAL = {"sizes": [24, 64], "cap_ranks": [1], "budget_mib": 20}


def _check_eval(r0: dict, r1: dict, together: bool) -> None:
    assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
    assert r1["capped"] and not r0["capped"]
    for r, n in ((r0, 24), (r1, 64)):
        # the unsplit, uncapped forward of the same prepared model; fp32, rows computed in other groupings
        assert r["shape"] == r["reference_shape"] == [n]
        assert r["max_abs"] <= 1e-6 and r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6), r
        assert r["training"]  # eval() for the call only
    # rank 1 failed at 64 with the allocator's own error, and ran 32 at a time
    assert len(r1["retries"]) == r1["oom_retries"] == 1 and "at micro-batch 64" in r1["retries"][0]
    assert "DefaultCPUAllocator" in r1["retries"][0] and r1["forwards"] == 2 and r1["micro"] == [32]
    if together:
        # the forward all-gathers parameters from both ranks: both halved together (logged on both); rank 0's 24
        # samples end before the second micro-batch [32, 64): it ran a padding forward, the same forwards as rank 1
        assert len(r0["retries"]) == r0["oom_retries"] == 1 and "on rank 1" in r0["retries"][0]
        assert (r0["forwards"], r0["padding_forwards"], r1["padding_forwards"]) == (1, 1, 0)
        assert r0["micro"] == [32]
    else:  # ZeRO-1/2 forwards start no collective: rank 0 ran its batch whole, alone
        assert (r0["retries"], r0["oom_retries"], r0["forwards"], r0["padding_forwards"]) == ([], 0, 1, 0)


@pytestmark_linux
@pytest.mark.parametrize("use_orig_params", [True, False])
def test_evaluate_under_fsdp1_splits_on_every_rank_when_one_runs_out(tmp_path: Path, use_orig_params: bool) -> None:
    # accelerator.prepare wraps the model in FullyShardedDataParallel (FULL_SHARD, each Linear a unit); every unit's
    # forward all-gathers its flat parameter, so the ranks split together (memguard.guard._fsdp1's forward reset)
    r0, r1 = _run_worker(tmp_path, world=2, worker=EVAL_WORKER, fsdp1={"use_orig_params": use_orig_params}, **_EVAL)
    assert r0["kind"] == r1["kind"] == "FSDP"
    _check_eval(r0, r1, together=True)


def test_evaluate_refuses_an_accelerator_it_does_not_run_under() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.MEGATRON_LM
    PartialState._shared_state["distributed_type"] = DistributedType.MEGATRON_LM
    with pytest.raises(ConfigError, match="distributed_type MEGATRON_LM is not one memguard evaluates under"):
        evaluate(accelerator, _net(), X)


_SHM_SKIP = "DeepSpeed's shm comm op is not built for the ninja on PATH (bash scripts/dev.sh setup builds it)"
# CI builds the op in its set-up, so there these tests never skip: a missing build fails them
_NO_SHM_OP = not shm_op_prebuilt() and not os.environ.get("CI")


@pytestmark_linux
@pytest.mark.skipif(_NO_SHM_OP, reason=_SHM_SKIP)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_one_rank_runs_out_and_both_ranks_replay_together(tmp_path: Path, stage: int) -> None:
    # torchrun, 2 CPU processes; a hand-made DeepSpeed plan of 32 x 2 (accelerator_kwargs builds Accelerate's
    # DeepSpeedPlugin from to_config(plan)), so accelerator.prepare builds a ZeRO-<stage> engine. memguard runs
    # each batch through the engine with an agreement before every DeepSpeed collective. Rank 1 is capped (20 MiB)
    # at its batch 3, the second of step 2: micro-batch 32 fails there (about 1 MiB per sample), 16 fits; both
    # ranks reset the engine and replay batch 2 before batch 3, at 16.
    r0, r1 = _run_worker(tmp_path, world=2, batch=32, plan=[32, 2], cap_batch=3, cap_ranks=[1], deepspeed=stage)
    assert r0["error"] is None and r1["error"] is None and r1.get("capped") and not r0.get("capped")
    m0 = [m for m in r0["messages"] if m.startswith("WARNING:out of memory")]
    m1 = [m for m in r1["messages"] if m.startswith("WARNING:out of memory")]
    # one halving, logged on both ranks; the capped rank names the allocator's real error
    assert len(m0) == len(m1) == 1 and "on rank 1;" in m0[0] and "DefaultCPUAllocator" in m1[0]
    assert "the 2 batches of this optimizer step so far (64 samples)" in m0[0]
    assert r0["micro_batch_size"] == r1["micro_batch_size"] == 16 and r0["steps"] == r1["steps"] == 3
    assert r0["oom_retries"] == r1["oom_retries"] == 1
    assert r0["agreements"] == r1["agreements"] > 0  # the same agreements on both ranks: none left unmatched
    for r in (r0, r1):
        check_samples(r, steps=3, per_step=64)
    w0, w1 = torch.load(tmp_path / "accelerate0.pt"), torch.load(tmp_path / "accelerate1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    # the reference is one process on the step's 128 samples; ~3e-7 observed at every stage, 1e-5 allowed
    assert _rel_sd(tmp_path) <= 1e-5


@pytestmark_linux
@pytest.mark.skipif(_NO_SHM_OP, reason=_SHM_SKIP)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluate_under_deepspeed_recovers_from_a_real_oom_on_one_rank(tmp_path: Path, stage: int) -> None:
    # accelerator.prepare builds a ZeRO-<stage> engine (Accelerate's DeepSpeed plugin) and evaluate runs the engine:
    # under ZeRO-3 its forward gathers every Linear's partitions, so the ranks split together; under ZeRO-1/2 it
    # starts no collective and the capped rank splits alone
    r0, r1 = _run_worker(tmp_path, world=2, worker=EVAL_WORKER, deepspeed=stage, **_EVAL)
    assert r0["kind"] == r1["kind"] == "DEEPSPEED"
    _check_eval(r0, r1, together=stage == 3)


@pytestmark_linux
@pytest.mark.skipif(_NO_SHM_OP, reason=_SHM_SKIP)
def test_evaluate_after_guarded_zero3_training_splits_on_every_rank(tmp_path: Path) -> None:
    # The ZeRO-3 training run above (rank 1 capped at 20 MiB from its batch 3), then each rank evaluates 64 samples
    # of its own (eval_factor=2) under the same cap: the engine's forward gathers every Linear's partitions, so
    # both ranks halve together, under the rank group memguard's training armed, and gather both ranks' predictions
    r0, r1 = _run_worker(tmp_path, world=2, batch=32, plan=[32, 2], cap_batch=3, cap_ranks=[1], deepspeed=3,
                         eval_factor=2)
    assert r0["error"] is None and r1["error"] is None and r1.get("capped") and not r0.get("capped")
    e0, e1 = r0["eval"], r1["eval"]
    for r, e in ((r0, e0), (r1, e1)):
        halvings = [m for m in r["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
        # 64 (32 MiB of fc1 and GELU outputs) fails on rank 1, 32 fits: one halving, logged on both ranks, and the
        # same eval micro-batch remembered on both
        assert len(halvings) == e["oom_retries"] == 1 and "at micro-batch 64 on rank 1" in halvings[0], (halvings, e)
        assert e["micro"] == [32]
        assert e["gathered"] == 128
        assert e["pred_max_diff"] <= 1e-5 and e["loss"] == pytest.approx(e["ref_loss"], rel=1e-6)
        assert e["train_micro"] == [16, 16]  # the training micro-batch is not the evaluation's
    assert any("DefaultCPUAllocator" in m for m in r1["messages"] if "OOM in evaluation" in m)


@pytestmark_linux
@pytest.mark.skipif(_NO_SHM_OP, reason=_SHM_SKIP)
def test_evaluate_under_zero3_parameter_offload_is_refused_on_every_rank(tmp_path: Path) -> None:
    # ZeRO-3 with offload_param: memguard's reset after an evaluation OOM is not verified with it, so both ranks
    # refuse at the same point (before any forward: no rank waits in an all-gather) and say what to do
    r0, r1 = _run_worker(tmp_path, world=2, worker=EVAL_WORKER, deepspeed=3, offload_param=True, **_EVAL)
    for r in (r0, r1):
        assert r["error"] is not None and r["error"]["type"] == "ConfigError", r["error"]
        assert "offload_param" in r["error"]["message"] and "drop offload_param" in r["error"]["message"]
        assert r["forwards"] == r["padding_forwards"] == 0


def _deepspeed_accelerator():
    """A CPU Accelerator in the state Accelerate's DeepSpeed branch sets (``AcceleratorState.__init__``,
    accelerate/state.py): the distributed type and the plugin, without building an engine."""
    from accelerate.state import PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                           "zero_optimization": {"stage": 2}})
    accelerator.state.distributed_type = DistributedType.DEEPSPEED
    accelerator.state.deepspeed_plugins = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    return accelerator


def test_deepspeed_prepare_lists_what_it_does_not_do() -> None:
    # under DeepSpeed the plan is the config's and the engine clips: planning and clipping options are refused,
    # and so is a plan that is not the config's, all at once and before any engine is built
    accelerator = _deepspeed_accelerator()
    model = _net()
    with pytest.raises(ConfigError) as info:
        prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), plan=_plan(4, 2), loss_fn=loss_fn,
                example_batch=(X[:8], Y[:8]), max_grad_norm=1.0, budget_bytes=1 << 30)
    text = str(info.value)
    assert "example_batch, budget_bytes" in text and "accelerator_kwargs(plan)" in text
    assert "gradient_clipping" in text
    assert "strategy is 'ddp'" in text and "train_micro_batch_size_per_gpu is 8, the plan's micro-batch 4" in text


def _fsdp_accelerator(version: int):
    """A CPU Accelerator that runs an FSDP plugin. Accelerate 1.15 enables an FSDP plugin only for GPU-like
    accelerator types (accelerate/state.py, AcceleratorState.__init__), so the test sets the distributed type
    and the plugin that branch sets (as accelerate_worker.force_fsdp_on_cpu does)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return accelerator


def test_fsdp2_needs_a_plan_or_an_example_batch_before_the_model_is_sharded() -> None:
    accelerator = _fsdp_accelerator(2)
    assert accelerator.is_fsdp2
    model = _net()
    with pytest.raises(ConfigError, match="under FSDP2 pass plan= .*or example_batch="):
        prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn)


def test_fsdp1_without_use_orig_params_is_refused() -> None:
    # the plugin's default use_orig_params=False would leave the optimizer built on the unwrapped model stale
    accelerator = _fsdp_accelerator(1)
    model = _net()
    with pytest.raises(ConfigError, match="use_orig_params=True"):
        prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), plan=_plan(8, 1), loss_fn=loss_fn)


@pytest.mark.parametrize("version, planned", [(1, ("fsdp1", (3,))), (2, ("fsdp2", (3,)))])
def test_the_fsdp_plugin_version_is_the_strategy_planned(version, planned) -> None:
    # FSDP1 (the plugin's FULL_SHARD default, a ShardingStrategy in reshard_after_forward) is planned with memguard's
    # FSDP1 model, FSDP2 (reshard_after_forward=True) with its FSDP2 model: each estimated as the engine that runs
    from memguard.integrations.accelerate import _constraints

    c = _constraints(_fsdp_accelerator(version), _net(), fsdp2=True)
    assert (c.strategies[0], c.zero_stages) == (planned[0], planned[1]) and len(c.strategies) == 1
