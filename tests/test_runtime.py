"""The runtime's memory: programs load on first use, the least recently used leave when the
loaded ones pass the memory budget, and idle ones leave after idle_unload_s."""

from __future__ import annotations

import numpy as np
import pytest

from compiler import Artifact, compile_onnx
from runtime import CpuDevice, Runtime
from runtime.runtime import artifact_bytes
from tests.onnx_models import mlp


@pytest.fixture(scope="module")
def artifacts() -> dict[str, Artifact]:
    # the NumPy program: no C build, and its size is its weights
    return {
        name: compile_onnx(mlp(seed=i, hidden=hidden).SerializeToString(), "cpu", ("numpy",))
        for i, (name, hidden) in enumerate({"small": 16, "medium": 64, "large": 256}.items())
    }


def run(runtime: Runtime, key: str) -> None:
    result = runtime.run_batch(key, [{"x": np.ones((1, 8), np.float32)}], [1])
    assert result.outputs[0]["y"].shape == (1, 3)


def test_the_least_recently_used_leaves_when_the_budget_is_passed(artifacts) -> None:
    sizes = {name: artifact_bytes(a) for name, a in artifacts.items()}
    assert sizes["small"] < sizes["medium"] < sizes["large"]
    budget = sizes["large"] + sizes["medium"]  # room for large and medium, not all three
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, max_loaded=8, memory_budget_bytes=budget)
    run(runtime, "medium")
    run(runtime, "small")
    run(runtime, "medium")  # small is now the least recently used
    run(runtime, "large")
    assert runtime.loaded_keys == ["medium", "large"]
    assert runtime.loaded_bytes == sizes["medium"] + sizes["large"] <= budget
    run(runtime, "small")  # back on demand, pushing out medium
    assert runtime.loaded_keys == ["large", "small"]


def test_a_program_larger_than_the_budget_still_runs_alone(artifacts) -> None:
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, memory_budget_bytes=1)
    run(runtime, "small")
    run(runtime, "large")
    assert runtime.loaded_keys == ["large"]


def test_idle_programs_leave_after_idle_unload_s(artifacts) -> None:
    runtime = Runtime(CpuDevice(), artifacts.__getitem__, idle_unload_s=10.0)
    run(runtime, "small")
    run(runtime, "medium")
    assert runtime.unload_idle(now=0.0) == []
    assert sorted(runtime.unload_idle(now=float("inf"))) == ["medium", "small"]
    assert runtime.loaded_keys == [] and runtime.loaded_bytes == 0
