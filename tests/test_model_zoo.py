"""Whole models that ship with the onnx package (onnx/backend/test/data).

    light/              ResNet-50, DenseNet-121, Inception v1/v2, ShuffleNet, SqueezeNet, VGG-19,
                        AlexNet, ZFNet-512 at full size (1x3x224x224, opset 9): they must compile
                        and match onnxruntime.
    pytorch-converted/  small torch modules and operators, each with test_data_set_*/ inputs
    pytorch-operator/   and expected outputs: compiled and compared with those outputs at the
    simple/             tolerances onnx's own runner uses; the cases in EXPECTED_REFUSALS must be
                        refused with that reason, every other case must compile.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.test.loader import load_model_tests

from compiler import UnsupportedModel, compile_onnx, executable

DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"
LIGHT_MODELS = sorted((DATA / "light").glob("light_*.onnx"))
SUITES = ("pytorch-converted", "pytorch-operator", "simple")
ROOT = Path(__file__).parents[1]
# each light model runs in a child process with this much address space: the machine is shared,
# and a process the kernel kills for memory would take the whole test session with it
LIGHT_MEMORY_BUDGET = 16 << 30
LIGHT_TIMEOUT_SECONDS = 240


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds: IR 3 models also list every initializer as an input."""
    initialized = {tensor.name for tensor in model.graph.initializer}
    return [value for value in model.graph.input if value.name not in initialized]


# ---- light: the shipped graphs with random weights, against onnxruntime ----


