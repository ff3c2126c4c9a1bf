"""The knobs of a hand-written loop in prepare/step: clipping, batch_dim, carried state, user errors, the summary."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import memguard
from memguard.guard import guard_status

ROOT = Path(__file__).resolve().parents[2]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _batches(n=3, size=24):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 16, generator=g) * 5, torch.randint(0, 4, (size,), generator=g)) for _ in range(n)]


def _reference(net, batches, *, max_norm=None, max_value=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    norms = []
    for b in batches:
        opt.zero_grad()
        _loss(net, b).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        if max_value is not None:
            torch.nn.utils.clip_grad_value_(net.parameters(), max_value)
        opt.step()
    return norms


def _close(a: nn.Module, b: nn.Module, tol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=tol), name


@pytest.mark.parametrize("source", ["micro_batch_size", "plan"])
def test_clipping_applies_with_a_fixed_micro_batch_and_a_given_plan(source):
    batches = _batches()
    ref = _net()
    norms = _reference(ref, batches, max_norm=0.05, max_value=0.01)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    if source == "plan":
        kw = {"plan": memguard.plan(net, batches[0], global_batch_size=24, device="cpu", budget_bytes=1 << 30,
                                    loss_fn=_loss, optimizer=opt, precision="32-true").replace(
            micro_batch_size=8, grad_accum_steps=3)}
    else:
        kw = {"micro_batch_size": 8}
    net, opt = memguard.prepare(net, opt, max_grad_norm=0.05, clip_grad_value=0.01, verbose=False, **kw)
    for b in batches:
        memguard.step(net, opt, b, _loss)
    _close(net, ref)
    status = guard_status(net)
    assert status.micro_batch_size == 8  # three micro-batches accumulated, clipped once
    assert status.grad_norm == pytest.approx(norms[-1], rel=1e-5) and norms[-1] > 0.05  # the norm before clipping


def test_clipping_threshold_zero_means_no_clipping():
    # nanoGPT's grad_clip=0.0 and the HF Trainer's max_grad_norm=0 mean "do not clip"; memguard reads 0 the same
    # way (torch's clip_grad_norm_(max_norm=0) would instead scale every gradient to zero, and clip_grad_value_(0)
    # would zero them: either makes the SGD step a no-op, which the reference below would expose).
    batches = _batches()
    ref = _net()
    _reference(ref, batches)  # no clipping at all
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net, opt = memguard.prepare(net, opt, micro_batch_size=8, max_grad_norm=0.0, clip_grad_value=0, verbose=False)
    start = copy.deepcopy(net)
    for b in batches:
        memguard.step(net, opt, b, _loss)
    _close(net, ref)
    assert any(not torch.equal(p, q) for p, q in zip(net.parameters(), start.parameters()))  # it did train
    assert guard_status(net).grad_norm is None  # no norm is taken when nothing clips
    with pytest.raises(memguard.ConfigError, match=r"max_grad_norm must be None, 0 \(no clipping\) or a positive"):
        memguard.prepare(_net(), torch.optim.SGD(_net().parameters(), lr=0.1), max_grad_norm=-1.0)


def test_clipping_under_16_mixed_unscales_first():
    batches = _batches(2)
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for b in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(ref, b)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        scaler.step(opt)
        scaler.update()
    net = _net()
    opt2 = torch.optim.SGD(net.parameters(), lr=0.5)
    net, opt2 = memguard.prepare(net, opt2, micro_batch_size=24, precision="16-mixed", max_grad_norm=0.05,
                                 grad_scaler=torch.amp.GradScaler("cpu", init_scale=1024.0), verbose=False)
    for b in batches:
        memguard.step(net, opt2, b, _loss)
    _close(net, ref, 1e-5)
    assert guard_status(net).grad_norm == pytest.approx(norm, rel=1e-3)  # unscaled: not 1024x the norm


class _LM(nn.Module):
    """word_language_model's RNN model, small: sequence-first data, an LSTM state carried across batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(40, 8), nn.LSTM(8, 16), nn.Linear(16, 40)

    def forward(self, data, hidden):
        output, hidden = self.rnn(self.emb(data), hidden)
        return self.out(output), hidden


