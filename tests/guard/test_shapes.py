"""Batches whose shape changes: one micro-batch per shape signature, and torch.compile.

The in-process tests use a model that raises the CPU allocator's real error message when a
micro-batch holds more positions (samples x length) than a limit, so which sizes fail is known
exactly. The tests at the end run real OOMs under ``RLIMIT_AS`` (see shapes_worker.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from two_ranks import ROOT, free_port, run_two_ranks  # this folder is on sys.path under pytest
import torch
from torch import nn

from memguard.guard import guard_status, prepare, step
from memguard.guard._options import Constraints, plan_options_problems
from memguard.guard._shapes import Signature, bucket, dims_of, halvings, pad_batch, signature_of, size_bound, snap_to


# --------------------------------------------------------------------------------------------------
# signatures


@pytest.mark.parametrize("n, top", [
    (1, 1), (8, 8),        # up to 8: exact
    (9, 10),               # next power of two 16, step 2
    (64, 64), (65, 80),    # 65..128 in steps of 16: the worst case, 80/65 = 1.23
    (100, 112), (128, 128),
    (129, 160), (512, 512), (513, 640), (4000, 4096),
])
def test_bucket_rounds_up_to_four_steps_per_doubling(n: int, top: int) -> None:
    assert bucket(n) == top
    assert n <= top <= 1.25 * n  # never below the size, never more than 25% above it


def test_signature_is_the_bucketed_non_batch_dims() -> None:
    batch = {"input_ids": torch.zeros(4, 100, dtype=torch.long), "mask": torch.ones(4, 100), "scale": torch.tensor(2.0),
             "name": "x", "pixels": torch.zeros(4, 3, 224, 224)}
    sig = signature_of(batch)
    # 0-dim tensors and strings go whole to every micro-batch: not part of the shape
    assert sig.dims == ((112,), (112,), (3, 224, 224))
    assert str(sig) == "input_ids[*,112] mask[*,112] pixels[*,3,224,224]"
    # a batch of another size and another length in the same bucket has the same signature
    assert signature_of({**batch, "input_ids": torch.zeros(9, 97, dtype=torch.long), "mask": torch.ones(9, 110),
                         "pixels": torch.zeros(9, 3, 224, 224)}) == sig
    padded = pad_batch(batch, sig)
    assert padded["input_ids"].shape == (4, 112) and padded["input_ids"].dtype == torch.long
    assert padded["pixels"] is batch["pixels"] and padded["scale"] is batch["scale"]
    assert sig.with_flat(sig.flat()) == sig


def test_a_covering_signature_needs_at_most_the_smaller_micro_batch() -> None:
    short, long = Signature(((64,),)), Signature(((512,),))
    assert long.covers(short) and not short.covers(long)
    assert size_bound(long, {short: 16}) == 16 and size_bound(short, {long: 4}) is None
    assert halvings(12) == [12, 6, 3, 1] and snap_to(5, halvings(16)) == 4 and snap_to(0, [4, 2, 1]) == 1


def test_an_exact_signature_keeps_the_dims_and_dtypes_that_evaluation_keys_by() -> None:
    batch = {"input_ids": torch.zeros(4, 100, dtype=torch.long), "scale": torch.tensor(2.0)}
    sig = signature_of(batch, exact=True)
    # evaluation's key: every tensor leaf's dims after dim 0, unbucketed, with its dtype
    assert sig.key() == (((100,), torch.long), ((), torch.float32))
    assert Signature.from_key(sig.key()) == sig
    shorter = signature_of({**batch, "input_ids": torch.zeros(4, 50, dtype=torch.long)}, exact=True)
    # one covers rule for both: an exact signature covers only one of the same dtypes
    assert sig.covers(shorter) and sig.scaled(8, shorter) == 16
    assert not sig.covers(signature_of({**batch, "input_ids": torch.zeros(4, 50)}, exact=True))


def test_only_the_dims_that_differ_from_the_reference_are_bucketed() -> None:
    # word_language_model carries an LSTM state h[layers, batch, hidden] in the batch (batch_dim=1 makes it
    # [batch, layers, hidden] here): the hidden size 200 is the model's own and equals the reference's in every
    # batch, so it stays 200 (bucket(200) = 224, which nn.LSTM rejects); the chunk length 35 -> 20 differs
    first = {"data": torch.zeros(32, 35, dtype=torch.long), "h": torch.zeros(32, 2, 200)}
    ref = dims_of(first)
    assert ref.dims == ((35,), (2, 200))
    assert signature_of(first, fixed=ref).dims == ((35,), (2, 200))  # the reference batch as it is
    last = {"data": torch.zeros(32, 21, dtype=torch.long), "h": torch.zeros(32, 2, 200)}
    sig = signature_of(last, fixed=ref)
    assert sig.dims == ((24,), (2, 200))  # 21 -> 24 (next power 32, steps of 4); 200 kept
    assert pad_batch(last, sig)["h"].shape == (32, 2, 200)
    assert signature_of(last).dims == ((24,), (2, 224))  # without the reference every dim is bucketed
    # another structure than the reference's: no dim can be matched, every one is bucketed
    assert signature_of({"data": torch.zeros(4, 21, dtype=torch.long)}, fixed=ref).dims == ((24,),)


class _LSTMLM(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(50, 16), nn.LSTM(16, hidden, 2), nn.Linear(hidden, 50)

    def forward(self, data, state):
        output, state = self.rnn(self.emb(data), state)
        return self.out(output), state


def test_a_short_last_chunk_is_planned_with_the_models_own_hidden_size(caplog: pytest.LogCaptureFixture) -> None:
    # the README's recipe for a carried RNN state (sequence-first, batch_dim=1); a longer chunk than the first is
    # a new signature (a shorter one is planned too once an OOM has halved the first's micro-batch) that memguard
    # plans with a probe batch padded to the top of its buckets: the hidden size 36 (bucket 40) must not be
    # padded, or nn.LSTM raises "Expected hidden[0] size (2, 8, 36), got [2, 8, 40]"
    hidden, batch = 36, 8
    model = _LSTMLM(hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m, mb):
        output, _ = m(mb["data"], (mb["h"], mb["c"]))
        return nn.functional.cross_entropy(output.reshape(-1, 50), mb["target"].reshape(-1))

    prepare(model, opt, batch_dim=1, budget_bytes=64 << 20, device="cpu", precision="32-true", verbose=False)
    state = {"h": torch.zeros(2, batch, hidden), "c": torch.zeros(2, batch, hidden)}
    with caplog.at_level(logging.WARNING, logger="memguard"):
        for seq in (21, 21, 35):
            data = torch.randint(0, 50, (seq, batch))
            step(model, opt, {"data": data, "target": data, **state}, loss_fn)
    assert not [r for r in caplog.records if "could not plan" in r.getMessage()], caplog.text
    status = guard_status(model)
    assert status.signatures_planned == 1  # the 35-token chunk (bucket 40), planned from a probe trace
    assert sorted(str(s) for s in status.planned_micro_batch_sizes) == [
        "data[*,21] target[*,21] h[*,2,36] c[*,2,36]", "data[*,40] target[*,40] h[*,2,36] c[*,2,36]"]


def test_constraints_pass_strategies_to_the_planner_only_when_set() -> None:
    assert "strategy" not in Constraints().planning_options({})
    one, two = (Constraints(strategies=s).planning_options({}) for s in (("fsdp2",), ("ddp", "fsdp2")))
    # one strategy as a value, several as a list: the planner takes both forms
    assert one["strategy"] == "fsdp2" and two["strategy"] == ["ddp", "fsdp2"]
    assert not plan_options_problems({**two, "budget_bytes": 1 << 30})


# --------------------------------------------------------------------------------------------------
# the guard follows the shape


class Tokens(nn.Module):
    """Per position 8 -> 16 -> 1; a micro-batch with more than ``limit`` positions fails as the CPU allocator does."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.limit = limit
        self.seen: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.seen.append((x.shape[0], x.shape[1]))
            if x.shape[0] * x.shape[1] > self.limit:
                # the message of c10/core/impl/alloc_cpu.cpp, which memguard recognises as an OOM
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return self.fc2(torch.relu(self.fc1(x))).mean()


