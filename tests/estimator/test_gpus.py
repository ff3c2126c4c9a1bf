"""Tests of the GPU catalog: self-consistency, name resolution, and the live-device lookup."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memguard.errors import ConfigError
from memguard.estimator._cuda import DEFAULT_CONTEXT_BYTES
from memguard.estimator.gpus import (
    GENERIC,
    GPUS,
    GPUSpec,
    lookup_gpu,
    current_gpu,
    get_gpu,
    measure_context_bytes,
)

GiB = 1 << 30
HAS_CUDA = torch.cuda.is_available()

# Nominal memory of each part in GiB, from its datasheet (HBM/GDDR capacities are binary:
# e.g. 80 GB HBM2e = 5 stacks x 16 GiB). total_memory must sit a little below it: the
# driver reserves some, never more than 12%.
NOMINAL_GIB = {
    "V100-16GB": 16,  # V100 datasheet: 16 GB HBM2
    "V100-32GB": 32,  # V100 datasheet: 32 GB HBM2
    "T4": 16,  # T4 datasheet: 16 GB GDDR6
    "A10G": 24,  # A10 datasheet: 24 GB GDDR6
    "L4": 24,  # L4 datasheet: 24 GB GDDR6
    "L40S": 48,  # L40S datasheet: 48 GB GDDR6
    "RTX-3090": 24,  # GA102 whitepaper: 24 GB GDDR6X
    "RTX-4090": 24,  # Ada whitepaper: 24 GB GDDR6X
    "A100-40GB": 40,  # A100 datasheet: 40 GB HBM2
    "A100-80GB": 80,  # A100 datasheet: 80 GB HBM2e
    "H100-80GB": 80,  # H100 datasheet: 80 GB HBM3
    "H200": 141,  # H200 datasheet: 141 GB HBM3e
    "MI300X": 192,  # MI300X datasheet: 192 GB HBM3
}

# Architectures: Volta 7.0 and Turing 7.5 lack bf16 and TF32; Ampere 8.0/8.6, Ada 8.9,
# Hopper 9.0 have both; MI300X (gfx942) is reported by torch as 9.4.
ARCH = {
    "V100-16GB": (7, 0),
    "V100-32GB": (7, 0),
    "T4": (7, 5),
    "A10G": (8, 6),
    "L4": (8, 9),
    "L40S": (8, 9),
    "RTX-3090": (8, 6),
    "RTX-4090": (8, 9),
    "A100-40GB": (8, 0),
    "A100-80GB": (8, 0),
    "H100-80GB": (9, 0),
    "H200": (9, 0),
    "MI300X": (9, 4),
}

# Streaming multiprocessors (AMD: compute units), as multi_processor_count reports them.
SM_COUNTS = {
    "V100-16GB": 80,  # Volta whitepaper, Table 1 (SXM2 and PCIe)
    "V100-32GB": 80,
    "T4": 40,  # T4 datasheet: 2,560 CUDA cores, 64 per Turing SM
    "A10G": 80,  # the A10G's count; the A10 (alias "a10") has 72: the larger is kept
    "L4": 58,  # 7,424 CUDA cores, 128 per Ada SM
    "L40S": 142,  # L40S datasheet: 18,176 CUDA cores, 142 RT cores
    "RTX-3090": 82,  # GA102 whitepaper
    "RTX-4090": 128,  # Ada whitepaper
    "A100-40GB": 108,  # A100 whitepaper
    "A100-80GB": 108,
    "H100-80GB": 132,  # H100 whitepaper: SXM5 132, PCIe 114: the larger is kept
    "H200": 132,  # as H100 SXM5
    "MI300X": 304,  # MI300X datasheet: 304 compute units
}


def test_catalog_has_the_required_entries():
    assert set(NOMINAL_GIB) <= set(GPUS)


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_entry_has_its_sm_count_cited(name):
    s = GPUS[name]
    assert s.sm_count == SM_COUNTS[name]
    unit = "compute units" if s.vendor == "amd" else "SMs"
    assert f"{s.sm_count} {unit}" in s.source  # cited beside the other figures


def test_sm_count_is_optional():
    # a spec built without one (a user's GPU) has none; the generic GPU's is unknown
    spec = dataclasses.replace(GPUS["H100-80GB"], name="mine")
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(GPUSpec) if f.name != "sm_count"}
    assert GPUSpec(**fields).sm_count is None
    assert GENERIC.sm_count is None


def test_an_entry_standing_for_several_parts_holds_the_largest_count():
    # the SM-dependent kernel choices allocate at least as much with more SMs, so the larger is safe
    assert get_gpu("a10") is GPUS["A10G"] and GPUS["A10G"].sm_count >= 72  # A10: 72 SMs
    assert get_gpu("NVIDIA H100 PCIe") is GPUS["H100-80GB"] and GPUS["H100-80GB"].sm_count >= 114  # PCIe: 114


def _fake_device(monkeypatch, name, total, major, minor, sms):
    import types

    props = types.SimpleNamespace(name=name, total_memory=total, major=major, minor=minor,
                                  multi_processor_count=sms)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.version, "hip", None)


def test_current_gpu_takes_the_devices_sm_count(monkeypatch):
    # an H100 PCIe matches the H100-80GB entry by name and memory; its own 114 SMs replace the SXM5's
    _fake_device(monkeypatch, "NVIDIA H100 PCIe", 85_029_158_912, 9, 0, 114)
    spec = current_gpu(0)
    assert spec.name == "H100-80GB" and spec.sm_count == 114
    # a device not in the catalog: a spec named after it, with its SM count
    _fake_device(monkeypatch, "NVIDIA RTX A6000", 50_925_535_232, 8, 6, 84)
    spec = current_gpu(0)
    assert spec.name == "NVIDIA RTX A6000" and spec.sm_count == 84


@pytest.mark.parametrize("name", sorted(GPUS))
def test_entry_is_self_consistent(name):
    s = GPUS[name]
    assert isinstance(s, GPUSpec) and s.name == name
    assert isinstance(s.memory_bytes, int)
    ratio = s.memory_bytes / (NOMINAL_GIB[name] * GiB)
    assert 0.88 <= ratio <= 1.0, f"{name}: {s.memory_bytes / GiB:.2f} GiB vs nominal"
    assert s.compute_capability == ARCH[name]
    # bf16 and TF32 arrived with Ampere (sm80) on NVIDIA; CDNA3 has both.
    has_ampere_features = s.vendor == "amd" or s.compute_capability >= (8, 0)
    assert s.bf16 is has_ampere_features
    assert (s.bf16_tflops > 0) is s.bf16
    assert (s.tf32_tflops > 0) is has_ampere_features
    if s.bf16:
        assert s.bf16_tflops == s.fp16_tflops  # same tensor-core rate on every listed part
    assert s.tensor_cores
    # tensor-core fp16 beats plain fp32 on every part with tensor cores
    assert s.fp16_tflops > s.fp32_tflops > 0
    if s.tf32_tflops:
        assert s.fp32_tflops <= s.tf32_tflops < s.fp16_tflops
    assert 100 <= s.memory_bandwidth_gbps <= 10_000
    assert 10 <= s.interconnect_gbps <= 1_000
    assert s.context_bytes == DEFAULT_CONTEXT_BYTES
    assert s.vendor == ("amd" if name.startswith("MI") else "nvidia")
    assert "datasheet" in s.source or "whitepaper" in s.source


@pytest.mark.parametrize("name", ["V100-16GB", "V100-32GB", "T4"])
def test_no_bf16_before_ampere(name):
    assert GPUS[name].bf16 is False and GPUS[name].bf16_tflops == 0


def test_bigger_sibling_has_more_memory():
    assert GPUS["A100-80GB"].memory_bytes > 2 * GPUS["A100-40GB"].memory_bytes * 0.99
    assert GPUS["V100-32GB"].memory_bytes > GPUS["V100-16GB"].memory_bytes
    assert GPUS["H200"].memory_bytes > GPUS["H100-80GB"].memory_bytes


def test_catalog_is_read_only():
    with pytest.raises(TypeError):
        GPUS["X"] = GENERIC  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["T4"].memory_bytes = 1  # type: ignore[misc]


def test_generic():
    assert GENERIC.name == "generic"
    assert GENERIC.memory_bytes == 0  # unknown: callers must pass a budget
    assert GENERIC.fp16_tflops > 0 and GENERIC.context_bytes == DEFAULT_CONTEXT_BYTES
    assert GENERIC.sm_count is None  # not the A100's: the SM-dependent choices stay bounded


# ------------------------------------------------------------------------------ names
@pytest.mark.parametrize("name", sorted(GPUS))
def test_catalog_names_resolve_in_any_case(name):
    assert get_gpu(name) is GPUS[name]
    assert get_gpu(name.lower()) is GPUS[name]
    assert get_gpu(name.upper()) is GPUS[name]


@pytest.mark.parametrize(
    "alias, expected",
    [
        ("h100", "H100-80GB"),  # only one H100 memory size is catalogued
        ("H100 80GB", "H100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),  # torch.cuda.get_device_name on H100 SXM
        ("rtx4090", "RTX-4090"),
        ("4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),  # device name of the consumer card
        ("3090", "RTX-3090"),
        ("a100-80gb", "A100-80GB"),
        ("A100 80G", "A100-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),  # device name, SXM form factor
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),  # device name, PCIe form factor
        ("Tesla V100-SXM2-16GB", "V100-16GB"),
        ("Tesla V100-PCIE-32GB", "V100-32GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10G"),  # same 24 GB and sm86; the entry carries the A10 datasheet figures
        ("nvidia l40s", "L40S"),
        ("NVIDIA H200", "H200"),
        ("AMD Instinct MI300X", "MI300X"),  # ROCm device name
        ("mi300", "MI300X"),
        ("  l4 ", "L4"),
    ],
)
def test_aliases(alias, expected):
    assert get_gpu(alias).name == expected


@pytest.mark.parametrize("alias, options", [("a100", "A100-40GB"), ("V100", "V100-32GB")])
def test_ambiguous_alias_raises(alias, options):
    with pytest.raises(ConfigError, match="ambiguous") as info:
        get_gpu(alias)
    assert options in str(info.value)


def test_unknown_name_suggests_and_lists_all():
    with pytest.raises(ConfigError) as info:
        get_gpu("H10O")
    msg = str(info.value)
    assert "did you mean" in msg and "'H100-80GB'" in msg
    for name in GPUS:
        assert name in msg


def test_unknown_without_close_match_lists_all():
    with pytest.raises(ConfigError) as info:
        get_gpu("TPUv5")
    assert "did you mean" not in str(info.value)
    assert "MI300X" in str(info.value)


def test_non_string_name_raises():
    with pytest.raises(ConfigError, match="string"):
        get_gpu(80)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ devices
@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_no_cuda_returns_none():
    assert current_gpu() is None
    assert measure_context_bytes() is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_current_gpu_on_device():
    spec = current_gpu(0)
    props = torch.cuda.get_device_properties(0)
    assert spec is not None
    assert spec.memory_bytes == props.total_memory
    assert spec.compute_capability == (props.major, props.minor)
    assert spec.sm_count == props.multi_processor_count
    # current_gpu's rule: a catalogue entry matched by name and within 10% of the memory wins,
    # otherwise the spec is named after the device
    catalogued = lookup_gpu(props.name)
    if catalogued is not None and abs(catalogued.memory_bytes - props.total_memory) <= 0.10 * catalogued.memory_bytes:
        assert spec.name == catalogued.name
        # the catalogue's figure is the lowest public observation, within 2% of the real one
        assert abs(catalogued.memory_bytes - props.total_memory) <= 0.02 * props.total_memory
    else:
        assert spec.name == props.name
    with pytest.raises(ConfigError, match="not a visible device"):
        current_gpu(torch.cuda.device_count())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_measure_context_bytes_on_device():
    torch.ones(1, device="cuda")
    ctx = measure_context_bytes(0)
    assert ctx is not None
    # a live context takes at least tens of MiB and, with lazy loading, well under 4 GiB
    assert 32 << 20 <= ctx <= 4 * GiB


def test_interconnect_agrees_with_link_bandwidth():
    """The topology field and the link bandwidth come from the same datasheets: NVLink / Infinity
    Fabric parts have peer links faster than PCIe 4.0 x16 (32 GB/s per direction), PCIe parts do not."""
    from memguard.estimator.gpus import GPUS

    for spec in GPUS.values():
        if spec.interconnect == "pcie":
            assert spec.interconnect_gbps <= 32.0, spec.name
        else:
            assert spec.interconnect_gbps > 32.0, spec.name
        # every caveat names the setting and where it comes from
        if spec.p2p_caveat:
            assert "NCCL_P2P_DISABLE=1" in spec.p2p_caveat and "environment.py" in spec.p2p_caveat
