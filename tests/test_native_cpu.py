"""The native CPU backend: lowering to the kernel IR, C rendering, building, and running, checked
against the reference interpreter and onnxruntime; candidate selection and artifact reloading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from compiler import Artifact, compile_onnx, executable
from compiler.frontends.onnx import load_graph
from compiler.kernels.ir import Atom, Ix, Load
from compiler.kernels.ir_walk import kernel_reads, kernel_writes, linear
from compiler.kernels.lower import lower
from compiler.pipeline import sample_inputs
from compiler.reference import run_graph
from compiler.render.c import render
from tests.conftest import FIXTURES
from tests.onnx_models import mlp

MODELS = ["torch_mlp", "torch_cnn", "bert_dynamo", "gpt2_dynamo", "resnet_dynamo"]


def _inputs(graph, size: int, seed: int) -> dict[str, np.ndarray]:
    return sample_inputs(graph, seed=seed, int_high=1, symbol_size=size)


@pytest.mark.parametrize("candidate", ["native-blas", "native-mixed", "native-panels", "native-tiled", "native-loops"])
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
    # the hidden layer: the call, then bias add and relu (a max over {x, 0}, unrolled) in the one
    # loop nest that writes the next call's operand
    assert kinds[:2] == [("GemmCall", "sum_reduce"), ("LoopKernel", "view")]
    relu = program.kernels[1]
    assert kernel_reads(relu) == {program.kernels[0].c, *(b.id for b in program.buffers if b.role == "weight" and
                                                          b.shape == (16,))}
    # softmax: max, exp, sum and the normalizing multiply; the bias add and the reciprocal are
    # recomputed by their readers; no kernel per broadcast
    assert [op for _, op in kinds[3:]] == ["max_reduce", "exp2", "sum_reduce", "mul"]
    assert "LC_MAX(" in render(program).split("static void k1(")[1].split("static void k2(")[0]
    source = render(program)
    assert source.count("scipy_cblas_sgemm(101") == 2
    assert "int lc_run(const int64_t *S, void **B)" in source and "while (lc_next(&lc_t))" in source


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


def _single_node_model(
    op: str, inputs: list[tuple[str, int, list]], output_type: int, output_shape: list, **attributes
) -> bytes:
    from onnx import helper

    node = helper.make_node(op, [name for name, _, _ in inputs], ["y"], **attributes)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", output_type, output_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_float32_exp_is_vectorizable_arithmetic_within_two_ulp() -> None:
    from onnx import TensorProto

    artifact = compile_onnx(_single_node_model("Exp", [("x", TensorProto.FLOAT, ["n"])], TensorProto.FLOAT, ["n"]))
    assert "lc_exp2f(" in artifact.kernels[0]["source"].split("int lc_run")[0].split("static void k0")[1]
    program = executable(artifact)
    x = np.concatenate([
        np.linspace(-110, 89, 20001, dtype=np.float32),  # past both ends of float32's normal range
        np.array([0.0, -0.0, 1e-8, -1e-8, np.inf, -np.inf, np.nan, -200.0, 200.0], np.float32),
    ])
    got = program.run({"x": x})["y"]
    # exp is exp2(x * log2 e), the product rounded to float32 as the reference rounds it; the
    # exact exp2 of that product, in float64, is the yardstick (NumPy's own float32 exp2 is up to
    # 2.7 ulp off on AVX-512 machines)
    with np.errstate(over="ignore"):
        want = np.exp2((x * np.float32(1.4426950216293335)).astype(np.float64))
    finite = np.isfinite(want) & (want >= np.finfo(np.float32).tiny) & (want <= np.finfo(np.float32).max)
    ulp = np.spacing(want[finite].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got[finite] - want[finite]) / ulp) <= 2.0
    tiny = want < np.finfo(np.float32).tiny  # subnormal results: a run flushes them to zero
    assert tiny.sum() > 1000 and np.all(got[tiny] == 0.0)
    assert np.isnan(got[-3]) and got[-4] == 0.0 and np.isinf(got[-5]) and got[-2] == 0.0 and np.isinf(got[-1])
    assert np.all(got[~np.isfinite(want) & ~np.isnan(x)] >= 0)


def test_vectorized_max_reductions_propagate_nan() -> None:
    from onnx import TensorProto

    maximum = executable(compile_onnx(_single_node_model(
        "ReduceMax", [("x", TensorProto.FLOAT, ["n", 300])], TensorProto.FLOAT, ["n"], axes=[1], keepdims=0
    )))
    x = np.random.default_rng(0).standard_normal((4, 300)).astype(np.float32)
    x[1, 7] = np.nan
    x[2, 299] = np.nan
    got = maximum.run({"x": x})["y"]
    assert np.isnan(got[1]) and np.isnan(got[2])
    np.testing.assert_array_equal(got[[0, 3]], x[[0, 3]].max(axis=1))


def test_a_scalar_computed_from_constants_is_a_literal_not_a_buffer() -> None:
    from onnx import TensorProto, helper, numpy_helper

    # x * (1 / sqrt(32)): the attention scale, which once filled a [batch, heads, seq, seq] buffer
    nodes = [
        helper.make_node("Sqrt", ["d"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["scale"]),
        helper.make_node("Mul", ["x", "scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "scale", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [numpy_helper.from_array(np.array(32.0, np.float32), "d")],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = lower(load_graph(data))
    assert len(program.kernels) == 1 and not [b for b in program.buffers if b.role in ("weight", "temp")]
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_allclose(executable(compile_onnx(data)).run({"x": x})["y"], x / np.sqrt(32), rtol=1e-6)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_convolution_is_one_product_per_image_written_in_place(batch: int) -> None:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 5, 5])],
        [numpy_helper.from_array(weight, "w")],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = lower(load_graph(data))
    gemms = [k for k in program.kernels if type(k).__name__ == "GemmCall"]
    # [channel] x [y, x] per image: the weights are the left operand as stored and the product
    # lands in the output's NCHW layout, with no transpose kernel after it
    assert len(gemms) == 1 and (gemms[0].m, gemms[0].n, gemms[0].k) == (8, 25, 36) and not gemms[0].trans_a
    assert program.buffers[gemms[0].a].role == "weight"
    # the windows are never stored whole: the product fills a panel of them at a time
    assert gemms[0].b_panels is not None and program.buffers[gemms[0].b].role == "panel"
    assert not [k for k in program.kernels if kernel_writes(k) == gemms[0].b]
    (copy,) = [k for k in program.kernels if k is not gemms[0] and gemms[0].c in kernel_reads(k)]
    assert copy.value == Load(gemms[0].c, linear([Ix.var(f"o{j}") for j in range(4)], copy.shape))
    x = rng.standard_normal((batch, 4, 9, 9)).astype(np.float32)
    want = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(executable(compile_onnx(data)).run({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def test_where_is_a_select_in_one_loop_with_no_index_buffer() -> None:
    from onnx import TensorProto

    # Where spells cond ? x : y as a gather from the interleaved pair at 2*i + cond; that index is
    # affine in i, so it folds into the loop (no int64 index buffer, no division per element)
    data = _single_node_model(
        "Where", [("c", TensorProto.BOOL, ["b", "s", 6]), ("x", TensorProto.FLOAT, ["b", "s", 6]),
                  ("z", TensorProto.FLOAT, ["b", "s", 6])], TensorProto.FLOAT, ["b", "s", 6],
    )
    program = lower(load_graph(data))
    assert len(program.kernels) == 1 and not [b for b in program.buffers if b.role == "temp"]
    body = render(program).split("static void k0(")[1].split("int lc_run")[0]
    (store,) = [line for line in body.splitlines() if "] = " in line]  # the element's statement
    assert "lc_index" not in body and " / " not in store and " % " not in store
    rng = np.random.default_rng(0)
    feeds = {"c": rng.random((2, 3, 6)) < 0.5, "x": rng.standard_normal((2, 3, 6)).astype(np.float32),
             "z": rng.standard_normal((2, 3, 6)).astype(np.float32)}
    feeds["x"][0, 0, :3] = [np.nan, np.inf, -np.inf]
    got = executable(compile_onnx(data)).run(feeds)["y"]
    np.testing.assert_array_equal(got, np.where(feeds["c"], feeds["x"], feeds["z"]))


def test_a_flat_index_read_back_through_its_digits_is_not_divided() -> None:
    from compiler.kernels.ir import ix_floordiv, ix_mod
    from compiler.shape import parse_dim

    seq = parse_dim("seq")
    shape = (parse_dim("batch"), seq, 1536)
    flat = Ix.var("o0")
    extents = {"o0": parse_dim("1536*batch*seq")}
    digits = [ix_floordiv(flat, parse_dim("1536*seq"), extents),
              ix_mod(ix_floordiv(flat, 1536, extents), seq, extents), ix_mod(flat, 1536, extents)]
    assert linear(digits, shape) == flat
    # the inner two digits alone: the flat index modulo their product
    inner = linear([Ix.var("o1")] + digits[1:], shape)
    assert inner == Ix.var("o1").scale(parse_dim("1536*seq")) + ix_mod(flat, parse_dim("1536*seq"), extents)
    # the interleaving 2*i + flag, divided by a symbolic multiple of 2, loses the flag
    flag = Ix.var(Atom("flag", (Load(0, Ix()),)))
    pair = flat.scale(2) + flag
    assert ix_floordiv(pair, parse_dim("2*seq"), extents) == ix_floordiv(flat, seq, extents)
    assert ix_mod(pair, parse_dim("2*seq"), extents) == ix_mod(flat, seq, extents).scale(2) + flag
    assert ix_mod(pair, 2, extents) == flag


def _gemm_model(weight: np.ndarray, k: int, n: int, trans_a: int, trans_b: int) -> bytes:
    """y = x @ w through one ONNX Gemm, x [m, k] (or [k, m] with trans_a) for a symbolic m."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transA=trans_a, transB=trans_b)], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, "m"] if trans_a else ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _check_gemm(program, weight: np.ndarray, k: int, trans_a: int, trans_b: int, sizes, rng) -> None:
    for m in sizes:
        x = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
        a = x.T if trans_a else x
        b = weight.T if trans_b else weight
        want = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(program.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4, err_msg=f"m={m}")


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_the_generated_tiled_product_matches_numpy_at_ragged_sizes(trans_a: int, trans_b: int) -> None:
    # k = 300 crosses a 256-deep block; m and n leave partial register tiles and partial blocks
    rng = np.random.default_rng(0)
    k, n = 300, 1100
    weight = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    artifact = compile_onnx(_gemm_model(weight, k, n, trans_a, trans_b), candidates=("native-tiled",))
    assert artifact.report["chosen"] == "native-tiled", artifact.report["rejected"]
    source = artifact.kernels[0]["source"]
    # the weight is packed at compile time: the product reads its panels, the original is gone
    assert "lc_sgemm_pw(split_m" in source and "scipy_cblas_sgemm(101" not in source
    bound = [b["name"] for b in artifact.kernels[0]["layout"]["buffers"] if b["role"] == "weight"]
    assert len(bound) == 1 and ":panels" in bound[0], bound
    packed = artifact.program_weights[bound[0]]
    assert packed.size == k * -(-n // 48) * 48  # the padded last tile aside, no more than the weight
    _check_gemm(executable(artifact), weight, k, trans_a, trans_b, (1, 2, 13, 97, 200), rng)


def test_a_packed_weight_is_its_panels_block_by_block() -> None:
    from compiler.render.c_gemm import PANEL_DEPTH, PANEL_WIDTH, pack_weight

    # a full block of 256 rows and one of 44; a full panel, one of 4 columns, and one of padding
    # that makes the columns a whole register tile of the widest target (48)
    k, n = 300, 20
    b = np.arange(k * n, dtype=np.float32).reshape(k, n)
    packed = pack_weight(b)
    assert packed.shape == (k * 48,)
    first = packed[: PANEL_DEPTH * 48].reshape(3, PANEL_DEPTH, PANEL_WIDTH)  # block 0: three panels
    np.testing.assert_array_equal(first[0], b[:PANEL_DEPTH, :16])
    np.testing.assert_array_equal(first[1][:, :4], b[:PANEL_DEPTH, 16:])
    assert not first[1][:, 4:].any() and not first[2].any()
    second = packed[PANEL_DEPTH * 48 :].reshape(3, k - PANEL_DEPTH, PANEL_WIDTH)
    np.testing.assert_array_equal(second[0], b[PANEL_DEPTH:, :16])
    np.testing.assert_array_equal(second[1][:, :4], b[PANEL_DEPTH:, 16:])


def test_a_weight_read_elsewhere_too_keeps_its_rows_beside_its_panels() -> None:
    from onnx import TensorProto, helper, numpy_helper

    from compiler.render.c import prepack_weights

    # y = x @ w + w[i]: the product reads w packed, the gather reads a row of it as stored
    rng = np.random.default_rng(5)
    w = rng.standard_normal((40, 40)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["p"]),
            helper.make_node("Gather", ["w", "i"], ["row"], axis=0),
            helper.make_node("Add", ["p", "row"], ["y"]),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 40]), helper.make_tensor_value_info("i", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 40])],
        [numpy_helper.from_array(w, "w")],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    program = prepack_weights(lower(load_graph(data)))
    (name,) = (b.name for b in lower(load_graph(data)).buffers if b.role == "weight")
    assert sorted(program.weights) == [name, f"{name}:panels"]
    artifact = compile_onnx(data, candidates=("native-mixed",))
    assert artifact.report["chosen"] == "native-mixed", artifact.report["rejected"]
    x = rng.standard_normal((7, 40)).astype(np.float32)
    got = executable(artifact).run({"x": x, "i": np.array(3)})["y"]
    np.testing.assert_allclose(got, x @ w + w[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("n", [1, 700])
def test_matrix_vector_products_stream_the_matrix_through_gemv(n: int, trans_a: int, trans_b: int) -> None:
    rng = np.random.default_rng(1)
    k = 300
    weight = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    artifact = compile_onnx(_gemm_model(weight, k, n, trans_a, trans_b), candidates=("native-blas",))
    assert "scipy_cblas_sgemv(101" in artifact.kernels[0]["source"]
    # m = 1 is a product with the matrix w (split across threads from 1 MiB), n = 1 with x's rows
    _check_gemm(executable(artifact), weight, k, trans_a, trans_b, (1, 2, 1000), rng)


def test_one_token_per_sequence_times_a_weight_is_one_product_of_every_sequence() -> None:
    """A decoding step's [batch, 1, k] @ [k, n]: the axis of extent 1 is read by both operands (the
    weight as [1, k, n]), which must not make each sequence a matrix-vector product of its own,
    every one streaming the whole weight."""
    from onnx import TensorProto, helper, numpy_helper

    from compiler.kernels.ir import GemmCall

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((64, 96)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "decode-step",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 96])],
        [numpy_helper.from_array(weight, "w")],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    (call,) = [k for k in lower(load_graph(data)).kernels if isinstance(k, GemmCall)]
    assert call.batch == () and str(call.m) == "batch" and (call.n, call.k) == (96, 64)
    program = executable(compile_onnx(data, candidates=("native-blas",)))
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = rng.standard_normal((batch, 1, 64)).astype(np.float32)
        np.testing.assert_allclose(program.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_padded_windows_read_unchecked_between_their_edges_and_keep_nan() -> None:
    from onnx import TensorProto

    rng = np.random.default_rng(2)
    for h, w in ((1, 1), (2, 5), (9, 8), (33, 64)):
        pool = _single_node_model(
            "MaxPool", [("x", TensorProto.FLOAT, ["n", 3, h, w])], TensorProto.FLOAT, ["n", 3, (h + 1) // 2, (w + 1) // 2],
            kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
        )
        artifact = compile_onnx(pool, candidates=("native-blas",))
        source = artifact.kernels[0]["source"]
        # each output row by lc_pool_row (its input rows staged padded and split by phase), but for
        # a single output column, which reads better in place
        assert ("lc_pool_row(1, " in source) == ((w + 1) // 2 > 1), source
        program = executable(artifact)
        session = onnxruntime.InferenceSession(pool, providers=["CPUExecutionProvider"])
        x = rng.standard_normal((2, 3, h, w)).astype(np.float32)
        np.testing.assert_array_equal(program.run({"x": x})["y"], session.run(None, {"x": x})[0], err_msg=f"{h}x{w}")
        x[1, 2, h - 1, w - 1] = np.nan  # in the last window of the row and column
        got = program.run({"x": x})["y"]
        assert np.isnan(got[1, 2, -1, -1]) and np.isnan(got).sum() == 1, f"{h}x{w}"


@pytest.mark.parametrize(
    ("op", "h", "w", "attributes", "staged"),
    [
        ("MaxPool", 17, 23, {"kernel_shape": [3, 2], "strides": [1, 3], "pads": [1, 0, 1, 1]}, False),
        ("MaxPool", 20, 19, {"kernel_shape": [3, 3], "strides": [2, 2], "dilations": [2, 3], "pads": [2, 1, 1, 2]}, True),
        ("MaxPool", 14, 14, {"kernel_shape": [3, 3], "strides": [2, 2]}, True),
        ("MaxPool", 15, 16, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, True),
        ("MaxPool", 17, 23, {"kernel_shape": [3, 4], "strides": [1, 3], "pads": [1, 0, 1, 1]}, True),
        ("AveragePool", 13, 18, {"kernel_shape": [3, 3], "strides": [2, 1], "pads": [1, 1, 1, 1], "count_include_pad": 1}, True),
        ("AveragePool", 13, 18, {"kernel_shape": [3, 5], "strides": [2, 2], "pads": [1, 2, 1, 2]}, True),
        ("AveragePool", 9, 7, {"kernel_shape": [2, 3], "strides": [1, 2]}, True),
        ("AveragePool", 14, 14, {"kernel_shape": [7, 7]}, False),
        ("MaxPool", 7, 7, {"kernel_shape": [7, 7]}, False),
        ("GlobalAveragePool", 7, 7, {}, False),
    ],
)
def test_pooling_rows_equal_onnxruntime(op: str, h: int, w: int, attributes: dict, staged: bool) -> None:
    """Max and average pooling by lc_pool_row at strides, dilations, uneven padding and ceil mode:
    the staged phases of each input row must hand every tap the columns the window reads, and
    `fill` (the max's -inf, the sum's 0) where it reaches past the input. Windows read in place at
    stride 1 with no padding, a single output column, or windows that do not overlap along the row
    (a global pool's rows) keep the in-place form."""
    from onnx import TensorProto

    data = _single_node_model(op, [("x", TensorProto.FLOAT, ["n", 4, h, w])], TensorProto.FLOAT, ["n", 4, "oh", "ow"], **attributes)
    artifact = compile_onnx(data, candidates=("native-blas",))
    assert (f"lc_pool_row({int(op == 'MaxPool')}, " in artifact.kernels[0]["source"]) == staged
    program = executable(artifact)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((3, 4, h, w)).astype(np.float32)
    np.testing.assert_allclose(program.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("candidate", ["native-blas", "native-mixed", "native-tiled"])
def test_convolutions_multiply_their_windows_a_panel_at_a_time(candidate: str) -> None:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    # 2-D: a panel holds 12 of the 40 output rows (the last block partial); 1-D: the only n axis
    # is the one split, 18 blocks of the 20000 positions; rows narrower than CONV_MIN_WIDTH, so the
    # generated kinds keep panels too
    cases = [
        ((24, 16, 3, 3), [1, 1, 1, 1], [1, 1], ["n", 16, 40, 16], ["n", 24, 40, 16]),
        ((5, 8, 7), [3, 3], [1], ["n", 8, 20000], ["n", 5, 20000]),
        ((6, 3, 7, 7), [3, 3, 3, 3], [2, 2], ["n", 3, 45, 30], ["n", 6, 23, 15]),
    ]
    for weight_shape, pads, strides, x_shape, y_shape in cases:
        weight = rng.standard_normal(weight_shape).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], pads=pads, strides=strides)], "conv",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
            [numpy_helper.from_array(weight, "w")],
        )
        data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
        artifact = compile_onnx(data, candidates=(candidate,))
        assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
        source = artifact.kernels[0]["source"]
        assert "lc_scratch(" in source and "lc_conv_rows(g" not in source
        # the generated product reads the panel in place, unless the library does it all
        assert ("lc_sgemm_direct(rows_m" in source) == (candidate != "native-blas")
        program = executable(artifact)
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        for batch in (1, 3):
            x = rng.standard_normal((batch, *x_shape[1:])).astype(np.float32)
            want = session.run(None, {"x": x})[0]
            np.testing.assert_allclose(program.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4, err_msg=f"{x_shape} {batch}")


