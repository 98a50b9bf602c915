"""The CUDA target without a GPU: the kernel IR rendered as CUDA C (golden lines), the launch plan,
NVRTC compiling every rendered kernel of the exported fixtures to PTX and an sm_90 cubin, and what
the kernels compute, run by the CPU emulation of compiler/backends/cuda_emulator.py against the reference."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.backends.cuda import ARENA_ALIGNMENT, CudaBuildFailed, CudaProgram, compile_cuda, kernel_record
from compiler.backends.cuda_emulator import EmulatedArtifact, EmulatedDriver, emulate
from compiler.conformance import load_cases, run_case
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, LoopKernel
from compiler.kernels.lower import lower
from compiler.kernels.precision import narrow_storage, out_of_range, tf32_products
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.cuda import (
    ELEMENTWISE_THREADS,
    GEMM_TILE,
    LARGE_THREADS,
    MMA_THREADS,
    SCHEDULES,
    render_cuda,
)
from compiler.shape import dim_from_json, evaluate
from compiler.targets import PRECISION_TOLERANCE
from tests.conftest import FIXTURES

MODELS = ["torch_mlp", "torch_cnn", "bert_dynamo", "gpt2_dynamo", "resnet_dynamo"]


def _program(data: bytes):
    return fuse(lower(load_graph(data)))


def _kernel_source(source: str, number: int) -> str:
    start = source.index(f" k{number}(const lc_symbols S")
    end = source.find('extern "C"', start)
    return source[start : end if end >= 0 else len(source)]


def _softmax_after_gemm() -> bytes:
    """x @ w1 + b1, relu, @ w2, softmax over 40 classes."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (8, 24)), ("b1", (24,)), ("w2", (24, 40)))
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 40])], weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_each_kernel_kind_renders_as_its_cuda_shape() -> None:
    program = _program(_softmax_after_gemm())
    rendered = render_cuda(program)
    kinds = [type(k).__name__ for k in program.kernels]
    assert kinds[0] == "GemmCall" and program.kernels[0].epilogue is not None  # bias and relu fused
    assert len(rendered.launches) == len(program.kernels)
    product = _kernel_source(rendered.source, 0)
    # C's tiles staged in shared memory; the epilogue applied where each element is stored
    assert "__shared__ float lc_as[16][64 + 1];" in product
    assert "lc_acc[i][j] += lc_a[i] * lc_b[j];" in product
    assert re.search(r"b\d+\[t \* m \* n \+ i \* n \+ j\] = \(float\)\(LC_MAX\(", product)
    reductions = [n for n, k in enumerate(program.kernels) if isinstance(k, LoopKernel) and k.reduce is not None]
    assert reductions, kinds
    reduction = _kernel_source(rendered.source, reductions[0])
    # a warp per output row (the row has 40 elements), eight rows a block, combined by shuffles
    # alone: no shared memory, no block barrier
    assert "__shfl_down_sync(0xffffffffu, lc_acc, lc_d)" in reduction
    assert rendered.launches[reductions[0]].threads == 256
    assert "for (int64_t lc_o = (int64_t)blockIdx.x * 8 + threadIdx.x / 32; lc_o < lc_total; lc_o += (int64_t)gridDim.x * 8)" in reduction
    assert "for (int64_t lc_r = (int64_t)(threadIdx.x % 32); lc_r < lc_reduced; lc_r += 32)" in reduction
    assert "__syncthreads" not in reduction and "__shared__" not in reduction
    elementwise = [n for n, k in enumerate(program.kernels) if isinstance(k, LoopKernel) and k.reduce is None]
    loop = _kernel_source(rendered.source, elementwise[-1])
    assert "lc_e < lc_total; lc_e += (int64_t)gridDim.x * blockDim.x" in loop


@pytest.mark.parametrize(("columns", "per_output"), [(100, "warp"), (3000, "block")])
def test_a_reduction_takes_a_warp_per_output_up_to_1024_elements_and_a_block_beyond(columns: int, per_output: str) -> None:
    # 13 rows: the last block's warps run fewer rows than its first ones (a warp barrier is the
    # warp's alone); the maximum of each row, as NumPy takes it
    graph_proto = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["y"], axes=[1], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", columns])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows"])],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = _program(data)
    rendered = render_cuda(program)
    (launch,) = rendered.launches
    source = _kernel_source(rendered.source, 0)
    if per_output == "warp":
        assert launch.threads == 256 and evaluate(launch.grid[0], {"rows": 13}) == 2
        assert "__syncthreads" not in source
    else:
        assert launch.threads == 256 and evaluate(launch.grid[0], {"rows": 13}) == 13
        assert "lc_partial[8]" in source and "__syncthreads();" in source
    x = np.random.default_rng(7).standard_normal((13, columns)).astype(np.float32)
    np.testing.assert_array_equal(emulate(program).run({"x": x})["y"], x.max(axis=1))


