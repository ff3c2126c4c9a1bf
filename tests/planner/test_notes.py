"""Plan notes: each rule applies exactly where its condition holds, and names its source."""

from __future__ import annotations

import types

import pytest

from memguard.estimator.gpus import GPUS
from memguard.planner._notes import RunSettings, notes_of, operational_notes
from memguard.vocab import GiB

# A multi-GPU DDP plan on NVLink GPUs, comfortably inside its budget: the baseline that each test varies.
BASE = dict(device="cuda", world_size=4, zero_stage=0, strategy="ddp", gpu="A100-80GB", peak_bytes=40 * GiB,
            usable_bytes=70 * GiB, grad_bytes=2 * GiB, hidden_size=2048, precision="bf16-mixed")


def _has(notes, *words) -> bool:
    return any(all(w in n for w in words) for n in notes)


def test_ddp_bucket_view_applies_to_multi_rank_ddp_only():
    notes = operational_notes(RunSettings(**BASE))
    # DDP copies every gradient into its buckets; the flag saves exactly grad_bytes (2 GiB)
    assert _has(notes, "gradient_as_bucket_view=True", "2.00 GiB")
    assert _has(notes, "bucket_cap_mb=25", "NCCL_BUFFSIZE")
    # one rank: no DDP, no buckets, no NCCL
    single = operational_notes(RunSettings(**{**BASE, "world_size": 1}))
    assert not _has(single, "gradient_as_bucket_view") and not _has(single, "NCCL")
    # ZeRO shards gradients through DeepSpeed's buckets, not DDP's
    zero = operational_notes(RunSettings(**{**BASE, "zero_stage": 2, "strategy": "deepspeed"}))
    assert not _has(zero, "gradient_as_bucket_view")


def test_deepspeed_bucket_note_uses_hidden_squared():
    notes = operational_notes(RunSettings(**{**BASE, "zero_stage": 2, "strategy": "deepspeed"}))
    # hidden_size^2 = 2048^2 = 4,194,304 elements (memguard.integrations.deepspeed's rule)
    assert _has(notes, "reduce_bucket_size=4,194,304", "deepspeed/runtime/zero/config.py")
    # without the hidden size, a 25 MiB bucket of 16-bit elements: 13,107,200
    unknown = operational_notes(RunSettings(**{**BASE, "zero_stage": 2, "strategy": "deepspeed", "hidden_size": None}))
    assert _has(unknown, "13,107,200")
    # DDP plans get no DeepSpeed note; nor does a single GPU without offload
    assert not _has(operational_notes(RunSettings(**BASE)), "reduce_bucket_size")
    assert not _has(operational_notes(RunSettings(**{**BASE, "world_size": 1, "zero_stage": 2, "strategy": "deepspeed"})),
                    "reduce_bucket_size")
    # single GPU with ZeRO-Offload is a DeepSpeed run: the note applies
    assert _has(operational_notes(RunSettings(**{**BASE, "world_size": 1, "zero_stage": 2, "strategy": "deepspeed",
                              "offload_optimizer": True})), "reduce_bucket_size")


def test_p2p_caveat_only_for_catalog_gpus_that_have_one():
    assert GPUS["RTX-4090"].p2p_caveat and not GPUS["A100-80GB"].p2p_caveat
    rtx = operational_notes(RunSettings(**{**BASE, "gpu": "RTX-4090"}))
    assert _has(rtx, "NCCL_P2P_DISABLE=1", "NCCL_IB_DISABLE=1", "accelerate")
    assert not _has(operational_notes(RunSettings(**BASE)), "NCCL_P2P_DISABLE")  # NVLink A100: no caveat
    # one RTX 4090: no peers, no NCCL
    assert not _has(operational_notes(RunSettings(**{**BASE, "gpu": "RTX-4090", "world_size": 1})), "NCCL_P2P_DISABLE")


def test_pcie_note_only_for_pcie_parts():
    assert _has(operational_notes(RunSettings(**{**BASE, "gpu": "L4"})), "PCIe only", "NCCL_P2P_LEVEL")
    assert not _has(operational_notes(RunSettings(**BASE)), "PCIe only")  # A100 SXM: NVLink
    assert not _has(operational_notes(RunSettings(**{**BASE, "gpu": "MI300X"})), "PCIe only")  # Infinity Fabric, and not NVIDIA


def test_expandable_segments_when_tight_or_shapes_vary():
    # 40 of 70 GiB: not tight, fixed shapes: no allocator note
    assert not _has(operational_notes(RunSettings(**BASE)), "expandable_segments")
    # 68 of 70 GiB is within 5%: fragmentation can tip it over
    assert _has(operational_notes(RunSettings(**{**BASE, "peak_bytes": 68 * GiB})), "expandable_segments:True", "CUDA semantics")
    assert _has(operational_notes(RunSettings(**{**BASE, "variable_shapes": True})), "expandable_segments:True", "varies")
    # not on the CPU target, nor on ROCm parts (the PyTorch docs describe the CUDA allocator)
    assert not _has(operational_notes(RunSettings(**{**BASE, "device": "cpu", "variable_shapes": True})), "expandable")
    assert not _has(operational_notes(RunSettings(**{**BASE, "gpu": "MI300X", "variable_shapes": True})), "expandable")


def test_single_gpu_comfortable_plan_has_no_notes():
    # nothing to advise: one device, no DeepSpeed, plenty of room
    assert operational_notes(RunSettings(**{**BASE, "world_size": 1})) == ()


@pytest.mark.parametrize("precision,item", [("bf16-mixed", 4), ("bf16-true", 2)])
def test_notes_for_plan_reads_the_plan(precision, item):
    # gradients have the parameters' dtype: fp32 under mixed precision, bf16 under bf16-true
    est = types.SimpleNamespace(peak_bytes=10 * GiB, num_trainable_params=GiB // 4)
    plan = types.SimpleNamespace(device="cuda", world_size=2, zero_stage=0, strategy="ddp", gpu="A100-80GB",
                                 estimate=est, usable_bytes=70 * GiB, hidden_size=None, precision=precision,
                                 offload_optimizer=False)
    notes = notes_of(plan)
    expected = "1.00 GiB" if item == 4 else "512.00 MiB"
    assert _has(notes, "gradient_as_bucket_view=True", expected)
