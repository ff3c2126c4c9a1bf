"""Per-rank model states under ZeRO and DDP, checked against DeepSpeed's own estimators.

DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (runtime/zero/stage_1_and_2.py) and
``estimate_zero3_model_states_mem_needs`` (runtime/zero/stage3.py) give the GPU bytes of
params + grads + optimizer state per rank for mixed-precision Adam: ``2Ψ + 18Ψ/N`` (ZeRO-2),
``4·largest_layer + 18Ψ/N`` (ZeRO-3), ``2Ψ`` (ZeRO-2, optimizer offloaded) and
``4·largest_layer + 2Ψ/N`` (ZeRO-3, optimizer offloaded, params on the GPU).

Which moment to compare: DeepSpeed counts every model state as present at once (16-bit weights,
16-bit grads, fp32 grads, fp32 master weights, two Adam moments). In the traced step that is the
end of backward, when every gradient exists and the optimizer step has not started; the tests
read the scaled timeline there. ``Estimate.model_state_bytes`` is the same sum *at the peak*,
which equals it only when the peak falls in the optimizer step (checked where used).

DeepSpeed's stage 1/2 estimator counts the fp32 gradient partition (4Ψ/N, "4_grads_32bit") as
resident; the engine makes it in ``step()`` (stage_1_and_2.py: ``single_grad_partition =
flat_grad_partition.to(fp32)``, after freeing the module's gradients), so memguard carries it with
the step's temporaries (``optimizer_temporaries``), and ZeRO-1's 16-bit partition copy
(``grads_in_partition``) appears when backward ends (``grads_at_end_of_backward``). The comparisons
add both to the end-of-backward states (:func:`deepspeed_resident`): DeepSpeed's figure is the
states of the end of backward and the step together.

The trace's Adam also keeps one 0-dim fp32 ``step`` tensor per parameter tensor (torch.optim),
which DeepSpeed's formula (one flat partition) does not count: comparisons allow a few bytes per
parameter tensor for them (see ``step_slack``), plus 1 byte for DeepSpeed's ``int()`` truncation.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import memguard
from memguard.estimator._sharding import ShardFactors, TracedStates, ZeroSetup, model_state_factors
from memguard.estimator._trace import trace_step

FP32 = 4
STATE = ("params", "grads", "optimizer")
WORLD_SIZES = [1, 2, 3, 8, 64]


@pytest.fixture(scope="module")
def ds():
    """DeepSpeed's estimator functions (a real DeepSpeed install; skipped without one)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return {
        "zero2": stage_1_and_2.estimate_zero2_model_states_mem_needs,
        "zero3": stage3.estimate_zero3_model_states_mem_needs,
        "model_to_params": stage3.model_to_params,
    }


def deepspeed_resident(f: ShardFactors, stage: int, psi_t: int, n: int, *, sixteen_bit: bool = True,
                       offload: bool = False) -> float:
    """What DeepSpeed's estimator counts resident but the engine holds otherwise (see the module
    docstring): ZeRO-1's partition copy at the end of backward; at stages 1-2 the fp32 gradient
    partition of the step (16-bit only: in fp32 the partition's flat copy is that gradient); at
    stage 3 the two gathered largest layers (forward and backward only: ``gathered_in_passes``) and
    the gradient partition, which the estimator counts in fp32 and the engine keeps in the weights'
    dtype (stage3.py ``grad_partitions_flat_buffer``, ``gradient_accumulation_dtype``)."""
    if stage == 3:
        narrower = (4 - (2 if sixteen_bit else 4)) * psi_t / n if not offload else 0.0
        return f.gathered_in_passes + narrower
    step_fp32_grads = 4 * psi_t / n if sixteen_bit and not offload else 0.0
    return f.grads_at_end_of_backward + step_fp32_grads


def ds_gpu_bytes(ds, stage: int, psi: int, largest: int, n: int, offload: bool = False) -> int:
    if stage == 2:
        return ds["zero2"](psi, num_gpus_per_node=n, num_nodes=1, cpu_offload=offload)[1]
    return ds["zero3"](psi, largest, num_gpus_per_node=n, num_nodes=1, cpu_offload=offload,
                       cpu_offload_params=False)[1]


