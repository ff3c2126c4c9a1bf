"""MemguardCallback guards Lightning's validation and test loops, in process, on CPU.

A tiny LightningModule trains on batches of 8 samples and is evaluated on batches of 64 (8x the
training batch, as validation batches often are). Its ``validation_step``/``test_step`` raise the CPU
allocator's out-of-memory error whenever they are given more than 20 samples, so an unguarded run
fails; with the callback, every evaluation batch must run in micro-batches of at most 20 samples and
the epoch-level ``val_loss``/``test_loss`` must equal an uncapped run's. The training micro-batch
must not change, and the module's steps must be restored afterwards. Each Trainer run takes about
a second.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memguard.guard._evaluate import eval_status
from memguard.guard._oom import is_oom_error

PACKAGES = [name for name in ("lightning.pytorch", "pytorch_lightning")
            if importlib.util.find_spec(name.split(".")[0]) is not None]
if not PACKAGES:
    pytest.skip("Lightning is not installed", allow_module_level=True)

from memguard.integrations.lightning import MemguardCallback  # noqa: E402 - after the skip

TRAIN_BATCH, EVAL_BATCH, OOM_ABOVE = 8, 64, 20
N_TRAIN = 32
# 150 evaluation samples: batches of 64, 64 and 22. The last batch splits unevenly (16 + 6), which
# is what makes the epoch mean depend on each micro-batch's weight (see _wrongly_weighted).
N_EVAL = 150
X = torch.randn(N_TRAIN, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(N_TRAIN, generator=torch.Generator().manual_seed(2))
XE = torch.randn(N_EVAL, 16, generator=torch.Generator().manual_seed(3))
YE = 3 * torch.randn(N_EVAL, generator=torch.Generator().manual_seed(4))

# What the CPU allocator raises when malloc fails (c10/core/impl/alloc_cpu.cpp, torch 2.x; this is
# the text torch.empty(2**50, dtype=torch.uint8) raises on Linux), as a plain RuntimeError.
OOM_MESSAGE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
               "tried to allocate {nbytes} bytes. Error code 12 (Cannot allocate memory)")

# Where the callback's evaluation guard halves to: 64 and 32 samples are over the cap, 16 fit.
FITTING = 16


def _classes(pl):
    """The test's LightningModule, a probe callback and a Trainer factory on Lightning package ``pl``."""

    class Lit(pl.LightningModule):
        """A two-layer MLP; its eval steps log the batch's MSE and fail over ``oom_above`` samples."""

        def __init__(self, oom_above: int | None = None) -> None:
            super().__init__()
            self.batch_size = TRAIN_BATCH
            self.oom_above = oom_above
            self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
            self.calls: list[tuple[str, int]] = []  # every call of an eval step: (stage, samples)
            self.ran: dict[str, list[torch.Tensor]] = {"val": [], "test": []}  # inputs of the calls that ran

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def _eval_step(self, stage: str, batch) -> None:
            x, y = batch
            self.calls.append((stage, len(x)))
            if self.oom_above is not None and len(x) > self.oom_above:
                raise RuntimeError(OOM_MESSAGE.format(nbytes=len(x) * (1 << 30)))
            self.ran[stage].append(x)
            self.log(f"{stage}_loss", F.mse_loss(self(x), y))

        def validation_step(self, batch, batch_idx):
            self._eval_step("val", batch)

        def test_step(self, batch, batch_idx):
            self._eval_step("test", batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size)

        def val_dataloader(self):
            return DataLoader(TensorDataset(XE, YE), batch_size=EVAL_BATCH)

        def test_dataloader(self):
            return DataLoader(TensorDataset(XE, YE), batch_size=EVAL_BATCH)

    class Probe(pl.Callback):
        """Records, at each training batch, its size and the callback's training micro-batch and retries."""

        def __init__(self, cb: MemguardCallback) -> None:
            self.cb = cb
            self.seen: list[tuple[int, int | None, int]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            status = self.cb.status()
            self.seen.append((len(batch[0]), status.micro_batch_size, status.oom_retries))

    def make_trainer(*callbacks, **kw):
        kw.setdefault("max_epochs", 1)
        return pl.Trainer(accelerator="cpu", devices=1, callbacks=list(callbacks), logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, **kw)

    return Lit, Probe, make_trainer


_BY_PACKAGE: dict[str, tuple] = {}


def _for(package: str):
    if package not in _BY_PACKAGE:
        _BY_PACKAGE[package] = _classes(importlib.import_module(package))
    return _BY_PACKAGE[package]


def _uncapped_copy(model):
    ref = copy.deepcopy(model)
    ref.oom_above = None
    ref.calls.clear()
    for seen in ref.ran.values():
        seen.clear()
    return ref


def _split_calls(stage: str) -> list[tuple[str, int]]:
    """The eval-step calls of one evaluation pass over the 150 samples with a cap of 20, the first time.

    Batch 1 (64): 64 fails, halved to 32, fails, halved to 16: four micro-batches of 16. The guard
    remembers 16 for this batch shape, so batch 2 (64) starts at 16 and batch 3 (22) runs as 16 + 6.
    """
    return [(stage, 64), (stage, 32)] + [(stage, FITTING)] * 9 + [(stage, 6)]


def _wrongly_weighted(model) -> float:
    """The epoch mean Lightning would log if each micro-batch's mean were weighted by the size of the
    dataloader batch it came from (not by its own): the bug the callback prevents by handing Lightning
    the micro-batch while the step logs."""
    with torch.no_grad():
        total, weight = 0.0, 0
        for start, stop in ((0, 64), (64, 128), (128, 150)):  # the dataloader's batches
            for s in range(start, stop, FITTING):  # the micro-batches they ran as
                e = min(s + FITTING, stop)
                total += F.mse_loss(model(XE[s:e]), YE[s:e]).item() * (stop - start)
                weight += stop - start
    return total / weight


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _max_rel(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(((sa[k] - sb[k]).norm() / sb[k].norm()).item() for k in sb)


# Lightning accumulates an epoch mean as sum(mean_i * n_i) / sum(n_i) in float32
# (trainer/connectors/logger_connector/result.py, _ResultMetric.update/compute); split and unsplit
# sums differ only in the order of about a dozen float32 roundings (~1e-7 relative each).
TOL = 1e-5


def test_the_oom_message_is_recognised() -> None:
    # the test's failure mode must be one memguard treats as an OOM, or nothing below would split
    assert is_oom_error(RuntimeError(OOM_MESSAGE.format(nbytes=123)))


@pytest.mark.parametrize("package", PACKAGES)
def test_validation_batches_that_do_not_fit_run_in_micro_batches(package: str) -> None:
    Lit, Probe, make_trainer = _for(package)
    torch.manual_seed(0)
    model = Lit(oom_above=OOM_ABOVE)
    plain = _uncapped_copy(model)  # same initial weights, no cap, no callback
    cb = MemguardCallback(budget_bytes=1 << 30)
    probe = Probe(cb)
    trainer = make_trainer(cb, probe, max_epochs=2)
    trainer.fit(model)
    reference = make_trainer(max_epochs=2)
    reference.fit(plain)

    # Epoch 1 splits as in _split_calls; epoch 2 starts from the remembered 16.
    first = _split_calls("val")
    assert model.calls == first + first[2:]
    assert eval_status(model).oom_retries == 2
    # every sample was evaluated exactly once per epoch, in order, and no call over the cap ran
    ran = model.ran["val"]
    assert max(len(x) for x in ran) <= OOM_ABOVE
    half = len(ran) // 2
    assert torch.equal(torch.cat(ran[:half]), XE) and torch.equal(torch.cat(ran[half:]), XE)

    # Training ran at its own micro-batch (8, the planned one, as 1 GiB holds it) with no retry,
    # before and after the validation OOMs of epoch 1, and so trained as plain Lightning does.
    assert probe.seen == [(TRAIN_BATCH, TRAIN_BATCH, 0)] * (2 * N_TRAIN // TRAIN_BATCH)
    status = cb.status()
    assert (status.micro_batch_size, status.planned_micro_batch_size, status.oom_retries) == (TRAIN_BATCH,
                                                                                             TRAIN_BATCH, 0)
    assert _max_rel(model, plain) <= TOL

    # The logged epoch mean is the mean over all 150 samples, as in the uncapped run: each micro-batch's
    # mean is weighted by its own sample count, so sum(mean_i * n_i) / 150 is the same sum of
    # per-sample losses whatever the grouping (up to float32 rounding, and training matched above).
    got = trainer.callback_metrics["val_loss"].item()
    want = reference.callback_metrics["val_loss"].item()
    assert _rel(got, want) <= TOL, (got, want)
    # the check can fail: weighting micro-batches by their dataloader batch's size would be far off
    assert _rel(_wrongly_weighted(plain), want) > 100 * TOL

    # The patched step is gone after fit: the class's own methods are back.
    assert "validation_step" not in model.__dict__ and "test_step" not in model.__dict__
    assert model.validation_step.__func__ is Lit.validation_step


@pytest.mark.parametrize("package", PACKAGES)
def test_test_batches_that_do_not_fit_run_in_micro_batches(package: str) -> None:
    Lit, _, make_trainer = _for(package)
    torch.manual_seed(0)
    model = Lit(oom_above=OOM_ABOVE)
    cb = MemguardCallback(budget_bytes=1 << 30)
    trainer = make_trainer(cb, limit_val_batches=0)
    trainer.fit(model)
    trainer.test(model)
    plain = _uncapped_copy(model)  # the trained weights, no cap, no callback
    reference = make_trainer()
    reference.test(plain)

    assert model.calls == _split_calls("test")
    assert torch.equal(torch.cat(model.ran["test"]), XE)
    # the same evaluation through the plain step, unsplit: three batches
    assert plain.calls == [("test", 64), ("test", 64), ("test", 22)]
    got = trainer.callback_metrics["test_loss"].item()
    want = reference.callback_metrics["test_loss"].item()
    assert _rel(got, want) <= TOL, (got, want)  # same weights; only the float32 sum's order differs
    assert _rel(_wrongly_weighted(plain), want) > 100 * TOL
    # the test OOMs left the training micro-batch alone
    status = cb.status()
    assert (status.micro_batch_size, status.oom_retries) == (TRAIN_BATCH, 0)
    assert "test_step" not in model.__dict__ and "validation_step" not in model.__dict__
    assert model.test_step.__func__ is Lit.test_step


@pytest.mark.parametrize("package", PACKAGES)
def test_an_evaluation_that_fits_runs_each_batch_whole(package: str) -> None:
    Lit, _, make_trainer = _for(package)
    torch.manual_seed(0)
    model = Lit()  # no cap: nothing fails
    plain = _uncapped_copy(model)
    trainer, reference = make_trainer(MemguardCallback(budget_bytes=1 << 30)), make_trainer()
    got = [trainer.validate(model)[0]["val_loss"], trainer.test(model)[0]["test_loss"]]
    want = [reference.validate(plain)[0]["val_loss"], reference.test(plain)[0]["test_loss"]]

    # one call of the user's step per dataloader batch, on the whole batch
    whole = [64, 64, 22]
    assert model.calls == [("val", n) for n in whole] + [("test", n) for n in whole]
    assert eval_status(model).oom_retries == 0
    # the same calls on the same weights, so the logged means are bitwise the same
    assert got == want
    assert "validation_step" not in model.__dict__ and "test_step" not in model.__dict__


def test_a_short_last_batch_does_not_shrink_the_remembered_micro_batch() -> None:
    """Cap 40: the first 64-sample batch fails whole and runs as 32 + 32, and 32 is remembered for
    this batch shape. The last batch (22 samples) then runs whole under that cap of 32; it says nothing
    about what fits, so the next pass must start its 64-sample batches from 32 again, not from 22."""
    Lit, _, make_trainer = _for(PACKAGES[0])
    torch.manual_seed(0)
    model = Lit(oom_above=40)
    trainer = make_trainer(MemguardCallback(budget_bytes=1 << 30))
    trainer.validate(model)
    trainer.validate(model)
    once = [("val", 32)] * 4 + [("val", 22)]
    assert model.calls == [("val", 64)] + once + once
    assert eval_status(model).oom_retries == 1


def test_without_the_callback_the_capped_module_fails() -> None:
    # the cap is real: the plain Trainer meets the OOM on the first validation batch
    Lit, _, make_trainer = _for(PACKAGES[0])
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
        make_trainer().validate(Lit(oom_above=OOM_ABOVE))


@pytest.mark.parametrize("package", PACKAGES)
def test_without_a_process_group_each_strategy_splits_validation_alone(package: str, caplog) -> None:
    pl = importlib.import_module(package)

    class Trainer:  # what _patch_eval_step reads of a Trainer, from the package it names
        __module__ = f"{package}.trainer.trainer"
        is_global_zero = True
        _results = None

        def __init__(self, strategy) -> None:
            self.strategy = strategy

    class Module(nn.Linear):
        def validation_step(self, batch, batch_idx):
            return None

    module = Module(2, 2)
    callback = MemguardCallback(budget_bytes=1 << 30)
    # No process group (this process): no rank to keep in step, so the module's own step is split here under every
    # strategy; with one (tests/integrations/test_lightning_sharded_eval.py) FSDP1, FSDP2 and ZeRO-3 split together.
    for strategy, split in ((pl.strategies.FSDPStrategy(), True), (pl.strategies.DeepSpeedStrategy(stage=3), True),
                            (pl.strategies.DeepSpeedStrategy(stage=2), True),
                            (pl.strategies.ModelParallelStrategy(), True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="memguard"):
            callback._patch_eval_step(Trainer(strategy), module, "validation_step")
        assert ("validation_step" in module.__dict__) == split, strategy
        assert any("not guarded" in r.getMessage() for r in caplog.records) != split
        callback._restore_attributes(module, "validation_step")
