"""The CPU device: runs the NumPy program generated for target "cpu"."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from compiler import Artifact, executable


@dataclass
class CpuProgram:
    artifact: Artifact
    program: object


class CpuDevice:
    target = "cpu"

    def load(self, artifact: Artifact) -> CpuProgram:
        if artifact.target != self.target:
            raise ValueError(f"artifact for {artifact.target!r} cannot load on {self.target!r}")
        return CpuProgram(artifact, executable(artifact))

    def execute(
        self, loaded: CpuProgram, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and the device seconds spent computing them."""
        started = time.perf_counter()
        outputs = loaded.program.run(inputs)
        return outputs, time.perf_counter() - started