def test_the_launch_plan_sizes_grids_from_the_symbols() -> None:
    program = _program(_softmax_after_gemm())
    plan = render_cuda(program).launches
    assert program.symbols == ["batch"]
    gemm = plan[0]
    # C is [batch, 24]: one tile of columns, ceil(batch / 64) tiles of rows, one batch index
    assert [evaluate(d, {"batch": 130}) for d in gemm.grid] == [1, -(-130 // GEMM_TILE), 1]
    # the plan travels as JSON in the artifact: its grid reads back to the same sizes
    grid = [dim_from_json(d) for d in gemm.to_json()["grid"]]
    assert [evaluate(d, {"batch": 130}) for d in grid] == [1, 3, 1]
    for launch, kernel in zip(plan, program.kernels):
        if isinstance(kernel, LoopKernel) and kernel.reduce is None:
            elements = int(np.prod([evaluate(d, {"batch": 1000}) for d in kernel.shape]))
            assert evaluate(launch.grid[0], {"batch": 1000}) == -(-elements // ELEMENTWISE_THREADS)
        if isinstance(kernel, LoopKernel) and kernel.reduce is not None:  # a warp per output, 8 a block
            outputs = int(np.prod([evaluate(d, {"batch": 7}) for d in kernel.shape]))
            assert evaluate(launch.grid[0], {"batch": 7}) == -(-outputs // 8)


@pytest.mark.parametrize("model", MODELS)
def test_every_kernel_of_an_exported_model_compiles_to_ptx_and_an_sm90_cubin(model: str) -> None:
    program = _program((FIXTURES / f"{model}.onnx").read_bytes())
    rendered = render_cuda(program)
    ptx, cubin = compile_cuda(rendered.source, "sm_90")
    entries = set(re.findall(rb"\.entry (k\d+)\(", ptx))
    assert entries == {launch.kernel.encode() for launch in rendered.launches}
    assert b".target sm_90" in ptx
    assert cubin[:4] == b"\x7fELF"
    if model in ("bert_dynamo", "gpt2_dynamo"):
        # the repeated layers' kernels are one function each, launched with each layer's buffers
        assert len(entries) < len(rendered.launches)
        shared = [l for l in rendered.launches if sum(m.kernel == l.kernel for m in rendered.launches) > 1]
        assert len({l.buffers for l in shared}) == len(shared)
    if any(isinstance(k, GemmCall) and k.b_panels is not None for k in program.kernels):
        # a convolution's windows are read in place by its product: no kernel stores them
        assert all(program.buffers[k.b].role == "panel" for k in program.kernels if isinstance(k, GemmCall) and k.b_panels)


def test_source_nvrtc_refuses_fails_with_its_log() -> None:
    with pytest.raises(CudaBuildFailed, match=r"NVRTC compile failed.*undefined_name"):
        compile_cuda('extern "C" __global__ void k0(float *x) { x[0] = undefined_name; }', "sm_90")


def test_a_compute_capability_is_checked_before_compiling() -> None:
    with pytest.raises(ValueError, match="not a compute capability: 'hopper'"):
        compile_cuda("", "hopper")


@pytest.mark.parametrize("model", MODELS)
def test_the_rendered_kernels_compute_what_the_reference_does(model: str) -> None:
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    graph = load_graph(data)
    program = _program(data)
    emulated = emulate(program, graph.size_limits)
    for size, seed in ((1, 0), (3, 1)):
        inputs = sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)
        want = run_graph(graph, inputs)
        got = emulated.run(inputs)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} size={size}")


def test_a_product_with_more_rows_and_columns_than_a_tile_and_a_ragged_k() -> None:
    # tiles at the edges of C and the last, partial, step of k read zeros past the operands
    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.standard_normal((37, 150)).astype(np.float32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph_proto = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 37])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 150])], [w],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = _program(data)
    assert isinstance(program.kernels[0], GemmCall)
    x = rng.standard_normal((70, 37)).astype(np.float32)
    got = emulate(program).run({"x": x})["y"]
    np.testing.assert_allclose(got, x @ numpy_helper.to_array(w), rtol=1e-4, atol=1e-4)


# every this-many-th case of the node suite runs as emulated CUDA here (a build costs ~0.3 s);
# benchmarks/onnx_conformance.py --cuda-emulated runs them all
CUDA_SAMPLE_EVERY = 32
NODE_CASES = load_cases()


@pytest.mark.parametrize("case", NODE_CASES[::CUDA_SAMPLE_EVERY], ids=lambda c: c.name)
def test_node_suite_cases_run_as_cuda_match_or_are_refused(case, monkeypatch) -> None:
    import compiler.onnx_backend as backend

    monkeypatch.setattr(backend, "candidates", ("numpy",))  # the artifact's graph is all that is read
    monkeypatch.setattr(backend, "executable", EmulatedArtifact)
    outcome = run_case(case)
    assert outcome.status in ("passed", "unsupported"), f"{outcome.status}: {outcome.detail}"


def test_a_model_uploaded_for_a_gpu_type_compiles_to_cuda_and_waits_for_a_gpu_runtime(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app
    from cloud.auth import create_key
    from cloud.db import open_database
    from tests.conftest import auth, make_settings, upload, wait_for

    # without a GPU here, only the setting lets this server compile for one
    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"), allow_unmeasured_compile=True)
    db = open_database(settings)
    try:
        key = create_key(db, "alice")
    finally:
        db.dispose()
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    with TestClient(create_app(settings)) as client:
        upload(client, key, "mlp", data, target="h100")
        version = wait_for(client, key, "mlp", 1)
        assert version["status"] == "ready", version
        report = client.get("/v1/models/mlp", headers=auth(key)).json()["versions"][0]["report"]
        assert report["chosen"] == "cuda-default"  # every kernel's first schedule: none is timed without a GPU
        assert report["target"]["arch"] == "sm_90" and report["verified_on"] == "cpu emulation"
        assert report["verify_max_abs_error"] < 1e-4
        # no GPU runtime in this server: the request is refused, not run elsewhere
        body = {"inputs": {"input": np.zeros((1, 20), np.float32).tolist()}}
        response = client.post("/v1/models/mlp/infer", headers=auth(key), json=body)
        assert response.status_code == 503, response.text
        assert "h100" in response.json()["error"]["message"]
        # a GPU type the deployment does not offer is refused at upload
        response = client.post(
            "/v1/models", headers=auth(key), files={"file": ("m.onnx", data, "application/octet-stream")},
            data={"name": "other", "target": "a100"},
        )
        assert response.status_code == 400 and "unknown target 'a100'" in response.text


def test_a_cuda_artifact_carries_its_source_launch_plan_ptx_and_cubin() -> None:
    from compiler import Artifact, compile_onnx, executable

    artifact = compile_onnx((FIXTURES / "torch_cnn.onnx").read_bytes(), "h100")
    loaded = Artifact.from_files(artifact.to_files().__getitem__)
    kernel = loaded.kernels[0]
    assert kernel == artifact.kernels[0]
    assert kernel["kind"] == "cuda" and kernel["arch"] == "sm_90"
    # every launch names a function of the source, every function is launched
    functions = set(re.findall(r"\) (k\d+)\(const lc_symbols", kernel["source"]))
    assert {launch["kernel"] for launch in kernel["launches"]} == functions
    assert len(kernel["launches"]) == artifact.report["kernels"]
    assert loaded.binaries["program.cubin"][:4] == b"\x7fELF" and b".target sm_90" in loaded.binaries["program.ptx"]
    with pytest.raises(UnsupportedModel, match="runs on a h100 GPU runtime"):
        executable(loaded)


def test_a_model_exported_in_float16_computes_in_float32_and_keeps_its_float16_interface() -> None:
    from compiler import compile_onnx

    data = (FIXTURES / "attention_fp16_dynamo.onnx").read_bytes()
    artifact = compile_onnx(data, "h100")
    report = artifact.report
    assert report["precision"]["chosen"] == "float16" and report["precision"]["products"].startswith("tensor cores: float16")
    layout = artifact.kernels[0]["layout"]["buffers"]
    assert {b["dtype"] for b in layout if b["role"] in ("input", "output")} == {"float16"}
    graph = load_graph(data)
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, EmulatedDriver())
    inputs = sample_inputs(graph, seed=5, symbol_size=3)
    got, want = program.run(inputs)["output"], run_graph(graph, inputs)["output"]
    assert got.dtype == np.float16
    _narrow_close(got, want.astype(np.float64), "float16", "output")
    # a graph in both narrow floats is refused, naming them
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)
    graph_proto = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 4])],
    )
    mixed = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(UnsupportedModel, match="a graph computing in both bfloat16 and float16"):
        compile_onnx(mixed, "h100")


