"""The device types a model can be compiled for: "cpu" (the machine's own CPU type, fingerprinted
at compile time) and the NVIDIA GPU types the cloud provisions, each with the compute capability
its programs are compiled for and its device memory (a runtime's budget). Settings choose which of
them a deployment offers (`LUMINAL_TARGETS`)."""

from __future__ import annotations

from dataclasses import dataclass

CPU = "cpu"


@dataclass(frozen=True)
class GpuType:
    # NVRTC's --gpu-architecture for a cubin: sm_<major><minor>
    arch: str
    memory_bytes: int


GIB = 1024**3
GPU_TYPES: dict[str, GpuType] = {
    # "cuda" names the default GPU type: the H100 the cloud provisions first
    "cuda": GpuType("sm_90", 80 * GIB),
    "h100": GpuType("sm_90", 80 * GIB),
    "h200": GpuType("sm_90", 141 * GIB),
    "a100": GpuType("sm_80", 80 * GIB),
    "l4": GpuType("sm_89", 24 * GIB),
}

KNOWN_TARGETS = (CPU, *GPU_TYPES)


def is_gpu(target: str) -> bool:
    return target in GPU_TYPES


__all__ = ["CPU", "GPU_TYPES", "KNOWN_TARGETS", "GpuType", "is_gpu"]