def _stream(steps=3, seq=6, batch=10):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 40, (steps * seq + 1, batch), generator=g), seq


def test_batch_dim_and_carried_state_match_the_original_loop():
    source, seq = _stream()
    batch = source.shape[1]
    ref = _LM()
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    hidden = (torch.zeros(1, batch, 16), torch.zeros(1, batch, 16))
    for i in range(0, source.shape[0] - 1, seq):  # the original loop (word_language_model's train())
        data, target = source[i:i + seq], source[i + 1:i + 1 + seq].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        opt.zero_grad()
        output, hidden = ref(data, hidden)
        nn.functional.cross_entropy(output.view(-1, 40), target).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.25)
        opt.step()

    model = _LM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = memguard.prepare(model, opt, micro_batch_size=4, batch_dim=1, max_grad_norm=0.25, verbose=False)
    state = {"h": torch.zeros(1, batch, 16), "c": torch.zeros(1, batch, 16)}
    new_state = {k: v.clone() for k, v in state.items()}

    def loss_fn(m, mb):  # mb: this micro-batch's columns, in the batch's own (sequence-first) layout
        output, (h, c) = m(mb["data"], (mb["h"], mb["c"]))
        cols = mb["cols"][0]  # which samples this micro-batch holds: a replay writes the same ones again
        new_state["h"][:, cols], new_state["c"][:, cols] = h.detach(), c.detach()
        return nn.functional.cross_entropy(output.reshape(-1, 40), mb["target"].reshape(-1))

    for i in range(0, source.shape[0] - 1, seq):
        b = {"data": source[i:i + seq], "target": source[i + 1:i + 1 + seq], **state,
             "cols": torch.arange(batch)[None]}
        memguard.step(model, opt, b, loss_fn)
        state = {k: v.clone() for k, v in new_state.items()}
    assert guard_status(model).micro_batch_size == 4  # 10 columns ran as 4 + 4 + 2
    _close(model, ref, 1e-5)
    assert torch.allclose(state["h"], hidden[0].detach(), atol=1e-6)


def test_batch_dim_problems_are_config_errors():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(memguard.ConfigError) as info:
        memguard.prepare(net, opt, micro_batch_size=4, batch_dim=-1, clip_grad_value=-0.5, verbose="no")
    text = str(info.value)
    assert "batch_dim must be an int >= 0" in text and "clip_grad_value must be" in text and "verbose" in text
    net, opt = memguard.prepare(net, opt, micro_batch_size=4, batch_dim=1, verbose=False)
    with pytest.raises(memguard.ConfigError, match=r"have no dim 1.*flatten inside loss_fn"):
        memguard.step(net, opt, (torch.randn(3, 8, 16), torch.randint(0, 4, (8,))), _loss)


def test_a_user_error_keeps_its_type_and_says_where_memguard_called_it():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = memguard.prepare(net, opt, micro_batch_size=8, verbose=False)

    class Broken(Exception):
        pass

    def bad_loss(model, batch):
        if batch[0].shape[0] < 8:
            raise Broken("my loss")
        return _loss(model, batch)

    with pytest.raises(Broken, match="my loss") as info:
        memguard.step(net, opt, (torch.randn(20, 16), torch.randint(0, 4, (20,))), bad_loss)
    assert info.value.__notes__ == ["memguard: raised in the loss function (or the model's forward) that memguard "
                                    "called on micro-batch 3 of 3 (samples 16:20 of the batch's 20)"]

    def hook(optimizer, args, kwargs):
        raise KeyError("my hook")

    handle = opt.register_step_pre_hook(hook)
    with pytest.raises(KeyError) as info:
        memguard.step(net, opt, (torch.randn(8, 16), torch.randint(0, 4, (8,))), _loss)
    handle.remove()
    assert len(info.value.__notes__) == 1 and "optimizer step (with its hooks)" in info.value.__notes__[0]


