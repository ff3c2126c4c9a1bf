"""Tests of ``memguard.estimator._trace``: the recorded allocation timeline of one traced step.

Expected byte counts follow from the tensors involved: float32 is 4 bytes per element; AdamW
keeps ``exp_avg`` and ``exp_avg_sq`` (fp32, parameter-shaped) and a 0-dim fp32 ``step`` per
parameter (torch/optim/adamw.py).
"""

from __future__ import annotations

from collections import UserDict, defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memguard.errors import ConfigError
from memguard.estimator._analysis import scan
from memguard.estimator._trace import OPTIMIZER_TEMPORARIES, PHASES, Trace, TraceSpec, trace_step

FP32 = 4


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1)
        self.register_buffer("offset", torch.zeros(dim))

    def forward(self, x):
        h = self.inp(x) + self.offset
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def net(**kwargs) -> Net:
    torch.manual_seed(0)
    return Net(**kwargs)


def x(batch: int = 16, dim: int = 32) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(0))


def category_bytes(trace: Trace) -> dict[str, int]:
    """Largest live bytes each category reaches over the step."""
    live: dict[str, int] = defaultdict(int)
    best: dict[str, int] = defaultdict(int)
    for handle, nbytes in trace.events:
        cat = trace.category[handle]
        live[cat] += nbytes
        best[cat] = max(best[cat], live[cat])
    return dict(best)


def test_events_are_balanced():
    model = net()
    trace = trace_step(model, x())
    state: dict[int, int] = {}
    for handle, nbytes in trace.events:
        if nbytes > 0:
            assert handle not in state, "allocated twice without a free"
            state[handle] = nbytes
        elif nbytes < 0:
            assert state.pop(handle) == -nbytes, "freed bytes differ from allocated bytes"
    assert all(n == trace.sizes[h] for h, n in state.items())


def test_live_state_when_zero_grad_starts():
    """After the optimizer step: weights, buffers, gradients, optimizer state, the batch and the
    0-dim loss (a training loop holds it until the next step) are live, and nothing else. (The
    events after that may or may not include the traced copy's own teardown, depending on when
    Python frees it; nothing reads them.)"""
    model = net()
    trace = trace_step(model, x())
    live: dict[str, int] = defaultdict(int)
    for handle, nbytes in trace.events[: trace.phase_starts["zero_grad"]]:
        live[trace.category[handle]] += nbytes
    params = sum(p.numel() for p in model.parameters()) * FP32
    buffers = sum(b.numel() for b in model.buffers()) * FP32
    adamw_state = 2 * params + len(list(model.parameters())) * FP32
    assert {c: n for c, n in live.items() if n} == {
        "params": params + buffers, "grads": params, "optimizer": adamw_state, "inputs": x().numel() * FP32,
        "activations": FP32,  # the loss
    }


def test_phases_are_in_order():
    trace = trace_step(net(), x())
    starts = [trace.phase_starts[p] for p in PHASES[1:]]
    assert starts == sorted(starts) and starts[0] > 0  # the setup registers the state first
    assert trace.phase_of(0) == "setup"
    for name in PHASES[1:]:
        assert trace.phase_of(trace.phase_starts[name]) == name
    assert trace.phase_of(len(trace.events) - 1) == "zero_grad"


def test_categories_hold_the_right_bytes():
    model = net()
    trace = trace_step(model, x())
    params = sum(p.numel() for p in model.parameters()) * FP32
    buffers = sum(b.numel() for b in model.buffers()) * FP32
    totals = category_bytes(trace)
    assert totals["params"] == params + buffers  # buffers are model state
    assert totals["grads"] == params  # every parameter is trainable
    assert totals["optimizer"] == 2 * params + len(list(model.parameters())) * FP32
    assert totals["inputs"] == x().numel() * FP32
    assert totals["activations"] > 0 and totals["temporaries"] > 0
    assert set(trace.category) <= {"params", "grads", "optimizer", "inputs", "activations", "temporaries",
                                   OPTIMIZER_TEMPORARIES}  # the step's temporaries, sharded like its state


def test_activations_are_what_forward_leaves_for_backward():
    """At the start of backward the live forward tensors are exactly what backward needs.

    Linear (no bias) -> ReLU -> sum: the Linear saves its input (the batch, category "inputs")
    and its weight; ReLU saves its own output (threshold_backward reads the result), so the
    Linear's output is freed; the loss is a 0-dim fp32 tensor.
    """
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU())
    trace = trace_step(model, x(4, 8), loss_fn=lambda m, b: m(b).sum())
    live: dict[str, int] = defaultdict(int)
    for handle, nbytes in trace.events[: trace.phase_starts["backward"]]:
        live[trace.category[handle]] += nbytes
    assert live["activations"] == 4 * 16 * FP32 + FP32


