"""The SDK's native graph API (luminal_cloud.graph): models built with it run in onnxruntime and
through our compiler at several sizes and match NumPy references written here independently;
every shape mistake raises GraphError at the call that makes it; Client.deploy uploads a Graph."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import httpx
import numpy as np
import onnx
import onnxruntime
import pytest

from api.server import BackgroundServer
from compiler import compile_onnx, executable
from luminal_cloud import Client, GraphError
from luminal_cloud.graph import OPSET, Graph, Tensor, attention, concat, embedding, where

Arrays = dict[str, np.ndarray]


@dataclass
class Case:
    graph: Graph
    # the expected outputs for some inputs, computed with NumPy alone
    reference: Callable[[Arrays], Arrays]
    # inputs at two sizes of the symbolic dims
    feeds: list[Arrays]

    @property
    def model(self) -> bytes:
        return self.graph.to_onnx()


# ---- NumPy references ---------------------------------------------------------------------------


def np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + eps) * weight + bias


def np_conv2d(x, weight, bias, stride=1, padding=0, dilation=1, groups=1) -> np.ndarray:
    batch, _, height, width = x.shape
    out_channels, per_group, kh, kw = weight.shape
    x = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    out_h = (height + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    out_w = (width + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((batch, out_channels, out_h, out_w), np.float64)
    per_out_group = out_channels // groups
    for o in range(out_channels):
        first = (o // per_out_group) * per_group
        for i in range(out_h):
            for j in range(out_w):
                rows = i * stride + dilation * np.arange(kh)
                cols = j * stride + dilation * np.arange(kw)
                window = x[:, first : first + per_group][:, :, rows][:, :, :, cols]
                out[:, o, i, j] = (window * weight[o]).sum((1, 2, 3))
    return out + (bias[None, :, None, None] if bias is not None else 0)


def np_pool(x: np.ndarray, kernel: int, stride: int, reduce: Callable) -> np.ndarray:
    batch, channels, height, width = x.shape
    out_h, out_w = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    out = np.zeros((batch, channels, out_h, out_w), x.dtype)
    for i in range(out_h):
        for j in range(out_w):
            window = x[:, :, i * stride : i * stride + kernel, j * stride : j * stride + kernel]
            out[:, :, i, j] = reduce(window, axis=(2, 3))
    return out


def np_attention(q, k, v, causal: bool) -> np.ndarray:
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    return np_softmax(scores) @ v


# ---- models built with the graph API ------------------------------------------------------------


def weights(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)


@cache
def mlp_case() -> Case:
    rng = np.random.default_rng(0)
    w1, b1, w2, b2 = weights(rng, 32, 64), weights(rng, 64), weights(rng, 64, 10), weights(rng, 10)
    g = Graph()
    x = g.input("x", ("batch", 32))
    hidden = (x @ g.constant(w1, name="w1") + g.constant(b1, name="b1")).relu()
    g.output("probs", hidden.linear(w2, b2).softmax(-1))

    def reference(feeds: Arrays) -> Arrays:
        return {"probs": np_softmax(np.maximum(feeds["x"] @ w1 + b1, 0) @ w2 + b2)}

    feeds = [{"x": rng.standard_normal((n, 32)).astype(np.float32)} for n in (1, 7)]
    return Case(g, reference, feeds)


@cache
def cnn_case() -> Case:
    rng = np.random.default_rng(1)
    c1, c1b = weights(rng, 8, 3, 3, 3), weights(rng, 8)
    c2, c2b = weights(rng, 16, 4, 3, 3), weights(rng, 16)
    c3 = weights(rng, 4, 8, 2, 2)
    fc, fcb = weights(rng, 16 * 2 * 2, 5), weights(rng, 5)
    g = Graph()
    x = g.input("image", ("batch", 3, 12, 12))
    h = x.conv2d(c1, c1b, padding=1).relu().max_pool2d(2)  # (batch, 8, 6, 6)
    dilated = h.conv2d(c3, dilation=2)  # (batch, 4, 4, 4)
    h = h.conv2d(c2, c2b, stride=2, groups=2).relu()  # (batch, 16, 2, 2)
    pooled = h.global_avg_pool().flatten()
    assert pooled.shape == ("batch", 16) and dilated.shape == ("batch", 4, 4, 4)
    g.output("logits", h.flatten().linear(fc, fcb))
    g.output("pooled", pooled)
    g.output("dilated", dilated.avg_pool2d(2, stride=1, padding=1))

    def reference(feeds: Arrays) -> Arrays:
        h = np_pool(np.maximum(np_conv2d(feeds["image"], c1, c1b, padding=1), 0), 2, 2, np.max)
        dilated = np_conv2d(h, c3, None, dilation=2)
        padded = np.pad(dilated, ((0, 0), (0, 0), (1, 1), (1, 1)))
        # padding is left out of each average: divide the padded sums by the real elements counted
        counted = np_pool(np.pad(np.ones_like(dilated), ((0, 0), (0, 0), (1, 1), (1, 1))), 2, 1, np.sum)
        h = np.maximum(np_conv2d(h, c2, c2b, stride=2, groups=2), 0)
        return {
            "logits": h.reshape(len(h), -1) @ fc + fcb,
            "pooled": h.mean((2, 3)),
            "dilated": np_pool(padded, 2, 1, np.sum) / counted,
        }

    feeds = [{"image": rng.standard_normal((n, 3, 12, 12)).astype(np.float32)} for n in (1, 3)]
    return Case(g, reference, feeds)


WIDTH, HEADS, VOCAB = 32, 4, 50


@cache
def transformer_case() -> Case:
    """Token embedding, then a pre-norm block: x + attention(ln(x)), h + mlp(ln(h))."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((VOCAB, WIDTH)).astype(np.float32)
    ln1, ln1b, ln2, ln2b = (
        1 + weights(rng, WIDTH),
        weights(rng, WIDTH),
        1 + weights(rng, WIDTH),
        weights(rng, WIDTH),
    )
    wq, wk, wv, wo = (weights(rng, WIDTH, WIDTH) for _ in range(4))
    up, upb, down, downb = (
        weights(rng, WIDTH, 4 * WIDTH),
        weights(rng, 4 * WIDTH),
        weights(rng, 4 * WIDTH, WIDTH),
        weights(rng, WIDTH),
    )
    head = WIDTH // HEADS

    g = Graph()
    ids = g.input("ids", ("batch", "seq"), dtype="int64")
    x = embedding(ids, g.constant(table, name="embedding"))

    def heads(t):  # (batch, seq, width) -> (batch, heads, seq, head)
        return t.reshape("batch", "seq", HEADS, head).transpose(1, 2)

    normed = x.layer_norm(ln1, ln1b)
    mixed = attention(heads(normed @ wq), heads(normed @ wk), heads(normed @ wv), causal=True)
    h = x + mixed.transpose(1, 2).reshape("batch", "seq", WIDTH) @ wo
    out = h + h.layer_norm(ln2, ln2b).linear(up, upb).gelu().linear(down, downb)
    g.output("hidden", out)

    def reference(feeds: Arrays) -> Arrays:
        x = table[feeds["ids"]]
        batch, seq, _ = x.shape

        def split(t):
            return t.reshape(batch, seq, HEADS, head).transpose(0, 2, 1, 3)

        n = np_layer_norm(x, ln1, ln1b)
        mixed = np_attention(split(n @ wq), split(n @ wk), split(n @ wv), causal=True)
        h = x + mixed.transpose(0, 2, 1, 3).reshape(batch, seq, WIDTH) @ wo
        return {"hidden": h + np_gelu(np_layer_norm(h, ln2, ln2b) @ up + upb) @ down + downb}

    feeds = [{"ids": rng.integers(0, VOCAB, size).astype(np.int64)} for size in ((2, 5), (3, 9))]
    return Case(g, reference, feeds)