def mlp(width: int = 256, layers: int = 4) -> nn.Sequential:
    """Identical Linear layers: memguard's repeated blocks are the Linears, so its largest layer is
    the largest module's own parameters, exactly what DeepSpeed's ``model_to_params`` finds."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def loss_fn(model, batch):
    return model(batch).pow(2).mean()


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def end_of_backward_state(model, batch, *, stage, world_size, precision="bf16-mixed", optimizer=adam,
                          offload=False, loss=loss_fn) -> int:
    """Per-rank params + grads + optimizer bytes at the end of backward, from the trace scaled by
    ``model_state_factors`` the way ``memguard.estimate`` scales it."""
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    param_dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)
    trace = trace_step(model, batch, optimizer=optimizer, loss_fn=loss, autocast_dtype=autocast,
                       param_dtype=param_dtype)
    live: dict[str, int] = defaultdict(int)
    best: dict[str, int] = defaultdict(int)
    for handle, nbytes in trace.events:
        cat = trace.category[handle]
        live[cat] += nbytes
        best[cat] = max(best[cat], live[cat])
    f = model_state_factors(
        TracedStates(params=best["params"], grads=best["grads"], optimizer=best["optimizer"],
                     num_params=trace.num_params, num_trainable=trace.num_trainable_params,
                     largest_layer=trace.largest_layer_params),
        ZeroSetup(zero_stage=stage, world_size=world_size, sixteen_bit=precision != "32-true",
                  offload_optimizer=offload),
    )
    at: dict[str, int] = defaultdict(int)
    for handle, nbytes in trace.events[: trace.phase_starts["optimizer"]]:
        at[trace.category[handle]] += nbytes
    scaled = sum(at[c] * getattr(f, c) for c in STATE)
    resident = deepspeed_resident(f, stage, trace.num_trainable_params, world_size,
                                  sixteen_bit=precision != "32-true", offload=offload)
    return int(round(scaled + resident)) + f.extra_params + f.extra_grads


def step_slack(model, n: int) -> int:
    """Allowance for Adam's 0-dim fp32 step counters: one per parameter tensor, counted up to twice
    (a trace in 16-bit parameters has its optimizer state scaled back to fp32, counters included),
    partitioned over n ranks; plus DeepSpeed's int() truncation."""
    return -(-2 * FP32 * len(list(model.parameters())) // n) + 1


# ------------------------------------------------------------- the factors, in isolation
@pytest.mark.parametrize("psi", [1_000_003, 124_439_808, 8_030_261_248])  # odd, GPT-2 124M, Llama-3-8B
@pytest.mark.parametrize("n", [1, 2, 3, 8, 64, 1024])
@pytest.mark.parametrize("stage, offload", [(2, False), (3, False), (2, True), (3, True)])
def test_factors_reproduce_deepspeed_formulas(ds, psi, n, stage, offload):
    largest = psi // 40
    # a bf16-mixed Adam trace holds fp32 weights (4Ψ), fp32 grads (4Ψ) and two fp32 moments (8Ψ)
    traced = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    f = model_state_factors(
        TracedStates(params=traced["params"], grads=traced["grads"], optimizer=traced["optimizer"],
                     num_params=psi, num_trainable=psi, largest_layer=largest),
        ZeroSetup(zero_stage=stage, world_size=n, sixteen_bit=True, offload_optimizer=offload),
    )
    ours = (sum(traced[c] * getattr(f, c) for c in STATE) + f.extra_params + f.extra_grads
            + deepspeed_resident(f, stage, psi, n, offload=offload))
    assert abs(ours - ds_gpu_bytes(ds, stage, psi, largest, n, offload)) <= 1 + 1e-9 * ours  # int() and float rounding


def test_stage_0_single_rank_changes_nothing():
    f = model_state_factors(TracedStates(params=400, grads=400, optimizer=800, num_params=100, num_trainable=100,
                                         largest_layer=10), ZeroSetup(zero_stage=0, world_size=1, sixteen_bit=True))
    assert f == ShardFactors()


def test_ddp_buckets_are_as_large_as_all_gradients():
    # torch DDP docs (gradient_as_bucket_view): the buckets hold a copy of every gradient
    f = model_state_factors(TracedStates(params=400, grads=400, optimizer=800, num_params=100, num_trainable=100,
                                         largest_layer=10), ZeroSetup(zero_stage=0, world_size=4, sixteen_bit=True))
    assert (f.params, f.grads, f.optimizer) == (1.0, 1.0, 1.0)
    assert f.extra_grads == 400 and f.extra_params == 0


def test_zero_1_partitions_only_optimizer_side_state():
    # ZeRO paper §5.1 (P_os) with DeepSpeed's byte layout: 2Ψ weights + 2Ψ grads on every rank,
    # fp32 grads, fp32 master weights and Adam moments (4 + 4 + 8 bytes) partitioned; plus the
    # partition's own 16-bit gradient copy (stage_1_and_2.py, reduce_ipg_grads "zero stage 1":
    # copy_grads_in_partition into grads_in_partition, contiguous_gradients being DeepSpeed's default)
    psi = 1000
    f = model_state_factors(TracedStates(params=4 * psi, grads=4 * psi, optimizer=8 * psi, num_params=psi,
                                         num_trainable=psi, largest_layer=10),
                            ZeroSetup(zero_stage=1, world_size=4, sixteen_bit=True))
    ours = (4 * psi * f.params + 4 * psi * f.grads + 8 * psi * f.optimizer + f.extra_params + f.extra_grads
            + deepspeed_resident(f, 1, psi, 4))
    assert ours == pytest.approx(4 * psi + 18 * psi / 4)
    assert f.grads_at_end_of_backward == 2 * psi / 4  # the 16-bit partition copy, made when backward ends


# ------------------------------------------------------------ the estimator, end to end
@pytest.mark.parametrize("stage", [2, 3])
def test_end_of_backward_state_matches_deepspeed(ds, stage):
    model, batch = mlp(), torch.randn(4, 256)
    psi, largest = ds["model_to_params"](model)  # real CPU weights: data_ptr dedup works
    for n in WORLD_SIZES:
        ours = end_of_backward_state(model, batch, stage=stage, world_size=n)
        expected = ds_gpu_bytes(ds, stage, psi, largest, n)
        assert 0 <= ours - expected <= step_slack(model, n), (n, ours, expected)


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_optimizer_matches_deepspeed(ds, stage):
    model, batch = mlp(), torch.randn(4, 256)
    psi, largest = ds["model_to_params"](model)
    for n in (1, 8):
        ours = end_of_backward_state(model, batch, stage=stage, world_size=n, offload=True)
        assert abs(ours - ds_gpu_bytes(ds, stage, psi, largest, n, offload=True)) <= 1


@pytest.mark.parametrize("stage", [2, 3])
def test_estimate_model_state_bytes_matches_deepspeed(ds, stage):
    """The public number. ``model_state_bytes`` is taken at the peak: on one rank, with a tiny
    micro-batch, the peak is in the optimizer step, where every model state is live, so it is
    DeepSpeed's figure. On more ranks the step's temporaries shrink with the partition and the
    peak can move to the forward pass, where no gradient exists yet: then it is less."""
    model, batch = mlp(), torch.randn(2, 256)
    psi, largest = ds["model_to_params"](model)
    for n in (1, 2, 8):
        # cpu="avx2": ATen's own 16-bit kernels, which allocate no scratchpad, so that the peak's
        # phase depends on the model states alone (oneDNN's matmul scratchpad on an AVX-512 host
        # is as large as this tiny step's activations and moves the peak into the backward)
        est = memguard.estimate(model, batch, loss_fn=loss_fn, optimizer=adam, device="cpu", precision="bf16-mixed",
                                zero_stage=stage, world_size=n, cpu="avx2")
        expected = ds_gpu_bytes(ds, stage, psi, largest, n)
        if stage == 2:
            # the engine's step() has freed the 16-bit gradient partition (2Ψ/N) by the time the torch
            # optimizer runs, and its fp32 copy (4Ψ/N) is counted with the step's temporaries
            expected -= 6 * psi // n
        else:
            # the step finds ZeRO-3's gathered layers (4 x largest layer, 16-bit) released, and its
            # gradient partition is in bf16 (2Ψ/N), not the fp32 DeepSpeed's estimator counts (4Ψ/N)
            expected -= 4 * largest + 2 * psi // n
        if n == 1:
            assert est.peak_phase == "optimizer"
        if est.peak_phase == "optimizer":
            assert 0 <= est.model_state_bytes - expected <= step_slack(model, n), (n, est.model_state_bytes, expected)
        else:
            # forward: the module's gradients were freed; ZeRO-3 keeps its flat bf16 gradient partition
            assert est.breakdown.get("grads", 0) == (0 if stage == 2 else 2 * psi // n)
            if stage == 2:  # (ZeRO-3's forward ends with the whole model gathered: more, not less)
                assert est.model_state_bytes < expected


class TinyGPT(nn.Module):
    """Blocks (attention-free) larger than any single module: 2 x (Linear 64->256, Linear 256->64)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(2))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return h.pow(2).mean()


def test_zero3_largest_layer_is_deepspeeds(ds):
    model, batch = TinyGPT(), torch.randint(0, 100, (2, 8))
    psi, largest = ds["model_to_params"](model)
    ours = end_of_backward_state(model, batch, stage=3, world_size=8, loss=lambda m, b: m(b))
    assert 0 <= ours - ds_gpu_bytes(ds, 3, psi, largest, 8) <= step_slack(model, 8)


def test_zero_1_end_to_end():
    model, batch = mlp(), torch.randn(4, 256)
    psi = sum(p.numel() for p in model.parameters())
    for n in (1, 4):
        ours = end_of_backward_state(model, batch, stage=1, world_size=n)
        assert 0 <= ours - (4 * psi + 18 * psi // n) <= step_slack(model, n)  # see the test above


def test_fp32_training_keeps_an_fp32_master_partition():
    # 32-true: weights 4Ψ replicated (stage 2), grads 4Ψ/N, Adam's 8Ψ/N and the fp32 master
    # partition 4Ψ/N: DeepSpeed clones the partition whatever the dtype (stage_1_and_2.py,
    # DeepSpeedZeroOptimizer.__init__: ``weights_partition = ...detach().clone().to(...)``); a real
    # 2-rank engine holds it (benchmarks/results/deepspeed_cpu.md: 20Ψ/N at rest, not 16Ψ/N)
    model, batch = mlp(), torch.randn(4, 256)
    psi = sum(p.numel() for p in model.parameters())
    for n in (1, 4):
        ours = end_of_backward_state(model, batch, stage=2, world_size=n, precision="32-true")
        assert 0 <= ours - (4 * psi + 16 * psi // n) <= step_slack(model, n)


def test_optimizer_state_size_comes_from_the_trace():
    # SGD with momentum keeps 4 bytes per parameter instead of Adam's 8 (and no step counter):
    # ZeRO-2 = 2Ψ + (2 + 4 + 4 + 4)Ψ/N
    model, batch = mlp(), torch.randn(4, 256)
    psi = sum(p.numel() for p in model.parameters())
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    for n in (1, 4):
        ours = end_of_backward_state(model, batch, stage=2, world_size=n, optimizer=sgd)
        assert abs(ours - (2 * psi + 14 * psi // n)) <= 1 + n  # 4Ψ/N of them are the step's fp32 grads (float)


def test_frozen_parameters_are_replicated_but_not_trained():
    # ZeRO-2 with frozen layers: every weight in 16 bits on every rank (2Ψ); grads, fp32 copies
    # and optimizer state only for the trainable Ψ_t
    model, batch = mlp(), torch.randn(4, 256)
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    psi = sum(p.numel() for p in model.parameters())
    psi_t = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for n in (1, 4):
        ours = end_of_backward_state(model, batch, stage=2, world_size=n,
                                     optimizer=lambda ps: adam([p for p in ps if p.requires_grad]))
        slack = -(-2 * FP32 * len(trainable) // n) + 1
        assert 0 <= ours - (2 * psi + 18 * psi_t // n) <= slack


def test_ddp_adds_gradient_buckets_when_world_size_is_above_one():
    model, batch = mlp(), torch.randn(2, 256)
    grads = sum(p.numel() for p in model.parameters()) * FP32
    one = memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu", world_size=1)
    two = memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu", world_size=2)
    eight = memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu", world_size=8)
    assert one.peak_phase == two.peak_phase == "optimizer"  # every gradient is live there
    assert two.breakdown["grads"] - one.breakdown["grads"] == grads
    assert two.peak_bytes - one.peak_bytes == grads  # buckets live through the whole step
    assert eight == memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu", world_size=8)
    assert eight.peak_bytes == two.peak_bytes  # DDP replicates: the rank count does not matter
    # with ZeRO the gradients are reduced by DeepSpeed, not DDP: no all-gradient buckets (ZeRO-1
    # holds the full gradients plus its partition's copy, 1.5x on 2 ranks, not DDP's 2x)
    z1 = memguard.estimate(model, batch, loss_fn=loss_fn, device="cpu", world_size=2, zero_stage=1)
    assert z1.breakdown["grads"] < two.breakdown["grads"]


def test_ddp_buckets_on_the_cuda_target():
    model, batch = mlp(), torch.randn(2, 256)
    grads = sum(p.numel() for p in model.parameters()) * FP32
    one = memguard.estimate(model, batch, loss_fn=loss_fn, device="cuda", world_size=1)
    two = memguard.estimate(model, batch, loss_fn=loss_fn, device="cuda", world_size=2)
    assert two.allocated_peak_bytes - one.allocated_peak_bytes == grads
    assert two.peak_bytes - one.peak_bytes >= grads  # reserved: rounded up to whole segments


def test_estimate_reports_its_target():
    est = memguard.estimate(mlp(), torch.randn(2, 256), loss_fn=loss_fn, device="cpu", precision="bf16-mixed",
                            zero_stage=3, world_size=4)
    assert (est.zero_stage, est.world_size) == (3, 4)
    assert est.model_state_bytes == sum(est.breakdown.get(c, 0) for c in STATE)


# ------------------------------------------- the real engine's terms (DeepSpeed 0.19.8's source)
# Byte layouts read from deepspeed/runtime/zero/stage_1_and_2.py and stage3.py and checked against
# real 2-rank CPU engines (benchmarks/deepspeed_cpu.py; results in benchmarks/results/deepspeed_cpu.md).
from memguard.estimator._sharding import ZeroBuckets  # noqa: E402

PSI = 1_000_000


def fp32_factors(stage: int, n: int = 2, *, buckets: ZeroBuckets | None = None, **traced) -> ShardFactors:
    """Factors for an fp32 Adam trace of PSI parameters (4Ψ weights, 4Ψ grads, 8Ψ moments);
    ``traced`` sets further :class:`TracedStates` fields."""
    states = TracedStates(params=4 * PSI, grads=4 * PSI, optimizer=8 * PSI, num_params=PSI, num_trainable=PSI,
                          largest_layer=PSI // 10, **traced)
    return model_state_factors(states, ZeroSetup(zero_stage=stage, world_size=n, sixteen_bit=False, buckets=buckets))


def test_zero_buckets_read_deepspeeds_keys_and_defaults():
    d = ZeroBuckets()
    # deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig) defaults
    assert (d.reduce_bucket_size, d.allgather_bucket_size, d.prefetch_bucket_size) == (500_000_000, 500_000_000,
                                                                                       50_000_000)
    assert (d.max_live_parameters, d.param_persistence_threshold, d.max_reuse_distance) == (10**9, 100_000, 10**9)
    zero = {"stage": 3, "reduce_bucket_size": 65536, "stage3_prefetch_bucket_size": 58982,
            "stage3_param_persistence_threshold": 2560, "stage3_max_reuse_distance": "auto", "overlap_comm": True}
    b = ZeroBuckets.from_config(zero)
    assert (b.reduce_bucket_size, b.prefetch_bucket_size, b.param_persistence_threshold) == (65536, 58982, 2560)
    assert b.max_reuse_distance == 10**9  # "auto" is dropped by DeepSpeed inside zero_optimization
    assert b.overlap_comm is True
    assert ZeroBuckets.from_config({"zero_optimization": zero}) == b  # a whole config works too
    from_ds = pytest.importorskip("deepspeed.runtime.zero.config").DeepSpeedZeroConfig()
    assert (from_ds.reduce_bucket_size, from_ds.allgather_bucket_size, from_ds.prefetch_bucket_size,
            from_ds.max_live_parameters, from_ds.param_persistence_threshold, from_ds.max_reuse_distance) == (
        d.reduce_bucket_size, d.allgather_bucket_size, d.prefetch_bucket_size, d.max_live_parameters,
        d.param_persistence_threshold, d.max_reuse_distance)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_master_partition_at_stages_1_and_2(stage):
    # at rest: Adam's 8Ψ/N plus the fp32 master clone 4Ψ/N (optimizer category)
    f = fp32_factors(stage, n=4)
    assert 8 * PSI * f.optimizer == pytest.approx(12 * PSI / 4)
    assert 4 * PSI * f.params == pytest.approx(4 * PSI)


def test_zero_3_fp32_rank_holds_twenty_bytes_per_partition_element_at_rest():
    # parameter partition 4 (lp_param_buffer) + fp32 master clone 4 (_create_fp32_partitions, else
    # branch) + flat gradient partition 4 (grad_partitions_flat_buffer) + Adam 8 = 20Ψ/N. The
    # benchmark's llama-z3 rank starts every step at 37.94 MiB = 20 x 3,950,848 / 2 bytes + the
    # 65536-element reduce bucket.
    n = 2
    f = fp32_factors(3, n=n, buckets=ZeroBuckets(reduce_bucket_size=65536, param_persistence_threshold=0))
    at_rest = 4 * PSI * f.params + 8 * PSI * f.optimizer + f.extra_grads
    assert at_rest == pytest.approx(20 * PSI / n + 65536 * 4, abs=2)
    assert f.grads == 0.0  # per-module grads are reduced into the flat partition at once


@pytest.mark.parametrize("stage,item,copies", [(1, 4, 1), (2, 4, 1), (3, 4, 1)])
def test_reduce_bucket_is_allocated_whole(stage, item, copies):
    # setup_buckets / _setup_for_real_optimizer: torch.empty(reduce_bucket_size), whatever the model's
    # size; stages 1-2 make it at each backward's first gradient hook and drop it by the step
    # (bucket_in_backward), stage 3 keeps it for the engine's life (extra_grads)
    def bucket(f):
        return f.extra_grads + f.bucket_in_backward

    without = fp32_factors(stage, buckets=ZeroBuckets(reduce_bucket_size=1, param_persistence_threshold=0))
    default = fp32_factors(stage, buckets=ZeroBuckets(param_persistence_threshold=0))
    assert bucket(default) - bucket(without) == (500_000_000 - 1) * item * copies  # the ~2 GB buffer
    assert (default.bucket_in_backward > 0) == (stage < 3)


def test_overlap_comm_doubles_the_stage_2_bucket():
    one = fp32_factors(2, buckets=ZeroBuckets(reduce_bucket_size=1000))
    two = fp32_factors(2, buckets=ZeroBuckets(reduce_bucket_size=1000, overlap_comm=True))
    assert two.bucket_in_backward - one.bucket_in_backward == 1000 * 4
    assert fp32_factors(2).bucket_in_backward == 0  # no config: buckets unknown, left out


def test_zero_1_keeps_full_grads_and_the_partition_copy():
    # full gradients through backward; the partition's copy once backward has ended (reduce_gradients
    # without overlap_comm), or during it with overlap_comm (the hooks reduce)
    f = fp32_factors(1, n=2)
    assert 4 * PSI * f.grads == pytest.approx(4 * PSI)
    assert f.grads_at_end_of_backward == 4 * PSI // 2
    assert f.release_grads_at_step  # step() frees the module's gradients before the torch optimizer runs
    overlap = fp32_factors(1, n=2, buckets=ZeroBuckets(reduce_bucket_size=1000, overlap_comm=True))
    assert 4 * PSI * overlap.grads == pytest.approx(4 * PSI + 4 * PSI / 2) and overlap.grads_at_end_of_backward == 0
    # every gradient fits the bucket: each is moved into it (its own storage freed) before the copy
    fits = fp32_factors(1, n=2, buckets=ZeroBuckets(reduce_bucket_size=PSI))
    assert fits.grads_at_end_of_backward == 0
    no_copy = fp32_factors(1, n=2, buckets=ZeroBuckets(contiguous_gradients=False))
    assert no_copy.grads == pytest.approx(1.0) and no_copy.grads_at_end_of_backward == 0


def test_zero_3_gathers_the_whole_model_with_the_default_reuse_distance():
    # __params_to_release keeps a module's parameters while they recur within max_reuse_distance
    # elements: with 1e9 nothing is released in forward. The gathered bytes ride on the activations
    # (gathered and released with them); 2·largest_layer of them are gathered_in_passes (forward and
    # backward).
    acts = 3 * PSI
    f = fp32_factors(3, activations=acts, buckets=ZeroBuckets(param_persistence_threshold=0))
    assert acts * (f.activations - 1) + f.gathered_in_passes == pytest.approx(4 * PSI)
    assert f.gathered_share == pytest.approx(1 - 1 / f.activations)
    short = fp32_factors(3, activations=acts,
                         buckets=ZeroBuckets(param_persistence_threshold=0, max_reuse_distance=PSI))
    assert short.activations == 1.0 and short.gathered_in_passes == 2 * 4 * (PSI // 10)  # DeepSpeed's 4·largest_layer
    # no config: DeepSpeed's default reuse distance (to_config never sets it)
    assert fp32_factors(3, activations=acts).activations == f.activations


def test_zero_3_persistent_parameters_stay_gathered():
    numels = (1000,) * 100 + (PSI - 100_000,)  # 100 small tensors at the threshold, one large
    f = fp32_factors(3, param_numels=numels, buckets=ZeroBuckets(param_persistence_threshold=1000))
    assert 4 * PSI * f.params == pytest.approx(4 * PSI / 2 + 4 * 100_000)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_temporaries_are_those_of_one_flat_partition(stage):
    # torch AdamW (single tensor) makes two temporaries of a parameter's size (sqrt, div): the trace's
    # peak step temporaries are twice its largest parameter tensor. DeepSpeed steps one flat partition:
    # two temporaries of Ψ/N fp32 elements plus the flat fp32 gradient of the partition (step() /
    # _prepare_fp32_grad_for_sub_group). At stages 1-2 the module's gradients are gone by then
    # (release_grads_at_step); at stage 3 they were reduced into the flat partition (no per-module grads).
    n, largest = 2, 4 * (PSI // 10)
    f = fp32_factors(stage, n=n, temporaries=2 * largest, largest_param_bytes=largest)
    temps = 2 * largest * f.optimizer_temporaries
    # what the engine adds over its resting state in the step: 3Ψ/N x 4 bytes at every stage
    # (measured: benchmarks/results/deepspeed_cpu.md, the fp32 rank's optimizer-phase peak)
    assert temps == pytest.approx(3 * 4 * PSI / n)
    assert f.release_grads_at_step == (stage < 3)


def test_estimate_from_trace_takes_the_engines_buckets():
    from memguard.estimator._pricing import estimate_from_trace
    from memguard.estimator._targets import Target
    from memguard.estimator._tracing import TraceRequest, run_trace

    model, batch = mlp(), torch.randn(2, 256)
    psi = sum(p.numel() for p in model.parameters())
    trace = run_trace(model, batch, TraceRequest(device="cpu", precision="32-true"), optimizer=adam, loss_fn=loss_fn)
    for stage in (1, 2, 3):
        target = Target(device="cpu", precision="32-true", zero_stage=stage, world_size=2, strategy="deepspeed")
        plain, _ = estimate_from_trace(trace, target)
        # stage 2: a bucket of all gradients (a smaller one is reduced early in backward and brings the
        # last rank's whole partition then: tests/estimator/test_deepspeed_precision.py)
        one = psi if stage == 2 else 1
        small, _ = estimate_from_trace(trace, target, zero_config={"reduce_bucket_size": one,
                                                                   "stage3_param_persistence_threshold": 0})
        big, _ = estimate_from_trace(trace, target, zero_config={"stage3_param_persistence_threshold": 0})
        # DeepSpeed's default bucket: through backward at stages 1-2 (gone by the step), all the time at 3
        grown = big.phase_peaks["backward"] - small.phase_peaks["backward"]
        if stage == 1:
            # with the default bucket every gradient fits it: moved in, own storage freed, so ZeRO-1's
            # partition copy (4 x Ψ/2 bytes in fp32) no longer comes on top of them
            copy = FP32 * sum(p.numel() for p in model.parameters()) // 2
            assert (500_000_000 - 1) * FP32 - copy <= grown <= (500_000_000 - 1) * FP32
        else:
            assert grown == (500_000_000 - one) * FP32
        if stage < 3:
            assert big.phase_peaks["optimizer"] == small.phase_peaks["optimizer"]
            assert small.phase_peaks["backward"] - plain.phase_peaks["backward"] == one * FP32  # the small bucket
        else:  # plus the whole model gathered at the end of forward, reported as params
            assert small.peak_bytes > plain.peak_bytes
            assert small.breakdown["params"] >= plain.breakdown["params"]


def _deepspeed_engines_run_here() -> bool:
    """DeepSpeed installed and its shm comm op built (tests/deepspeed_op.py); always in CI, which
    builds it in its set-up."""
    import importlib.util
    import os

    from tests.deepspeed_op import shm_op_prebuilt

    return bool(os.environ.get("CI")) or (importlib.util.find_spec("deepspeed") is not None and shm_op_prebuilt())


@pytest.mark.skipif(not _deepspeed_engines_run_here(),
                    reason="needs DeepSpeed with its shm comm op built (bash scripts/dev.sh setup)")
@pytest.mark.parametrize("case_kw", [
    {"model": "llama", "zero_stage": 3, "buckets": "plan"},
    # bf16: the step's fp32 gradient and the freed module gradients decide this rank's peak
    {"model": "llama", "zero_stage": 1, "buckets": "plan", "precision": "bf16-mixed"},
])
def test_real_engine_on_two_cpu_ranks_matches_the_estimate(case_kw):
    """One real case of benchmarks/deepspeed_cpu.py (about 15 s each): a 2-rank ZeRO engine on CPU
    with to_config's buckets; ``memguard.estimate(deepspeed_config=<its config>)`` is within 3% of the
    worst rank's steady-state peak, and the replay closes (both steady steps start level)."""
    pytest.importorskip("transformers")
    from benchmarks.deepspeed_cpu import Case, estimate_case, run_case, steady

    case = Case(**case_kw)
    ranks = run_case(case, steps=2, warmup=1, timeout=240)
    assert all("error" not in r for r in ranks), ranks
    for r in ranks:
        assert len(set(steady(r, "step_starts"))) == 1, r["step_starts"]
    real = max(p for r in ranks for p in steady(r))
    est = estimate_case(case)["peak_bytes"]
    assert abs(est - real) / real <= 0.03, (est, real)


def test_foreach_step_temporaries_cover_every_parameter():
    # a foreach step (CUDA's default) makes its temporaries for all parameters at once: the trace's
    # peak is then ~2x all parameter bytes, not 2x the largest tensor; the flat partition still gets 2x
    n, largest, all_bytes = 2, 4 * (PSI // 100), 4 * PSI
    single = fp32_factors(2, n=n, temporaries=2 * largest, largest_param_bytes=largest)
    foreach = fp32_factors(2, n=n, temporaries=2 * all_bytes, largest_param_bytes=largest,
                           trainable_param_bytes=all_bytes)
    # two Adam temporaries of the partition plus its flat fp32 gradient (step())
    assert 2 * largest * single.optimizer_temporaries == pytest.approx(3 * 4 * PSI / n)
    assert 2 * all_bytes * foreach.optimizer_temporaries == pytest.approx(3 * 4 * PSI / n)


def test_gloo_all_gather_stages_the_whole_flat_buffer():
    # step() ends with all_gather_into_tensor of the flat weights; gloo (the CPU target's backend,
    # ProcessGroupGloo AsyncAllgatherWork: newLikeFlat) gathers into a buffer of the whole output:
    # 4Ψ bytes in fp32, more than the torch step's 3 x 4Ψ/N at N = 4 (the measured 4-rank Llama's
    # step peak, benchmarks/results/deepspeed_cpu.md); NCCL gathers in place
    largest = 4 * (PSI // 10)
    states = TracedStates(params=4 * PSI, grads=4 * PSI, optimizer=8 * PSI, num_params=PSI, num_trainable=PSI,
                          largest_layer=PSI // 10, temporaries=2 * largest, largest_param_bytes=largest)
    for stage in (1, 2):
        gloo = model_state_factors(states, ZeroSetup(zero_stage=stage, world_size=4, sixteen_bit=False, gloo=True))
        nccl = model_state_factors(states, ZeroSetup(zero_stage=stage, world_size=4, sixteen_bit=False))
        assert 2 * largest * gloo.optimizer_temporaries == pytest.approx(4 * PSI)
        assert 2 * largest * nccl.optimizer_temporaries == pytest.approx(3 * 4 * PSI / 4)
        two = model_state_factors(states, ZeroSetup(zero_stage=stage, world_size=2, sixteen_bit=False, gloo=True))
        assert 2 * largest * two.optimizer_temporaries == pytest.approx(3 * 4 * PSI / 2)  # the step's own is larger
