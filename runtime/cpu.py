"""The CPU device: runs the NumPy program generated for target "cpu"."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from compiler import Artifact, Signature, executable


@dataclass
class CpuProgram:
    """A loaded program and what serving it needs; the artifact itself is not kept, so a native
    program holds only the weights its code reads (a weight replaced by packed panels leaves)."""

    signature: Signature
    program: object
    # memory held while loaded: the weights the program reads and its native code
    resident_bytes: int


class CpuDevice:
    target = "cpu"

    def load(self, artifact: Artifact) -> CpuProgram:
        if artifact.target != self.target:
            raise ValueError(f"artifact for {artifact.target!r} cannot load on {self.target!r}")
        program = executable(artifact)
        return CpuProgram(artifact.signature, program, program.resident_bytes())

    def execute(
        self, loaded: CpuProgram, inputs: Mapping[str, np.ndarray], busy: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and the device seconds spent computing them; `busy`: other requests are waiting."""
        started = time.perf_counter()
        outputs = loaded.program.run(inputs, busy=busy)
        return outputs, time.perf_counter() - started
