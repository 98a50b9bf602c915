"""ONNX models of well-known shapes for benchmarking, built with onnx.helper from random weights.

    mlp()             784 -> 512 -> 512 -> 10 with ReLU                 features [batch, 784]
    resnet_cnn()      ResNet-style: 7x7/2 stem, max pool, 4 basic blocks image [batch, 3, 224, 224]
    bert_minilm()     all-MiniLM-L6-v2's shape, post-LayerNorm encoder  input_ids, attention_mask [batch, seq]
    gpt2_decoder()    GPT-2-style pre-LayerNorm decoder, causal mask    input_ids [batch, seq]
    resnet50_light()  ResNet-50 from the onnx package's light zoo       gpu_0/data_0 [1, 3, 224, 224]

Each builder returns serialized model bytes (opset 17, standard ops only), with a dynamic batch
dimension and, for text, a dynamic sequence dimension. Weights come from a fixed seed, so every
call returns the same bytes: no torch, no downloads.

    .venv/bin/python benchmarks/models.py    # checks each model and runs it once in onnxruntime
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPSET = 17  # the first with LayerNormalization; ReduceMean still takes its axes as an attribute
SEED = 0
ValueInfo = onnx.ValueInfoProto


class GraphBuilder:
    """Collects nodes and initializers under fresh names; `op` returns its output's name."""

    def __init__(self, seed: int = SEED) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def _name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, value: np.ndarray | float | list, dtype=np.float32) -> str:
        name = self._name("const")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, *shape: int, fan_in: int | None = None) -> str:
        """Normal values scaled by 1/sqrt(fan in), so activations keep unit scale through depth."""
        scale = 1.0 / np.sqrt(fan_in if fan_in is not None else int(np.prod(shape[:-1])))
        return self.const(self.rng.standard_normal(shape) * scale)

    def bias(self, size: int, mean: float = 0.0, spread: float = 0.1) -> str:
        return self.const(mean + spread * self.rng.standard_normal(size))

    def op(self, op_type: str, *inputs: str, **attributes) -> str:
        output = self._name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attributes))
        return output

    def output(self, value: str, name: str) -> None:
        """Renames `value`, the result of the last layer, to the graph output `name`."""
        node = next(node for node in reversed(self.nodes) if value in node.output)
        node.output[list(node.output).index(value)] = name

    def model(self, name: str, inputs: list[ValueInfo], outputs: list[ValueInfo]) -> bytes:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        opsets = [helper.make_opsetid("", OPSET)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="benchmarks")
        return model.SerializeToString()

    # ---- layers ----

    def linear(self, x: str, d_in: int, d_out: int) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(d_in, d_out)), self.bias(d_out))

    def gelu_erf(self, x: str) -> str:
        """0.5 x (1 + erf(x / sqrt 2)), as BERT computes it."""
        erf = self.op("Erf", self.op("Div", x, self.const(np.sqrt(2.0))))
        return self.op("Mul", self.op("Mul", x, self.const(0.5)), self.op("Add", erf, self.const(1.0)))

    def gelu_tanh(self, x: str) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as GPT-2 computes it."""
        cube = self.op("Mul", self.op("Pow", x, self.const(3.0)), self.const(0.044715))
        inner = self.op("Mul", self.op("Add", x, cube), self.const(np.sqrt(2.0 / np.pi)))
        one_plus = self.op("Add", self.op("Tanh", inner), self.const(1.0))
        return self.op("Mul", self.op("Mul", x, self.const(0.5)), one_plus)

    def layer_norm(self, x: str, width: int) -> str:
        return self.op(
            "LayerNormalization", x, self.bias(width, mean=1.0), self.bias(width), axis=-1, epsilon=1e-5
        )

    def layer_norm_spelled(self, x: str, width: int) -> str:
        """LayerNorm as exporters before opset 17 spell it: ReduceMean, Sub, Pow, Sqrt, Div."""
        centred = self.op("Sub", x, self.op("ReduceMean", x, axes=[-1]))
        variance = self.op("ReduceMean", self.op("Pow", centred, self.const(2.0)), axes=[-1])
        std = self.op("Sqrt", self.op("Add", variance, self.const(1e-12)))
        normed = self.op("Div", centred, std)
        return self.op("Add", self.op("Mul", normed, self.bias(width, mean=1.0)), self.bias(width))

    def attention(self, x: str, hidden: int, heads: int, mask: str) -> str:
        """Multi-head self-attention over [batch, seq, hidden]; `mask` is added to the scores."""
        size = hidden // heads
        split = self.const([0, 0, heads, size], np.int64)  # 0 keeps batch and seq as they are

        def heads_of(perm: list[int]) -> str:
            return self.op("Transpose", self.op("Reshape", self.linear(x, hidden, hidden), split), perm=perm)

        query, key_t, value = heads_of([0, 2, 1, 3]), heads_of([0, 2, 3, 1]), heads_of([0, 2, 1, 3])
        scores = self.op("Div", self.op("MatMul", query, key_t), self.const(np.sqrt(size)))
        probs = self.op("Softmax", self.op("Add", scores, mask), axis=-1)
        context = self.op("Transpose", self.op("MatMul", probs, value), perm=[0, 2, 1, 3])
        merged = self.op("Reshape", context, self.const([0, 0, hidden], np.int64))
        return self.linear(merged, hidden, hidden)

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1) -> str:
        """Conv without bias followed by BatchNormalization, as torchvision's ResNets have it."""
        pad = kernel // 2
        conv = self.op(
            "Conv", x, self.weight(c_out, c_in, kernel, kernel, fan_in=c_in * kernel * kernel),
            kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4,
        )
        scale, shift, mean = self.bias(c_out, mean=1.0), self.bias(c_out), self.bias(c_out)
        variance = self.const(self.rng.uniform(0.5, 1.5, c_out))
        return self.op("BatchNormalization", conv, scale, shift, mean, variance, epsilon=1e-5)

    def basic_block(self, x: str, c_in: int, c_out: int, stride: int) -> str:
        body = self.op("Relu", self.conv(x, c_in, c_out, 3, stride))
        body = self.conv(body, c_out, c_out, 3)
        shortcut = x if stride == 1 and c_in == c_out else self.conv(x, c_in, c_out, 1, stride)
        return self.op("Relu", self.op("Add", body, shortcut))

    def sequence_slice(self, table: str, input_ids: str) -> str:
        """The first seq rows of `table`, seq being input_ids' second dimension."""
        seq = self.op("Shape", input_ids, start=1, end=2)
        return self.op("Slice", table, self.const([0], np.int64), seq, self.const([0], np.int64))