def test_the_summary_says_what_runs_and_the_switch_silences_it(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="memguard")
    net = _net()
    opt = torch.optim.AdamW(net.parameters())
    b = (torch.randn(64, 16), torch.randint(0, 4, (64,)))
    memguard.prepare(net, opt, example_batch=b, loss_fn=_loss, device="cpu", precision="32-true")
    text = caplog.text
    assert "memguard planned micro-batch 64 x accumulation 1 x world 1 = 64 samples per optimizer step, 32-true, " \
           "no activation checkpointing" in text
    assert "predicted peak" in text and "no budget given: the machine's available RAM" in text
    assert "MEMGUARD_QUIET=1" in text

    guard = memguard.guard._core.guard_of(net, "")
    plan = guard.plan.replace(precision="bf16-mixed", micro_batch_size=16, grad_accum_steps=4)
    guard.options.plan_options.pop("precision")  # as if memguard had chosen the precision
    caplog.clear()
    guard.announce(plan, made=True)
    assert ("  overrides your script:\n"
            "    precision bf16-mixed instead of your model's 32-true (memguard autocasts; precision='32-true' keeps "
            "yours)\n"
            "    each batch of 64 runs as 4 micro-batches of 16 (gradient accumulation, the same gradient)\n") \
        in caplog.text

    caplog.clear()
    memguard.prepare(net, opt, plan=plan, verbose=False)
    assert "runs the plan" not in caplog.text
    monkeypatch.setenv("MEMGUARD_QUIET", "1")
    memguard.prepare(net, opt, plan=plan)
    assert "runs the plan" not in caplog.text
    monkeypatch.delenv("MEMGUARD_QUIET")
    memguard.prepare(net, opt, plan=plan)
    assert "memguard runs the plan: micro-batch 16 x accumulation 4" in caplog.text and "the plan's" in caplog.text


_SCRIPT = """
import torch, memguard
from torch import nn
net = nn.Linear(8, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
net, opt = memguard.prepare(net, opt, device="cpu", budget_bytes=64 << 20, precision="32-true")
memguard.step(net, opt, (torch.randn(16, 8), torch.randint(0, 2, (16,))),
              lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_the_summary_is_shown_without_any_logging_set_up(quiet):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MEMGUARD_QUIET", None)
    if quiet:
        env["MEMGUARD_QUIET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if quiet:
        assert proc.stderr == ""
    else:
        assert proc.stderr.startswith("memguard planned micro-batch 16 x accumulation 1 x world 1")
        assert "64.00 MiB budget, given; 10% headroom" in proc.stderr


def test_the_accelerate_summary_says_what_runs_not_the_plans_numbers(caplog):
    accelerate = pytest.importorskip("accelerate")
    from memguard.integrations.accelerate import prepare, status, step

    caplog.set_level(logging.INFO, logger="memguard")
    net = _net()
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
    net, opt = prepare(accelerator, net, torch.optim.SGD(net.parameters(), lr=0.1), loss_fn=_loss,
                       budget_bytes=1 << 30, max_grad_norm=0.05)
    for b in _batches(2, 16):
        step(accelerator, net, opt, b)
    plan = status(net).plan
    assert plan.micro_batch_size == 32 and plan.grad_accum_steps == 1  # the planner's numbers for 32 samples
    assert ("memguard planned micro-batch 16 (1 per dataloader batch of 16) x accumulation 2 (the Accelerator's) x "
            "world 1 = 32 samples per optimizer step") in caplog.text
    assert status(net).grad_norm is not None and status(net).steps == 1


def test_planning_with_batch_dim_counts_the_samples_along_it():
    model = _LM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = memguard.prepare(model, opt, batch_dim=1, device="cpu", budget_bytes=64 << 20, precision="32-true",
                                  verbose=False)

    def loss_fn(m, mb):
        assert mb["data"].shape[0] == 6  # the loss function sees the batch's own layout: [seq, samples]
        output, _ = m(mb["data"], None)
        return nn.functional.cross_entropy(output.reshape(-1, 40), mb["target"].reshape(-1))

    data = torch.randint(0, 40, (6, 10))
    memguard.step(model, opt, {"data": data, "target": data}, loss_fn)
    plan = guard_status(model).plan
    assert plan.global_batch_size == 10 and plan.micro_batch_size * plan.grad_accum_steps == 10
