"""Products as cuBLAS calls (compiler.backends.cublas): rendered as library launches with
cuBLAS's own column-major arguments, emulated on the CPU from exactly those arguments, raced
against the generated tiles on a GPU (here an emulated one posing as an H100), and run on a GPU
where there is one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from compiler.backends.cublas import OP_N, OP_T, GemmArguments, emulated_gemm
from compiler.backends.cuda import CudaProgram, compile_cuda, kernel_record
from compiler.backends.cuda_emulator import EmulatedDriver, emulate
from compiler.frontends.onnx import load_graph
from compiler.kernels.ir import GemmCall
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.cuda import SCHEDULES, render_cuda, scheduled
from compiler.shape import dim_to_json
from tests.conftest import FIXTURES
from tests.test_cuda import (
    _EmulatedH100,
    _gpu_driver,
    _in_precision,
    _kernel_source,
    _matches_reference,
    _narrow_close,
    _program,
)

CUBLAS = SCHEDULES["cuda-cublas"]


def _function(source: str, name: str) -> str:
    start = source.index(f" {name}(const lc_symbols S")
    end = source.find('extern "C"', start)
    return source[start : end if end >= 0 else len(source)]


@pytest.mark.parametrize(("transa", "transb"), list(itertools.product((OP_N, OP_T), repeat=2)))
def test_the_emulated_gemm_computes_what_cublas_defines_column_major(transa: int, transb: int) -> None:
    # cuBLAS's definition, element by element: op(A)[r, p] is A[r + p*lda] untransposed, A[p +
    # r*lda] transposed; C[r + c*ldc] = sum_p op(A)[r, p] op(B)[p, c] for each batch index
    rng = np.random.default_rng(transa * 2 + transb)
    m, n, k, batch = 5, 7, 3, 2
    lda = (m if transa == OP_N else k) + 2  # rows of a wider buffer
    ldb = (k if transb == OP_N else n) + 1
    ldc = m + 3
    stride_a, stride_b, stride_c = lda * (k if transa == OP_N else m) + 4, 0, ldc * n + 1  # B shared by the batch
    a = rng.standard_normal(stride_a * batch).astype(np.float32)
    b = rng.standard_normal(ldb * (n if transb == OP_N else k)).astype(np.float32)
    c = np.full(stride_c * batch, 7.0, np.float32)
    args = GemmArguments(transa, transb, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch, "float32", "float32", "float32", "float32")
    emulated_gemm(args, a.ctypes.data, b.ctypes.data, c.ctypes.data)
    want = np.full_like(c, 7.0)
    for t, r, col in itertools.product(range(batch), range(m), range(n)):
        total = 0.0
        for p in range(k):
            x = a[t * stride_a + (r + p * lda if transa == OP_N else p + r * lda)]
            y = b[t * stride_b + (p + col * ldb if transb == OP_N else col + p * ldb)]
            total += float(x) * float(y)
        want[t * stride_c + r + col * ldc] = total
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-6)  # the padding between columns untouched


def test_a_product_on_cublas_is_a_library_launch_and_its_epilogue_a_kernel_of_its_own() -> None:
    program = _program((FIXTURES / "torch_mlp.onnx").read_bytes())
    rendered = render_cuda(program, CUBLAS)
    products = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    library = [launch for launch in rendered.launches if launch.library is not None]
    assert [launch.kernel_number for launch in library] == products
    first = program.kernels[products[0]]
    # x[batch, 20] @ W^T, W stored [32, 20]: cuBLAS computes C^T (32 x batch) = op(W) x^T
    assert library[0].buffers == (first.b, first.a, first.c)
    assert library[0].library == {
        "op": "gemm", "transa": OP_T, "transb": OP_N, "m": 32, "n": "batch", "k": 20, "lda": 20, "ldb": 20, "ldc": 32,
        "stride_a": 0, "stride_b": 0, "stride_c": "32*batch", "batch": 1,
        "a_type": "float32", "b_type": "float32", "c_type": "float32", "compute": "float32",
    }
    # the bias and ReLU after it: a kernel that reads the sums from C and writes C
    following = rendered.launches[rendered.launches.index(library[0]) + 1]
    assert following.kernel_number == products[0] and following.buffers[-1] == first.c
    epilogue = _kernel_source(rendered.source, int(following.kernel[1:]))
    assert "lc_as[" not in epilogue and "LC_MAX(" in epilogue
    # every function a launch names is in the PTX; the library launches name none
    ptx, _ = compile_cuda(rendered.source, "sm_90")
    assert all(f".entry {launch.kernel}(".encode() in ptx for launch in rendered.launches if launch.library is None)
    assert b".entry cublas(" not in ptx
    record = kernel_record(program, rendered, "sm_90", {})
    assert sum("library" in launch for launch in record["launches"]) == len(products)


def test_a_convolution_on_cublas_stores_its_windows_whole_first_in_a_temp_of_their_own() -> None:
    cnn = _program((FIXTURES / "torch_cnn.onnx").read_bytes())
    rendered = render_cuda(cnn, CUBLAS)
    panels = [n for n, k in enumerate(cnn.kernels) if isinstance(k, GemmCall) and k.b_panels is not None]
    assert len(panels) == 2
    for number in panels:
        windows, product = [launch for launch in rendered.launches if launch.kernel_number == number][:2]
        # im2col: the panels' loop as an elementwise kernel into their buffer, then cuBLAS reads it
        assert windows.kernel == f"k{number}_windows" and windows.buffers[-1] == cnn.kernels[number].b
        assert product.library is not None and product.buffers[0] == cnn.kernels[number].b
        assert product.library["lda"] == dim_to_json(cnn.kernels[number].n)
    layout = kernel_record(cnn, rendered, "sm_90", {})["layout"]
    windows = {str(cnn.kernels[number].b) for number in panels}
    assert {layout["buffers"][int(b)]["role"] for b in windows} == {"temp"}
    assert len({layout["slots"][b] for b in windows}) == 1 and layout["slots"][next(iter(windows))] not in [
        slot for b, slot in layout["slots"].items() if b not in windows
    ]
    # the generated schedules keep reading the windows as they multiply
    assert all(b.role == "panel" for b in cnn.buffers if str(b.id) in windows)
    assert "_windows" not in render_cuda(cnn).source


def test_a_product_cublas_cannot_compute_stays_a_generated_kernel() -> None:
    # in float16 the MLP's first product multiplies a float32 input by a float16 weight: cuBLAS
    # takes operands of one type, so that one stays generated (on tensor cores) and the others go
    mlp = _in_precision(_program((FIXTURES / "torch_mlp.onnx").read_bytes()), "float16")
    rendered = render_cuda(mlp, CUBLAS)
    library = [launch for launch in rendered.launches if launch.library is not None]
    assert len(library) == 2 and all(launch.library["a_type"] == "float16" for launch in library)
    first = next(launch for launch in rendered.launches if launch.kernel_number == 0)
    assert first.library is None and "lc_mma_f16(" in _function(rendered.source, first.kernel)


@pytest.mark.parametrize(
    ("model", "precision"),
    [
        ("torch_mlp", "exported"), ("torch_mlp", "tf32"), ("bert_dynamo", "float16"), ("gpt2_dynamo", "bfloat16"),
        ("torch_cnn", "exported"), ("resnet_dynamo", "float16"),
    ],
)
def test_products_on_cublas_compute_what_the_reference_does_in_the_emulation(model: str, precision: str) -> None:
    graph = load_graph((FIXTURES / f"{model}.onnx").read_bytes())
    program = _program((FIXTURES / f"{model}.onnx").read_bytes())
    program = scheduled(program if precision == "exported" else _in_precision(program, precision), CUBLAS)
    _matches_reference(emulate(program, graph.size_limits, CUBLAS), graph, precision, sizes=((1, 0), (3, 1)))


class _LibraryEmulation(_EmulatedH100):
    """An emulated H100 with cuBLAS: a library launch takes `library_ms` for the MLP's first
    product (its k is 20) and `later_ms` for the others, a generated product 1 ms and any other
    kernel 0.1 ms."""

    def __init__(self, library_ms: float, later_ms: float) -> None:
        super().__init__()
        self.library_ms, self.later_ms = library_ms, later_ms

    def profile(self, module, calls) -> list[float]:
        super().profile(module, calls)
        seconds = []
        for call in calls:
            if call.library is not None:
                seconds.append((self.library_ms if call.library.k == 20 else self.later_ms) / 1000)
            else:
                product = "lc_as[" in _function(self.sources[id(module)], call.function)
                seconds.append((1.0 if product else 0.1) / 1000)
        return seconds


@pytest.mark.parametrize(("later_ms", "tiles"), [(0.5, {"cublas": 3}), (3.0, {"tile64": 2, "cublas": 1})])
def test_on_a_gpu_products_run_on_cublas_where_it_measures_faster(monkeypatch, later_ms: float, tiles: dict) -> None:
    from compiler import compile_onnx, devices

    monkeypatch.setattr(devices, "_gpu_of_arch", lambda arch: _LibraryEmulation(0.5, later_ms))
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    artifact = compile_onnx(data, "h100")
    report = artifact.report
    # each product's alternatives came from the schedule rules, cuBLAS among them, each measured
    kernels = report["search"]["schedule"]["forms"]["cuda"]["kernels"]
    products = [k for k in kernels.values() if k["term"].startswith("(Product")]
    assert len(products) == 3 and all(set(k["measured"]) == {"tile64", "tile128", "cublas"} for k in products)
    assert report["chosen"] == "cuda-searched" and report["product_tiles"] == tiles
    assert report["precision"]["library_products"] == f"{tiles['cublas']} on cuBLAS (cublasGemmStridedBatchedEx): float32 operands, float32 sums"
    launches = artifact.kernels[0]["launches"]
    assert sum("library" in launch for launch in launches) == tiles["cublas"]
    # the artifact runs as a GPU runtime loads it
    loaded = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, EmulatedDriver())
    graph = load_graph(data)
    inputs = sample_inputs(graph, seed=0, symbol_size=4)
    np.testing.assert_allclose(loaded.run(inputs)["output"], run_graph(graph, inputs)["output"], rtol=1e-4, atol=1e-5)


# ---- on a GPU (skipped without one) -------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "precision"),
    [
        ("torch_mlp", "exported"), ("torch_mlp", "tf32"), ("bert_dynamo", "exported"), ("bert_dynamo", "float16"),
        ("gpt2_dynamo", "bfloat16"), ("torch_cnn", "exported"), ("resnet_dynamo", "float16"),
    ],
)
def test_on_a_gpu_products_on_cublas_compute_what_the_reference_does(model: str, precision: str) -> None:
    driver = _gpu_driver()
    assert driver.has_cublas, "this GPU machine cannot load cuBLAS (pip install nvidia-cublas)"
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    graph = load_graph(data)
    program = _program(data)
    program = scheduled(program if precision == "exported" else _in_precision(program, precision), CUBLAS)
    rendered = render_cuda(program, CUBLAS)
    assert any(launch.library is not None for launch in rendered.launches)
    ptx, cubin = compile_cuda(rendered.source, driver.arch)
    loaded = CudaProgram(kernel_record(program, rendered, driver.arch, graph.size_limits), program.weights, {"program.ptx": ptx, "program.cubin": cubin}, driver)
    try:
        _matches_reference(loaded, graph, precision)
        assert all(seconds is None or seconds > 0 for seconds in loaded.profile(sample_inputs(graph, seed=3, int_high=1, symbol_size=2)))
    finally:
        loaded.close()


def _convolutions() -> bytes:
    """x -> 3x3 conv (padding 1), ReLU -> 1x1 conv (stride 1) + bias -> 1x1 conv of stride 2."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (12, 8, 3, 3)), ("w2", (6, 12, 1, 1)), ("b2", (6,)), ("w3", (4, 6, 1, 1)))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["h2"]),
        helper.make_node("Conv", ["h2", "w3"], ["y"], strides=[2, 2]),
    ]
    graph = helper.make_graph(
        nodes, "convolutions", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 3, 3])], weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("precision", ["exported", "float16"])