def _float(name: str, *dims: int | str) -> ValueInfo:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims))


def _int64(name: str, *dims: int | str) -> ValueInfo:
    return helper.make_tensor_value_info(name, TensorProto.INT64, list(dims))


def mlp(widths: tuple[int, ...] = (784, 512, 512, 10)) -> bytes:
    g = GraphBuilder()
    x = "features"
    for index, (d_in, d_out) in enumerate(itertools.pairwise(widths)):
        x = g.op("Gemm", x, g.weight(d_in, d_out), g.bias(d_out))
        if index < len(widths) - 2:
            x = g.op("Relu", x)
    g.output(x, "logits")
    return g.model("mlp", [_float("features", "batch", widths[0])], [_float("logits", "batch", widths[-1])])


def resnet_cnn(classes: int = 1000) -> bytes:
    """A ResNet-18-like net at a quarter of its width and with one block in the deeper stages."""
    g = GraphBuilder()
    x = g.op("Relu", g.conv("image", 3, 32, 7, stride=2))
    x = g.op("MaxPool", x, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    for c_in, c_out, stride in ((32, 32, 1), (32, 32, 1), (32, 64, 2), (64, 128, 2)):
        x = g.basic_block(x, c_in, c_out, stride)
    pooled = g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)
    g.output(g.op("Gemm", pooled, g.weight(128, classes), g.bias(classes)), "logits")
    image = _float("image", "batch", 3, 224, 224)
    return g.model("resnet_cnn", [image], [_float("logits", "batch", classes)])


def bert_minilm(
    vocab: int = 1000, layers: int = 6, hidden: int = 384, heads: int = 12, intermediate: int = 1536,
    max_positions: int = 512,
) -> bytes:
    """all-MiniLM-L6-v2's encoder (its vocabulary of 30522 cut to `vocab`): BERT embeddings,
    post-LayerNorm layers with erf GELU, the attention mask added to the scores as -10000."""
    g = GraphBuilder()
    words = g.op("Gather", g.const(0.02 * g.rng.standard_normal((vocab, hidden))), "input_ids")
    positions = g.sequence_slice(g.const(0.02 * g.rng.standard_normal((max_positions, hidden))), "input_ids")
    token_type = g.const(0.02 * g.rng.standard_normal(hidden))  # every token is of type 0
    x = g.layer_norm_spelled(g.op("Add", g.op("Add", words, positions), token_type), hidden)
    keep = g.op("Unsqueeze", g.op("Cast", "attention_mask", to=TensorProto.FLOAT), g.const([1, 2], np.int64))
    mask = g.op("Mul", g.op("Sub", g.const(1.0), keep), g.const(-10000.0))  # [batch, 1, 1, seq]
    for _ in range(layers):
        x = g.layer_norm_spelled(g.op("Add", x, g.attention(x, hidden, heads, mask)), hidden)
        ffn = g.linear(g.gelu_erf(g.linear(x, hidden, intermediate)), intermediate, hidden)
        x = g.layer_norm_spelled(g.op("Add", x, ffn), hidden)
    g.output(x, "last_hidden_state")
    text = [_int64("input_ids", "batch", "seq"), _int64("attention_mask", "batch", "seq")]
    return g.model("bert_minilm", text, [_float("last_hidden_state", "batch", "seq", hidden)])


