"""prepare/step in one process: splitting, losses, precision, and recovery from real allocator failures.

The in-process OOMs come from :class:`Hungry`, a layer that asks the CPU allocator for a 4 EiB
workspace when it sees more than ``limit`` rows: the allocator really fails with its own error,
nothing is mocked, but the failure happens at a size the test chooses. The address-space-capped
subprocess tests (test_recovery.py) show the same recovery with memory that really runs out.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import memguard
from memguard.errors import ConfigError, OOMRecoveryError
from memguard.estimator._result import Estimate
from memguard.guard import compute_loss, guard_status, prepare, step
from memguard.planner._plan import Plan


def _allocate_impossible() -> None:
    torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: the CPU allocator fails for real


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[override]
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.layer.check(grad)
        return grad, None


class Hungry(nn.Module):
    """Identity that needs an impossible workspace (forward or backward) above ``limit`` rows."""

    def __init__(self, limit: int, where: str = "forward") -> None:
        super().__init__()
        self.limit, self.where, self.seen = limit, where, []

    def check(self, t: torch.Tensor) -> None:
        if isinstance(t, FakeTensor) or t.device.type == "meta":
            return  # memguard's estimator traces on fake tensors: the planner cannot foresee this failure
        self.seen.append(t.shape[0])
        if t.shape[0] > self.limit:
            _allocate_impossible()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            self.check(x)
            return x
        return _FailInBackward.apply(x, self)


def hungry(model: nn.Module) -> Hungry:
    return next(m for m in model.modules() if isinstance(m, Hungry))


def make_net(limit: int = 1 << 30, where: str = "forward", norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 8)]
    if norm:
        layers.append(nn.BatchNorm1d(8))
    layers += [Hungry(limit, where), nn.Tanh(), nn.Linear(8, 1)]
    return nn.Sequential(*layers)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).mean()


def data(n: int = 16, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, generator=g), torch.randn(n, generator=g)) for _ in range(steps)]


def reference_weights(model: nn.Module, batches: list) -> dict[str, torch.Tensor]:
    """Plain full-batch PyTorch: the result every guarded run must reproduce."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, Hungry):
            m.limit = 1 << 30
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for b in batches:
        mse(model, b).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def assert_close(a: dict, b: dict, rel: float = 1e-5) -> None:
    # fp32 with a different summation order (micro-batches) differs by a few ulps per step; 1e-5
    # relative in norm leaves two orders of magnitude of margin over the ~1e-7 observed.
    for k in b:
        if b[k].is_floating_point():
            assert ((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() <= rel, k


def hand_plan(micro_batch_size: int, n: int, precision: str = "32-true", **kw) -> Plan:
    est = Estimate(peak_bytes=7 << 20, breakdown={"params": 1 << 20, "activations": 6 << 20}, context_bytes=0,
                   peak_phase="backward", allocated_peak_bytes=7 << 20, device="cpu", precision=precision,
                   zero_stage=0, world_size=1, gpu=None, micro_batch_size=micro_batch_size)
    kw.setdefault("activation_checkpointing", False)
    return Plan(micro_batch_size=micro_batch_size, grad_accum_steps=n // micro_batch_size, world_size=1,
                global_batch_size=n, precision=precision, zero_stage=0, budget_bytes=8 << 20, estimate=est,
                device="cpu", **kw)


# ---------------------------------------------------------------------------------------------- prepare


def test_prepare_returns_the_same_objects_in_the_order_given() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert prepare(model, opt, micro_batch_size=4) == (model, opt)
    out = prepare(opt, model, micro_batch_size=4)
    assert out[0] is opt and out[1] is model and type(out[1]) is nn.Sequential


def test_prepare_lists_every_problem() -> None:
    model = make_net()
    with pytest.raises(ConfigError) as info:
        prepare(model, "sgd", micro_batch_size=0, max_retries=-1, probe_up_after=0)
    # the optimizer, micro_batch_size, max_retries and probe_up_after
    assert len(info.value.problems) == 4


def test_prepare_refuses_conflicting_sources_and_zero_plans() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="only one of"):
        prepare(model, opt, plan=hand_plan(4, 16), micro_batch_size=4)
    est_plan = hand_plan(4, 16).replace(zero_stage=2, strategy="deepspeed")
    with pytest.raises(ConfigError, match="ZeRO stage 2"):
        prepare(model, opt, plan=est_plan)
    with pytest.raises(ConfigError, match="only apply when memguard plans"):
        prepare(model, opt, micro_batch_size=4, budget_bytes=1 << 30)


def test_step_requires_prepare() -> None:
    model = make_net()
    with pytest.raises(ConfigError, match="memguard.prepare"):
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), data()[0], mse)