def mean_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch)


def test_an_oom_halves_only_the_current_shapes_micro_batch(caplog: pytest.LogCaptureFixture) -> None:
    model = Tokens(limit=16 * 64)  # 16 samples of 64 fit; of 512 tokens only 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=16, loss_fn=mean_loss)
    sizes = []
    with caplog.at_level(logging.INFO, logger="memguard"):
        for length in (64, 64, 512, 64, 512, 64):
            step(model, opt, torch.randn(16, length, 8))
            sizes.append(guard_status(model).micro_batch_size)
    # 512: 16 -> 8 -> 4 -> 2 fits (2 x 512 = 1024 positions); 64 goes back to 16, and the second
    # 512 batch starts at the 2 it learnt, without an OOM
    assert sizes == [16, 16, 2, 16, 2, 16]
    status = guard_status(model)
    assert status.oom_retries == 3
    assert {str(k): v for k, v in status.micro_batch_sizes.items()} == {"batch[*,64,8]": 16, "batch[*,512,8]": 2}
    assert model.seen.count((16, 64)) == 4 and (16, 512) in model.seen
    assert model.seen[-1] == (16, 64)
    assert "new batch shape batch[*,512,8]: micro-batch 16" in caplog.text


def test_a_longer_shape_starts_at_most_at_a_shorter_ones_reduced_micro_batch() -> None:
    model = Tokens(limit=4 * 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=16, loss_fn=mean_loss)
    step(model, opt, torch.randn(16, 64, 8))  # 16 -> 8 -> 4
    model.seen.clear()
    step(model, opt, torch.randn(16, 128, 8))
    # 128 covers 64, so it starts at 64's 4 (not the planned 16) and halves once, to 2
    assert model.seen[0] == (4, 128) and guard_status(model).micro_batch_size == 2