def test_a_1x1_convolution_of_stride_1_runs_on_cublas_reading_its_input_as_it_is(precision: str) -> None:
    data = _convolutions()
    graph = load_graph(data)
    program = _program(data)
    program = program if precision == "exported" else _in_precision(program, precision)
    rendered = render_cuda(program, CUBLAS)
    convolutions = [n for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    library = [launch for launch in rendered.launches if launch.library is not None]
    # all three on cuBLAS; the 3x3 (padded windows) and the strided 1x1 store their windows first,
    # the 1x1 of stride 1 reads the ReLU's output in place: per image, B = [12 channels, 30
    # pixels], a row of 30; C^T = op(B) W^T
    assert [launch.kernel_number for launch in library] == convolutions
    assert [launch.kernel_number for launch in rendered.launches if launch.kernel.endswith("_windows")] == convolutions[::2]
    assert library[1].buffers[0] == program.kernels[convolutions[0]].c
    arguments = library[1].library
    assert (arguments["m"], arguments["n"], arguments["k"], arguments["lda"], arguments["stride_a"]) == (30, 6, 12, 30, 360)
    assert (arguments["batch"], arguments["stride_b"], arguments["stride_c"]) == ("n", 0, 180)
    loaded = emulate(program, graph.size_limits, CUBLAS)
    for size, seed in ((1, 0), (3, 1)):
        inputs = sample_inputs(graph, seed=seed, symbol_size=size)
        got, want = loaded.run(inputs)["y"], run_graph(graph, inputs)["y"]
        if precision == "exported":
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"size={size}")
        else:
            _narrow_close(got, want, precision, f"size={size}")