def test_a_loaded_program_keeps_its_weights_and_one_arena_grown_to_the_largest_call() -> None:
    class Recording(EmulatedDriver):
        def __init__(self) -> None:
            super().__init__()
            self.allocs: list[int] = []
            self.keys: list = []

        def alloc(self, nbytes: int) -> int:
            self.allocs.append(nbytes)
            return super().alloc(nbytes)

        def execute(self, module, calls, key) -> float:
            self.keys.append(key)
            return super().execute(module, calls, key)

    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    graph = load_graph(data)
    program = _program(data)
    driver = Recording()
    loaded = CudaProgram(kernel_record(program, render_cuda(program), "sm_90", graph.size_limits), program.weights, {}, driver)
    weights = sum(b.role == "weight" for b in program.buffers)
    assert len(driver.allocs) == weights
    for batch in (4, 4, 2, 5):
        inputs = sample_inputs(graph, seed=batch, symbol_size=batch)
        np.testing.assert_allclose(loaded.run(inputs)["output"], run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
    # an arena for the first call, reused by the equal and the smaller one, replaced by the larger
    # (at least doubled: a runtime's growing batches replace it a few times, not at every size)
    assert len(driver.allocs) == weights + 2 and driver.allocs[-1] >= 2 * driver.allocs[-2]
    # equal calls are the same launches (a GPU driver replays its captured graph)
    assert driver.keys[0] == driver.keys[1] != driver.keys[2]
    assert loaded.resident_bytes() == sum(w.nbytes for k, w in program.weights.items() if any(b.name == k for b in program.buffers))


def _gpu_driver():
    """The first GPU through the driver API, or a skip saying why there is none."""
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable

    try:
        return CudaDriver(0)
    except CudaUnavailable as exc:
        pytest.skip(f"no GPU here: {exc}")


def test_a_runtime_serves_batches_of_a_gpu_artifact_on_the_emulated_device() -> None:
    # the runtime path a GPU runtime takes (load, batch, run, split, time), on the CPU emulation
    from compiler import compile_onnx
    from compiler.backends.cuda_emulator import EmulatedDriver
    from runtime import CudaDevice, Runtime

    data = (FIXTURES / "bert_dynamo.onnx").read_bytes()
    artifact = compile_onnx(data, "h100")
    runtime = Runtime(CudaDevice("h100", EmulatedDriver()), {"bert": artifact}.__getitem__)
    graph = load_graph(data)
    requests = [sample_inputs(graph, seed=seed, int_high=1, symbol_size=4) for seed in (0, 1)]
    result = runtime.run_batch("bert", requests, [4, 4])
    assert result.exec_seconds > 0
    for request, outputs in zip(requests, result.outputs):
        for name, want in run_graph(graph, request).items():
            np.testing.assert_allclose(outputs[name], want, rtol=1e-4, atol=1e-5)


def test_a_device_name_is_a_gpu_type_and_an_ordinal() -> None:
    from runtime.cuda import parse_device

    assert parse_device("cuda:0") == ("cuda", 0) and parse_device("h100:3") == ("h100", 3)
    assert parse_device("cpu") == ("cpu", 0)
    with pytest.raises(ValueError, match="ordinal after ':' must be a number"):
        parse_device("cuda:first")


def test_a_gpu_runtime_that_cannot_start_says_why(tmp_path) -> None:
    from api.services import build_runtime
    from cloud.errors import LuminalError
    from cloud.storage import make_object_store
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable
    from tests.conftest import make_settings

    settings = make_settings(tmp_path / "data")
    store = make_object_store(settings)
    with pytest.raises(LuminalError, match="device 'tpu:0' is not known"):
        build_runtime(settings, store, "tpu:0")
    try:
        CudaDriver(0)
    except CudaUnavailable:
        with pytest.raises(LuminalError, match="device 'cuda:0' cannot be used: "):
            build_runtime(settings, store, "cuda:0")
    with pytest.raises(LuminalError, match="device 'cuda:99' cannot be used: "):
        build_runtime(settings, store, "cuda:99")


def test_a_gathered_index_out_of_range_is_an_index_error_as_on_the_cpu() -> None:
    table = numpy_helper.from_array(np.arange(15, dtype=np.float32).reshape(5, 3), "table")
    graph_proto = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [table],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = emulate(_program(data))
    np.testing.assert_array_equal(program.run({"ids": np.array([4, -1, 0])})["y"], numpy_helper.to_array(table)[[4, 4, 0]])
    with pytest.raises(IndexError, match="an index is out of bounds"):
        program.run({"ids": np.array([1, 5])})
    # the flag is cleared: the next good call succeeds
    np.testing.assert_array_equal(program.run({"ids": np.array([2])})["y"], numpy_helper.to_array(table)[[2]])


class _CountingDriver(EmulatedDriver):
    """The emulated device, counting what is allocated and not yet freed."""

    def live(self) -> int:
        return len(self._blocks)


def _runtime_of(artifacts: dict, driver, **options):
    from runtime import CudaDevice, Runtime

    return Runtime(CudaDevice("h100", driver), artifacts.__getitem__, **options)


@pytest.fixture(scope="module")
def gpu_artifacts() -> dict:
    from compiler import compile_onnx

    return {name: compile_onnx((FIXTURES / f"{name}.onnx").read_bytes(), "h100") for name in ("torch_mlp", "torch_cnn")}


def _run_once(runtime, name: str, artifacts: dict) -> None:
    graph = artifacts[name].graph
    request = sample_inputs(graph, seed=0, symbol_size=2)
    (outputs,) = runtime.run_batch(name, [request], [2]).outputs
    for output, want in run_graph(graph, request).items():
        np.testing.assert_allclose(outputs[output], want, rtol=1e-4, atol=1e-5)


def test_a_gpu_runtime_frees_the_device_memory_of_what_it_evicts_and_unloads(gpu_artifacts) -> None:
    driver = _CountingDriver()
    # room for one program's weights: loading the second evicts the first
    budget = max(a.report["weights_bytes"] for a in gpu_artifacts.values()) + 1
    runtime = _runtime_of(gpu_artifacts, driver, memory_budget_bytes=budget)
    _run_once(runtime, "torch_mlp", gpu_artifacts)
    mlp_blocks = driver.live()  # its weights and its arena
    _run_once(runtime, "torch_cnn", gpu_artifacts)
    assert runtime.loaded_keys == ["torch_cnn"]
    cnn_blocks = sum(b["role"] == "weight" for b in gpu_artifacts["torch_cnn"].kernels[0]["layout"]["buffers"]) + 1
    assert driver.live() == cnn_blocks, (mlp_blocks, driver.live())
    assert runtime.unload_idle(now=10**9) == ["torch_cnn"]
    assert driver.live() == 0


def test_a_program_evicted_during_its_batch_is_freed_after_the_batch(gpu_artifacts) -> None:
    import threading

    from runtime import CudaDevice

    started, finish = threading.Event(), threading.Event()

    class SlowDevice(CudaDevice):
        def execute(self, loaded, inputs, busy=False):
            if not finish.is_set():
                started.set()
                finish.wait(30)
            return super().execute(loaded, inputs, busy)

    from runtime import Runtime

    driver = _CountingDriver()
    runtime = Runtime(SlowDevice("h100", driver), gpu_artifacts.__getitem__, max_loaded=1)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            _run_once(runtime, "torch_mlp", gpu_artifacts)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(30)
    # the second model's load evicts the first, whose batch is still running: not freed yet
    loaded_before = driver.live()
    with runtime._load_lock:
        runtime._load("torch_cnn")
    assert runtime.loaded_keys == ["torch_cnn"] and driver.live() > loaded_before
    finish.set()
    thread.join(30)
    assert not errors, errors
    cnn_weights = sum(b["role"] == "weight" for b in gpu_artifacts["torch_cnn"].kernels[0]["layout"]["buffers"])
    assert driver.live() == cnn_weights  # the first program's weights and arena went with its batch


class _SmallGpu(_CountingDriver):
    """The emulated device with `capacity` bytes: an allocation past it is a MemoryError, as
    CudaDriver raises for CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, capacity: int = 2**62) -> None:
        super().__init__()
        self.capacity = capacity

    def used(self) -> int:
        return sum(raw.nbytes - ARENA_ALIGNMENT for raw in self._blocks.values())

    def alloc(self, nbytes: int) -> int:
        if self.used() + nbytes > self.capacity:
            raise MemoryError(f"the GPU has {self.capacity - self.used()} bytes free; {nbytes} were asked for")
        return super().alloc(nbytes)


def _request(artifacts: dict, name: str, size: int) -> dict[str, np.ndarray]:
    return sample_inputs(artifacts[name].graph, seed=size, symbol_size=size)


def test_a_gpu_out_of_memory_unloads_what_no_batch_uses_then_fails_only_the_batch_too_large(gpu_artifacts) -> None:
    from runtime.runtime import DoesNotFit

    # what each needs, on a device without a limit: the small CNN's weights, its arena at batch 2 and 8
    probe = _SmallGpu()
    sizes = _runtime_of(gpu_artifacts, probe)
    _run_once(sizes, "torch_mlp", gpu_artifacts)
    mlp_bytes = probe.used()
    sizes.run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 2)], [2])
    cnn_at_2 = probe.used() - mlp_bytes
    sizes.run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 8)], [8])
    cnn_at_8 = probe.used() - mlp_bytes
    assert cnn_at_8 > cnn_at_2 + mlp_bytes  # the batch of 8's arena is what needs the room
    # room for both at batch 2, and for the CNN alone at batch 8
    driver = _SmallGpu(capacity=cnn_at_8 + 1024)
    assert mlp_bytes + cnn_at_2 <= driver.capacity < mlp_bytes + cnn_at_8
    runtime = _runtime_of(gpu_artifacts, driver)
    _run_once(runtime, "torch_mlp", gpu_artifacts)
    runtime.run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 2)], [2])
    assert runtime.loaded_keys == ["torch_mlp", "torch_cnn"]
    request = _request(gpu_artifacts, "torch_cnn", 8)
    (outputs,) = runtime.run_batch("torch_cnn", [request], [8]).outputs
    assert runtime.loaded_keys == ["torch_cnn"]  # the MLP made room
    np.testing.assert_allclose(outputs["output"], run_graph(gpu_artifacts["torch_cnn"].graph, request)["output"], rtol=1e-4, atol=1e-5)
    # a batch too large for the device alone fails with MemoryError (the engine then fails only
    # the request that is too large); the program still serves what fits
    with pytest.raises(MemoryError, match="bytes free"):
        runtime.run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 64)], [64])
    runtime.run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 2)], [2])
    # a model whose weights do not fit even alone does not fit (the engine answers 503), and
    # leaves nothing behind
    tiny = _SmallGpu(capacity=1024)
    with pytest.raises(DoesNotFit, match="does not fit in this device's free memory"):
        _runtime_of(gpu_artifacts, tiny).run_batch("torch_cnn", [_request(gpu_artifacts, "torch_cnn", 2)], [2])
    assert tiny.live() == 0


@pytest.mark.parametrize("model", MODELS)
def test_the_large_product_schedule_computes_what_the_reference_does(model: str) -> None:
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    graph = load_graph(data)
    program = _program(data)
    rendered = render_cuda(program, SCHEDULES["cuda-tile128"])
    products = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    # two staged buffers, the next step's elements loaded into registers under this step's products
    assert "__shared__ float lc_as[2][8][128 + 4];" in _kernel_source(rendered.source, products[0])
    assert all(rendered.launches[n].threads == LARGE_THREADS for n in products)
    emulated = CudaProgram(kernel_record(program, rendered, "emulated", graph.size_limits), program.weights, {}, EmulatedDriver())
    for size, seed in ((1, 0), (3, 1)):
        inputs = sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)
        for name, want in run_graph(graph, inputs).items():
            np.testing.assert_allclose(emulated.run(inputs)[name], want, rtol=1e-4, atol=1e-5, err_msg=f"{name} size={size}")


class _EmulatedH100(EmulatedDriver):
    """The emulated device posing as an H100 (sm_90), remembering each loaded program's source,
    a call's device time the sum of its launches' (as `profile` gives them)."""

    name, arch = "emulated H100", "sm_90"

    def load(self, kernel, binaries):
        module = super().load(kernel, binaries)
        self.sources = getattr(self, "sources", {})
        self.sources[id(module)] = kernel["source"]
        return module

    def execute(self, module, calls, key) -> float:
        return sum(self.profile(module, calls))


class _TimedEmulation(_EmulatedH100):
    """An emulated H100 whose device time is the given seconds per call of a program whose
    source holds `marker` (else 1 s), and that corrupts the outputs of a program whose source
    holds `broken`."""

    has_cublas = False  # the tiles raced alone (tests/test_cublas.py races cuBLAS)

    def __init__(self, marker: str, seconds: float, broken: str | None = None) -> None:
        super().__init__()
        self.marker, self.seconds, self.broken = marker, seconds, broken

    def profile(self, module, calls) -> list[float]:
        # the program's time shared evenly among its kernels: one schedule is fastest everywhere
        super().profile(module, calls)
        self.last_source = self.sources[id(module)]
        total = self.seconds if self.marker in self.last_source else 1.0
        return [total / len(calls)] * len(calls)

    def download(self, address: int, array: np.ndarray) -> None:
        super().download(address, array)  # (a call's outputs, after its execute)
        if self.broken is not None and self.broken in self.last_source and array.dtype == np.float32:
            array += 1.0


@pytest.mark.parametrize(("seconds", "large"), [(0.5, True), (2.0, False)])
def test_on_a_gpu_every_alternative_is_built_verified_timed_and_the_fastest_kept(monkeypatch, seconds: float, large: bool) -> None:
    from compiler import compile_onnx, devices

    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _TimedEmulation("lc_ra[", seconds))
    artifact = compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), "h100")
    report = artifact.report
    assert report["chosen"] == "cuda-searched" and report["verified_on"] == "emulated H100 (sm_90)"
    timed = report["measuring"]["device_ms_by_size"]
    # round 0 (every kernel's default), one round per further alternative, then the winners whole
    assert set(timed) == {"cuda-round0", "cuda-round1", "cuda-round2", "cuda-searched"}
    assert all(set(t) == set(timed["cuda-round0"]) for t in timed.values())
    assert ("lc_ra[" in artifact.kernels[0]["source"]) == large
    assert report["product_tiles"] == ({"tile128": 3} if large else {"tile64": 3})
    space = report["search"]["schedule"]["forms"]["cuda"]["space"]
    assert space["searched_kernels"] >= 3 and space["programs"] >= 8


def test_on_a_gpu_an_alternative_that_disagrees_with_the_reference_is_dropped(monkeypatch) -> None:
    from compiler import compile_onnx, devices

    # the large tile's program is the faster, but its outputs are wrong
    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _TimedEmulation("lc_ra[", 0.5, broken="lc_ra["))
    artifact = compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), "h100")
    report = artifact.report
    assert report["chosen"] == "cuda-searched" and "lc_ra[" not in artifact.kernels[0]["source"]
    failed = [k["failed"] for k in report["search"]["schedule"]["forms"]["cuda"]["kernels"].values() if "failed" in k]
    assert failed and all("max error" in why for record in failed for why in record.values())
    assert any("max error" in str(t) for t in report["measuring"]["device_ms_by_size"].values())


class _PerKernelEmulation(_EmulatedH100):
    """An emulated H100 on which the large tile is the faster for the first product of a program
    and the small tile for the others: a kernel's device time is 1 ms, 2 ms for a product in the
    tile that loses there; a program's is the sum of its kernels'."""

    has_cublas = False

    def profile(self, module, calls) -> list[float]:
        super().profile(module, calls)
        source = self.sources[id(module)]
        seconds, products = [], 0
        for call in calls:
            text = _kernel_source(source, int(call.function[1:]))
            large, product = "lc_ra[" in text, "lc_as[" in text
            first = products == 0
            products += product
            seconds.append(0.002 if product and large != first else 0.001)
        return seconds


def test_on_a_gpu_each_product_gets_the_tile_that_measured_fastest_for_it(monkeypatch) -> None:
    from compiler import compile_onnx, devices

    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _PerKernelEmulation())
    artifact = compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), "h100")
    report = artifact.report
    # each product's tile from its own measured time, the winners verified and timed whole
    assert report["chosen"] == "cuda-searched"
    assert report["product_tiles"] == {"tile128": 1, "tile64": 2}
    source = artifact.kernels[0]["source"]
    products = [launch for launch in artifact.kernels[0]["launches"] if "lc_as[" in _kernel_source(source, int(launch["kernel"][1:]))]
    assert ["lc_ra[" in _kernel_source(source, int(launch["kernel"][1:])) for launch in products] == [True, False, False]


def test_a_second_compile_of_the_same_kernels_on_the_same_gpu_measures_nothing_again(monkeypatch, tmp_path) -> None:
    from compiler import compile_onnx, devices
    from compiler.search.schedule import DirectoryKernelCache

    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _PerKernelEmulation())
    cache = DirectoryKernelCache(tmp_path)
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    first = compile_onnx(data, "h100", kernel_cache=cache).report
    assert first["search"]["schedule"]["forms"]["cuda"]["cache"]["hits"] == 0
    second = compile_onnx(data, "h100", kernel_cache=cache).report
    searched = second["search"]["schedule"]["forms"]["cuda"]
    assert searched["cache"] == {"hits": first["search"]["schedule"]["forms"]["cuda"]["cache"]["misses"], "misses": 0}
    assert [r["round"] for r in searched["rounds"]] == [0]  # only the winners' own round
    assert second["product_tiles"] == first["product_tiles"] == {"tile128": 1, "tile64": 2}


# ---- narrow precisions: float16 and bfloat16 storage, tensor-core products ---------------------

NARROW = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _narrow_close(got: np.ndarray, want: np.ndarray, precision: str, what: str) -> None:
    """Within the precision's verification tolerance, relative to the largest expected value."""
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    error = float(np.abs(got.astype(np.float64) - want).max(initial=0.0))
    assert error <= PRECISION_TOLERANCE[precision] * scale, f"{what}: error {error:.3g} at scale {scale:.3g}"


def test_a_narrow_program_stores_16_bits_and_multiplies_on_tensor_cores() -> None:
    program = narrow_storage(_program(_softmax_after_gemm()), "float16")
    assert {b.dtype for b in program.buffers if b.role in ("weight", "temp")} == {"float16"}
    assert {b.dtype for b in program.buffers if b.role in ("input", "output")} == {"float32"}
    rendered = render_cuda(program)
    product = _kernel_source(rendered.source, 0)
    # operands staged as halves, 16x16x16 warp products accumulated in float, sums staged for the epilogue
    assert "__shared__ __align__(32) lc_half lc_as[64][40];" in product
    assert "lc_mma_f16(lc_acc[i][j], lc_a[i], lc_b[j]);" in product
    assert "lc_mma_store(&lc_cs[lc_wm * 32 + 16 * i][lc_wn * 32 + 16 * j], lc_acc[i][j], 68);" in product
    # a weight is read into float; the output tile is rounded once as it is stored
    assert re.search(r"lc_v = lc_from_f16\(b\d+\[", product)
    assert re.search(r"b\d+\[t \* m \* n \+ i \* n \+ j\] = lc_to_f16\(lc_cs\[", product)
    assert rendered.launches[0].threads == MMA_THREADS
    assert re.search(r"const lc_half \*__restrict__ b\d+", product)
    bf16 = render_cuda(narrow_storage(_program(_softmax_after_gemm()), "bfloat16")).source
    assert "lc_mma_bf16(lc_acc[i][j], lc_a[i], lc_b[j]);" in bf16 and "lc_half *" not in bf16.split("#endif")[-1]


def _in_precision(program, precision: str):
    return tf32_products(program) if precision == "tf32" else narrow_storage(program, precision)


@pytest.mark.parametrize("precision", [*sorted(NARROW), "tf32"])
@pytest.mark.parametrize("model", ["torch_cnn", "bert_dynamo"])
def test_a_program_on_tensor_cores_compiles_to_ptx_and_an_sm90_cubin_with_its_warp_products(model: str, precision: str) -> None:
    program = _in_precision(_program((FIXTURES / f"{model}.onnx").read_bytes()), precision)
    ptx, cubin = compile_cuda(render_cuda(program).source, "sm_90")
    shape, kind = {"float16": ("m16n16k16", "f16"), "bfloat16": ("m16n16k16", "bf16"), "tf32": ("m16n16k8", "tf32")}[precision]
    assert f"wmma.mma.sync.aligned.row.row.{shape}.f32.".encode() in ptx
    assert f"wmma.load.a.sync.aligned.row.{shape}.shared.{kind}".encode() in ptx
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("precision", [*sorted(NARROW), "tf32"])
@pytest.mark.parametrize("model", MODELS)
def test_a_program_in_a_narrower_precision_computes_what_the_float32_reference_does_within_its_tolerance(model: str, precision: str) -> None:
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    graph = load_graph(data)
    emulated = emulate(_in_precision(_program(data), precision), graph.size_limits)
    inputs = sample_inputs(graph, seed=3, int_high=1, symbol_size=2)
    got = emulated.run(inputs)
    for name, want in run_graph(graph, inputs).items():
        assert got[name].dtype == want.dtype  # the interface keeps the exported dtypes
        _narrow_close(got[name], want, precision, name)


@pytest.mark.parametrize("precision", sorted(NARROW))
def test_a_stored_value_rounds_to_the_nearest_narrow_float_as_numpy_does(precision: str) -> None:
    # the max of x and 69 -infs into a narrow temp, then doubled into the float32 output: every
    # output is twice the narrow rounding of x, bit for bit (ties to even, overflow to inf, NaN kept)
    nodes = [helper.make_node("ReduceMax", ["x"], ["r"], axes=[1], keepdims=0), helper.make_node("Add", ["r", "r"], ["y"])]
    graph_proto = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 70])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = narrow_storage(lower(load_graph(data)), precision)  # unfused: r is a temp
    assert any(b.role == "temp" and b.dtype == precision for b in program.buffers)
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    special = [65519.0, 65520.0, -65520.0, 1e30, np.nan, np.inf, -np.inf, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25]
    values = np.concatenate([bits.view(np.float32), np.array(special, np.float32)])
    x = np.full((len(values), 70), -np.inf, np.float32)
    x[:, 33] = values
    got = emulate(program).run({"x": x})["y"]
    with np.errstate(all="ignore"):  # overflow to inf and NaN are cases here
        want = values.astype(NARROW[precision]).astype(np.float32) * 2
    np.testing.assert_array_equal(got, want)