def test_probe_up_doubles_each_shape_towards_its_own_size() -> None:
    model = Tokens(limit=16 * 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=16, loss_fn=mean_loss, probe_up_after=1)
    step(model, opt, torch.randn(16, 512, 8))  # the first shape: 16 -> 2
    model.limit = 1 << 30  # the memory pressure goes away
    sizes = []
    for length in (512, 64, 512, 512):
        step(model, opt, torch.randn(16, length, 8))
        sizes.append(guard_status(model).micro_batch_sizes)
    by = [{str(k): v for k, v in s.items()}["batch[*,512,8]"] for s in sizes]
    # one clean step of 512 doubles its micro-batch each time, up to the 16 it was given
    assert by == [4, 4, 8, 16]


# --------------------------------------------------------------------------------------------------
# torch.compile


def test_compiled_model_retries_without_recompiling_for_each_micro_batch() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    compiles = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append([tuple(getattr(t, "shape", ())) for t in example_inputs])
        return gm.forward

    model = torch.compile(Tokens(limit=1 << 30), backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = {"positions": 1 << 30}

    def hungry_loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        # the check runs outside the compiled graph, where dynamo would not run it
        if b.shape[0] * b.shape[1] > memory["positions"]:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
        return m(b)

    prepare(model, opt, micro_batch_size=12, loss_fn=hungry_loss)
    step(model, opt, torch.randn(12, 64, 8))
    assert len(compiles) == 1
    memory["positions"] = 600  # 12 x 64 no longer fits, 6 x 64 does
    step(model, opt, torch.randn(12, 64, 8))
    # the retry at micro-batch 6 runs the graph compiled for 12: memguard marked the batch dim dynamic
    # (without the mark dynamo recompiles here, for the second batch size it sees)
    assert len(compiles) == 1 and guard_status(model).micro_batch_size == 6
    sizes = []
    for length in (512, 64, 512):
        step(model, opt, torch.randn(12, length, 8))
        sizes.append(guard_status(model).micro_batch_size)
    status = guard_status(model)
    # 512 starts at 64's 6 (it covers 64) and halves to 3, then 1 (3 x 512 > 600): all halvings of 12
    assert status.compiled and sizes == [1, 6, 1] and set(status.micro_batch_sizes.values()) <= set(halvings(12))
    # one more graph for the new length (dynamo specialises a micro-batch of 1 and the length 512)
    assert len(compiles) == 2, compiles


def test_a_compiled_model_is_planned_through_its_eager_module() -> None:
    torch._dynamo.reset()
    eager = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    model = torch.compile(eager, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return m(b).mean()

    prepare(model, opt, loss_fn=loss, budget_bytes=1 << 30, device="cpu", precision="32-true")
    step(model, opt, torch.randn(12, 32, 8))
    step(model, opt, torch.randn(12, 16, 8))
    status = guard_status(model)
    assert status.plan is not None and status.plan.micro_batch_size == 12 and status.compiled
    # 16 positions need no more memory than the planned 32, which runs at the planned 12: no new plan
    assert status.micro_batch_size == 12 and status.signatures_planned == 0


# --------------------------------------------------------------------------------------------------
# real out-of-memory errors under RLIMIT_AS

WORKER = Path(__file__).with_name("shapes_worker.py")
TIMEOUT_S = 240
LENGTHS = [64, 64, 512, 64, 64]  # the batches of issue 13's reproduction


def _start(out: Path, **cfg) -> subprocess.Popen:
    env = dict(os.environ)
    # one malloc arena and a fixed mmap threshold, so the address space tracks live memory (as in test_recovery)
    env.update(MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    out.mkdir()
    cfg = {"out": str(out), "lengths": LENGTHS, "batch": 16, "cap_mib": 64, **cfg}
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _check_samples(result: dict, batch: int) -> None:
    """In every step, the attempt after the last retry saw each sample exactly once, in order."""
    steps = []
    for e in result["events"]:
        if e == "STEP":
            steps.append([[]])
        elif e == "RETRY":
            steps[-1].append([])
        else:
            steps[-1][-1].extend(e)
    assert len(steps) == len(LENGTHS)
    for s, attempts in enumerate(steps):
        assert attempts[-1] == list(range(s * batch, (s + 1) * batch)), f"step {s}"


@pytest.mark.cpu_truth
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_variable_length_batches_under_a_real_memory_cap(tmp_path: Path) -> None:
    # Both runs cap the address space at 64 MiB over what the process holds. 16 samples of 512 tokens
    # need ~176 MiB (memguard.estimate), 8 need ~89, 4 need ~46: "planned" plans 64 MiB on the first
    # batch and must run 512 without an OOM; "fixed" (micro_batch_size=16, no budget to plan with)
    # must hit the OOMs at 16 and 8 and go on at 4.
    procs = {"planned": _start(tmp_path / "planned", budget_mib=64),
             "fixed": _start(tmp_path / "fixed", micro_batch_size=16)}
    outs = {}
    try:
        for name, p in procs.items():
            outs[name] = p.communicate(timeout=TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        for p in procs.values():
            p.kill()
        pytest.fail(f"a worker did not finish within {TIMEOUT_S} s")
    results = {}
    for name, p in procs.items():
        assert p.returncode == 0, outs[name][-3000:]
        results[name] = json.loads((tmp_path / name / "result.json").read_text())
        assert results[name]["error"] is None, results[name]["error"]
        _check_samples(results[name], 16)
        guarded = torch.load(tmp_path / name / "guarded.pt")
        reference = torch.load(tmp_path / name / "reference.pt")
        # micro-batches weighted by their share of samples give the full batch's gradient: equal up to rounding
        rel = max(((guarded[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-12)).item()
                  for k in reference if reference[k].is_floating_point())
        assert rel <= 1e-4, (name, rel)
    planned, fixed = results["planned"], results["fixed"]
    assert planned["oom_retries"] == 0 and planned["signatures_planned"] == 1
    assert planned["sizes"][:2] + planned["sizes"][3:] == [16, 16, 16, 16] and 1 < planned["sizes"][2] < 8
    # the long batch's micro-batch is the largest that a full estimate says fits the plan's usable bytes
    usable, peaks = planned["usable_bytes"], planned["long_peaks"]
    assert peaks[0] <= usable < peaks[1], (usable, peaks)
    assert planned["planning_seconds"] > 0
    assert fixed["oom_retries"] == 2 and fixed["sizes"] == [16, 16, 4, 16, 16]
    assert all("DefaultCPUAllocator" in m for m in fixed["messages"] if m.startswith("WARNING"))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_ddp_ranks_with_different_lengths_agree_on_the_longest(tmp_path: Path) -> None:
    run_two_ranks(Path(__file__).with_name("shapes_ddp_worker.py"), {"out": str(tmp_path), "port": free_port()},
                  timeout=TIMEOUT_S)
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    # Step 1: rank 0 has 64 tokens, rank 1 16; both run the longest shape's micro-batch, which starts at
    # 16's 8, fails on rank 0 (512 positions > 256), and is halved on both to 4. Step 2 (the other way
    # round) starts at 4 on both: the ranks remember the same sizes.
    for r in (r0, r1):
        assert r["sizes"] == [8, 4, 4] and r["oom_retries"] == 1
        assert r["by_signature"] == {"batch[*,16,8]": 8, "batch[*,64,8]": 4}
    assert r0["weights"] == r1["weights"]
    for k, ref in r0["reference"].items():
        got = torch.tensor(r0["weights"][k])
        assert torch.allclose(got, torch.tensor(ref), rtol=1e-5, atol=1e-6), k
