"""The native CPU backend: lowering to the kernel IR, C rendering, building, and running, checked
against the reference interpreter and onnxruntime; candidate selection and artifact reloading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from compiler import Artifact, compile_onnx, executable
from compiler.frontends.onnx import load_graph
from compiler.kernels.lower import kernel_reads, lower
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.c import render
from tests.conftest import FIXTURES
from tests.onnx_models import mlp

MODELS = ["torch_mlp", "torch_cnn", "bert_dynamo", "gpt2_dynamo", "resnet_dynamo"]


def _inputs(graph, size: int, seed: int) -> dict[str, np.ndarray]:
    return sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)


@pytest.mark.parametrize("candidate", ["native-blas", "native-loops"])
@pytest.mark.parametrize("model", MODELS)
def test_generated_c_matches_the_reference_at_several_sizes(model: str, candidate: str) -> None:
    data = (FIXTURES / f"{model}.onnx").read_bytes()
    artifact = compile_onnx(data, candidates=(candidate,))
    assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
    program = executable(artifact)
    graph = load_graph(data)
    for size, seed in ((1, 0), (5, 1)):
        inputs = _inputs(graph, size, seed)
        want = run_graph(graph, inputs)
        got = program.run(inputs)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"{name} size={size}")


def test_gemm_then_bias_and_relu_is_one_library_call_and_one_loop() -> None:
    graph = load_graph(mlp().SerializeToString())  # Gemm, Relu, Gemm, Softmax
    program = lower(graph)
    kinds = [(type(k).__name__, graph.nodes[k.node].op.value) for k in program.kernels]
    # the hidden layer: the call, then bias add and relu in one loop nest (a max over {x, 0})
    assert kinds[:2] == [("GemmCall", "sum_reduce"), ("LoopKernel", "max_reduce")]
    relu = program.kernels[1]
    assert kernel_reads(relu) == {program.kernels[0].c, *(b.id for b in program.buffers if b.role == "weight" and
                                                          b.shape == (16,))}
    # softmax: max, exp, sum, reciprocal and the normalizing multiply; no kernel per broadcast
    assert [op for _, op in kinds[3:]] == ["add", "max_reduce", "exp2", "sum_reduce", "recip", "mul"]
    source = render(program)
    assert source.count("scipy_cblas_sgemm(101") == 2
    assert "int lc_run(const int64_t *S, void **B)" in source and "#pragma omp parallel for" in source


def test_matches_onnxruntime_on_a_transformers_encoder() -> None:
    path = Path(FIXTURES) / "hf" / "bert_dynamo.onnx"
    data = path.read_bytes()
    program = executable(compile_onnx(data, candidates=("native-blas",)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), np.int64)
    mask[1, 6:] = 0
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = {"input_ids": ids, "attention_mask": mask}
    feeds = {n: feeds[n] for n in names if n in feeds}
    want = session.run(None, feeds)[0]
    got = program.run(feeds)[session.get_outputs()[0].name]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_candidates_are_verified_timed_and_the_fastest_kept() -> None:
    artifact = compile_onnx((FIXTURES / "torch_mlp.onnx").read_bytes(), candidates=("native-blas", "numpy"))
    report = artifact.report
    names = [c["name"] for c in report["candidates"]]
    assert "native-blas" in names and "numpy" in names
    fastest = min(report["candidates"], key=lambda c: c["median_ms"])
    assert report["chosen"] == fastest["name"]
    assert all(c["max_abs_error"] < 1e-4 for c in report["candidates"])


def test_a_program_built_for_another_cpu_is_rebuilt_from_its_source() -> None:
    data = (FIXTURES / "torch_mlp.onnx").read_bytes()
    artifact = compile_onnx(data, candidates=("native-blas",))
    files = artifact.to_files()
    loaded = Artifact.from_files(files.__getitem__)
    loaded.kernels[0]["fingerprint"] = "another-cpu"
    loaded.binaries["program.so"] = b"not a shared object"
    x = np.random.default_rng(0).standard_normal((4, 20)).astype(np.float32)
    np.testing.assert_allclose(
        executable(loaded).run({"input": x})["output"], executable(artifact).run({"input": x})["output"], rtol=1e-6
    )


def test_float16_graphs_stay_on_the_numpy_lowering_and_say_why() -> None:
    artifact = compile_onnx((FIXTURES / "attention_fp16_dynamo.onnx").read_bytes(), candidates=("native-blas",))
    assert artifact.report["chosen"] == "numpy"
    assert "float16" in artifact.report["rejected"]["native"]
