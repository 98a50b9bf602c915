"""The CPU device: runs the NumPy program generated for target "cpu"."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from compiler import Artifact, executable
from compiler.kv_layout import CacheLayout
from runtime.kv_cache import HostKVStorage
from runtime.runtime import LoadedProgram


class CpuDevice:
    target = "cpu"

    def load(self, artifact: Artifact) -> LoadedProgram:
        if artifact.target != self.target:
            raise ValueError(f"artifact for {artifact.target!r} cannot load on {self.target!r}")
        program = executable(artifact)
        return LoadedProgram(artifact.signature, program, program.resident_bytes())

    def release(self, loaded: LoadedProgram) -> None:
        """Nothing to do: a CPU program's memory goes with its last reference."""

    def execute(
        self, loaded: LoadedProgram, inputs: Mapping[str, np.ndarray], busy: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """Outputs and the device seconds spent computing them; `busy`: other requests are waiting."""
        started = time.perf_counter()
        outputs = loaded.program.run(inputs, busy=busy)
        return outputs, time.perf_counter() - started

    def kv_storage(self, layout: CacheLayout, pool_slots: int, device_lock: object) -> HostKVStorage:
        """A KV cache's pools in host memory, the CPU's own: its programs read them in place."""
        return HostKVStorage(layout, pool_slots)