def _conv_model(weight: np.ndarray, x_shape: list, attributes: dict) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    spatial = []
    for d, size in enumerate(x_shape[2:]):
        rank = len(x_shape) - 2
        pads, step = attributes.get("pads", [0] * 2 * rank), attributes.get("strides", [1] * rank)[d]
        reach = attributes.get("dilations", [1] * rank)[d] * (weight.shape[2 + d] - 1) + 1
        spatial.append(size if isinstance(size, str) else (size + pads[d] + pads[d + rank] - reach) // step + 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attributes)], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x_shape[0], weight.shape[0], *spatial])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


# (weight shape, input shape, Conv attributes): output rows of at least CONV_MIN_WIDTH columns
WIDE_CONVOLUTIONS = [
    ((10, 5, 3, 3), ["n", 5, 24, 30], {"pads": [1, 1, 1, 1]}),  # m not a multiple of the tile
    ((8, 3, 7, 7), ["n", 3, 45, 50], {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # a stem: 4 phase planes
    ((6, 4, 3, 3), ["n", 4, 26, 28], {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    ((7, 4, 3, 3), ["n", 4, 21, 23], {"pads": [0, 1, 2, 0]}),  # asymmetric: begin y, x, end y, x
    ((6, 4, 5, 5), ["n", 8, 30, 27], {"group": 2}),  # no padding: no guards; groups are a batch axis
    ((4, 3, 5, 5), ["n", 3, 12, 60], {"pads": [2, 2, 2, 2], "strides": [1, 2]}),  # phases along x only
]


@pytest.mark.parametrize("case", range(len(WIDE_CONVOLUTIONS)))
def test_wide_convolutions_multiply_their_windows_in_place(case: int) -> None:
    from compiler.kernels.ir import GemmCall
    from compiler.kernels.windows import window_geometry

    weight_shape, x_shape, attributes = WIDE_CONVOLUTIONS[case]
    rng = np.random.default_rng(case)
    data = _conv_model(rng.standard_normal(weight_shape).astype(np.float32), x_shape, attributes)
    (call,) = [k for k in lower(load_graph(data)).kernels if isinstance(k, GemmCall)]
    geometry = window_geometry(call.b_panels)
    assert geometry is not None
    strides = attributes.get("strides", [1, 1])
    assert [a.step for a in geometry.axes] == strides and [a.kernel for a in geometry.axes] == list(weight_shape[2:])
    assert [a.pad for a in geometry.axes] == attributes.get("pads", [0, 0])[:2]
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for candidate in ("native-mixed", "native-tiled"):
        artifact = compile_onnx(data, candidates=(candidate,))
        assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
        assert "lc_conv_rows(g" in artifact.kernels[0]["source"]
        program = executable(artifact)
        for batch in (1, 3):
            x = rng.standard_normal((batch, *x_shape[1:])).astype(np.float32)
            x[0, 0, 0, 0] = np.nan  # reaches the outputs whose windows hold it, and only those
            want = session.run(None, {"x": x})[0]
            got = program.run({"x": x})["y"]
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{candidate} {batch}")


def test_windows_that_are_not_a_2d_convolution_are_left_to_panels() -> None:
    from compiler.kernels.ir import GemmCall
    from compiler.kernels.windows import window_geometry

    rng = np.random.default_rng(5)
    conv_1d = _conv_model(rng.standard_normal((4, 3, 5)).astype(np.float32), ["n", 3, 100], {"pads": [2, 2]})
    (call,) = [k for k in lower(load_graph(conv_1d)).kernels if isinstance(k, GemmCall)]
    assert call.b_panels is not None and window_geometry(call.b_panels) is None
    # symbolic image sizes: the copy of the input rows is sized when the program is rendered
    symbolic = _conv_model(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), ["n", 3, "h", "w"], {"pads": [1, 1, 1, 1]})
    (call,) = [k for k in lower(load_graph(symbolic)).kernels if isinstance(k, GemmCall)]
    assert call.b_panels is not None and window_geometry(call.b_panels) is None


def test_the_mixed_candidate_is_built_only_where_windows_or_weights_make_it_differ() -> None:
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(4).standard_normal((8, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 16, 16])],
        [numpy_helper.from_array(weight, "w")],
    )
    conv = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    wanted = ("native-blas", "native-mixed")
    measured = {c["name"] for c in compile_onnx(conv, candidates=wanted).report["candidates"]}
    assert measured == set(wanted)
    # a dense layer's weight is packed for the generated product: that is a program of its own
    dense = compile_onnx(mlp().SerializeToString(), candidates=wanted).report
    assert {c["name"] for c in dense["candidates"]} == set(wanted)
    # a product of two inputs, with no weight and no windows, is the library call in both
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])], "inputs",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [16, 16]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 16])],
    )
    inputs_only = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    report = compile_onnx(inputs_only, candidates=wanted).report
    assert {c["name"] for c in report["candidates"]} == {"native-blas"} and "native-mixed" not in report["rejected"]


