"""The GPU catalog: per-device constants the estimator and the planner need.

Each :class:`GPUSpec` holds the memory PyTorch sees on the device, its compute capability
(which decides the cuBLAS workspace size, see :mod:`memguard.estimator._cuda`), and datasheet
throughput and bandwidth figures for the planner's cost model.

``memory_bytes`` is what ``torch.cuda.get_device_properties(i).total_memory`` reports, not the
marketing size: the driver keeps part of the memory (and ECC, where on, takes more). The
figures are those PyTorch prints in its out-of-memory message ("GPU 0 has a total capacity of
79.14 GiB"), in public reports cited in each entry's ``source``; they are rounded to 0.01 GiB
and vary by a few tens of MiB with driver version, ECC and board, so the lowest commonly
reported value is used. :func:`current_gpu` replaces it with the real figure on a device.

``sm_count`` is the number of streaming multiprocessors (AMD: compute units), which
``torch.cuda.get_device_properties(i).multi_processor_count`` reports and CUDA kernels read as
``multiProcessorCount`` to choose their launch: the CUDA target passes it to the rules whose
choice depends on it (:class:`~memguard.estimator._cuda_kernels.CudaTarget`). Where one entry
stands for parts with different counts (the alias ``"a10"``, an H100 PCIe's device name), it
holds the largest, because both SM-dependent choices modelled (layer/RMS-norm weight-gradient
partial buffers, :func:`memguard.estimator._cuda_rules.layer_norm_partial_rows`; a reduction's
split over blocks, :func:`memguard.estimator._unmodelled.set_reduce_config`) allocate at least
as much with more SMs. A spec without one (None) keeps those choices bounded instead.

Throughput figures are dense (no structured sparsity) tensor-core peaks from the vendor
datasheets; ``interconnect_gbps`` is the per-direction bandwidth to peers in GB/s (half the
bidirectional figure vendors quote): NVLink / Infinity Fabric where the part has it in its
usual server form, PCIe otherwise.

Aliases accepted by :func:`get_gpu` (case, spaces, dashes and vendor words such as "NVIDIA",
"GeForce", "Tesla", "AMD Instinct" are ignored): each catalog name; ``"h100"`` ->
``H100-80GB``; ``"4090"`` / ``"rtx4090"`` -> ``RTX-4090`` (same for 3090); ``"mi300"`` ->
``MI300X``; ``"a10"`` -> ``A10G`` (same memory and compute capability; the entry's
throughput figures are the A10 datasheet's); the names ``torch.cuda.get_device_name()``
returns, such as ``"NVIDIA A100-SXM4-80GB"`` or ``"Tesla V100-SXM2-16GB"``. ``"a100"`` and
``"v100"`` are ambiguous (two memory sizes) and raise :class:`~memguard.errors.ConfigError` naming both,
because silently picking one would halve or double the memory budget.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal, Mapping

from memguard.errors import ConfigError
from memguard.estimator._cuda import DEFAULT_CONTEXT_BYTES

__all__ = ["GPUSpec", "GPUS", "GENERIC", "NETWORK_SOURCES", "DEFAULT_NETWORK_GBPS", "get_gpu", "lookup_gpu", "current_gpu", "measure_context_bytes"]

logger = logging.getLogger("memguard")


def _gib(x: float) -> int:
    """Bytes of a figure printed with two decimals in GiB, rounded to whole MiB."""
    return int(round(x * 1024)) << 20


@dataclass(frozen=True)
class GPUSpec:
    """Constants of one GPU model.

    Attributes:
        name: catalog name, e.g. ``"A100-80GB"``.
        memory_bytes: total device memory as ``torch.cuda.get_device_properties(i).total_memory``
            reports it (public observations, see ``source``); 0 for :data:`GENERIC` (unknown).
        compute_capability: ``(major, minor)`` as torch reports it (``gfx942`` reads ``(9, 4)``).
        bf16: native bfloat16 arithmetic (Ampere and newer, CDNA2 and newer).
        tensor_cores: has tensor cores / matrix cores.
        fp16_tflops: dense fp16 tensor-core TFLOP/s, fp32 accumulate (datasheet).
        bf16_tflops: dense bf16 tensor-core TFLOP/s (0 without native bf16).
        tf32_tflops: dense TF32 TFLOP/s (0 without TF32).
        fp32_tflops: fp32 (non-tensor) TFLOP/s.
        memory_bandwidth_gbps: device memory bandwidth, GB/s.
        interconnect_gbps: per-direction bandwidth to peer GPUs, GB/s (NVLink or PCIe).
        context_bytes: typical CUDA context plus library handles, not in ``memory_reserved``.
        vendor: ``"nvidia"`` or ``"amd"``.
        source: where the figures come from.
        interconnect: how the usual multi-GPU form of the part links its GPUs: ``"nvlink"``,
            ``"infinity-fabric"`` or ``"pcie"`` (the datasheets in ``source``).
        network_gbps: per-GPU bandwidth to GPUs in other nodes, GB/s per direction: the node's
            scale-out NICs divided by its GPUs (see :data:`NETWORK_SOURCES`); the layout planner's
            data- and pipeline-parallel traffic between nodes travels at this rate.
        nvlink_domain: GPUs per NVLink (or Infinity Fabric) domain in the part's usual server form
            (8 on HGX/DGX boards, 1 for PCIe-only parts); the layout planner keeps tensor
            parallelism inside it.
        p2p_caveat: a known problem of NCCL's peer-to-peer / InfiniBand transports on this part,
            with its source, or ``""``; :mod:`memguard.planner._notes` turns it into a plan note.
        sm_count: streaming multiprocessors (AMD: compute units) as ``multi_processor_count``
            reports them (the datasheets and whitepapers in ``source``); None when unknown, as for
            :data:`GENERIC` (the SM-dependent kernel choices are then bounded, not evaluated).
        stack: the torch, CUDA and cuDNN versions the target runs
            (:class:`~memguard.estimator._targets.CudaStack`), set by ``torch_version=``,
            ``cuda_version=`` and ``cudnn_version=``; None (every catalog entry) means the installed
            torch and the CUDA and cuDNN of its default wheel
            (:func:`~memguard.estimator._targets.stack_of`).
    """

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    bf16: bool
    tensor_cores: bool
    fp16_tflops: float
    bf16_tflops: float
    tf32_tflops: float
    fp32_tflops: float
    memory_bandwidth_gbps: float
    interconnect_gbps: float
    context_bytes: int
    vendor: Literal["nvidia", "amd"]
    source: str
    interconnect: Literal["nvlink", "infinity-fabric", "pcie"] = "pcie"
    p2p_caveat: str = ""
    stack: Any = None
    network_gbps: float = 0.0
    nvlink_domain: int = 1
    sm_count: int | None = None

    @property
    def scale_out_gbps(self) -> float:
        """``network_gbps``, or :data:`DEFAULT_NETWORK_GBPS` where the catalog has no figure."""
        return self.network_gbps or DEFAULT_NETWORK_GBPS


# Per-direction link bandwidths in GB/s (half of the bidirectional figures vendors quote).
_PCIE3 = 16.0  # PCIe 3.0 x16: 32 GB/s bidirectional (PCI-SIG PCIe 3.0 specification).
_PCIE4 = 32.0  # PCIe 4.0 x16: 64 GB/s bidirectional (PCI-SIG PCIe 4.0; L4/L40S/A10 datasheets).

# Scale-out network per GPU, GB/s per direction (a NIC's line rate in Gb/s / 8).
_NIC400 = 50.0  # one 400 Gb/s NDR InfiniBand / RoCE NIC per GPU: NVIDIA DGX H100 user guide (8x ConnectX-7, 400 Gb/s each, for 8 GPUs); HGX H100/H200 reference nodes
_NIC200 = 25.0  # one 200 Gb/s HDR InfiniBand NIC per GPU: NVIDIA DGX A100 user guide (8x ConnectX-6, 200 Gb/s each, for 8 GPUs)
_NIC100 = 12.5  # 100 Gb/s Ethernet per GPU: an assumed typical cloud figure for PCIe GPU nodes (no vendor reference design)
#: Used by :attr:`GPUSpec.scale_out_gbps` where an entry has no ``network_gbps``: 100 Gb/s per GPU.
DEFAULT_NETWORK_GBPS = _NIC100
#: Where each entry's ``network_gbps`` and ``nvlink_domain`` come from.
NETWORK_SOURCES: Mapping[str, str] = MappingProxyType({
    "V100-16GB": "NVIDIA DGX-1 (V100) system: 4x 100 Gb/s EDR InfiniBand for 8 GPUs (50 Gb/s per GPU); "
                 "NVLink hybrid cube mesh of 8 GPUs",
    "V100-32GB": "NVIDIA DGX-1 (V100) system: 4x 100 Gb/s EDR InfiniBand for 8 GPUs; 8-GPU NVLink mesh",
    "A100-40GB": "NVIDIA DGX A100 user guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU; 8 GPUs on NVSwitch",
    "A100-80GB": "NVIDIA DGX A100 user guide: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU; 8 GPUs on NVSwitch",
    "H100-80GB": "NVIDIA DGX H100 user guide: 8x ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU; 8 GPUs on "
                 "NVSwitch (torchtitan's docs/performance.md: 400 Gb/s RDMA per GPU on its H100 hosts)",
    "H200": "NVIDIA HGX H200 reference: 8 GPUs on NVSwitch, one 400 Gb/s ConnectX-7 NIC per GPU (DGX H200 user guide)",
    "MI300X": "AMD Instinct MI300X platform: 8 GPUs on Infinity Fabric; one 400 Gb/s NIC per GPU in the usual "
              "OCP UBB server designs (AMD Instinct MI300X platform data sheet)",
})

# Context bytes: no per-model measurement is published; every entry uses the default, which
# memguard.estimator.gpus.measure_context_bytes replaces on a real device.
_CTX = DEFAULT_CONTEXT_BYTES

_SPECS = (
    GPUSpec(
        name="V100-16GB", memory_bytes=_gib(15.75), compute_capability=(7, 0), bf16=False,
        tensor_cores=True, fp16_tflops=125.0, bf16_tflops=0.0, tf32_tflops=0.0, fp32_tflops=15.7,
        memory_bandwidth_gbps=900.0, interconnect_gbps=150.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA V100 Tensor Core GPU datasheet (SXM2: 125 TFLOPS tensor, 15.7 FP32, "
        "900 GB/s, NVLink 300 GB/s); total_memory 15.75-15.78 GiB in PyTorch OOM reports "
        "(e.g. Morizeyao/GPT2-Chinese#215); 80 SMs (NVIDIA Tesla V100 GPU architecture whitepaper, "
        "Table 1: SXM2 and PCIe)",
        interconnect="nvlink",
        network_gbps=6.25, nvlink_domain=8,
        sm_count=80,
    ),
    GPUSpec(
        name="V100-32GB", memory_bytes=_gib(31.74), compute_capability=(7, 0), bf16=False,
        tensor_cores=True, fp16_tflops=125.0, bf16_tflops=0.0, tf32_tflops=0.0, fp32_tflops=15.7,
        memory_bandwidth_gbps=900.0, interconnect_gbps=150.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB); total_memory 31.74-31.75 GiB in "
        "PyTorch OOM reports (haotian-liu/LLaVA#812, hiyouga/LlamaFactory#182); 80 SMs (NVIDIA Tesla "
        "V100 GPU architecture whitepaper, Table 1)",
        interconnect="nvlink",
        network_gbps=6.25, nvlink_domain=8,
        sm_count=80,
    ),
    GPUSpec(
        name="T4", memory_bytes=_gib(14.75), compute_capability=(7, 5), bf16=False,
        tensor_cores=True, fp16_tflops=65.0, bf16_tflops=0.0, tf32_tflops=0.0, fp32_tflops=8.1,
        memory_bandwidth_gbps=320.0, interconnect_gbps=_PCIE3, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA T4 Tensor Core GPU datasheet (65 TFLOPS FP16 mixed precision, 8.1 FP32, "
        "320 GB/s, PCIe 3.0 x16); total_memory 14.75-14.76 GiB in PyTorch OOM reports; 40 SMs (the "
        "datasheet's 2,560 CUDA cores and 320 tensor cores, 64 and 8 per Turing SM: NVIDIA Turing "
        "GPU architecture whitepaper)",
        sm_count=40,
    ),
    GPUSpec(
        name="A10G", memory_bytes=_gib(21.99), compute_capability=(8, 6), bf16=True,
        tensor_cores=True, fp16_tflops=125.0, bf16_tflops=125.0, tf32_tflops=62.5, fp32_tflops=31.2,
        memory_bandwidth_gbps=600.0, interconnect_gbps=_PCIE4, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA A10 Tensor Core GPU datasheet (A10G is AWS's variant of A10, no separate "
        "datasheet; its tensor throughput is reportedly lower); total_memory 21.99-22.06 GiB in "
        "PyTorch OOM reports on A10/A10G (zai-org/CogVLM#236); 80 SMs on the A10G "
        "(torch.cuda.get_device_properties prints multi_processor_count=80 in TorchCodec's CUDA "
        "decoding tutorial); the A10 has 72 (the A10 datasheet's 72 RT cores, one per Ampere SM), "
        "the larger count is kept",
        sm_count=80,
    ),
    GPUSpec(
        name="L4", memory_bytes=_gib(22.03), compute_capability=(8, 9), bf16=True,
        tensor_cores=True, fp16_tflops=121.0, bf16_tflops=121.0, tf32_tflops=60.0, fp32_tflops=30.3,
        memory_bandwidth_gbps=300.0, interconnect_gbps=_PCIE4, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA L4 Tensor Core GPU datasheet (242 TFLOPS FP16/BF16 and 120 TF32 with "
        "sparsity, halved here; 30.3 FP32; 300 GB/s; PCIe 4.0 x16); total_memory 22.03 GiB in "
        "PyTorch OOM reports; 58 SMs (7,424 CUDA cores, 128 per Ada SM (NVIDIA Ada GPU architecture "
        "whitepaper): the datasheet's 30.3 FP32 TFLOPS at the L4's 2,040 MHz boost clock)",
        sm_count=58,
    ),
    GPUSpec(
        name="L40S", memory_bytes=_gib(44.39), compute_capability=(8, 9), bf16=True,
        tensor_cores=True, fp16_tflops=362.05, bf16_tflops=362.05, tf32_tflops=183.0,
        fp32_tflops=91.6, memory_bandwidth_gbps=864.0, interconnect_gbps=_PCIE4,
        context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA L40S GPU datasheet (733 TFLOPS FP16/BF16 and 366 TF32 with sparsity, halved "
        "here; 91.6 FP32; 864 GB/s; PCIe 4.0 x16); total_memory 44.39-44.52 GiB in PyTorch OOM "
        "reports; 142 SMs (the datasheet's 18,176 CUDA cores, 568 tensor cores and 142 RT cores: "
        "128, 4 and 1 per Ada SM)",
        # axolotl/utils/environment.py check_cuda_p2p_ib_support: 2-7 L40S (or RTX 6000 Ada) GPUs
        p2p_caveat="2 to 7 L40S GPUs in one machine have unreliable NCCL P2P transfers over PCIe: "
        "axolotl sets NCCL_P2P_DISABLE=1 for them (axolotl/utils/environment.py, "
        "check_cuda_p2p_ib_support); check with nvidia-smi topo -p2p n",
        sm_count=142,
    ),
    GPUSpec(
        name="RTX-3090", memory_bytes=_gib(23.55), compute_capability=(8, 6), bf16=True,
        tensor_cores=True, fp16_tflops=71.0, bf16_tflops=71.0, tf32_tflops=35.6, fp32_tflops=35.6,
        memory_bandwidth_gbps=936.0, interconnect_gbps=_PCIE4, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090: 71 TFLOPS FP16/BF16 "
        "tensor with FP32 accumulate, 35.6 TF32 and FP32, 936 GB/s, PCIe 4.0 x16); total_memory "
        "23.55-23.69 GiB in PyTorch OOM reports; 82 SMs (the same whitepaper's RTX 3090 column)",
        sm_count=82,
    ),
    GPUSpec(
        name="RTX-4090", memory_bytes=_gib(23.64), compute_capability=(8, 9), bf16=True,
        tensor_cores=True, fp16_tflops=165.2, bf16_tflops=165.2, tf32_tflops=82.6, fp32_tflops=82.6,
        memory_bandwidth_gbps=1008.0, interconnect_gbps=_PCIE4, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA Ada GPU architecture whitepaper (RTX 4090: 165.2 TFLOPS FP16/BF16 tensor "
        "with FP32 accumulate, 82.6 TF32 and FP32, 1008 GB/s, PCIe 4.0 x16); total_memory "
        "23.64-23.65 GiB in PyTorch OOM reports; 128 SMs (the same whitepaper's RTX 4090 column)",
        # accelerate/utils/environment.py check_cuda_p2p_ib_support: several "RTX 40" GPUs with a
        # driver older than 550.40.07 have broken P2P/IB transports; accelerate's launcher then
        # sets NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1
        p2p_caveat="several RTX 40-series GPUs with an NVIDIA driver older than 550.40.07 cannot use "
        "NCCL's P2P or InfiniBand transports (hangs or wrong results): set NCCL_P2P_DISABLE=1 and "
        "NCCL_IB_DISABLE=1, as accelerate launch does (accelerate/utils/environment.py, "
        "check_cuda_p2p_ib_support), or update the driver",
        sm_count=128,
    ),
    GPUSpec(
        name="A100-40GB", memory_bytes=_gib(39.50), compute_capability=(8, 0), bf16=True,
        tensor_cores=True, fp16_tflops=312.0, bf16_tflops=312.0, tf32_tflops=156.0,
        fp32_tflops=19.5,
        memory_bandwidth_gbps=1555.0, interconnect_gbps=300.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB: 312 TFLOPS FP16/BF16, 156 TF32, "
        "19.5 FP32, 1555 GB/s, NVLink 600 GB/s); total_memory 39.50-39.59 GiB in PyTorch OOM "
        "reports (TianheWu/CoSeR#10, raoyongming/DenseCLIP#52); 108 SMs (NVIDIA A100 Tensor Core "
        "GPU architecture whitepaper)",
        interconnect="nvlink",
        network_gbps=_NIC200, nvlink_domain=8,
        sm_count=108,
    ),
    GPUSpec(
        name="A100-80GB", memory_bytes=_gib(79.14), compute_capability=(8, 0), bf16=True,
        tensor_cores=True, fp16_tflops=312.0, bf16_tflops=312.0, tf32_tflops=156.0,
        fp32_tflops=19.5,
        memory_bandwidth_gbps=2039.0, interconnect_gbps=300.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: 312 TFLOPS FP16/BF16, 156 TF32, "
        "19.5 FP32, 2039 GB/s, NVLink 600 GB/s); total_memory 79.14-79.25 GiB in PyTorch OOM "
        "reports (lianqi1008/Control-GIC#6, levihsu/OOTDiffusion#235); 108 SMs (NVIDIA A100 Tensor "
        "Core GPU architecture whitepaper)",
        interconnect="nvlink",
        network_gbps=_NIC200, nvlink_domain=8,
        sm_count=108,
    ),
    GPUSpec(
        name="H100-80GB", memory_bytes=_gib(79.11), compute_capability=(9, 0), bf16=True,
        tensor_cores=True, fp16_tflops=989.5, bf16_tflops=989.5, tf32_tflops=494.5,
        fp32_tflops=67.0,
        memory_bandwidth_gbps=3350.0, interconnect_gbps=450.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 1979 TFLOPS FP16/BF16 and 989 TF32 "
        "with sparsity, halved here; 67 FP32; 3.35 TB/s; NVLink 900 GB/s); total_memory 79.11 GiB "
        "in PyTorch OOM reports (vllm-project/vllm#27508); 132 SMs on the SXM5, 114 on the PCIe "
        "card, whose device name maps here too, the larger count is kept (NVIDIA H100 Tensor Core "
        "GPU architecture whitepaper)",
        interconnect="nvlink",
        network_gbps=_NIC400, nvlink_domain=8,
        sm_count=132,
    ),
    GPUSpec(
        name="H200", memory_bytes=_gib(139.72), compute_capability=(9, 0), bf16=True,
        tensor_cores=True, fp16_tflops=989.5, bf16_tflops=989.5, tf32_tflops=494.5,
        fp32_tflops=67.0,
        memory_bandwidth_gbps=4800.0, interconnect_gbps=450.0, context_bytes=_CTX, vendor="nvidia",
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, NVLink "
        "900 GB/s, compute as H100 SXM); total_memory 139.72-139.81 GiB in PyTorch OOM reports; "
        "132 SMs, the H100 SXM5's (NVIDIA H100 Tensor Core GPU architecture whitepaper; "
        "torch.cuda.get_device_properties on an H200 prints multi_processor_count=132)",
        interconnect="nvlink",
        network_gbps=_NIC400, nvlink_domain=8,
        sm_count=132,
    ),
    GPUSpec(
        name="MI300X", memory_bytes=_gib(191.69), compute_capability=(9, 4), bf16=True,
        tensor_cores=True, fp16_tflops=1307.4, bf16_tflops=1307.4, tf32_tflops=653.7,
        fp32_tflops=163.4, memory_bandwidth_gbps=5300.0, interconnect_gbps=448.0,
        context_bytes=_CTX, vendor="amd",
        source="AMD Instinct MI300X accelerator datasheet (1307.4 TFLOPS FP16/BF16 dense, 653.7 "
        "TF32, 163.4 FP32, 5.3 TB/s, 7 Infinity Fabric links totalling 896 GB/s); total_memory "
        "191.69-191.98 GiB in PyTorch (ROCm) OOM reports; 304 compute units (the datasheet; "
        "torch.cuda.get_device_properties prints multi_processor_count=304 in ROCm/ROCm#4203)",
        interconnect="infinity-fabric",
        network_gbps=_NIC400, nvlink_domain=8,
        sm_count=304,
    ),
)

#: The catalog, by name.
GPUS: Mapping[str, GPUSpec] = MappingProxyType({s.name: s for s in _SPECS})

#: Used when ``gpu=None`` and no device is present. Memory is unknown (0): pass a budget.
#: Compute capability and throughput are those of an A100 (the most common training GPU in
#: public cloud fleets), so workspaces and the cost model get plausible values. Its SM count is
#: unknown (None), so the SM-dependent kernel choices stay bounded rather than taken for an A100.
GENERIC = replace(
    GPUS["A100-80GB"],
    name="generic",
    memory_bytes=0,
    sm_count=None,
    source="placeholder: A100-80GB figures with unknown memory; pass gpu= or budget_bytes=",
)

# Words that carry no identity in device names: vendor, brand, form factor, memory type.
_NOISE = re.compile(
    r"nvidia|geforce|tesla|quadro|amd|instinct|radeon|sxm\d?|pcie|hbm3e?|hbm2e?|gddr6x?"
)


def _normalize(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    key = _NOISE.sub("", key)
    # "80gb" / "80g" at the end -> "80": users write memory sizes several ways.
    return re.sub(r"(\d)gb?$", r"\1", key)


def _build_aliases() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    aliases: dict[str, str] = {}
    for name in GPUS:
        aliases[_normalize(name)] = name
    extra = {
        "h100": "H100-80GB",
        "h10080hbm3": "H100-80GB",
        "4090": "RTX-4090",
        "3090": "RTX-3090",
        "mi300": "MI300X",
        "a10080": "A100-80GB",
        "a10040": "A100-40GB",
        "v10016": "V100-16GB",
        "v10032": "V100-32GB",
        "h200141": "H200",
    }
    aliases.update(extra)
    ambiguous = {
        "a100": ("A100-40GB", "A100-80GB"),
        "v100": ("V100-16GB", "V100-32GB"),
    }
    return aliases, ambiguous


_ALIASES, _AMBIGUOUS = _build_aliases()


def lookup_gpu(name: str) -> GPUSpec | None:
    """The catalog entry a GPU name (catalog name, alias or device name) maps to, or None;
    unlike :func:`get_gpu` it never raises."""
    return GPUS.get(_ALIASES.get(_normalize(name), ""))


def get_gpu(name: str) -> GPUSpec:
    """Look up a GPU by catalog name or alias, ignoring case and punctuation.

    Args:
        name: e.g. ``"A100-80GB"``, ``"h100"``, ``"rtx4090"``, ``"NVIDIA A100-SXM4-40GB"``.

    Returns:
        The catalog entry.

    Raises:
        ConfigError: the name is not a string, is ambiguous (``"a100"``, ``"v100"``), or is
            unknown; the message lists close matches and every catalog name.
    """
    if not isinstance(name, str):
        raise ConfigError(f"gpu must be a catalog name string, got {type(name).__name__}")
    spec = lookup_gpu(name)
    if spec is not None:
        return spec
    key = _normalize(name)
    if key in _AMBIGUOUS:
        options = " or ".join(repr(n) for n in _AMBIGUOUS[key])
        raise ConfigError(
            f"gpu {name!r} is ambiguous: it comes with different memory sizes; pass {options}"
        )
    # Suggest against every alias (normalized) and map back to catalog names.
    candidates = {**_ALIASES, **{n.lower(): n for n in GPUS}}
    close = []
    for c in difflib.get_close_matches(key or name.lower(), list(candidates), n=6, cutoff=0.6):
        if candidates[c] not in close:
            close.append(candidates[c])
    close = close[:3]
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise ConfigError(
        f"unknown gpu {name!r}; {hint}known GPUs: {', '.join(GPUS)}; for another GPU pass "
        "gpu=None with budget_bytes="
    )


def current_gpu(index: int = 0) -> GPUSpec | None:
    """The spec of a visible CUDA (or ROCm) device, with its real total memory.

    The device name is matched against the catalog; a match whose catalog memory is within
    10% of the device's ``total_memory`` is returned with ``memory_bytes`` (and compute
    capability and SM count, ``multi_processor_count``) replaced by the device's own. Otherwise a spec named after the device is
    built from its properties, with :data:`GENERIC` throughput figures as placeholders.

    Args:
        index: device index, as in ``torch.cuda.get_device_properties(index)``.

    Returns:
        The spec, or None when CUDA is not available.

    Raises:
        ConfigError: ``index`` is not a visible device.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(
            f"device index {index!r} is not a visible device; {count} device(s) visible, "
            f"use 0..{count - 1}"
        )
    props = torch.cuda.get_device_properties(index)
    total = int(props.total_memory)
    cc = (int(props.major), int(props.minor))
    sms = int(props.multi_processor_count) if getattr(props, "multi_processor_count", 0) else None
    vendor: Literal["nvidia", "amd"] = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    spec = lookup_gpu(props.name)
    if spec is not None and abs(total - spec.memory_bytes) <= 0.10 * spec.memory_bytes:
        return replace(spec, memory_bytes=total, compute_capability=cc, sm_count=sms or spec.sm_count)
    if spec is not None:
        logger.info(
            "device %r matches catalog entry %s by name but has %d bytes, not ~%d; using a "
            "generic spec", props.name, spec.name, total, spec.memory_bytes,
        )
    bf16 = vendor == "amd" or cc >= (8, 0)  # bf16 arrived with Ampere (sm80) / CDNA2.
    return replace(
        GENERIC,
        name=props.name,
        memory_bytes=total,
        compute_capability=cc,
        bf16=bf16,
        bf16_tflops=GENERIC.bf16_tflops if bf16 else 0.0,
        tf32_tflops=GENERIC.tf32_tflops if cc >= (8, 0) else 0.0,
        tensor_cores=vendor == "amd" or cc >= (7, 0),  # tensor cores arrived with Volta (sm70).
        vendor=vendor,
        sm_count=sms,
        source="torch.cuda.get_device_properties; throughput figures are GENERIC placeholders",
    )


def measure_context_bytes(index: int = 0) -> int | None:
    """Device memory in use that the caching allocator does not hold: context and handles.

    ``total - free`` from ``torch.cuda.mem_get_info`` minus ``torch.cuda.memory_reserved``.
    Call it after at least one training step, so that cuBLAS/cuDNN handles and lazily loaded
    kernels are counted.

    Args:
        index: device index.

    Returns:
        Bytes, or None when CUDA is not available.

    Raises:
        ConfigError: ``index`` is not a visible device.

    Known limitations:
        Memory used by other processes on the same device is counted too.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ConfigError(
            f"device index {index!r} is not a visible device; {count} device(s) visible, "
            f"use 0..{count - 1}"
        )
    free, total = torch.cuda.mem_get_info(index)
    return max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(index)))
