"""A CUDA program's host copies through page-locked staging blocks, and its device-resident entry
point, on the CPU emulation (the calls a GPU driver gets are the same); the real driver's on a GPU
(skipped without one)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from compiler.backends.cuda import (
    MAX_LENT_OUTPUT_BLOCKS,
    CudaProgram,
    DeviceTensor,
    kernel_record,
    staging_size,
)
from compiler.backends.cuda_emulator import EmulatedDriver
from compiler.frontends.onnx import load_graph
from compiler.kernels.fusion import fuse
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.cuda import render_cuda
from tests.conftest import FIXTURES


class _CountingDriver(EmulatedDriver):
    """The emulated device, counting the page-locked blocks it hands out and takes back."""

    def __init__(self) -> None:
        super().__init__()
        self.host_allocs: list[int] = []
        self.host_frees = 0

    def host_alloc(self, nbytes: int) -> np.ndarray:
        self.host_allocs.append(nbytes)
        return super().host_alloc(nbytes)

    def host_free(self, block: np.ndarray) -> None:
        self.host_frees += 1
        super().host_free(block)


@pytest.fixture(scope="module")
def mlp():
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    graph = load_graph(data)
    program = fuse(lower(graph))
    return graph, program, kernel_record(program, render_cuda(program), "emulated", graph.size_limits)


def _load(mlp, driver) -> CudaProgram:
    _, program, kernel = mlp
    return CudaProgram(kernel, program.weights, {}, driver)


def _inputs(graph, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return sample_inputs(graph, seed=seed, symbol_size=batch)


def test_outputs_equal_the_reference_and_the_staging_blocks_are_reused_across_calls(mlp) -> None:
    graph = mlp[0]
    driver = _CountingDriver()
    program = _load(mlp, driver)
    for seed in range(4):
        inputs = _inputs(graph, 3, seed)
        got = program.run(inputs)
        np.testing.assert_allclose(got["output"], run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
        del got  # (the caller is done with them: their block goes back to the pool)
    # one block for the inputs and one for the outputs, locked on the first call and reused since
    assert len(driver.host_allocs) == 2 and program.staging.allocated == 2
    assert all(n == staging_size(n) for n in driver.host_allocs)
    # a smaller batch fits the same size class: nothing new is locked
    program.run(_inputs(graph, 1))
    assert program.staging.allocated == 2
    program.close()


def test_the_outputs_of_one_call_are_not_changed_by_the_next(mlp) -> None:
    graph = mlp[0]
    driver = _CountingDriver()
    program = _load(mlp, driver)
    first_inputs, second_inputs = _inputs(graph, 4, seed=1), _inputs(graph, 4, seed=2)
    first = program.run(first_inputs)["output"]
    kept = first.copy()
    second = program.run(second_inputs)["output"]
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_allclose(second, run_graph(graph, second_inputs)["output"], rtol=1e-4, atol=1e-5)
    # the first call's block is still lent: the second took another of the same class
    assert program.staging.lent == 2 and program.staging.allocated == 3
    assert first.flags.writeable and not np.shares_memory(first, second)
    # a view of an output keeps its block too; once every view is gone the block is reused
    row = first[1:]
    del first
    gc.collect()
    assert program.staging.lent == 2
    np.testing.assert_array_equal(row, kept[1:])
    del row, second
    gc.collect()
    assert program.staging.lent == 0
    program.run(first_inputs)
    assert program.staging.allocated == 3
    program.close()


def test_a_caller_keeping_every_output_gets_pageable_arrays_past_the_lending_limit(mlp) -> None:
    graph = mlp[0]
    driver = _CountingDriver()
    program = _load(mlp, driver)
    inputs = _inputs(graph, 2)
    want = run_graph(graph, inputs)["output"]
    kept = [program.run(inputs)["output"] for _ in range(MAX_LENT_OUTPUT_BLOCKS + 3)]
    assert program.staging.lent == MAX_LENT_OUTPUT_BLOCKS
    assert program.staging.allocated == MAX_LENT_OUTPUT_BLOCKS + 1  # and the inputs' block
    for output in kept:
        np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-5)
    program.close()


def test_close_unlocks_the_staging_blocks_and_a_lent_one_once_its_arrays_go(mlp) -> None:
    graph = mlp[0]
    driver = _CountingDriver()
    program = _load(mlp, driver)
    inputs = _inputs(graph, 3)
    dropped = program.run(inputs)["output"]
    held = program.run(inputs)["output"]
    del dropped
    gc.collect()
    kept = held.copy()
    assert len(driver.host_blocks) == 3  # inputs, the block `dropped` gave back, the one `held` views
    program.close()
    # the outputs a caller holds stay valid: only the lock goes, when they do
    assert len(driver.host_blocks) == 1
    np.testing.assert_array_equal(held, kept)
    del held
    gc.collect()
    assert driver.host_blocks == {} and driver.host_frees == len(driver.host_allocs) == 3
    with pytest.raises(RuntimeError, match="unloaded"):
        program.run(inputs)


def _on_device(driver, array: np.ndarray) -> DeviceTensor:
    address = driver.alloc(array.nbytes)
    driver.upload(address, array)
    return DeviceTensor(address, array.shape, str(array.dtype))


def _from_device(driver, tensor: DeviceTensor) -> np.ndarray:
    array = np.empty(tensor.shape, tensor.dtype)
    driver.download(tensor.address, array)
    return array


def test_run_on_device_reads_the_inputs_where_they_are_and_leaves_the_outputs_on_the_device(mlp) -> None:
    graph = mlp[0]

    class Recording(_CountingDriver):
        def __init__(self) -> None:
            super().__init__()
            self.uploads: list[int] = []
            self.keys: list = []

        def upload(self, address: int, array: np.ndarray) -> None:
            self.uploads.append(address)
            super().upload(address, array)

        def execute(self, module, calls, key) -> float:
            self.keys.append(key)
            return super().execute(module, calls, key)

    driver = Recording()
    program = _load(mlp, driver)
    inputs = _inputs(graph, 5, seed=3)
    placed = {name: _on_device(driver, array) for name, array in inputs.items()}
    copies_before = len(driver.uploads)
    outputs = program.run_on_device(placed)
    assert len(driver.uploads) == copies_before and driver.host_allocs == []  # no host copy either way
    assert set(outputs) == {"output"} and outputs["output"].dtype == "float32"
    np.testing.assert_allclose(_from_device(driver, outputs["output"]), run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
    # the same addresses replay the same graph; new ones are another
    program.run_on_device(placed)
    moved = {name: _on_device(driver, array) for name, array in inputs.items()}
    again = program.run_on_device(moved)
    assert driver.keys[0] == driver.keys[1] != driver.keys[2]
    np.testing.assert_allclose(_from_device(driver, again["output"]), run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
    # a host call after device calls launches from the arena again
    np.testing.assert_allclose(program.run(inputs)["output"], run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="input 'input' is float32"):
        program.run_on_device({"input": DeviceTensor(placed["input"].address, placed["input"].shape, "float16")})
    program.close()


# ---- on a GPU (skipped without one) -------------------------------------------------------------


def test_on_a_gpu_the_driver_stages_through_page_locked_blocks_and_runs_on_device_tensors() -> None:
    from compiler import compile_onnx
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable
    from compiler.targets import GPU_TYPES

    try:
        driver = CudaDriver(0)
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU here: {exc}")
    block = driver.host_alloc(100_000)
    assert block.ctypes.data in driver._registered and block.ctypes.data % 4096 == 0
    driver.host_free(block)
    assert driver._registered == set()
    target = next((t for t, gpu in GPU_TYPES.items() if t != "cuda" and gpu.arch == driver.arch), "cuda")
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    graph = load_graph(data)
    artifact = compile_onnx(data, target)
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, driver)
    first_inputs, second_inputs = _inputs(graph, 4, seed=1), _inputs(graph, 4, seed=2)
    first = program.run(first_inputs)["output"]
    kept = first.copy()
    second = program.run(second_inputs)["output"]
    np.testing.assert_array_equal(first, kept)
    np.testing.assert_allclose(first, run_graph(graph, first_inputs)["output"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(second, run_graph(graph, second_inputs)["output"], rtol=1e-4, atol=1e-5)
    assert program.staging.allocated == 3 and len(driver._registered) == 3
    placed = {name: _on_device(driver, array) for name, array in first_inputs.items()}
    outputs = program.run_on_device(placed)
    assert program.last_device_seconds > 0
    np.testing.assert_allclose(_from_device(driver, outputs["output"]), kept, rtol=1e-5, atol=1e-6)
    program.close()
    assert len(driver._registered) == 2  # the blocks `first` and `second` view, until they go
    del first, second
    gc.collect()
    assert driver._registered == set()
    for tensor in placed.values():
        driver.free(tensor.address)
    driver.close()