def _attention_without_biases(hidden: int = 32, heads: int = 4) -> bytes:
    """Multi-head self-attention whose projections have no bias (as in LLaMA-style models), x [batch, seq, hidden]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    size = hidden // heads
    weights = [numpy_helper.from_array((rng.standard_normal((hidden, hidden)) / hidden**0.5).astype(np.float32), f"w{j}")
               for j in range(4)]
    shape = numpy_helper.from_array(np.array([0, -1, heads, size], np.int64), "heads")
    merged = numpy_helper.from_array(np.array([0, -1, hidden], np.int64), "merged")
    scale = numpy_helper.from_array(np.array(size**-0.5, np.float32), "scale")
    node = helper.make_node
    nodes = []
    for name, weight, perm in (("q", "w0", [0, 2, 1, 3]), ("k", "w1", [0, 2, 3, 1]), ("v", "w2", [0, 2, 1, 3])):
        nodes += [node("MatMul", ["x", weight], [f"{name}_flat"]), node("Reshape", [f"{name}_flat", "heads"], [f"{name}_split"]),
                  node("Transpose", [f"{name}_split"], [name], perm=perm)]
    nodes += [
        node("MatMul", ["q", "k"], ["scores"]), node("Mul", ["scores", "scale"], ["scaled"]),
        node("Softmax", ["scaled"], ["probs"], axis=-1), node("MatMul", ["probs", "v"], ["context"]),
        node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]), node("Reshape", ["context_t", "merged"], ["joined"]),
        node("MatMul", ["joined", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [*weights, shape, merged, scale],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("candidate", ["native-blas", "native-tiled"])
def test_attention_reads_its_heads_in_place_and_divides_after_the_second_product(candidate: str) -> None:
    data = _attention_without_biases()
    program = lower(load_graph(data))
    products = [k for k in program.kernels if type(k).__name__ == "GemmCall"]
    scores, context = products[3], products[4]
    # q, k and v are read as rows of the projections' [tokens, hidden] outputs, not transposed first
    assert (scores.lda, scores.ldb, scores.trans_b, context.ldb) == (32, 32, True, 32)
    assert scores.a == products[0].c and scores.b == products[1].c and context.b == products[2].c
    # the softmax's exponentials go to the product as they are; its division scales the product's rows
    exps = next(k for k in program.kernels if kernel_writes(k) == context.a)
    assert type(exps).__name__ == "LoopKernel" and exps.reduce is None
    scaled = program.kernels[program.kernels.index(context) + 1]
    assert kernel_writes(scaled) == context.c and context.c in kernel_reads(scaled)
    artifact = compile_onnx(data, candidates=(candidate,))
    assert artifact.report["chosen"] == candidate, artifact.report["rejected"]
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    run = executable(artifact)
    rng = np.random.default_rng(1)
    for batch, seq in ((1, 5), (3, 17)):
        x = rng.standard_normal((batch, seq, 32)).astype(np.float32)
        np.testing.assert_allclose(run.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)


def _threaded_program():
    """The CNN fixture as native C whose convolutions' tasks are shared among the threads, with
    inputs at a batch large enough that every product and loop nest runs in parallel."""
    from compiler.backends import native_cpu
    from compiler.kernels.fusion import fuse

    data = (FIXTURES / "torch_cnn.onnx").read_bytes()
    graph = load_graph(data)
    program = fuse(lower(graph))
    library = native_cpu.build(render(program, gemm="mixed"))
    make = lambda: native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library)
    return graph, make


def test_two_callers_of_one_library_each_get_their_own_outputs() -> None:
    # two programs loaded from the same library share its threads and their job board: lc_run
    # takes them one call at a time
    import threading

    graph, make = _threaded_program()
    inputs = [_inputs(graph, 48, seed) for seed in (0, 1)]
    want = [run_graph(graph, x) for x in inputs]
    programs = [make(), make()]
    errors: list[str] = []

    def call(which: int) -> None:
        for _ in range(15):
            got = programs[which].run(inputs[which])
            for name, value in want[which].items():
                if not np.allclose(got[name], value, rtol=1e-4, atol=1e-5):
                    errors.append(f"caller {which}: {name} differs")

    threads = [threading.Thread(target=call, args=(which,)) for which in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_forked_child_runs_a_program_its_parent_had_loaded() -> None:
    # the child has none of the parent's worker threads: its calls must neither wait for them nor
    # find the run lock held
    import multiprocessing

    graph, make = _threaded_program()
    program = make()
    inputs = _inputs(graph, 48, 0)
    want = run_graph(graph, inputs)
    program.run(inputs)  # the parent's workers exist now
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe()

    def child() -> None:
        child_end.send(program.run(inputs))

    process = context.Process(target=child)
    process.start()
    assert parent_end.poll(60), "the forked child did not answer within 60 s"
    got = parent_end.recv()
    process.join(10)
    assert process.exitcode == 0
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5)


def test_a_busy_run_raises_the_work_that_wakes_a_worker_and_an_idle_one_lowers_it() -> None:
    from compiler.render.c import WAKE_MIN_WORK

    graph, make = _threaded_program()
    program = make()
    set_in_library = []
    wake = program._set_wake_work
    program._set_wake_work = lambda work: (set_in_library.append(work), wake(work))
    for batch, busy in ((2, True), (48, True), (2, False), (48, False), (2, True)):
        inputs = _inputs(graph, batch, batch)
        for name, value in run_graph(graph, inputs).items():
            np.testing.assert_allclose(program.run(inputs, busy=busy)[name], value, rtol=1e-4, atol=1e-5)
    # set only when it changes: a run costs no extra call into the library
    assert set_in_library == [WAKE_MIN_WORK, 0, WAKE_MIN_WORK]


def test_weights_are_bound_at_a_vector_boundary() -> None:
    from compiler.backends.native_cpu import ALIGNMENT, _aligned

    raw = np.arange(40, dtype=np.float32)
    start = 1 if (raw.ctypes.data + 4) % ALIGNMENT else 2
    offset = raw[start : start + 32].reshape(4, 8)
    assert offset.ctypes.data % ALIGNMENT
    aligned = _aligned(offset)
    assert aligned.ctypes.data % ALIGNMENT == 0
    np.testing.assert_array_equal(aligned, offset)


def test_a_packed_weight_that_ends_at_a_page_boundary_is_read_only_within_it() -> None:
    # the last register tile of a product by a packed weight once read panels past the weight's
    # end: a server crashed when the copy that aligned the weight ended a mapping
    import mmap

    from compiler.backends import native_cpu
    from compiler.kernels.fusion import fuse
    from compiler.render.c import prepack_weights

    rng = np.random.default_rng(3)
    k, n = 64, 4096 + 16  # the last tile of 48 columns holds one panel of 16
    from onnx import TensorProto, helper, numpy_helper

    w = rng.standard_normal((k, n)).astype(np.float32)
    graph_proto = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", n])],
        [numpy_helper.from_array(w, "w")],
    )
    data = helper.make_model(graph_proto, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    graph = load_graph(data)
    program = prepack_weights(fuse(lower(graph)))
    (packed_name,) = [name for name in program.weights if ":panels" in name]
    packed = np.asarray(program.weights[packed_name], np.float32)
    # the packed weight at the very end of readable pages, an unreadable page after it
    import ctypes

    page = mmap.PAGESIZE
    size = -(-packed.nbytes // page) * page
    region = mmap.mmap(-1, size + page)
    guard = np.frombuffer(region, np.uint8)
    libc = ctypes.CDLL(None)
    assert libc.mprotect(ctypes.c_void_p(guard.ctypes.data + size), page, 0) == 0  # PROT_NONE
    at_end = guard[size - packed.nbytes : size].view(np.float32)
    at_end[:] = packed
    weights = dict(program.weights, **{packed_name: at_end})
    library = native_cpu.build(render(program, gemm="mixed"))
    runner = native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), weights, library)
    inputs = [rng.standard_normal((rows, k)).astype(np.float32) for rows in (1, 7, 64)]

    def check() -> None:  # in a child: a read past the weight is a segfault
        ok = all(np.allclose(runner.run({"x": x})["y"], x @ w, rtol=1e-4, atol=1e-4) for x in inputs)
        os._exit(0 if ok else 1)

    import multiprocessing
    import os

    child = multiprocessing.get_context("fork").Process(target=check)
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the product exited with {child.exitcode} (a negative number is a signal)"


def test_a_run_flushes_denormals_and_gives_the_caller_its_floating_point_mode_back() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "three"], ["y"])],
        "triple",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [helper.make_tensor("three", TensorProto.FLOAT, [], [3.0])],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    artifact = compile_onnx(data, candidates=("native-loops",))
    assert artifact.report["chosen"] == "native-loops", artifact.report["rejected"]
    tiny = np.float32(1e-40)  # a subnormal: inside a run it reads as zero (an FMA on it costs Intel an assist)
    got = executable(artifact).run({"x": np.array([tiny, 1.0, -2.0, 0.5], np.float32)})["y"]
    np.testing.assert_array_equal(got, np.array([0.0, 3.0, -6.0, 1.5], np.float32))
    # the calling thread computes with subnormals again once the run is over
    assert 0 < tiny * np.float32(3.0) < np.finfo(np.float32).tiny
