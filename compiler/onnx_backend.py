"""`onnx.backend.base.Backend` over the compiler, so ONNX's own test runner can drive it.

    import compiler.onnx_backend as backend
    rep = backend.prepare(model, device="CPU")
    outputs = rep.run([x])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

from compiler.artifact import Artifact
from compiler.frontends.onnx import onnx_to_graph, parse_model
from compiler.pipeline import compile_graph, executable


class LuminalRep(BackendRep):
    def __init__(self, artifact: Artifact) -> None:
        self.artifact = artifact
        self._program = executable(artifact)

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


class LuminalBackend(Backend):
    @classmethod
    def supports_device(cls, device: str) -> bool:
        return Device(device).type == DeviceType.CPU

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> LuminalRep:
        if not cls.supports_device(device):
            raise ValueError(f"device {device!r} is not supported; use 'CPU'")
        parsed = parse_model(model.SerializeToString())
        return LuminalRep(compile_graph(onnx_to_graph(parsed), "cpu"))

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