def test_a_product_on_tensor_cores_with_ragged_tiles_and_batches() -> None:
    # edge tiles, a ragged last k step and a batch of products with their own operands
    rng = np.random.default_rng(5)
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph_proto = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "m", 37]), helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 37, 150])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, "m", 150])],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = narrow_storage(_program(data), "float16")
    assert isinstance(program.kernels[0], GemmCall)
    x = rng.standard_normal((3, 70, 37)).astype(np.float32)
    w = rng.standard_normal((3, 37, 150)).astype(np.float32)
    got = emulate(program).run({"x": x, "w": w})["y"]
    # the operands are rounded to float16 and the sums kept in float32: as NumPy computes it
    want = x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    # in tf32: operands rounded to 10 mantissa bits, to nearest with ties away from zero
    got = emulate(tf32_products(_program(data))).run({"x": x, "w": w})["y"]
    np.testing.assert_allclose(got, _tf32(x) @ _tf32(w), rtol=1e-5, atol=1e-4)
    assert np.abs(got - x @ w).max() > 1e-4  # it did round


def _tf32(array: np.ndarray) -> np.ndarray:
    bits = array.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def test_a_mask_of_the_float32_minimum_stays_float32_so_a_fully_masked_row_is_uniform() -> None:
    # scores + (1 - mask) * float32 min, softmax: in float16 the minimum would be -inf, and a
    # row with every position masked NaN where the float32 model gives 1/n
    minimum = numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "minimum")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    nodes = [
        helper.make_node("Sub", ["one", "mask"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "minimum"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["y"], axis=-1),
    ]
    graph_proto = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 16]), helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], [minimum, one],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    base = lower(load_graph(data))  # unfused: the masked scores are a temp
    assert out_of_range(base, 65504.0)
    program = narrow_storage(base, "float16")
    wide = [b for b in program.buffers if b.role == "temp" and b.dtype == "float32"]
    assert wide and all(b.id in out_of_range(base, 65504.0) for b in wide)
    scores = np.random.default_rng(6).standard_normal((2, 16)).astype(np.float32)
    mask = np.stack([np.zeros(16, np.float32), (np.arange(16) < 5).astype(np.float32)])
    got = emulate(program).run({"scores": scores, "mask": mask})["y"]
    np.testing.assert_allclose(got[0], np.full(16, 1 / 16), rtol=1e-6)
    expected = np.exp(scores[1, :5] - scores[1, :5].max())
    np.testing.assert_allclose(got[1, :5], expected / expected.sum(), rtol=1e-2)
    assert not got[1, 5:].any()