def test_counts():
    model = net()
    model.inp.requires_grad_(False)
    trace = trace_step(model, x())
    assert trace.num_params == sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trace.num_trainable_params == sum(p.numel() for p in trainable)
    assert trace.trainable_param_bytes == trace.num_trainable_params * FP32
    assert trace.num_blocks == 4
    # DeepSpeed's "largest layer": the most parameters one module holds itself (recurse=False)
    assert trace.largest_layer_params == max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    # every block runs the same kernels, so the op count is affine in the number of blocks
    ops = [trace_step(net(blocks=n), x()).num_ops for n in (2, 3, 4)]
    assert ops[2] - ops[1] == ops[1] - ops[0] > 0


def test_tied_parameters_are_one_storage():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)
            self.b.weight = self.a.weight

        def forward(self, z):
            return self.b(torch.tanh(self.a(z))).sum()

    model = Tied()
    trace = trace_step(model, x(4, 16))
    assert trace.num_params == 16 * 16 + 16 + 16
    assert category_bytes(trace)["params"] == trace.num_params * FP32
    assert category_bytes(trace)["grads"] == trace.num_params * FP32


def test_keep_blocks_memory_is_affine_in_blocks():
    """Identical blocks add identical bytes: the planner's cheap probes rely on it."""
    model = net(blocks=4)
    peaks = {}
    for keep in (1, 2, 3, None):
        trace = trace_step(model, x(), keep_blocks=keep)
        assert trace.num_blocks == (keep or 4)
        peaks[keep or 4] = scan(trace).phase_peaks
    for phase in ("forward", "backward", "optimizer"):
        step = peaks[2][phase] - peaks[1][phase]
        assert step > 0
        assert peaks[3][phase] - peaks[2][phase] == step
        assert peaks[4][phase] - peaks[3][phase] == step


def test_keep_blocks_leaves_the_model_whole():
    model = net(blocks=4)
    trace_step(model, x(), keep_blocks=1)
    assert len(model.blocks) == 4
    assert all(type(b) is Block for b in model.blocks)


def test_checkpoint_blocks_lowers_forward_memory_and_leaves_the_model_alone():
    model = net(blocks=4)
    plain = scan(trace_step(model, x(256))).phase_peaks["forward"]
    ckpt = scan(trace_step(model, x(256), checkpoint_blocks=4)).phase_peaks["forward"]
    assert ckpt < plain
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_grads_present_registers_gradients_before_forward():
    model = net()
    trace = trace_step(model, x(), grads_present=True)
    before = defaultdict(int)
    for handle, nbytes in trace.events[: trace.phase_starts["forward"]]:
        before[trace.category[handle]] += nbytes
    assert before["grads"] == sum(p.numel() for p in model.parameters()) * FP32


def test_trace_leaves_rng_and_model_alone():
    model = net()
    values = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    trace_step(model, x())  # the model has dropout: the traced copy draws random numbers
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, v) and p.grad is None for p, v in zip(model.parameters(), values))


def test_param_dtype_casts_weights_and_float_inputs():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))  # no buffer: see the next test
    trace = trace_step(model, x(), loss_fn=lambda m, b: m(b).mean(), param_dtype=torch.bfloat16)
    totals = category_bytes(trace)
    assert totals["params"] == sum(p.numel() for p in model.parameters()) * 2
    assert totals["grads"] == totals["params"]
    assert totals["inputs"] == x().numel() * 2


def test_param_dtype_casts_floating_buffers_like_module_to():
    model = net()
    trace = trace_step(model, x(), param_dtype=torch.bfloat16)
    reference = net().to(torch.bfloat16)  # what Lightning's HalfPrecision does to the module
    state = sum(t.numel() * t.element_size() for t in [*reference.parameters(), *reference.buffers()])
    assert category_bytes(trace)["params"] == state


def test_count_flops_counts_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode

    model = net()
    trace = trace_step(model, x(), count_flops=True)
    real = net()
    with FlopCounterMode(display=False) as counter:
        real(x()).backward()
    assert trace.flops == counter.get_total_flops()


# ----------------------------------------------------------------------------- batches
class Encoding(UserDict):
    """Like HF's BatchEncoding: a Mapping that is not a dict."""


class Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 1)

    def forward(self, x, scale):
        return self.lin(x * scale).mean()


def test_trace_takes_any_mapping_as_keyword_arguments():
    # memguard.batch.call_model passes a Mapping as **batch: a UserDict batch must trace like a
    # dict, and its fake copy must carry both entries as inputs (x: 16x32 fp32, scale: 32 fp32)
    plain = trace_step(Keyword(), {"x": x(), "scale": torch.ones(32)})
    user = trace_step(Keyword(), Encoding(x=x(), scale=torch.ones(32)))
    assert category_bytes(user)["inputs"] == (16 * 32 + 32) * FP32
    assert user.events == plain.events


def test_trace_reports_a_failing_loss_fn_as_config_error():
    def broken(model, batch):
        return F.linear(batch, torch.ones(3, 5)).sum()  # wrong shapes

    with pytest.raises(ConfigError, match="loss_fn"):
        trace_step(net(), x(), loss_fn=broken)