_DRIVE = r"""
import ctypes, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
built = sys.argv[2]
from compiler.backends import cublas
# the stand-in, whatever cuBLAS this machine may have
library = ctypes.CDLL(f"{built}/libcublas.so.13")
library.cublasCreate_v2.restype = library.cublasGemmStridedBatchedEx_64.restype = ctypes.c_int
cublas._LOADED.append(library)
from compiler.backends.cuda import CudaProgram, gemm_arguments
from compiler.backends.cuda_driver import CudaDriver
from compiler.frontends.onnx import load_graph
from compiler.pipeline import sample_inputs
from tests.conftest import FIXTURES

# one product through the adapter on the stand-in's memory: what emulated_gemm computes from
# the same arguments (every one of the 23 crossed ctypes in its place)
driver = CudaDriver(0)
assert driver.has_cublas and library.fake_cublas_handles() == 1
rng = np.random.default_rng(0)
args = cublas.GemmArguments(cublas.OP_T, cublas.OP_N, 5, 7, 3, 4, 6, 9, 20, 0, 70, 2, "float32", "float32", "float32", "float32")
arrays = [rng.standard_normal(40).astype(np.float32), rng.standard_normal(42).astype(np.float32), np.full(140, 3.0, np.float32)]
addresses = [driver.alloc(x.nbytes) for x in arrays]
for address, x in zip(addresses, arrays):
    driver.upload(address, x)
driver.blas().gemm(args, *addresses)
got = np.empty_like(arrays[2])
driver.download(addresses[2], got)
want = arrays[2].copy()
cublas.emulated_gemm(args, arrays[0].ctypes.data, arrays[1].ctypes.data, want.ctypes.data)
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
for address in addresses:
    driver.free(address)
driver.close()
assert library.fake_cublas_handles() == 0
print("GEMM", float(np.abs(got - want).max()))

# a program with library launches on a fresh driver: loading it makes the handle, so its first
# call's stream capture holds its products
kernel = json.loads(open(f"{built}/kernel.json").read())
weights = dict(np.load(f"{built}/weights.npz"))
binaries = {name: open(f"{built}/{name}", "rb").read() for name in ("program.ptx", "program.cubin")}
driver = CudaDriver(0)
program = CudaProgram(kernel, weights, binaries, driver)
assert library.fake_cublas_handles() == 1
graph = load_graph((FIXTURES / "torch_mlp.onnx").read_bytes())
program.run(sample_inputs(graph, seed=0, symbol_size=3))
codes = {**cublas.DATA_TYPES}
for launch in kernel["launches"]:
    if "library" in launch:
        g = gemm_arguments(launch["library"], {"batch": 3})
        print("LIBRARY", f"cublas {g.transa} {g.transb} {g.m} {g.n} {g.k} 1 {codes[g.a_type]} {g.lda} {g.stride_a} {codes[g.b_type]} "
              f"{g.ldb} {g.stride_b} 0 {codes[g.c_type]} {g.ldc} {g.stride_c} {g.batch} {cublas.COMPUTE_TYPES[g.compute]} -1")
program.close()
driver.close()
"""