def test_a_weight_beyond_the_narrow_range_stays_float32_and_so_does_what_derives_from_it() -> None:
    # a mask weight of -1e9 (GPT-2's causal mask): in float16 -inf, and -inf * 0 is NaN where the
    # float32 model gives 0
    weight = np.where(np.arange(16) < 4, -1e9, 0.5).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "x"], ["z"])]
    graph_proto = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 16])], [numpy_helper.from_array(weight, "w")],
    )
    graph = load_graph(helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    program = narrow_storage(lower(graph), "float16")
    assert [b.dtype for b in program.buffers if b.role == "weight"] == ["float32"]
    x = np.zeros((2, 16), np.float32)
    x[1] = 1e-6
    got = emulate(program).run({"x": x})["z"]
    want = run_graph(graph, {"x": x})["z"]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-2)
    # a weight within the range is stored narrow
    small = narrow_storage(lower(load_graph(_softmax_after_gemm())), "float16")
    assert {b.dtype for b in small.buffers if b.role == "weight"} == {"float16"}


def test_a_narrow_precision_compiles_for_a_gpu_type_and_is_refused_on_the_cpu() -> None:
    from compiler import compile_onnx

    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    report = compile_onnx(data, "h100", precision="bfloat16").report
    assert report["precision"]["chosen"] == "bfloat16" and report["precision"]["tolerance"] == PRECISION_TOLERANCE["bfloat16"]
    assert report["precision"]["products"].startswith("tensor cores: bfloat16")
    assert 0 < report["verify_max_abs_error"] <= PRECISION_TOLERANCE["bfloat16"]
    with pytest.raises(ValueError, match="precision 'float16' runs on GPU targets .* not on 'cpu'"):
        compile_onnx(data, "cpu", precision="float16")
    with pytest.raises(ValueError, match="unknown precision 'float8'"):
        compile_onnx(data, "h100", precision="float8")
    report = compile_onnx(data, "h100", precision="tf32").report
    assert report["precision"]["chosen"] == "tf32" and report["precision"]["products"].startswith("tensor cores: tf32")
    with pytest.raises(ValueError, match="precision 'tf32' runs on GPU targets"):
        compile_onnx(data, "cpu", precision="tf32")