def gpt2_decoder(
    vocab: int = 1000, layers: int = 4, hidden: int = 384, heads: int = 12, max_positions: int = 1024
) -> bytes:
    """GPT-2's block structure (pre-LayerNorm, tanh GELU, 4x MLP) with a separate LM head; the
    causal mask is an additive constant sliced to the sequence length."""
    g = GraphBuilder()
    words = g.op("Gather", g.const(0.02 * g.rng.standard_normal((vocab, hidden))), "input_ids")
    positions = g.sequence_slice(g.const(0.01 * g.rng.standard_normal((max_positions, hidden))), "input_ids")
    x = g.op("Add", words, positions)
    causal = np.triu(np.full((max_positions, max_positions), -1e9, np.float32), k=1)
    rows = g.sequence_slice(g.const(causal), "input_ids")
    seq = g.op("Shape", "input_ids", start=1, end=2)
    mask = g.op("Slice", rows, g.const([0], np.int64), seq, g.const([1], np.int64))  # [seq, seq]
    for _ in range(layers):
        x = g.op("Add", x, g.attention(g.layer_norm(x, hidden), hidden, heads, mask))
        up = g.gelu_tanh(g.linear(g.layer_norm(x, hidden), hidden, 4 * hidden))
        x = g.op("Add", x, g.linear(up, 4 * hidden, hidden))
    logits = g.op("MatMul", g.layer_norm(x, hidden), g.weight(hidden, vocab))
    g.output(logits, "logits")
    logits_info = _float("logits", "batch", "seq", vocab)
    return g.model("gpt2_decoder", [_int64("input_ids", "batch", "seq")], [logits_info])


def resnet50_light() -> bytes:
    """The light zoo's ResNet-50 (static 1x3x224x224, opset 9) with the random weights the
    model-zoo test gives it, and its logits exposed beside the saturated softmax."""
    from tests.test_model_zoo import DATA, expose_logits, with_random_weights

    model = with_random_weights(onnx.load(str(DATA / "light" / "light_resnet50.onnx")))
    expose_logits(model)
    return model.SerializeToString()


BUILDERS = {
    "mlp": mlp,
    "resnet_cnn": resnet_cnn,
    "bert_minilm": bert_minilm,
    "gpt2_decoder": gpt2_decoder,
    "resnet50_light": resnet50_light,
}


def sample_inputs(
    data: bytes, sizes: dict[str, int], seed: int = 1, int_high: int = 1000
) -> dict[str, np.ndarray]:
    """Inputs for `data` with each named dimension set from `sizes`: normal floats, token ids below
    `int_high`, and an attention mask that pads the last quarter of every row but the first."""
    model = onnx.load_from_string(data)
    initialized = {tensor.name for tensor in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        if value.name in initialized:
            continue
        tensor = value.type.tensor_type
        shape = tuple(sizes[d.dim_param] if d.dim_param else d.dim_value for d in tensor.shape.dim)
        if tensor.elem_type == TensorProto.FLOAT:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
        elif value.name == "attention_mask":
            mask = np.ones(shape, np.int64)
            mask[1:, shape[1] - shape[1] // 4:] = 0
            feeds[value.name] = mask
        else:
            feeds[value.name] = rng.integers(0, int_high, shape).astype(np.int64)
    return feeds


def main() -> None:
    import time

    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # the light zoo's unused initializers warn
    for name, build in BUILDERS.items():
        started = time.perf_counter()
        data = build()
        built = time.perf_counter() - started
        onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
        session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        feeds = sample_inputs(data, {"batch": 2, "seq": 16})
        started = time.perf_counter()
        outputs = session.run(None, feeds)
        ran = time.perf_counter() - started
        shapes = ", ".join(str(output.shape) for output in outputs)
        finite = all(np.isfinite(output).all() for output in outputs)
        print(f"{name:<16}{len(data) / 1e6:>7.1f} MB  built {built:.2f} s  ran {ran * 1000:.1f} ms  "
              f"outputs {shapes}  finite {finite}")


if __name__ == "__main__":
    main()
