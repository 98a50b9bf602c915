"""The Luminal compiler: ONNX (or any frontend) -> primitive IR -> program for a device.

    frontends/   ONNX to IR            ir.py, shape.py   the IR and symbolic shapes
    composite.py ops spelled in IR     reference.py      the NumPy oracle
    codegen/     one module a target   artifact.py       what a compile produces
    pipeline.py  the passes, in order

It imports nothing from the server packages.
"""

from compiler.artifact import Artifact, Signature, TensorSpec
from compiler.errors import CompilerError, CorruptArtifact, InvalidModel, UnsupportedModel
from compiler.pipeline import CODEGENS, compile_graph, compile_onnx, executable

__all__ = [
    "CODEGENS",
    "Artifact",
    "CompilerError",
    "CorruptArtifact",
    "InvalidModel",
    "Signature",
    "TensorSpec",
    "UnsupportedModel",
    "compile_graph",
    "compile_onnx",
    "executable",
]