@pytest.mark.parametrize("precision", ["tf32", *sorted(NARROW)])
@pytest.mark.parametrize("model", ["torch_cnn", "bert_dynamo"])
def test_the_large_schedule_on_tensor_cores_computes_what_the_reference_does(model: str, precision: str) -> None:
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    graph = load_graph(data)
    program = _in_precision(_program(data), precision)
    rendered = render_cuda(program, SCHEDULES["cuda-tile128"])
    products = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    # eight warps of 2x4 warp products, each warp's sums through its own scratch to the epilogue
    source = _kernel_source(rendered.source, products[0])
    assert "lc_frag_c lc_acc[2][4];" in source and "__syncwarp();" in source
    emulated = CudaProgram(kernel_record(program, rendered, "emulated", graph.size_limits), program.weights, {}, EmulatedDriver())
    inputs = sample_inputs(graph, seed=4, int_high=1, symbol_size=3)
    for name, want in run_graph(graph, inputs).items():
        _narrow_close(emulated.run(inputs)[name], want, precision, name)


# ---- the driver adapter through cuda-bindings, against a stand-in libcuda -----------------------

_DRIVE = r"""
import ctypes, json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from compiler.backends.cuda import CudaProgram
from compiler.backends.cuda_driver import CudaDriver
from compiler.frontends.onnx import load_graph
from compiler.pipeline import sample_inputs
from tests.conftest import FIXTURES

class Recording(CudaDriver):
    def execute(self, module, calls, key):
        self.calls.append(calls)
        return super().execute(module, calls, key)

fake = ctypes.CDLL("libcuda.so.1")
def state():
    values = (ctypes.c_int * 4)()
    fake.fake_cuda_state(values)
    return dict(zip(("retained", "captures", "modules", "bytes"), values))

# built by the test beforehand: NVRTC is not for a process with the stand-in loaded
built = sys.argv[2]
kernel = json.loads(open(f"{built}/kernel.json").read())
weights = dict(np.load(f"{built}/weights.npz"))
binaries = {name: open(f"{built}/{name}", "rb").read() for name in ("program.ptx", "program.cubin")}
driver = Recording(0)
driver.calls = []
assert (driver.name, driver.arch, driver.memory_bytes) == ("Fake GPU", "sm_52", 1 << 30)
program = CudaProgram(kernel, weights, binaries, driver)  # an sm_90 cubin: the PTX is loaded
graph = load_graph((FIXTURES / "torch_mlp.onnx").read_bytes())
inputs = [sample_inputs(graph, seed=s, symbol_size=size) for s, size in ((0, 3), (1, 3), (2, 5))]
for feed in inputs:
    program.run(feed)
    assert program.last_device_seconds == 0.00025
print("STATE", state())
# profiled, each kernel is launched on its own between events (none captured)
per_launch = program.profile(inputs[0])
assert per_launch == [0.00025] * len(program.launches), per_launch
assert fake.fake_cuda_direct_launches() == len(program.launches)
# the input, uploaded where the first launch reads it
first = driver.calls[-1][0]
address = first.pointers[program.launches[0][1].index(next(b.id for b in program.buffers if b.role == "input"))]
copy = np.empty_like(inputs[-1]["input"])
driver.download(address, copy)
assert np.array_equal(copy, inputs[-1]["input"])
# an index out of range, flagged by a kernel: IndexError, then the flag is cleared
ctypes.c_int.from_address(int(program.module.bad_index)).value = 1
try:
    program.run(inputs[0])
    raise AssertionError("no IndexError")
except IndexError:
    pass
assert ctypes.c_int.from_address(int(program.module.bad_index)).value == 0
program.run(inputs[0])
os.environ["FAKE_CUDA_MEMORY"] = str(1 << 20)
try:
    driver.alloc(1 << 21)
    raise AssertionError("no MemoryError")
except MemoryError as exc:
    assert "bytes free" in str(exc), exc
del os.environ["FAKE_CUDA_MEMORY"]
# the runtime a `luminal-cloud runtime --device h100:0` process builds, serving the stored artifact
from api.services import build_runtime
from cloud.settings import Settings
from cloud.storage import make_object_store

settings = Settings(data_dir=built + "/data")
runtime = build_runtime(settings, make_object_store(settings), "h100:0")
assert runtime.device.target == "h100" and runtime.memory_budget_bytes < (1 << 30)
result = runtime.run_batch("artifacts/mlp", [inputs[0], inputs[2]], [3, 5])
assert [o["output"].shape[0] for o in result.outputs] == [3, 5], [o["output"].shape for o in result.outputs]
assert result.exec_seconds == 0.00025, result.exec_seconds
print("RUNTIME", runtime.loaded_keys)
runtime.unload("artifacts/mlp")  # its weights, arena and module leave the device
runtime.device.driver.close()
for calls in driver.calls:
    print("CALLS", ";".join(f"{c.function} {' '.join(map(str, c.grid))} {c.threads} 1 1 " + c.symbols.astype("<i8").tobytes().hex() + " " + " ".join(int(p).to_bytes(8, "little").hex() for p in c.pointers) for c in calls))
program.close()
driver.close()
print("STATE", state())
"""


