"""The CUDA target without a GPU: the kernel IR rendered as CUDA C (golden lines), the launch plan,
NVRTC compiling every rendered kernel of the exported fixtures to PTX and an sm_90 cubin, and what
the kernels compute, run by the CPU emulation of compiler/backends/cuda_emulator.py against the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.backends.cuda import CudaBuildFailed, compile_cuda
from compiler.backends.cuda_emulator import EmulatedArtifact, emulate
from compiler.conformance import load_cases, run_case
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, LoopKernel
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.cuda import ELEMENTWISE_THREADS, GEMM_TILE, render_cuda
from compiler.shape import dim_from_json, evaluate
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
    # one block per output row: a warp (the row has 40 elements), combined by shuffles
    assert "__shfl_down_sync(0xffffffffu, lc_acc, lc_d)" in reduction
    assert rendered.launches[reductions[0]].threads == 32
    assert "for (int64_t lc_o = (int64_t)blockIdx.x; lc_o < lc_total; lc_o += (int64_t)gridDim.x)" in reduction
    elementwise = [n for n, k in enumerate(program.kernels) if isinstance(k, LoopKernel) and k.reduce is None]
    loop = _kernel_source(rendered.source, elementwise[-1])
    assert "lc_e < lc_total; lc_e += (int64_t)gridDim.x * blockDim.x" in loop


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
        if isinstance(kernel, LoopKernel) and kernel.reduce is not None:  # a block per output
            assert evaluate(launch.grid[0], {"batch": 7}) == int(np.prod([evaluate(d, {"batch": 7}) for d in kernel.shape]))


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

    settings = make_settings(tmp_path / "data", targets=("cpu", "h100"))
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
        assert report["chosen"] == "cuda-generated"
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


def test_a_float16_model_for_a_gpu_type_is_refused_with_the_reason() -> None:
    from compiler import compile_onnx

    node = helper.make_node("Relu", ["x"], ["y"])
    graph_proto = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 4])],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(UnsupportedModel, match="float16 values on h100"):
        compile_onnx(data, "h100")


def test_a_loaded_program_keeps_its_weights_and_one_arena_grown_to_the_largest_call() -> None:
    from compiler.backends.cuda import CudaProgram, kernel_record
    from compiler.backends.cuda_emulator import EmulatedDriver

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
    for batch in (4, 4, 2, 9):
        inputs = sample_inputs(graph, seed=batch, symbol_size=batch)
        np.testing.assert_allclose(loaded.run(inputs)["output"], run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)
    # an arena for the first call, reused by the equal and the smaller one, replaced by the larger
    assert len(driver.allocs) == weights + 2 and driver.allocs[-1] > driver.allocs[-2]
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


# ---- on a GPU (skipped without one) -------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_on_a_gpu_the_compiled_program_matches_the_reference(model: str) -> None:
    from compiler import compile_onnx
    from compiler.backends.cuda import CudaProgram
    from compiler.targets import GPU_TYPES

    driver = _gpu_driver()
    target = next((t for t, gpu in GPU_TYPES.items() if gpu.arch == driver.arch), "cuda")  # else its PTX
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    artifact = compile_onnx(data, target)
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, driver)
    graph = load_graph(data)
    for size, seed in ((1, 0), (5, 1), (5, 2)):  # the third replays the graph the second captured
        inputs = sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)
        got = program.run(inputs)
        assert program.last_device_seconds > 0
        for name, want in run_graph(graph, inputs).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5, err_msg=f"{name} size={size}")
