"""GPU presets for the cost model: memory, bandwidths and peak FLOP/s from vendor data sheets
(dense fp16/bf16 tensor-core peaks, no sparsity). Plain Python."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class GPUSpec:
    """One GPU as the roofline sees it."""

    name: str
    memory_bytes: float
    mem_bandwidth: float  # HBM/GDDR peak, bytes/s
    peak_flops: float  # dense fp16/bf16 tensor-core peak, FLOP/s
    host_link_bandwidth: float  # PCIe to host memory, bytes/s per direction (swapping)
    # Fixed cost of one host<->device copy call. vLLM swaps with one cudaMemcpyAsync per block
    # per layer for K and for V, so small blocks pay this many times (Fig. 19).
    host_copy_latency_s: float = 2e-6
    peer_bandwidth: float = 0.0  # NVLink per GPU, bytes/s (tensor-parallel all-reduce)
    allreduce_latency_s: float = 10e-6  # fixed cost of one small NCCL all-reduce

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for result files."""
        return asdict(self)


HARDWARE: dict[str, GPUSpec] = {
    # A100 SXM4: 1555 GB/s (40 GB) / 2039 GB/s (80 GB), 312 TFLOP/s fp16, PCIe 4.0 x16, NVLink 3.
    "a100-40gb": GPUSpec("A100-40GB", 40 * GiB, 1.555e12, 312e12, 32e9, peer_bandwidth=300e9),
    "a100-80gb": GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 32e9, peer_bandwidth=300e9),
    # GeForce RTX 3090: 936 GB/s GDDR6X, 71 TFLOP/s fp16 with fp32 accumulate, PCIe 4.0, no NVLink
    # switch (peer traffic goes over PCIe).
    "rtx3090": GPUSpec("RTX 3090", 24 * GiB, 0.936e12, 71e12, 32e9, peer_bandwidth=32e9),
    # H100 SXM5 80 GB: 3.35 TB/s, 989 TFLOP/s bf16 dense, PCIe 5.0, NVLink 4.
    "h100": GPUSpec("H100-SXM-80GB", 80 * GiB, 3.35e12, 989e12, 64e9, peer_bandwidth=450e9),
    # H200 SXM 141 GB: 4.8 TB/s HBM3e, same compute as H100.
    "h200": GPUSpec("H200-SXM-141GB", 141e9, 4.8e12, 989e12, 64e9, peer_bandwidth=450e9),
}


def get_hardware(name: str, **overrides: Any) -> GPUSpec:
    """A preset by name (e.g. ``a100-40gb``), with optional field overrides."""
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware '{name}'; choose one of {sorted(HARDWARE)}")
    return replace(HARDWARE[key], **overrides) if overrides else HARDWARE[key]
