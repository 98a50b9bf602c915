"""The Luminal compiler: ONNX (or any frontend) -> primitive IR -> program for a device.

    pipeline.py    the stages, in order: compile_graph, compile_onnx (imported on first use)
    runnable.py    executable(): an artifact made runnable here (what a runtime imports; not named
                   executable.py, whose import would shadow the function on the package)
    frontends/     parse: ONNX to the primitive-op IR   ir.py, shape.py    the IR, symbolic shapes
    composite.py   ops spelled in the IR                 reference.py      the NumPy oracle
    verify.py      reference case, checking a program    memory.py         memory need and budget
    search/        the graph e-graph and its rules, the kernel rules (attention, epilogues), the
                   schedule e-graph with extraction by measurement (schedule.py; per device:
                   cpu_schedules.py, cuda_schedules.py), the helper process (measure.py)
    kernels/       the kernel IR (ir.py, ir_walk.py), lowering to it, fusion, precision
    render/        C and CUDA C printed from the kernel IR   codegen/   the NumPy lowering
    candidates.py  lowered, rendered, built and verified candidate programs
    devices.py     build, load, run, time, memory: CPU, CUDA GPU, CUDA emulation
    backends/      what the devices drive (C compiler, NVRTC, driver API, cuBLAS, emulator)
    artifact.py    what a compile produces              tuning.py   the pipeline's tuning constants
    progress.py    what a compile tells the caller following it

It imports nothing from the server packages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from compiler.artifact import Artifact, Signature, TensorSpec
from compiler.errors import CompilerError, CorruptArtifact, InvalidModel, UnsupportedModel

if TYPE_CHECKING:
    from compiler.codegen import CODEGENS
    from compiler.pipeline import compile_graph, compile_onnx
    from compiler.runnable import executable

# imported on first use: a runtime that only runs artifacts never loads the pipeline (the search,
# egglog, the renderers), which is most of a cold start's process start
_LAZY = {
    "CODEGENS": "compiler.codegen",
    "executable": "compiler.runnable",
    "compile_graph": "compiler.pipeline",
    "compile_onnx": "compiler.pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'compiler' has no attribute {name!r}")


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
