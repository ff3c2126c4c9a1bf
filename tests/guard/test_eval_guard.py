"""Guarded evaluation (``memguard.guard._evaluate``): splitting, merging, and real CPU OOMs.

The unit tests raise the CPU allocator's own OOM message from a forward hook when a micro-batch is
larger than a limit (the message ``is_oom_error`` recognises: c10/core/impl/alloc_cpu.cpp). The
last test runs ``eval_oom_worker.py`` under a real ``RLIMIT_AS`` cap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from memguard.errors import ConfigError, OOMRecoveryError
from memguard.guard._evaluate import (
    EvalStatus,
    combine_outputs,
    eval_status,
    evaluate,
    split_eval,
    step_in_micro_batches,
)

pytestmark = pytest.mark.cpu_truth  # compares with real CPU kernels / a real memory cap

CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes"


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 3))
        self.limit: int | None = None  # micro-batches larger than this "run out of memory"
        self.sizes: list[int] = []

    def forward(self, x, y):
        if self.limit is not None and x.shape[0] > self.limit:
            raise RuntimeError(CPU_OOM)
        self.sizes.append(x.shape[0])
        logits = self.body(x)
        return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits, "name": "cls"}


def data(n=40):
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def test_split_result_equals_unsplit():
    model, batch = Classifier(), data()
    model.eval()
    with torch.no_grad():
        whole = model(**batch)
    out = evaluate(model, batch, micro_batch_size=7)  # 40 = 5 x 7 + 5: uneven on purpose
    assert model.sizes[1:] == [7, 7, 7, 7, 7, 5]
    # logits of each sample do not depend on the other samples: same rows (fp32 rounding only)
    torch.testing.assert_close(out["logits"], whole["logits"], rtol=1e-6, atol=1e-6)
    # the mean of per-micro-batch means weighted by their sizes is the mean over all 40 samples
    torch.testing.assert_close(out["loss"], whole["loss"], rtol=1e-6, atol=1e-7)
    assert out["name"] == "cls"


def test_oom_halves_from_the_failed_micro_batch_and_remembers():
    model, batch = Classifier(), data()
    model.limit = 12
    out = evaluate(model, batch)  # 40 fails, 20 fails, 10 fits: 10, 10, 10, 10
    assert model.sizes == [10, 10, 10, 10]
    state = eval_status(model)
    assert state.oom_retries == 2 and state.forwards == 4
    model.limit = None
    model.sizes.clear()
    evaluate(model, batch)  # the same shape starts from the remembered 10, without an OOM
    assert model.sizes == [10, 10, 10, 10] and state.oom_retries == 2
    evaluate(model, {"x": torch.randn(6, 8), "y": torch.zeros(6, dtype=torch.long)})
    assert model.sizes[-1] == 6  # the shape signature excludes dim 0: a smaller batch runs whole
    assert out["logits"].shape == (40, 3)


def test_a_shorter_shape_starts_from_a_longer_ones_micro_batch():
    state = EvalStatus()
    long_sig = (((512,), torch.int64), ((512,), torch.int64))
    state.remember(long_sig, 8)
    # half the tokens per sample: twice the samples need no more memory (memory per sample grows at
    # least linearly in the sequence length), so start from 16, not from the whole batch
    assert state.remembered((((256,), torch.int64), ((256,), torch.int64))) == 16
    assert state.remembered((((1024,), torch.int64), ((1024,), torch.int64))) is None  # longer: unknown
    assert state.remembered((((256,), torch.float32), ((256,), torch.int64))) is None  # another dtype


def test_training_mode_is_restored_and_dropout_off():
    model, batch = Classifier(), data()
    model.train()
    a = evaluate(model, batch, micro_batch_size=8)["logits"]
    b = evaluate(model, batch, micro_batch_size=40)["logits"]
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # equal only if dropout was off both times
    assert model.training and all(m.training for m in model.modules())
    assert not a.requires_grad


def test_one_sample_oom_raises_recovery_error():
    model, batch = Classifier(), data(4)
    model.limit = 0
    with pytest.raises(OOMRecoveryError, match="one sample does not fit") as info:
        evaluate(model, batch)
    assert info.value.micro_batch_size == 1


def test_other_errors_propagate_unchanged():
    def bad(model, micro):
        raise KeyError("user bug")

    with pytest.raises(KeyError):
        evaluate(Classifier(), data(), bad)


def test_weight_fn_gives_a_token_mean_loss():
    # a loss that averages over labelled tokens (label -100 ignored), as transformers' LM losses do
    g = torch.Generator().manual_seed(5)
    logits, labels = torch.randn(12, 6, 4, generator=g), torch.randint(0, 4, (12, 6), generator=g)
    labels[::3, 2:] = -100  # uneven token counts per sample

    def fn(model, b):
        return nn.functional.cross_entropy(b["logits"].reshape(-1, 4), b["labels"].reshape(-1), ignore_index=-100)

    batch = {"logits": logits, "labels": labels}
    whole = fn(None, batch)
    by_samples = split_eval(batch, lambda b: fn(None, b), state=EvalStatus(), micro_batch_size=5)
    by_tokens = split_eval(batch, lambda b: fn(None, b), state=EvalStatus(), micro_batch_size=5,
                           weight_fn=lambda b: int((b["labels"] != -100).sum()))
    torch.testing.assert_close(by_tokens, whole, rtol=1e-6, atol=1e-7)
    assert abs(float(by_samples) - float(whole)) > 1e-4  # sample weights are wrong for a token mean


def test_combine_structures_and_errors():
    Pair = namedtuple("Pair", "a b")
    merged = combine_outputs([Pair(torch.ones(2, 3), 1.0), Pair(torch.zeros(1, 3), 4.0)], [2, 1])
    assert isinstance(merged, Pair) and merged.a.shape == (3, 3) and merged.b == pytest.approx(2.0)
    with pytest.raises(ConfigError, match="combine="):
        combine_outputs([torch.tensor(1), torch.tensor(2)], [1, 1])  # a 0-dim int: neither per-sample nor mean
    with pytest.raises(ConfigError, match="differs"):
        combine_outputs(["a", "b"], [1, 1])


def test_bad_arguments_are_listed_together():
    with pytest.raises(ConfigError) as info:
        evaluate(Classifier(), data(), fn=3, micro_batch_size=0, inference_mode="yes")
    assert len(info.value.problems) == 3


def test_hf_model_output_merges(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    model.eval()
    with torch.no_grad():
        whole = model(**batch)
    out = evaluate(model, batch, micro_batch_size=4)
    assert type(out) is type(whole)
    torch.testing.assert_close(out.logits, whole.logits, rtol=1e-5, atol=1e-5)
    # every sample has the same number of labelled tokens (15), so sample weights give the token mean
    torch.testing.assert_close(out.loss, whole.loss, rtol=1e-5, atol=1e-6)


WORKER = Path(__file__).with_name("eval_oom_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_validation_batch_8x_training(tmp_path):
    """Training batch 16 (about 1 MiB per sample, so 16 MiB) fits a 24 MiB cap. The first validation
    batch, 128 samples of 64 positions, needs about 0.5 MiB per sample under no_grad (64 MiB): it
    fails whole and at 64 (32 MiB) and fits at 32 (16 MiB). The second has 32 positions (0.25 MiB
    per sample): it fails whole (32 MiB) and fits at 64 (16 MiB). 8 MiB of margin either way
    (see eval_oom_worker.py)."""
    cfg = {"out": str(tmp_path), "train_batch": 16, "seq": 64, "val_factor": 8, "steps": 4, "val_every": 2,
           "val_batches": 2, "val_seqs": [64, 32], "budget_mib": 24, "uncapped_eval_probe": True}
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(cfg)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["error"] is None, r["error"]
    assert r["whole_val_fits"] is False and "can't allocate memory" in r["whole_val_error"]  # a real OOM
    # each validation shape keeps its own micro-batch: the shorter batch runs twice as many samples
    assert r["eval_micro_batch_sizes"] == {"64": 32, "32": 64}
    assert r["eval_oom_retries"] == 2  # 128 -> 64 -> 32 for the long batch, once; never for the short one
    assert r["forwards"] == [4, 2, 4, 2]
    # the training micro-batch is untouched by the evaluation's OOMs
    assert r["train_micro_batch_size"] == r["train_planned"] == 16 and r["train_oom_retries"] == 0
    # every validation sample evaluated exactly once per validation, in order; training batches whole
    val_ids = [i for kind, ids in r["seen"] if kind == "val" for i in ids]
    one_pass = list(range(100_000, 100_128)) + list(range(101_000, 101_128))
    assert val_ids == one_pass * 2
    assert [len(ids) for kind, ids in r["seen"] if kind == "train"] == [16] * 4
    t = torch.load(tmp_path / "tensors.pt")
    for k, v in t["ref"].items():  # training is unchanged by the evaluations: identical weights
        assert torch.equal(v, t["guarded"][k]), k
    for ref_vs, g_vs in zip(t["ref_pred"], t["guarded_pred"], strict=True):
        for a, b in zip(ref_vs, g_vs, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # per-sample outputs, fp32 rounding only
    # the validation loss: a weighted mean of the micro-batches' means, equal up to summation order
    assert len(r["guarded_losses"]) == 2
    for g, ref in zip(r["guarded_losses"], r["ref_losses"], strict=True):
        assert g == pytest.approx(ref, rel=1e-6)


def test_framework_step_in_micro_batches():
    # a validation_step that "logs" a mean weighted by the batch the framework believes is current,
    # as Lightning's epoch-level self.log does (logger_connector/result.py: value * batch_size)
    model, batch = Classifier(), data()
    model.eval()
    model.limit = 16
    logged: list[tuple[float, int]] = []
    current = {}

    def validation_step(b, batch_idx):
        out = model(**b)
        logged.append((float(out["loss"]), current["n"]))
        return out["loss"]

    with torch.no_grad():
        merged = step_in_micro_batches(validation_step, batch, (0,), state=EvalStatus(),
                                       before_micro=lambda micro: current.update(n=micro["x"].shape[0]))
        whole = nn.functional.cross_entropy(model.body(batch["x"]), batch["y"])
    assert [n for _, n in logged] == [10, 10, 10, 10]  # 40 and 20 failed before running the step
    epoch_mean = sum(v * n for v, n in logged) / sum(n for _, n in logged)
    assert epoch_mean == pytest.approx(float(whole), rel=1e-6)
    torch.testing.assert_close(merged, whole, rtol=1e-6, atol=1e-7)


JOIN_WORKER = Path(__file__).with_name("eval_join_worker.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_real_oom_joined_outputs_are_built_in_place(tmp_path):
    """128 samples whose outputs are 32 MiB together (u = 256 KiB per sample, see eval_join_worker.py).
    Under a 56 MiB cap the whole batch (2 x 32 MiB) fails; halved to 64 each piece fits (32 MiB peak),
    but joining by concatenation holds the pieces and the whole at once (64 MiB) and fails: what
    memguard did before, here through combine=, now a MemguardError that names the loss-only way.
    The default join allocates the 32 MiB result once and copies each piece in: the second piece of
    64 (32 + 32 MiB) fails, 32 fits (32 + 16 MiB). Measured: the default works from 50 to 62 MiB and
    the concatenation fails there; under 40 MiB (fails 36-44) not even the joined result fits next
    to the first piece (16 + 32 MiB), while a loss-only fn (32 MiB peak at 64) works."""
    runs = [{"name": "default", "budget_mib": 56, "fn": "outputs", "probe_whole": True},
            {"name": "all_at_once", "budget_mib": 56, "fn": "outputs", "combine": "all_at_once"},
            {"name": "tight", "budget_mib": 40, "fn": "outputs"},
            {"name": "tight_loss", "budget_mib": 40, "fn": "loss"}]
    cfg = {"out": str(tmp_path), "batch": 128, "seq": 64, "runs": runs}
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(JOIN_WORKER), json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    default, all_at_once, tight, tight_loss = json.loads((tmp_path / "result.json").read_text())
    assert default["whole_fits"] is False and "can't allocate memory" in default["whole_error"]  # a real OOM
    assert default["error"] is None, default
    assert default["oom_retries"] == 2 and default["micro_batch_sizes"] == [32]  # 128 -> 64 -> 32
    assert default["forwards"] == 3  # 64 (copied in), then 64 failed, 32 and 32
    halvings = [m for m in default["messages"] if m.startswith("WARNING") and "OOM in evaluation" in m]
    assert [m.split("halving to ")[1].split(" ")[0] for m in halvings] == ["64", "32"], default["messages"]
    assert default["logits_shape"] == [128, 64, 1024] and default["logits_max_diff"] <= 1e-5
    assert default["loss"] == pytest.approx(default["ref_loss"], rel=1e-6)
    # joining all at once dies where the default did not: memguard's error, not torch.cat's RuntimeError
    assert all_at_once["error"]["type"] == "OOMRecoveryError", all_at_once
    assert "cannot be joined" in all_at_once["error"]["message"] and "fn=lambda m, b: m(**b).loss" in \
        all_at_once["error"]["message"]
    assert tight["error"]["type"] == "OOMRecoveryError", tight
    assert "joined result.logits (32.00 MiB) does not fit" in tight["error"]["message"]
    assert "m(**b).loss" in tight["error"]["message"]
    assert tight_loss["error"] is None and tight_loss["oom_retries"] == 1
    assert tight_loss["loss"] == pytest.approx(tight_loss["ref_loss"], rel=1e-6)


def test_pieces_are_not_held_once_copied():
    import weakref

    model, batch = Classifier(), data(40)
    model.limit = 10
    alive: list = []

    def fn(m, b):
        assert all(ref() is None for ref in alive), "an earlier piece is still held"
        out = m(**b)
        alive.append(weakref.ref(out["logits"]))
        return out

    out = evaluate(model, batch, fn)
    assert len(alive) == 4 and out["logits"].shape == (40, 3)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model.body(batch["x"]))


def test_outputs_not_proportional_to_samples_are_concatenated():
    # one row per micro-batch (not per sample): kept per piece and concatenated, as before
    model, batch = Classifier(), data(40)
    model.limit = 20
    out = evaluate(model, batch, lambda m, b: {"sum": m(**b)["logits"].sum(0, keepdim=True), "n": 3})
    assert out["sum"].shape == (2, 3) and out["n"] == 3


def test_pieces_that_change_shape_are_a_config_error():
    model, batch = Classifier(), data(40)
    model.limit = 20
    widths = iter([2, 3])  # (generated tokens, say) 2 per sample in the first piece, 3 in the second

    def fn(m, b):
        m(**b)
        return torch.zeros(b["x"].shape[0], next(widths))

    with pytest.raises(ConfigError, match=r"\(20, 3\).*\(1, 2\).*pass combine="):
        evaluate(model, batch, fn)


def test_a_micro_batch_with_nothing_to_average_does_not_make_the_mean_nan():
    # a token-mean loss whose first micro-batch has no labelled token: its mean is NaN with weight 0
    model, batch = Classifier(), data(40)
    model.limit = 20
    labelled = torch.arange(40) >= 20

    def fn(m, b):
        m(b["x"], b["y"])
        mask = b["mask"]
        return (b["x"][:, 0] * mask).sum() / mask.sum()  # NaN where nothing is labelled

    out = evaluate(model, {**batch, "mask": labelled.float()}, fn, weight_fn=lambda b: int(b["mask"].sum()))
    assert float(out) == pytest.approx(float(batch["x"][20:, 0].mean()), rel=1e-6)


def test_the_way_out_is_named_in_the_front_ends_terms(monkeypatch):
    # the joined result cannot be allocated: the front-end's way out is in the message (the real allocation
    # failure is test_real_oom_joined_outputs_are_built_in_place's)
    from memguard.guard import _evaluate

    model, batch = Classifier(), data(40)
    model.limit = 20

    def no_room(self, path, shape, like):  # what _allocate raises when neither the device nor the host has room
        raise self.too_large(f"the joined {path} does not fit")

    monkeypatch.setattr(_evaluate._Joiner, "_allocate", no_room)
    with pytest.raises(OOMRecoveryError, match="prediction_loss_only"):
        split_eval(batch, lambda b: model(**b), state=EvalStatus(), loss_only_hint="use prediction_loss_only=True")
    with pytest.raises(OOMRecoveryError, match=r"m\(\*\*b\)\.loss"):
        evaluate(model, batch)
