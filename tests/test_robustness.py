"""Mutated ONNX files (random bytes and protobuf fields of valid graphs, a bounded count with
fixed seeds) never get a 5xx at upload, and never hang or kill the process that compiles them:
each is refused with a message, compiled, or failed with a message."""

from __future__ import annotations

import collections
import random

import onnx
import pytest
from onnx import TensorProto

from compiler import CompilerError
from tests.conftest import auth
from tests.hf_corpus import CORPUS
from tests.onnx_models import mlp
from worker.sandbox import CompileCrashed, CompileTimeout, Sandbox

SEEDS = [
    mlp().SerializeToString(),
    (CORPUS / "bert_dynamo.onnx").read_bytes(),
    (CORPUS / "gpt2_torchscript.onnx").read_bytes(),
    (CORPUS / "resnet_dynamo.onnx").read_bytes(),
]
OPS = ["Add", "MatMul", "Reshape", "Gather", "Concat", "Softmax", "Transpose", "Slice", "Expand", "If"]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 1:
        del out[rng.randrange(len(out)) :]
    else:
        at = rng.randrange(len(out))
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(out)


def mutate_fields(data: bytes, rng: random.Random) -> bytes:
    model = onnx.load_from_string(data)
    graph = model.graph
    node = rng.choice(graph.node)
    choice = rng.randrange(7)
    if choice == 0:
        node.op_type = rng.choice(OPS)
    elif choice == 1 and node.input:
        values = [""] + [t.name for t in graph.initializer][:5] + [o for n in graph.node for o in n.output][:20]
        node.input[rng.randrange(len(node.input))] = rng.choice(values)
    elif choice == 2:
        for dim in rng.choice(list(graph.input) + list(graph.output)).type.tensor_type.shape.dim:
            if rng.random() < 0.5:
                dim.dim_value = rng.choice([0, 1, 7, 10**9])
    elif choice == 3 and graph.initializer:
        tensor = rng.choice(graph.initializer)
        tensor.data_type = rng.choice([TensorProto.FLOAT, TensorProto.INT64, TensorProto.STRING, TensorProto.FLOAT16])
    elif choice == 4:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.INT:
                attribute.i = rng.choice([-(2**40), -1, 0, 3, 2**40])
            elif attribute.type == onnx.AttributeProto.INTS:
                attribute.ints[:] = [rng.choice([-5, 0, 1, 10**6]) for _ in attribute.ints]
            elif attribute.type == onnx.AttributeProto.FLOAT:
                attribute.f = rng.choice([float("nan"), float("inf"), -1.0])
    elif choice == 5:
        model.opset_import[0].version = rng.choice([1, 5, 13, 21, 30])
    else:
        graph.node.remove(node)
    return model.SerializeToString()


def mutants(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        data = rng.choice(SEEDS)
        out.append(mutate_bytes(data, rng) if rng.random() < 0.4 else mutate_fields(data, rng))
    return out


def test_mutated_uploads_never_get_a_5xx(client, keys) -> None:
    statuses = collections.Counter()
    for i, data in enumerate(mutants(seed=1, count=60)):
        response = client.post(
            "/v1/models", headers=auth(keys["alice"]), files={"file": ("m.onnx", data)}, data={"name": f"m{i}"}
        )
        statuses[response.status_code] += 1
        assert response.status_code in (202, 400, 413), response.text
        assert response.json().get("error", {}).get("message", "x")
    assert statuses[400] and statuses[202]  # both kinds were exercised


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mutated_graphs_never_hang_or_kill_the_compiler(seed: int, tmp_path) -> None:
    sandbox = Sandbox(timeout_s=60, memory_bytes=4 * 1024**3)
    outcomes = collections.Counter()
    graph = tmp_path / "mutant.onnx"
    for i, data in enumerate(mutants(seed, count=60)):
        graph.write_bytes(data)
        try:
            sandbox.compile(i, graph, "cpu")
            outcomes["compiled"] += 1
        except (CompileTimeout, CompileCrashed) as exc:
            # a hang, a dead process or an unexpected exception (a compiler bug) fails the test
            pytest.fail(f"mutant {i} of seed {seed}: {type(exc).__name__}: {exc}")
        except CompilerError:
            outcomes["refused"] += 1
    assert outcomes["compiled"] and outcomes["refused"]