@cache
def ops_case() -> Case:
    """The element-wise, reduction, masking and layout ops the other models leave out."""
    rng = np.random.default_rng(3)
    scale = (1 + rng.random(8)).astype(np.float32)
    vector = rng.standard_normal(8).astype(np.float32)
    g = Graph()
    x = g.input("x", ("batch", 6, 8))
    first, rest = x.split([2, 6], axis=-1)
    outputs = {
        "arith": (1.0 - x) / (x + 2.0) * 3.0 + (-x) ** 2.0 - 2.0 / (x + 1.0),
        "unary": x.exp().log() + x.sqrt() + (x + 1).rsqrt() + x.sigmoid() + x.tanh() + (x - 0.5).abs(),
        "gelu_tanh": x.gelu(approximate="tanh"),
        "reduce": concat([x.sum(-1, keepdims=True), x.mean(-1, keepdims=True), x.max(-1, keepdims=True)], -1),
        "reduce_all": x.sum((1, 2)),
        "rms": x.rms_norm(scale, eps=1e-6),
        "masked": x.masked_fill(x > 0.5, 0.0) + where(x < 0.2, x, -x) + (x >= 0.7).cast("float32"),
        "layout": x.permute(2, 0, 1)[1:5, :, ::2].unsqueeze(0).squeeze(0),
        "split": concat([rest, first * 2.0], axis=-1),
        "index": x[:, -1] + x[..., 0, :],
        "log_softmax": x.log_softmax(1),
        "flat": x.flatten(),
        "matmul": (x @ x.transpose()).sum(-1) + x @ vector,
        "reshape": x.reshape("batch", 2, -1).mean(-1),
    }
    for name, tensor in outputs.items():
        g.output(name, tensor)

    def reference(feeds: Arrays) -> Arrays:
        x = feeds["x"]
        n = len(x)
        return {
            "arith": (1 - x) / (x + 2) * 3 + x**2 - 2 / (x + 1),
            "unary": x
            + np.sqrt(x)
            + 1 / np.sqrt(x + 1)
            + 1 / (1 + np.exp(-x))
            + np.tanh(x)
            + np.abs(x - 0.5),
            "gelu_tanh": np_gelu_tanh(x),
            "reduce": np.stack([x.sum(-1), x.mean(-1), x.max(-1)], -1),
            "reduce_all": x.sum((1, 2)),
            "rms": x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale,
            "masked": np.where(x > 0.5, 0, x) + np.where(x < 0.2, x, -x) + (x >= 0.7),
            "layout": x.transpose(2, 0, 1)[1:5, :, ::2],
            "split": np.concatenate([x[..., 2:], x[..., :2] * 2], -1),
            "index": x[:, -1] + x[..., 0, :],
            "log_softmax": np.log(np_softmax(x, 1)),
            "flat": x.reshape(n, 48),
            "matmul": (x @ x.transpose(0, 2, 1)).sum(-1) + x @ vector,
            "reshape": x.reshape(n, 2, 24).mean(-1),
        }

    feeds = [{"x": rng.random((n, 6, 8)).astype(np.float32)} for n in (2, 5)]
    return Case(g, reference, feeds)