def with_random_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Replaces each weight with deterministic random values, in place.

    The light models ship no weights: every weight is a ConstantOfShape(0.02) node over a
    '<name>__SHAPE' initializer, which makes all 1000 logits equal and every output 1/1000, a
    check that proves little. Each such node becomes an initializer of random values instead:
    matrices and kernels scaled by 1/sqrt(fan in), BatchNorm scales and variances in [0.5, 1.5],
    everything else (biases, means) small and centred.
    """
    rng = np.random.default_rng(seed)
    graph = model.graph
    shapes = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}
    positive = {
        name for node in graph.node if node.op_type == "BatchNormalization"
        for name in (node.input[1], node.input[4])
    }
    kept, weights, shape_names = [], [], set()
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in shapes:
            kept.append(node)
            continue
        shape = tuple(int(d) for d in shapes[node.input[0]])
        if len(shape) >= 2:
            weight = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(np.prod(shape[1:])))
        elif node.output[0] in positive:
            weight = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            weight = 0.1 * rng.standard_normal(shape, dtype=np.float32)
        weights.append(numpy_helper.from_array(weight, node.output[0]))
        shape_names.add(node.input[0])
    del graph.node[:]
    graph.node.extend(kept)
    # IR 3 lists initializers among the graph inputs: swap the shapes for the weights there too
    remaining = [tensor for tensor in graph.initializer if tensor.name not in shape_names]
    del graph.initializer[:]
    graph.initializer.extend(remaining + weights)
    inputs = [value for value in graph.input if value.name not in shape_names]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.input.extend(helper.make_tensor_value_info(w.name, TensorProto.FLOAT, w.dims) for w in weights)
    return model


def expose_logits(model: onnx.ModelProto) -> None:
    """Adds the input of a final Softmax as an output: random deep nets saturate their softmax,
    whose probabilities alone would then hide errors in the logits."""
    outputs = {value.name: value for value in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "Softmax" and node.output[0] in outputs:
            logits = model.graph.output.add()
            logits.CopyFrom(outputs[node.output[0]])  # Softmax keeps the shape
            logits.name = node.input[0]


def check_light_model(path: Path) -> None:
    model = with_random_weights(onnx.load(str(path)))
    expose_logits(model)
    (image,) = graph_inputs(model)
    shape = [d.dim_value for d in image.type.tensor_type.shape.dim]
    feed = {image.name: np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
    output_names = [value.name for value in model.graph.output]
    data = model.SerializeToString()
    del model  # the big models hold hundreds of MB of weights in each copy
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    wanted = dict(zip(output_names, session.run(None, feed)))
    del session
    # one candidate, the one whose generated code covers most (convolutions read in place or
    # through generated panel products): measuring the others took VGG-19 115 s on 2 cores
    artifact = compile_onnx(data, "cpu", ("native-panels",))
    assert artifact.report["chosen"] == "native-panels", artifact.report["rejected"]
    got = executable(artifact).run(feed)
    for name, want in wanted.items():
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        # float32 sums over thousands of terms, in another order than onnxruntime's
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-4 * scale, err_msg=name)


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIGHT_MEMORY_BUDGET, resource.getrlimit(resource.RLIMIT_AS)[1]))


@pytest.mark.parametrize("path", LIGHT_MODELS, ids=lambda path: path.stem.removeprefix("light_"))
def test_light_model_matches_onnxruntime(path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_model_zoo", str(path)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=LIGHT_TIMEOUT_SECONDS,
        preexec_fn=_limit_address_space,
    )
    assert child.returncode == 0, child.stderr[-4000:]


# ---- pytorch-converted, pytorch-operator, simple: against the shipped outputs ----


def suite_cases() -> list:
    cases = [case for kind in SUITES for case in load_model_tests(kind=kind)]
    return [
        pytest.param(case, id=f"{case.kind}/{case.name}")
        for case in sorted(cases, key=lambda case: (case.kind, case.name))
    ]


def load_tensors(directory: Path, prefix: str) -> list[np.ndarray]:
    count = len(list(directory.glob(f"{prefix}_*.pb")))
    paths = [directory / f"{prefix}_{i}.pb" for i in range(count)]
    return [numpy_helper.to_array(TensorProto.FromString(path.read_bytes())) for path in paths]


# case id -> what the refusal must say; a case that starts compiling must leave this list
EXPECTED_REFUSALS = {
    # the shape input is a graph input: its values, and so the output shape, come with each request
    **{f"simple/test_expand_shape_model{i}": "Expand with a shape computed at run time" for i in range(1, 5)},
    "simple/test_gradient_of_add": "ai.onnx.preview.training.Gradient",
    "simple/test_gradient_of_add_and_mul": "ai.onnx.preview.training.Gradient",
    # sequences are lists of tensors whose length is data
    **{f"simple/test_sequence_model{i}": "Sequence" for i in range(1, 9)},
    **{
        f"simple/test_strnorm_model_{name}": "element type STRING"
        for name in (
            "monday_casesensintive_lower", "monday_casesensintive_nochangecase", "monday_casesensintive_upper",
            "monday_empty_output", "monday_insensintive_upper_twodim", "nostopwords_nochangecase",
        )
    },
}


def test_expected_refusals_name_real_cases() -> None:
    ids = {f"{case.kind}/{case.name}" for kind in SUITES for case in load_model_tests(kind=kind)}
    assert set(EXPECTED_REFUSALS) <= ids, sorted(set(EXPECTED_REFUSALS) - ids)


@pytest.mark.parametrize("case", suite_cases())
def test_suite_model_matches_shipped_outputs(case) -> None:
    model_path = Path(case.model_dir) / "model.onnx"
    case_id = f"{case.kind}/{case.name}"
    if case_id in EXPECTED_REFUSALS:
        with pytest.raises(UnsupportedModel, match=EXPECTED_REFUSALS[case_id]):
            compile_onnx(model_path.read_bytes(), "cpu")
        return
    artifact = compile_onnx(model_path.read_bytes(), "cpu")
    model = onnx.load(str(model_path))
    inputs = graph_inputs(model)
    assert all(value.type.HasField("tensor_type") for value in inputs + list(model.graph.output))
    program = executable(artifact)
    data_sets = sorted(Path(case.model_dir).glob("test_data_set_*"))
    assert data_sets
    for data_set in data_sets:
        feed = dict(zip([value.name for value in inputs], load_tensors(data_set, "input"), strict=True))
        got = program.run(feed)
        expected = load_tensors(data_set, "output")
        assert len(expected) == len(model.graph.output)
        for value, want in zip(model.graph.output, expected):
            have = got[value.name]
            assert have.shape == want.shape and have.dtype == want.dtype, (data_set.name, value.name)
            np.testing.assert_allclose(have, want, rtol=case.rtol, atol=case.atol, err_msg=f"{data_set.name} {value.name}")


if __name__ == "__main__":  # one light model, in the child process the test starts
    check_light_model(Path(sys.argv[1]))
