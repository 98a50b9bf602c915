"""`onnx.backend.base.Backend` over the compiler, so ONNX's own test runner can drive it.

    import compiler.onnx_backend as backend
    rep = backend.prepare(model, device="CPU")
    outputs = rep.run([x])

A model whose output shapes depend on the values of small inputs (Reshape shapes, reduction
axes, Resize scales, Pad widths fed as graph inputs) cannot be compiled ahead of those values.
For such a model `prepare` returns a rep that specializes: it compiles once per distinct value
of those inputs, on first use, and caches the program, as a JIT with value guards would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from compiler.artifact import Artifact
from compiler.errors import UnsupportedModel
from compiler.frontends.onnx import onnx_to_graph, parse_model
from compiler.pipeline import compile_graph, executable
from compiler.targets import GPU_TYPES, is_gpu

# which candidate programs prepare() builds (None: the pipeline's); a test forces one
candidates: tuple[str, ...] | None = None
# the target prepare() compiles for: "cpu", or a GPU type, whose programs run where a GPU of that
# type is, else on the CPU emulation of the CUDA device (the same CudaProgram a GPU runtime runs)
target = "cpu"


class LuminalRep(BackendRep):
    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self._program = _gpu_program(artifact) if is_gpu(artifact.target) else executable(artifact)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        specs = self.artifact.signature.inputs
        if isinstance(inputs, dict):
            feed = {spec.name: inputs[spec.name] for spec in specs}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feed = {spec.name: np.asarray(x) for spec, x in zip(specs, inputs)}
        outputs = self._program.run(feed)
        return tuple(outputs[spec.name] for spec in self.artifact.signature.outputs)


# inputs this small with a static shape may be specialized on (axes, shapes, scales, pads)
MAX_SPECIALIZED_ELEMENTS = 64
# ops whose first input is itself shape-like (a Loop's trip count decides its unrolling)
_SHAPE_FIRST = frozenset({"Range", "ConstantOfShape", "Loop"})


class SpecializingRep(BackendRep):
    """Compiles per value of the inputs that decide output shapes; other inputs stay inputs."""

    def __init__(self, model: onnx.ModelProto, specialized: list[str]) -> None:
        self.model = model
        self.specialized = specialized
        initializers = {t.name for t in model.graph.initializer}
        self._input_names = [v.name for v in model.graph.input if v.name not in initializers]
        self._reps: dict[tuple, LuminalRep] = {}

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feed = {name: np.asarray(inputs[name]) for name in self._input_names}
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feed = {name: np.asarray(x) for name, x in zip(self._input_names, inputs)}
        key = tuple((name, feed[name].dtype.str, feed[name].shape, feed[name].tobytes()) for name in self.specialized)
        if key not in self._reps:
            self._reps[key] = _compile(_bind_inputs(self.model, {n: feed[n] for n in self.specialized}))
        return self._reps[key].run({n: x for n, x in feed.items() if n not in self.specialized})


def _bind_inputs(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    kept = [v for v in bound.graph.input if v.name not in values]
    del bound.graph.input[:]
    bound.graph.input.extend(kept)
    bound.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in values.items())
    return bound


def _shape_inputs(model: onnx.ModelProto) -> list[str]:
    """Small static graph inputs read only in shape-deciding positions (not as a node's data)."""
    initializers = {t.name for t in model.graph.initializer}
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, position))
    picked = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in initializers or not all(d.HasField("dim_value") for d in dims):
            continue
        if np.prod([d.dim_value for d in dims], dtype=np.int64) > MAX_SPECIALIZED_ELEMENTS:
            continue
        uses = readers.get(value.name, [])
        if uses and all(position > 0 or op in _SHAPE_FIRST for op, position in uses):
            picked.append(value.name)
    return picked


def _compile(model: onnx.ModelProto) -> LuminalRep:
    return LuminalRep(compile_graph(onnx_to_graph(model), target, candidates))


def _gpu_program(artifact: Artifact):
    """A GPU artifact loaded on this machine's GPU of its type, else on the emulated device."""
    from compiler.backends.cuda import CudaProgram
    from compiler.devices import cuda_device

    device = cuda_device(GPU_TYPES[artifact.target].arch)
    return CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, device.driver)


class LuminalBackend(Backend):
    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> LuminalRep:
        if not cls.supports_device(device):
            raise ValueError(f"device {device!r} is not supported; use 'CPU'")
        parsed = parse_model(model.SerializeToString())
        try:
            return _compile(parsed)
        except UnsupportedModel as exc:
            specialized = _shape_inputs(parsed)
            if not specialized or "computed at run time" not in str(exc):
                raise
            return SpecializingRep(parsed, specialized)

    @classmethod
    def run_model(
        cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any
    ) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[Any], device: str = "CPU", **kwargs: Any):
        raise NotImplementedError("Luminal compiles whole models; run_node is not supported")


prepare = LuminalBackend.prepare
run_model = LuminalBackend.run_model
run_node = LuminalBackend.run_node
supports_device = LuminalBackend.supports_device