CASES = {"mlp": mlp_case, "cnn": cnn_case, "transformer": transformer_case, "ops": ops_case}


def assert_matches(got: Arrays, want: Arrays, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        assert got[name].shape == want[name].shape, f"{what} {name}"
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=f"{what} {name}")


@pytest.mark.parametrize("case_name", CASES)
def test_exported_models_match_numpy_in_onnxruntime(case_name: str) -> None:
    case = CASES[case_name]()
    session = onnxruntime.InferenceSession(case.model, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for feeds in case.feeds:
        got = dict(zip(names, session.run(None, feeds)))
        assert_matches(got, case.reference(feeds), f"{case_name} at {feeds[next(iter(feeds))].shape}")


@pytest.mark.parametrize("case_name", CASES)
def test_compiled_models_match_numpy(case_name: str) -> None:
    case = CASES[case_name]()
    program = executable(compile_onnx(case.model, candidates=("native-blas",)))
    for feeds in case.feeds:
        assert_matches(
            program.run(feeds), case.reference(feeds), f"{case_name} at {feeds[next(iter(feeds))].shape}"
        )


# ---- the exported file --------------------------------------------------------------------------


def test_export_keeps_names_symbols_and_only_what_outputs_need() -> None:
    g = Graph("tiny")
    x = g.input("x", ("batch", 4))
    unused = g.constant(np.ones(4, np.float32), name="unused")
    (x * unused).relu()  # recorded, but no output needs it
    g.output("y", x + g.constant(np.arange(4, dtype=np.float32), name="bias") + 1.0)
    model = onnx.load_model_from_string(g.to_onnx())
    assert model.opset_import[0].version == OPSET == 18
    assert [i.name for i in model.graph.initializer] == ["bias", "const_1"]
    assert [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [
        "batch",
        4,
    ]
    assert [d.dim_param or d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [
        "batch",
        4,
    ]
    assert [n.op_type for n in model.graph.node] == ["Add", "Add", "Identity"]
    node_names = [n.name for n in model.graph.node]
    assert len(set(node_names)) == 3 and all(node_names)
    assert g.to_model_proto().graph.name == "tiny"


def test_reshape_to_a_moved_symbol_reads_the_dim_at_run_time(tmp_path) -> None:
    g = Graph()
    x = g.input("x", ("batch", "seq", 4))
    flat = x.reshape(-1, 4)
    assert flat.shape == ("batch*seq", 4)
    g.output("back", flat.reshape("batch", -1, 2, 2))
    g.output("swapped", x.reshape("seq", "batch", 4))
    g.save(tmp_path / "model.onnx")
    model = onnx.load(tmp_path / "model.onnx")
    assert {"Shape", "Concat"} <= {n.op_type for n in model.graph.node}
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    data = np.random.default_rng(0).random((3, 5, 4), np.float32)
    back, swapped = session.run(["back", "swapped"], {"x": data})
    np.testing.assert_array_equal(back, data.reshape(3, 5, 2, 2))
    np.testing.assert_array_equal(swapped, data.reshape(5, 3, 4))


def test_compiled_reshape_to_swapped_symbols() -> None:
    g = Graph()
    x = g.input("x", ("batch", "seq", 4))
    g.output("swapped", x.reshape("seq", "batch", 4))
    data = np.random.default_rng(0).random((2, 7, 4), np.float32)
    got = executable(compile_onnx(g.to_onnx(), candidates=("native-blas",))).run({"x": data})["swapped"]
    np.testing.assert_array_equal(got, data.reshape(7, 2, 4))


# ---- mistakes raise GraphError where they are made ----------------------------------------------


def _input(shape=("batch", 784)) -> Tensor:
    return Graph().input("x", shape)


def _matmul_inner() -> None:
    x = _input()
    x @ x.graph.constant(np.zeros((783, 10), np.float32))


def _broadcast() -> None:
    x = _input(("batch", 3))
    x + x.graph.constant(np.zeros(4, np.float32))


def _other_symbol() -> None:
    g = Graph()
    g.input("a", ("batch", "n")) * g.input("b", ("batch", "m"))


def _conv_channels() -> None:
    x = _input(("batch", 3, 8, 8))
    x.conv2d(np.zeros((8, 4, 3, 3), np.float32))


def _conv_groups() -> None:
    x = _input(("batch", 4, 8, 8))
    x.conv2d(np.zeros((6, 1, 3, 3), np.float32), groups=4)


def _conv_bias() -> None:
    x = _input(("batch", 3, 8, 8))
    x.conv2d(np.zeros((8, 3, 3, 3), np.float32), np.zeros(7, np.float32))


def _pool_window() -> None:
    x = _input(("batch", 3, 4, 4))
    x.max_pool2d(5)


def _reshape_count() -> None:
    x = _input()
    x.reshape("batch", 27, 28)


def _reshape_indivisible() -> None:
    x = _input()
    x.reshape(-1, 5)


def _reshape_two_free() -> None:
    x = _input()
    x.reshape(-1, -1)


def _reshape_unknown_product() -> None:
    x = _input(("batch", "seq", 2, 2))
    x.reshape("batch*seq", -1)


def _layer_norm_weight() -> None:
    x = _input(("batch", 8))
    x.layer_norm(np.ones(4, np.float32))


def _split_sizes() -> None:
    x = _input(("batch", 8))
    x.split([3, 4], axis=1)


def _squeeze() -> None:
    x = _input(("batch", 3))
    x.squeeze(1)


def _axis() -> None:
    x = _input(("batch", 3))
    x.softmax(2)


def _dtype() -> None:
    x = _input(("batch", 3))
    x + np.zeros(3)


def _float_scalar_on_ints() -> None:
    g = Graph()
    g.input("ids", ("batch",), dtype="int64") * 0.5


def _gather_floats() -> None:
    x = _input(("batch", 3))
    embedding(x, np.zeros((10, 4), np.float32))


def _index() -> None:
    x = _input(("batch", 3))
    x[:, 3]


def _two_graphs() -> None:
    x = _input(("batch", 3))
    x + Graph().input("y", ("batch", 3))


def _concat() -> None:
    x = _input(("batch", 3))
    concat([x, x.graph.input("y", ("batch", 4))], axis=0)


def _attention_scale() -> None:
    q = _input(("batch", "seq", "head"))
    attention(q, q, q)


def _gelu_kind() -> None:
    x = _input(("batch", 3))
    x.gelu("fast")


def _duplicate_input() -> None:
    _input().graph.input("x", ("batch", 784))


def _duplicate_output() -> None:
    x = _input()
    g = x.graph
    g.output("y", x.relu())
    g.output("y", x.tanh())


def _output_named_like_input() -> None:
    x = _input()
    g = x.graph
    g.output("x", x.relu())


def _duplicate_constant() -> None:
    g = _input().graph
    g.constant(np.ones(3, np.float32), name="w")
    g.constant(np.ones(3, np.float32), name="w")


def _constant_output() -> None:
    g = _input().graph
    g.output("c", g.constant(np.ones(3, np.float32)) * 2.0)


def _no_outputs() -> None:
    x = _input()
    g = x.graph
    x.relu()
    g.to_onnx()


def _bad_symbol() -> None:
    Graph().input("x", ("2batch", 3))


MISTAKES = {
    _matmul_inner: r"^matmul: inner dims differ: \(batch, 784\) @ \(783, 10\)$",
    _broadcast: r"^add: shapes \(batch, 3\) and \(4,\) do not broadcast$",
    _other_symbol: r"^mul: shapes \(batch, n\) and \(batch, m\) do not broadcast$",
    _conv_channels: r"^conv2d: input \(batch, 3, 8, 8\) has 3 channels but weight \(8, 4, 3, 3\) with groups=1 takes 4$",
    _conv_groups: r"^conv2d: weight \(6, 1, 3, 3\) has 6 out channels, not a multiple of groups=4$",
    _conv_bias: r"^conv2d: bias shape \(7,\) is not \(8,\)$",
    _pool_window: r"^max_pool2d: window of 5 is larger than dim 2 of \(batch, 3, 4, 4\) padded by 0$",
    _reshape_count: r"^reshape: \(batch, 784\) cannot become \(batch, 27, 28\): the element counts differ$",
    _reshape_indivisible: r"^reshape: \(batch, 784\) cannot become \(-1, 5\): the element counts differ$",
    _reshape_two_free: r"^reshape: \(-1, -1\) has more than one -1$",
    _reshape_unknown_product: r"^reshape: no input has the dim 'batch\*seq' of \(batch\*seq, -1\); write -1 for it$",
    _layer_norm_weight: r"^layer_norm: weight and bias must have shape \(8,\) \(dims 1.. of \(batch, 8\)\), not \(4,\)$",
    _split_sizes: r"^split: sizes \[3, 4\] do not add up to dim 1 of \(batch, 8\)$",
    _squeeze: r"^squeeze: dim 1 of \(batch, 3\) is not 1$",
    _axis: r"^softmax: axis 2 is out of range for a tensor of 2 dims$",
    _dtype: r"^add: dtypes float32 and float64 differ$",
    _float_scalar_on_ints: r"^0.5 is not a int64: cast the tensor first$",
    _gather_floats: r"^gather: indices must be int32 or int64, not float32$",
    _index: r"^index: 3 is out of range for dim 1 of \(batch, 3\)$",
    _two_graphs: r"belongs to another graph$",
    _concat: r"^concat: shapes \(batch, 3\) and \(batch, 4\) differ outside axis 0$",
    _attention_scale: r"^attention: head dim of \(batch, seq, head\) is symbolic; pass scale$",
    _gelu_kind: r"^gelu: approximate must be 'none' or 'tanh', not 'fast'$",
    _duplicate_input: r"^input name 'x' is already used in this graph$",
    _duplicate_output: r"^output name 'y' is already used in this graph$",
    _output_named_like_input: r"^output name 'x' is already used in this graph$",
    _duplicate_constant: r"^constant name 'w' is already used in this graph$",
    _constant_output: r"^output 'c' depends on no input: it would be a constant$",
    _no_outputs: r"^the graph has no outputs: call graph.output\(name, tensor\)$",
    _bad_symbol: r"^input 'x': symbolic dim '2batch' must be an identifier$",
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda f: f.__name__.strip("_"))
def test_mistakes_raise_graph_error_naming_the_op_and_shapes(mistake) -> None:
    with pytest.raises(GraphError, match=MISTAKES[mistake]):
        mistake()


def test_graph_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        _matmul_inner()


# ---- the SDK around it --------------------------------------------------------------------------


def test_importing_the_sdk_loads_onnx_only_for_graph_and_no_server_package() -> None:
    script = (
        "import sys, luminal_cloud\n"
        "assert 'onnx' not in sys.modules\n"
        "from luminal_cloud import Graph\n"
        "assert Graph.__module__ == 'luminal_cloud.graph' and 'onnx' in sys.modules\n"
        "heavy = {'torch', 'fastapi', 'egglog', 'compiler', 'api', 'cloud'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_deploy_uploads_a_graph_or_bytes() -> None:
    uploads: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        uploads.append(request.read())
        return httpx.Response(201, json={"name": "mlp", "version": len(uploads), "status": "queued"})

    model = mlp_case().model
    g = Graph()
    g.output("y", g.input("x", ("batch", 3)).relu())
    with Client("http://test", "lc_key", transport=httpx.MockTransport(answer)) as client:
        assert client.deploy(g, name="relu", wait=False)["version"] == 1
        assert client.deploy(model, name="mlp", wait=False)["version"] == 2
    assert g.to_onnx() in uploads[0] and b'filename="relu.onnx"' in uploads[0]
    assert model in uploads[1] and b'filename="mlp.onnx"' in uploads[1]


def test_a_deployed_transformer_graph_answers_like_the_reference(settings, keys) -> None:
    case = transformer_case()
    with BackgroundServer(settings) as server, Client(server.url, keys["alice"]) as client:
        assert client.deploy(case.graph, name="block")["status"] == "ready"
        feeds = case.feeds[1]
        got = client.predict("block", feeds)["hidden"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, case.reference(feeds)["hidden"], rtol=1e-4, atol=1e-4)
