"""An artifact made runnable on this machine: the native program loaded, or the NumPy lowering.
What a CPU runtime imports, without the pipeline that compiled it."""

from __future__ import annotations

from compiler.artifact import Artifact
from compiler.backends import native_cpu
from compiler.codegen import CODEGENS
from compiler.errors import UnsupportedModel
from compiler.targets import is_gpu


def executable(artifact: Artifact):
    if is_gpu(artifact.target):
        raise UnsupportedModel([f"running a {artifact.target} program here: it runs on a {artifact.target} GPU runtime"])
    if artifact.kernels and artifact.kernels[0].get("kind") == "native":
        return native_cpu.load(artifact.kernels[0], artifact.all_weights(), artifact.binaries.get("program.so"))
    return CODEGENS[artifact.target].Executable(artifact.graph, artifact.kernels)


__all__ = ["executable"]