# ---------------------------------------------------------------------------------------------- step


# Every split must give the full-batch gradient: the last micro-batch smaller (3, 7), one sample each
# (1), and one micro-batch for the whole batch (16).
@pytest.mark.parametrize("mbs", [1, 3, 7, 16])
def test_micro_batches_reproduce_the_full_batch(mbs: int) -> None:
    model, batches = make_net(), data()
    ref = reference_weights(model, batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepare(model, opt, micro_batch_size=mbs, loss_fn=mse)
    losses = [step(model, opt, b) for b in batches]
    assert_close(model.state_dict(), ref)
    assert all(isinstance(v, float) for v in losses)
    assert all(p.grad is None for p in model.parameters())


def test_returned_loss_is_the_batch_mean() -> None:
    model, (batch,) = make_net(), data(steps=1)
    with torch.no_grad():
        expected = mse(model, batch).item()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prepare(model, opt, micro_batch_size=5, loss_fn=mse)
    assert step(model, opt, batch) == pytest.approx(expected, rel=1e-6)


class WithLoss(nn.Module):
    """Returns an object with .loss, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor):  # noqa: ANN201
        return type("Out", (), {"loss": ((self.fc(x).squeeze(-1) - y) ** 2).mean()})()


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).pow(2).mean()


def test_default_loss_calls_the_model_by_batch_shape() -> None:
    x, y = torch.randn(6, 4), torch.randn(6)
    m = WithLoss()
    assert compute_loss(m, {"x": x, "y": y}).shape == ()  # dict -> model(**batch), output.loss
    assert compute_loss(m, (x, y)).shape == ()  # tuple -> model(*batch)
    assert compute_loss(Scalar(), x).shape == ()  # tensor -> model(batch), a scalar output


def test_missing_loss_says_how_to_pass_loss_fn() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=2)
    with pytest.raises(ConfigError, match="loss_fn=lambda model, batch"):
        step(model, opt, torch.randn(4, 4))


def test_bf16_mixed_runs_the_forward_under_autocast() -> None:
    model, batch = make_net(), data(steps=1)[0]
    dtypes = []
    model[0].register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=8, precision="bf16-mixed", loss_fn=mse)
    step(model, opt, batch)
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    assert model[0].weight.dtype == torch.float32 and guard_status(model).grad_scaler is None


def test_bf16_true_casts_the_model_and_the_inputs() -> None:
    model, batch = make_net(), data(steps=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=8, precision="bf16-true", loss_fn=mse)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert opt.param_groups[0]["params"][0] is model[0].weight
    assert isinstance(step(model, opt, batch), float)


def test_true_precision_after_the_first_optimizer_step_is_refused() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mse(model, data(steps=1)[0]).backward()
    opt.step()
    with pytest.raises(ConfigError, match="before the first optimizer step"):
        prepare(model, opt, micro_batch_size=8, precision="16-true")


def test_stale_gradients_are_discarded_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model, batches = make_net(), data()
    ref = reference_weights(model, batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepare(model, opt, micro_batch_size=4, loss_fn=mse)
    mse(model, batches[0]).mul(100).backward()  # gradients left over from user code
    with caplog.at_level(logging.WARNING, logger="memguard"):
        for b in batches:
            step(model, opt, b)
    assert "discards them" in caplog.text
    assert_close(model.state_dict(), ref)


# ---------------------------------------------------------------------------------------------- OOM


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_recovers_from_a_real_allocator_failure(where: str, caplog: pytest.LogCaptureFixture) -> None:
    model, batches = make_net(limit=4, where=where), data()
    ref = reference_weights(model, batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepare(model, opt, plan=hand_plan(16, 16), loss_fn=mse)
    with caplog.at_level(logging.WARNING, logger="memguard"):
        for b in batches:
            step(model, opt, b)
    # 16 fails, 8 fails, 4 fits; the later steps start at 4 (remembered) and never fail again.
    assert guard_status(model).micro_batch_size == 4 and guard_status(model).oom_retries == 2
    assert [r.getMessage().split(";")[0].split(" (")[0] for r in caplog.records] == [
        "out of memory at micro-batch 16", "out of memory at micro-batch 8"]
    assert "micro-batch 8" in caplog.records[0].getMessage() and "micro-batch 4" in caplog.records[1].getMessage()
    assert_close(model.state_dict(), ref)


def test_norm_statistics_of_a_failed_attempt_are_rolled_back() -> None:
    model, batch = make_net(limit=4, norm=True), data(steps=1)[0]
    clean = copy.deepcopy(model)
    hungry(clean).limit = 1 << 30
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=16, loss_fn=mse)
    step(model, opt, batch)
    clean_opt = torch.optim.SGD(clean.parameters(), lr=0.1)
    prepare(clean, clean_opt, micro_batch_size=4, loss_fn=mse)
    step(clean, clean_opt, batch)
    for k, v in clean.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


def test_micro_batch_one_raises_with_the_predicted_breakdown() -> None:
    model, batch = make_net(limit=0), data(steps=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, plan=hand_plan(4, 16), loss_fn=mse)
    with pytest.raises(OOMRecoveryError) as info:
        step(model, opt, batch)
    err = info.value
    assert isinstance(err, memguard.MemguardError)
    assert err.micro_batch_size == 1 and err.breakdown == {"params": 1 << 20, "activations": 6 << 20}
    assert "micro-batch 1" in str(err) and "What would help" in str(err) and "activations" in str(err)
    assert hungry(model).seen == [4, 2, 1]
    assert all(p.grad is None for p in model.parameters())


def test_max_retries_bounds_the_halvings() -> None:
    model, batch = make_net(limit=1), data(steps=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=16, loss_fn=mse, max_retries=2)
    with pytest.raises(OOMRecoveryError, match="max_retries=2") as info:
        step(model, opt, batch)
    assert info.value.micro_batch_size == 4 and hungry(model).seen == [16, 8, 4]


def test_probe_up_after_clean_steps(caplog: pytest.LogCaptureFixture) -> None:
    model = make_net(limit=2)
    batches = data(steps=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=8, loss_fn=mse, probe_up_after=2)
    sizes = []
    with caplog.at_level(logging.INFO, logger="memguard"):
        for i, b in enumerate(batches):
            if i == 1:
                hungry(model).limit = 1 << 30  # the memory pressure goes away
            step(model, opt, b)
            sizes.append(guard_status(model).micro_batch_size)
    # step 0: 8 -> 4 -> 2; two clean steps later 4, two more 8 (the planned size, not beyond).
    assert sizes == [2, 2, 4, 4, 8, 8]
    assert "probing micro-batch 2 -> 4" in caplog.text


def test_a_non_oom_error_propagates_unchanged() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=4)

    def broken(m: nn.Module, b: tuple) -> torch.Tensor:
        loss = mse(m, b)
        if b[0].shape[0] < 4:
            raise KeyError("user bug")
        return loss

    with pytest.raises(KeyError, match="user bug"):
        step(model, opt, data(n=7, steps=1)[0], broken)
    assert all(p.grad is None for p in model.parameters())


class HungryOptimizer(torch.optim.SGD):
    def step(self, closure=None):  # noqa: ANN001, ANN201
        _allocate_impossible()


def test_oom_in_the_optimizer_step_is_reported_not_retried() -> None:
    model = make_net()
    opt = HungryOptimizer(model.parameters(), lr=0.1)
    prepare(model, opt, micro_batch_size=4, loss_fn=mse)
    with pytest.raises(OOMRecoveryError, match="optimizer.step"):
        step(model, opt, data(steps=1)[0])
    assert guard_status(model).micro_batch_size == 4


def test_grad_scaler_is_untouched_by_a_failed_attempt() -> None:
    """16-mixed on CPU: a recovered step equals, bit for bit, a step that started at the final size."""
    batches = data(steps=3)
    batches[1][0][3] = 7e4  # overflows float16: the scaler must skip this step and back off

    def run(limit: int, start: int) -> tuple[nn.Module, torch.amp.GradScaler]:
        model = make_net(limit=limit)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        prepare(model, opt, micro_batch_size=start, precision="16-mixed", loss_fn=mse, grad_scaler=scaler)
        for b in batches:
            step(model, opt, b)
        return model, scaler

    recovered, scaler = run(limit=4, start=16)
    clean, clean_scaler = run(limit=1 << 30, start=4)
    assert guard_status(recovered).oom_retries == 2
    # scale: 2**10, x2 after step 0, /2 on the overflow of step 1, x2 after step 2.
    assert scaler.get_scale() == clean_scaler.get_scale() == 2.0**11
    assert scaler.state_dict() == clean_scaler.state_dict()
    for k, v in clean.state_dict().items():
        assert torch.equal(recovered.state_dict()[k], v), k


# ---------------------------------------------------------------------------------------------- plan


def test_activation_checkpointing_from_the_plan() -> None:
    from memguard.estimator import _blocks as blocks

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(x))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.out = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    torch.manual_seed(0)
    model, batches = Stack(), data()
    ref = reference_weights(model, batches)
    calls = []
    for b in model.blocks:  # a hook on the block's Linear also sees the recomputation in backward
        b.fc.register_forward_hook(lambda m, a, o: calls.append(id(m)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert len(blocks.find_blocks(model)) == 4
    prepare(model, opt, plan=hand_plan(8, 16, activation_checkpointing=True, checkpoint_blocks=2), loss_fn=mse)
    for b in batches:
        step(model, opt, b)
    # Checkpointed blocks (0, 1) run twice per micro-batch (forward, then recomputed in backward), the
    # others once; 2 micro-batches x 3 steps.
    per_block = {id(b): calls.count(id(b.fc)) for b in model.blocks}
    assert list(per_block.values()) == [12, 12, 6, 6]
    assert_close(model.state_dict(), ref)


def test_plans_on_the_first_step() -> None:
    model, batches = make_net(), data()
    ref = reference_weights(model, batches)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    prepare(model, opt, loss_fn=mse, budget_bytes=1 << 30, precision="32-true")
    assert guard_status(model).micro_batch_size is None
    for b in batches:
        step(model, opt, b)
    status = guard_status(model)
    assert status.plan is not None and status.plan.global_batch_size == 16
    assert status.micro_batch_size == status.plan.micro_batch_size
    assert_close(model.state_dict(), ref)


def test_a_reduced_micro_batch_is_remembered_in_the_plan_cache(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from memguard.planner._cache import PlanCache

    store = PlanCache(tmp_path)
    batch = data(steps=1)[0]

    def run() -> nn.Module:
        model = make_net(limit=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prepare(model, opt, loss_fn=mse, budget_bytes=1 << 30, precision="32-true", cache=store)
        step(model, opt, batch)
        return model

    first = run()
    # The planner does not know about Hungry's limit: 1 GiB holds the whole 16-sample batch, the fastest plan;
    # the guard then halves 16 -> 8 -> 4 -> 2.
    assert guard_status(first).plan.micro_batch_size == 16
    assert guard_status(first).micro_batch_size == 2 and guard_status(first).oom_retries == 3
    with caplog.at_level(logging.INFO, logger="memguard"):
        second = run()  # a new run of the same job: starts at the remembered size, no OOM
    assert guard_status(second).oom_retries == 0 and hungry(second).seen == [2] * 8
    assert guard_status(second).plan.micro_batch_size == 2
    assert "remembered in the plan cache" in caplog.text


def test_example_batch_plans_in_prepare_and_unknown_options_are_refused() -> None:
    model, batch = make_net(), data(steps=1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare(model, opt, example_batch=batch, loss_fn=mse, budget_bytes=1 << 30, precision="32-true")
    status = guard_status(model)
    assert status.plan is not None and status.micro_batch_size == status.plan.micro_batch_size
    with pytest.raises(ConfigError, match="unknown plan option 'budget_byte'"):
        prepare(model, opt, loss_fn=mse, budget_byte=1 << 30)
    with pytest.raises(ConfigError, match="zero_stage=2 is not run by memguard.prepare.*to_config"):
        prepare(model, opt, loss_fn=mse, zero_stage=2)
