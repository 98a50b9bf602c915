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


# the precision a model runs in: "exported" computes in the dtypes the graph declares; a narrow
# float stores float32 weights and intermediates in 16 bits (products on tensor cores, sums and
# products accumulated in float32) while inputs and outputs keep their declared dtypes; "tf32"
# keeps float32 everywhere but runs float32 products on tensor cores with operands rounded to
# 10 mantissa bits (what PyTorch's allow_tf32 does)
EXPORTED = "exported"
NARROW_PRECISIONS = ("float16", "bfloat16")
TF32 = "tf32"
# weight-only int8 (compiler.quantize): the products' weights stored as int8 with per-channel
# scales, dequantized inside the product kernels; everything else computes as exported
INT8 = "int8"
PRECISIONS = (EXPORTED, TF32, *NARROW_PRECISIONS, INT8)
# the largest error a program may show against the float32 reference, relative to the largest
# output magnitude (or 1): a few dozen roundings of the format's unit (2^-11, 2^-11, 2^-8)
PRECISION_TOLERANCE = {EXPORTED: 1e-3, TF32: 1e-2, "float16": 1e-2, "bfloat16": 5e-2}
# int8's bound is on the quantized graph against the float graph (a weight's channel rounds to
# 1/254 of its largest value); the program is held to "exported"'s against the quantized graph
INT8_TOLERANCE = 5e-2


def check_precision(target: str, precision: str) -> None:
    """ValueError naming the problem unless `precision` is offered on `target`: "exported" and
    "int8" run everywhere, the float formats on GPU types only."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if precision not in (EXPORTED, INT8) and not is_gpu(target):
        raise ValueError(
            f"precision {precision!r} runs on GPU targets ({', '.join(GPU_TYPES)}), not on {target!r}; "
            f"use precision {EXPORTED!r} or {INT8!r} there"
        )


__all__ = [
    "CPU", "EXPORTED", "GPU_TYPES", "INT8", "INT8_TOLERANCE", "KNOWN_TARGETS", "NARROW_PRECISIONS", "PRECISIONS", "PRECISION_TOLERANCE", "TF32",
    "GpuType", "check_precision", "is_gpu",
]
