"""Weight-only int8 (precision="int8"): the products' weights stored as int8 with a float32 scale
per output channel, widened inside the product kernels; its error against the float model
measured at compile time, reported, and refused past its tolerance."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

from compiler import compile_onnx, executable
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx import load_graph
from compiler.ir import Op
from compiler.kernels.epilogue import fuse_epilogues
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import GemmCall, LoopKernel
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.quantize import MIN_QUANTIZED_ELEMENTS, quantize_weights
from compiler.reference import run_graph
from compiler.targets import INT8_TOLERANCE
from compiler.verify import VerificationFailed
from tests.conftest import auth, upload, wait_for
from tests.onnx_models import init, make_model, tensor


def _mlp() -> bytes:
    """[n, 64] @ W1 [64, 96] -> Relu -> Gemm with W2 [48, 96] transposed, plus a bias of 48."""
    rng = np.random.default_rng(0)
    inits = [
        init("w1", (rng.standard_normal((64, 96)) * 0.2).astype(np.float32)),
        init("w2", (rng.standard_normal((48, 96)) * 0.2).astype(np.float32)),
        init("bias", rng.standard_normal(48).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "w2", "bias"], ["y"], transB=1),
    ]
    return make_model(nodes, [tensor("x", ["n", 64])], [tensor("y", ["n", 48])], inits).SerializeToString()


def _shared_table() -> bytes:
    """One table E [100, 64] that ids gather rows of and a product multiplies by."""
    rng = np.random.default_rng(1)
    table = init("embedding", (rng.standard_normal((100, 64)) * 0.2).astype(np.float32))
    nodes = [
        helper.make_node("Gather", ["embedding", "ids"], ["rows"]),
        helper.make_node("MatMul", ["x", "embedding"], ["y"]),
    ]
    return make_model(
        nodes,
        [tensor("ids", ["n"], TensorProto.INT64), tensor("x", ["n", 100])],
        [tensor("rows", ["n", 64]), tensor("y", ["n", 64])],
        [table],
    ).SerializeToString()


def _onnxruntime(data: bytes, inputs: dict) -> np.ndarray:
    return onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, inputs)[0]


def _relative(want: np.ndarray, got: np.ndarray) -> float:
    return float(np.max(np.abs(want - got)) / max(float(np.max(np.abs(want))), 1.0))


def test_a_products_weights_become_int8_with_one_scale_per_output_channel():
    graph = load_graph(_mlp())
    quantized, report = quantize_weights(graph)
    assert report["weights"] == 2 and report["kept_float"] == {}
    assert report["bytes_after"] < report["bytes_before"] / 3.5  # a byte a weight, plus the scales
    stored = {n.arg: quantized.weights[n.arg] for n in quantized.nodes if n.op is Op.CONSTANT}
    int8 = {k: v for k, v in stored.items() if v.dtype == np.int8}
    assert sorted(v.shape for v in int8.values()) == [(48, 96), (64, 96)]
    scales = sorted(v.shape for k, v in stored.items() if k.endswith(":q8scale"))
    # W1 [64, 96] is summed over its rows (a scale per column), W2 [48, 96] (transposed) over its columns
    assert scales == [(1, 96), (48, 1)]
    # the bias is below MIN_QUANTIZED_ELEMENTS and stays float32; no float copy of a quantized weight remains
    assert 48 < MIN_QUANTIZED_ELEMENTS
    assert sorted(v.size for v in stored.values() if v.dtype == np.float32) == [48, 48, 96]
    for key, values in int8.items():
        scale = stored[key.replace(":q8", ":q8scale")]
        original = graph.weights[key.removesuffix(":q8")]
        assert np.max(np.abs(values.astype(np.float32) * scale - original)) <= np.max(scale) / 2 + 1e-7
        assert np.max(np.abs(values)) == 127  # each channel's largest weight spans the range
    inputs = sample_inputs(graph, symbol_size=5)
    error = _relative(run_graph(graph, inputs)["y"], run_graph(quantized, inputs)["y"])
    assert 0 < error < 2e-2


def test_a_gathered_table_is_scaled_per_row_and_its_rows_widened_as_they_are_gathered():
    rng = np.random.default_rng(4)
    table = init("embedding", rng.standard_normal((1000, 64)).astype(np.float32))
    data = make_model(
        [helper.make_node("Gather", ["embedding", "ids"], ["y"])],
        [tensor("ids", ["n"], TensorProto.INT64)], [tensor("y", ["n", 64])], [table],
    ).SerializeToString()
    graph = load_graph(data)
    quantized, report = quantize_weights(graph)
    assert report["weights"] == 1
    assert [v.shape for k, v in quantized.weights.items() if k.endswith(":q8scale")] == [(1000, 1)]
    program = lower(quantized)
    # one loop gathers and widens the rows it reads; nothing computes the whole float table
    assert [program.buffers[k.out].shape for k in program.kernels] == [(program.buffers[0].shape[0], 64)]
    ids = {"ids": np.array([3, 999, 0, 3])}
    assert 0 < _relative(run_graph(graph, ids)["y"], run_graph(quantized, ids)["y"]) < 1e-2


def test_a_table_gathered_by_rows_and_multiplied_summing_its_rows_stays_float():
    graph = load_graph(_shared_table())
    quantized, report = quantize_weights(graph)
    assert report["weights"] == 0 and quantized is graph
    assert report["kept_float"] == {
        next(iter(graph.weights)): "its readers need scales along different axes (products summing different axes, or a gather)"
    }


def test_the_lowering_widens_int8_weights_inside_the_product_and_every_form_computes_the_quantized_model():
    from compiler.backends import native_cpu
    from compiler.render.c import render

    quantized, _ = quantize_weights(load_graph(_mlp()))
    program = fuse_epilogues(fuse(lower(quantized)))
    calls = [(n, k) for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
    assert len(calls) == 2
    for _, call in calls:
        # B is computed a block of columns at a time from the int8 weight (never stored as floats), and
        # the product also has a loop form that reads the int8 weight in place
        assert call.b_panels is not None and program.buffers[call.b].role == "panel"
        assert call.loops is not None
    weights = [b for b in program.buffers if b.role == "weight"]
    assert {b.dtype for b in weights if b.shape in ((64, 96), (48, 96))} == {"int8"}
    assert not any(
        isinstance(k, LoopKernel) and program.buffers[k.out].shape in ((64, 96), (48, 96)) for k in program.kernels
    )
    for batch in (1, 3, 6):  # (loops-columns: one-row tiles; a four-row tile and two one-row ones)
        inputs = sample_inputs(quantized, seed=batch, symbol_size=batch)
        want = run_graph(quantized, inputs)["y"]
        for kind in ("blas", "panels", "loops", "loops-columns", "dequantized"):
            gemm = {n: kind for n, _ in calls}
            library = native_cpu.build(render(program, gemm=gemm))
            got = native_cpu.NativeProgram(
                native_cpu.describe(program, quantized.size_limits), program.weights, library
            ).run(inputs)["y"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{kind}, batch {batch}")


def test_the_dequantized_form_widens_strips_of_an_int8_weight_for_every_row_and_computes_the_quantized_model():
    """x [rows, 300] @ W [300, 100]: two blocks of LC_KC rows, a last strip of columns that is part
    of one, and rows that fill register tiles, are left over one at a time, or both."""
    from compiler.backends import native_cpu
    from compiler.kernels.schedule import KernelSchedule
    from compiler.render.c import render, widens_integer_panels
    from compiler.search.cpu_schedules import kernel_terms
    from compiler.search.schedule import schedule_space

    weight = init("w", (np.random.default_rng(5).standard_normal((300, 100)) * 0.1).astype(np.float32))
    data = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor("x", ["n", 300])], [tensor("y", ["n", 100])], [weight]
    ).SerializeToString()
    quantized, _ = quantize_weights(load_graph(data))
    programs = {name: fuse_epilogues(fuse(lower(graph))) for name, graph in (("float", load_graph(data)), ("int8", quantized))}
    offered = {}
    for name, program in programs.items():
        ((number, call),) = [(n, k) for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)]
        space = schedule_space(kernel_terms(program), None, target="cpu")
        offered[name] = (widens_integer_panels(program, call), KernelSchedule("dequantized-tiles") in space.alternatives[number])
    assert offered == {"float": (False, False), "int8": (True, True)}
    with pytest.raises(ValueError, match="cannot run as 'dequantized'"):
        render(programs["float"], gemm={number: "dequantized"})
    program = programs["int8"]
    library = native_cpu.build(render(program, gemm={number: "dequantized"}))
    runner = native_cpu.NativeProgram(native_cpu.describe(program, quantized.size_limits), program.weights, library)
    for batch in (1, 4, 5, 19):
        inputs = sample_inputs(quantized, seed=batch, symbol_size=batch)
        want = run_graph(quantized, inputs)["y"]
        np.testing.assert_allclose(runner.run(inputs)["y"], want, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")


def test_an_int8_compile_serves_within_its_tolerance_of_onnxruntime_and_reports_its_error():
    data = _mlp()
    exported = compile_onnx(data, "cpu")
    artifact = compile_onnx(data, "cpu", precision="int8")
    precision = artifact.report["precision"]
    assert precision["chosen"] == "int8" and precision["tolerance"] == INT8_TOLERANCE
    assert precision["quantized_weights"] == 2
    assert 0 < precision["error_vs_float"] <= INT8_TOLERANCE
    assert artifact.report["weights_bytes"] < exported.report["weights_bytes"] / 3
    program = executable(artifact)
    for batch in (1, 7):
        inputs = {"x": np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)}
        want = _onnxruntime(data, inputs)
        error = _relative(want, program.run(inputs)["y"])
        assert 0 < error <= INT8_TOLERANCE, error


def test_int8_refuses_a_model_with_no_product_weight_and_names_why():
    data = make_model(
        [helper.make_node("Add", ["x", "b"], ["y"])], [tensor("x", ["n", 8])], [tensor("y", ["n", 8])],
        [init("b", np.ones(8, np.float32))],
    ).SerializeToString()
    with pytest.raises(UnsupportedModel, match="precision 'int8': no weight to quantize"):
        compile_onnx(data, "cpu", precision="int8")


def test_int8_past_its_tolerance_fails_the_compile_with_the_error(monkeypatch):
    import compiler.pipeline

    monkeypatch.setattr(compiler.pipeline, "INT8_TOLERANCE", 1e-9)
    with pytest.raises(VerificationFailed, match=r"int8 weights change the outputs by [0-9.e-]+ .* compile with precision 'exported'"):
        compile_onnx(_mlp(), "cpu", precision="int8")


def test_an_int8_upload_on_the_cpu_compiles_serves_and_shows_its_error(client, keys):
    data = _mlp()
    created = upload(client, keys["alice"], "q8", data, precision="int8")
    assert (created["target"], created["precision"]) == ("cpu", "int8")
    version = wait_for(client, keys["alice"], "q8", 1, timeout=120)
    assert version["status"] == "ready", version
    assert version["precision"] == "int8"
    assert 0 < version["report"]["precision"]["error_vs_float"] <= INT8_TOLERANCE
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    response = client.post("/v1/models/q8/infer", headers=auth(keys["alice"]), json={"inputs": {"x": x.tolist()}})
    assert response.status_code == 200, response.text
    got = np.asarray(response.json()["outputs"]["y"], np.float32)
    assert 0 < _relative(_onnxruntime(data, {"x": x}), got) <= INT8_TOLERANCE


def test_two_programs_of_one_model_hold_one_copy_of_each_weight_they_share():
    """A decoder's prompt and step programs are two artifacts of one graph: loaded in one
    process, their weights (named by content) are held once."""
    data = _mlp()
    first, second = executable(compile_onnx(data, "cpu", precision="int8")), executable(
        compile_onnx(data, "cpu", precision="int8", search=False)
    )
    held = lambda program: {id(w): w for w in program._weights}
    shared = set(held(first)) & set(held(second))
    # both int8 weights are held once (the scales and the bias too)
    assert sum(held(first)[i].dtype == np.int8 for i in shared) == 2
    x = {"x": np.ones((2, 64), np.float32)}
    np.testing.assert_allclose(first.run(x)["y"], second.run(x)["y"], rtol=1e-4, atol=1e-4)


def test_an_int8_compile_for_a_gpu_type_widens_the_weights_in_its_cuda_program():
    """Without the GPU here, the CUDA program runs on the CPU emulation, every kernel in its first
    schedule: verified against the quantized graph, its error against the float graph reported."""
    artifact = compile_onnx(_mlp(), "h100", precision="int8")
    assert artifact.report["precision"]["chosen"] == "int8"
    assert 0 < artifact.report["precision"]["error_vs_float"] <= INT8_TOLERANCE
    assert artifact.report["verify_max_abs_error"] < 1e-4  # the program against the quantized graph
    source = "".join(k.get("source", "") for k in artifact.kernels if isinstance(k, dict))
    assert "signed char" in source or "int8_t" in source  # the CUDA C reads the int8 weights


def test_a_weight_holding_inf_or_nan_stays_float_and_says_why():
    graph = load_graph(_mlp())
    key = next(k for k, v in graph.weights.items() if v.shape == (64, 96))
    graph.weights[key] = graph.weights[key].copy()
    graph.weights[key][3, 5] = np.inf
    quantized, report = quantize_weights(graph)
    assert report["weights"] == 1
    assert report["kept_float"] == {key: "it holds values that are not finite (inf or NaN), which no scale represents"}
    assert quantized.weights[key].dtype == np.float32