def test_the_cublas_adapter_calls_cublas_as_declared_and_before_any_capture(tmp_path) -> None:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for source, library in (("fake_libcuda.c", "libcuda.so.1"), ("fake_libcublas.c", "libcublas.so.13")):
        build = subprocess.run(
            [os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-O1", str(root / "tests" / source), "-o", str(tmp_path / library), "-ldl"],
            capture_output=True, text=True, check=False,
        )
        assert build.returncode == 0, build.stderr
    program = _program((FIXTURES / "torch_mlp.onnx").read_bytes())
    rendered = render_cuda(program, CUBLAS)
    ptx, cubin = compile_cuda(rendered.source, "sm_90")  # (NVRTC: not in a process with the stand-ins)
    (tmp_path / "kernel.json").write_text(json.dumps(kernel_record(program, rendered, "sm_90", {})))
    np.savez(tmp_path / "weights.npz", **program.weights)
    (tmp_path / "program.ptx").write_bytes(ptx)
    (tmp_path / "program.cubin").write_bytes(cubin)
    (tmp_path / "drive.py").write_text(_DRIVE)
    log = tmp_path / "launches.log"
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "FAKE_CUDA_LOG": str(log)}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "drive.py"), str(root), str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("GEMM ") for line in lines)
    # the graph's replay: each product's call as cuBLAS received it, between the epilogues' launches
    wanted = [line[8:] for line in lines if line.startswith("LIBRARY ")]
    replayed = [line for line in log.read_text().splitlines() if line.startswith("cublas ")]
    assert len(wanted) == 3 and replayed == wanted