def test_the_driver_adapter_runs_through_cuda_bindings_against_a_stand_in_libcuda(tmp_path) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    build = subprocess.run(
        [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O1", str(root / "tests" / "fake_libcuda.c"), "-o", str(tmp_path / "libcuda.so.1"), "-ldl"],
        capture_output=True, text=True, check=False,
    )
    assert build.returncode == 0, build.stderr
    import ast
    import json

    program = _program((FIXTURES / "torch_mlp.onnx").read_bytes())
    rendered = render_cuda(program)
    ptx, cubin = compile_cuda(rendered.source, "sm_90")
    (tmp_path / "kernel.json").write_text(json.dumps(kernel_record(program, rendered, "sm_90", {})))
    np.savez(tmp_path / "weights.npz", **program.weights)
    (tmp_path / "program.ptx").write_bytes(ptx)
    (tmp_path / "program.cubin").write_bytes(cubin)
    from cloud.storage import make_object_store, save_artifact
    from compiler import compile_onnx
    from tests.conftest import make_settings

    save_artifact(make_object_store(make_settings(tmp_path / "data")), "artifacts/mlp", compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), "h100"))
    (tmp_path / "drive.py").write_text(_DRIVE)
    log = tmp_path / "launches.log"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "FAKE_CUDA_LOG": str(log)}
    command = [sys.executable, str(tmp_path / "drive.py"), str(root), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    states = [ast.literal_eval(line[6:]) for line in lines if line.startswith("STATE ")]
    assert "RUNTIME ['artifacts/mlp']" in lines
    # sizes 3, 3, 5: the first captured once and replayed, the second (a larger arena) captured
    assert states[0]["captures"] == 2 and states[0]["retained"] == 1 and states[0]["modules"] == 1
    # then size 3 twice in the grown arena (captured once more), and the runtime's batch of 8;
    # unloaded and closed, nothing is held
    assert states[-1] == {"retained": 0, "captures": 4, "modules": 0, "bytes": 0}
    replayed = [block.strip().splitlines() for block in log.read_text().split("--\n") if block.strip()]
    launched = [line[6:].split(";") for line in lines if line.startswith("CALLS ")]
    assert len(launched) == 5 and len(replayed) == 6  # (the sixth, the runtime's batch)
    # every launch as libcuda received it: function, grid, block, the symbols' bytes, each pointer
    for got, want in zip(replayed, launched):
        assert got == [" ".join(w.split()) for w in want]


# ---- on a GPU (skipped without one) -------------------------------------------------------------


@pytest.mark.parametrize("precision", ["exported", "tf32", *sorted(NARROW)])
@pytest.mark.parametrize("model", MODELS)
def test_on_a_gpu_the_compiled_program_matches_the_reference(model: str, precision: str) -> None:
    from compiler import compile_onnx
    from compiler.backends.cuda import CudaProgram
    from compiler.targets import GPU_TYPES

    driver = _gpu_driver()
    target = next((t for t, gpu in GPU_TYPES.items() if gpu.arch == driver.arch), "cuda")  # else its PTX
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    artifact = compile_onnx(data, target, precision=precision)
    assert artifact.report["verified_on"] != "cpu emulation"
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, driver)
    _matches_reference(program, load_graph(data), precision)


