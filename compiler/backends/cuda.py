"""The CUDA backend's compile step: CUDA C to PTX and a cubin for one compute capability, with
NVRTC through cuda-python (`cuda-bindings`), which needs no GPU: CI compiles every rendered kernel.

    ptx, cubin = compile_cuda(source, "sm_90")

Loading modules, the arena and launching (the driver API) need a GPU and come with the runtime.
"""

from __future__ import annotations

import re

from compiler.errors import CompilerError

# -default-device: every function not marked otherwise is __device__ (the prelude's helpers)
NVRTC_OPTIONS = ("--std=c++17", "-default-device")


class CudaBuildFailed(CompilerError):
    """NVRTC refused the rendered source (a renderer bug): the log says where."""


def _check(result, what: str, program=None) -> None:
    from cuda.bindings import nvrtc

    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(program) if program is not None else ""
        raise CudaBuildFailed(f"NVRTC {what} failed ({result.name}){': ' + log if log else ''}")


def _log(program) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    buffer = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return buffer.rstrip(b"\0 ").decode(errors="replace")[-4000:]


def compile_cuda(source: str, arch: str, name: str = "program.cu") -> tuple[bytes, bytes]:
    """(PTX, cubin) of `source` for `arch` ("sm_90"); CudaBuildFailed with NVRTC's log if it fails."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"not a compute capability: {arch!r} (expected e.g. 'sm_90')")
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # the CUDA extra is not installed
        raise CudaBuildFailed(f"NVRTC is not available here ({exc}); install cuda-bindings and nvidia-cuda-nvrtc") from None
    ptx = _compile(nvrtc, source, name, f"--gpu-architecture=compute_{arch[3:]}", ptx=True)
    cubin = _compile(nvrtc, source, name, f"--gpu-architecture={arch}", ptx=False)
    return ptx, cubin


def _compile(nvrtc, source: str, name: str, target: str, ptx: bool) -> bytes:
    status, program = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(status, "create")
    try:
        options = [o.encode() for o in (*NVRTC_OPTIONS, target)]
        (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
        _check(status, "compile", program)
        if ptx:
            status, size = nvrtc.nvrtcGetPTXSize(program)
            _check(status, "PTX size")
            data = b" " * size
            (status,) = nvrtc.nvrtcGetPTX(program, data)
            _check(status, "PTX")
        else:
            status, size = nvrtc.nvrtcGetCUBINSize(program)
            _check(status, "cubin size")
            data = b" " * size
            (status,) = nvrtc.nvrtcGetCUBIN(program, data)
            _check(status, "cubin")
        return data
    finally:
        nvrtc.nvrtcDestroyProgram(program)


__all__ = ["CudaBuildFailed", "compile_cuda"]
