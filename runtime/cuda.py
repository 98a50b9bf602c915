"""A GPU device: runs the CUDA programs compiled for its type (`luminal-cloud runtime --device
cuda:0`, or `h100:1`: a GPU type of compiler/targets.py and the GPU's ordinal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from compiler.targets import GPU_TYPES
from runtime.runtime import LoadedProgram

if TYPE_CHECKING:
    from compiler import Artifact
    from compiler.backends.cuda import Driver


class CudaDevice:
    def __init__(self, target: str, driver: Driver) -> None:
        if target not in GPU_TYPES:
            raise ValueError(f"{target!r} is not a GPU type; known: {', '.join(GPU_TYPES)}")
        self.target = target
        self.driver = driver

    def load(self, artifact: Artifact) -> LoadedProgram:
        if artifact.target != self.target:
            raise ValueError(f"artifact for {artifact.target!r} cannot load on {self.target!r}")
        # imported here: the CUDA backend brings the compiler's renderer, which a CPU runtime
        # process (importing this module for parse_device) has no use for
        from compiler.backends.cuda import CudaProgram

        program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, self.driver)
        return LoadedProgram(artifact.signature, program, program.resident_bytes())

    def release(self, loaded: LoadedProgram) -> None:
        """Frees the program's device memory: its weights, arena and module (the runtime calls
        this once no batch uses it)."""
        loaded.program.close()

    def execute(
        self, loaded: LoadedProgram, inputs: Mapping[str, np.ndarray], busy: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and the device seconds of the batch's kernels (CUDA events around its graph:
        the copies in and out are not billed, as queueing is not)."""
        outputs = loaded.program.run(inputs, busy=busy)
        return outputs, loaded.program.last_device_seconds


def parse_device(device: str) -> tuple[str, int]:
    """("cuda", 0) from "cuda:0", ("h100", 1) from "h100:1", ("cpu", 0) from "cpu"."""
    target, _, ordinal = device.partition(":")
    if not ordinal:
        return target, 0
    if not ordinal.isdigit():
        raise ValueError(f"device {device!r}: the GPU ordinal after ':' must be a number")
    return target, int(ordinal)


__all__ = ["CudaDevice", "parse_device"]