def _matches_reference(program: CudaProgram, graph, precision: str, sizes=((1, 0), (5, 1), (5, 2))) -> None:
    """The loaded program's outputs at each (size, seed) against the reference, within the
    precision's tolerance (by default the third replays the CUDA graph the second captured)."""
    for size, seed in sizes:
        inputs = sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)
        got = program.run(inputs)
        assert program.last_device_seconds > 0
        for name, want in run_graph(graph, inputs).items():
            if precision == "exported":
                np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5, err_msg=f"{name} size={size}")
            else:
                _narrow_close(got[name], want, precision, f"{name} size={size}")


def test_on_a_gpu_a_runtime_built_for_the_device_serves_batches_and_frees_what_it_unloads(tmp_path, monkeypatch) -> None:
    # what `luminal-cloud runtime --device cuda:0` serves with: artifacts from the object store,
    # batches run as CUDA graphs, device time billed, every allocation freed on unload
    import api.services
    from api.services import build_runtime
    from cloud.storage import make_object_store, save_artifact
    from compiler import compile_onnx
    from compiler.backends.cuda_driver import CudaDriver
    from compiler.targets import GPU_TYPES
    from tests.conftest import make_settings

    live: set[int] = set()

    class CountingCudaDriver(CudaDriver):
        # (the GPU's free memory moves in 2 MiB pages: too coarse to see a small model go)
        def alloc(self, nbytes: int) -> int:
            address = super().alloc(nbytes)
            live.add(address)
            return address

        def free(self, address: int) -> None:
            super().free(address)
            live.remove(address)

    gpu = _gpu_driver()
    target = next((t for t, g in GPU_TYPES.items() if t != "cuda" and g.arch == gpu.arch), "cuda")
    gpu.close()
    settings = make_settings(tmp_path / "data")
    store = make_object_store(settings)
    graphs, weights, artifacts = {}, 0, []
    for name in ("torch_mlp", "torch_cnn"):
        data = (FIXTURES / f"{name}.onnx").read_bytes()
        artifact = compile_onnx(data, target)
        artifacts.append(artifact)
        save_artifact(store, f"artifacts/{name}", artifact)
        graphs[name] = load_graph(data)
        weights += sum(b["role"] == "weight" for b in artifact.kernels[0]["layout"]["buffers"])
    monkeypatch.setattr(api.services, "CudaDriver", CountingCudaDriver)
    runtime = build_runtime(settings, store, f"{target}:0")
    for name, sizes in (("torch_mlp", [1, 3]), ("torch_cnn", [2, 2]), ("torch_mlp", [4])):
        requests = [sample_inputs(graphs[name], seed=seed, symbol_size=size) for seed, size in enumerate(sizes)]
        result = runtime.run_batch(f"artifacts/{name}", requests, sizes)
        assert 0 < result.exec_seconds < 1
        for request, outputs in zip(requests, result.outputs):
            for output, want in run_graph(graphs[name], request).items():
                np.testing.assert_allclose(outputs[output], want, rtol=1e-4, atol=1e-5, err_msg=name)
    # each program's weights and its one arena; and cuBLAS's workspace where a product runs there
    # (the driver's, freed when it closes)
    library = any("library" in launch for a in artifacts for launch in a.kernels[0]["launches"])
    workspace = {runtime.device.driver.blas().workspace} if library else set()
    assert len(live - workspace) == weights + 2
    assert sorted(runtime.unload_idle(now=10**9)) == ["artifacts/torch_cnn", "artifacts/torch_mlp"]
    assert runtime.loaded_keys == [] and live == workspace
