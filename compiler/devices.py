"""The devices a compile builds, loads, runs and times candidate programs on, behind one small
interface, so every target goes through the same pipeline stages:

    binaries = device.build(source)                       # a shared object, or PTX and a cubin
    program = device.load(name, kernel, weights, binaries)
    outputs = device.run(program, inputs)                 # verified against the reference
    seconds = device.time(program, inputs)                # one run, as the device measures it
    device.memory()                                       # bytes it holds for programs, if known

    CpuDevice           generated C (compiler/backends/native_cpu.py), loaded, run and timed in
                        the measuring helper process (compiler/search/measure.py), so a candidate
                        that crashes or hangs is rejected, not the compile
    CudaDevice          a GPU through the driver API (compiler/backends/cuda_driver.py)
    EmulatedCudaDevice  the same CUDA programs on the CPU emulation (compiler/backends/cuda_emulator.py):
                        what CI and a compile worker without that GPU verify on, untimed

cuda_device(arch) is the one a CUDA compile runs on: this machine's GPU when it is of the
target's compute capability, else the emulation.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from compiler.backends import native_cpu
from compiler.backends.cuda import CudaProgram, compile_cuda
from compiler.search import measure


class Device(Protocol):
    """What the pipeline needs of a device to build, verify and time a candidate program."""

    # where programs run, as the report says it ("cpu", "NVIDIA H100 (sm_90)", "cpu emulation")
    name: str
    # whether its timings are the target's (an emulation's are not: candidates are not raced there)
    measures: bool

    def build(self, source: str) -> dict[str, bytes]:
        """The rendered source compiled for the device: the artifact's binaries by file name."""

    def load(self, name: str, kernel: Mapping[str, Any], weights: Mapping[str, np.ndarray], binaries: Mapping[str, bytes]) -> Any:
        """The program (its kernel record, weights and binaries) loaded, under `name`."""

    def run(self, program: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A loaded program's outputs for `inputs`."""

    def time(self, program: Any, inputs: Mapping[str, np.ndarray]) -> float:
        """Seconds one run of a loaded program on `inputs` takes, as this device measures it."""

    def memory(self) -> int | None:
        """Bytes of memory the device has for programs; None where it does not say."""


# ---- the CPU -------------------------------------------------------------------------------------


class CpuDevice:
    """This CPU: generated C built with the C compiler, loaded, run and timed in the measuring
    helper process, within `session()` (one compile at a time uses the helper)."""

    name = "cpu"
    measures = True

    def __init__(self) -> None:
        self._runner: measure.Runner | None = None
        # the helper holds inputs by key: the key of each inputs object sent (by identity)
        self._input_keys: dict[int, tuple[Mapping[str, np.ndarray], str]] = {}

    @contextlib.contextmanager
    def session(self) -> Iterator[CpuDevice]:
        """The helper process for this compile: programs load, run and time within it."""
        with measure.session() as runner:
            self._runner = runner
            try:
                yield self
            finally:
                self._runner = None
                self._input_keys.clear()

    def build(self, source: str) -> dict[str, bytes]:
        measure.prestart()  # the helper process imports while the C compiler runs
        return {"program.so": native_cpu.build(source)}

    def load(self, name: str, kernel: Mapping[str, Any], weights: Mapping[str, np.ndarray], binaries: Mapping[str, bytes]) -> str:
        """The program loaded in the helper under `name` (CandidateFailed when it cannot be)."""
        self._helper().load(name, kernel["layout"], weights, binaries["program.so"])
        return name

    def run(self, program: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._helper().run(program, self._inputs_key(inputs))

    def time(self, program: str, inputs: Mapping[str, np.ndarray]) -> float:
        """Seconds one run takes when runs come back to back (the median of a short burst)."""
        return self._helper().time(program, self._inputs_key(inputs))

    def profile(self, program: str, inputs: Mapping[str, np.ndarray], kernels: int) -> list[float]:
        """Seconds each kernel of a program built with render(profile=True) takes in one run."""
        return self._helper().profile(program, self._inputs_key(inputs), kernels)

    @property
    def fingerprint(self) -> str:
        """What measured times depend on: this CPU's model and flags, and how many cores it has."""
        return f"{native_cpu.cpu_fingerprint()}|{os.cpu_count()} cpus"

    def memory(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            return None

    def _helper(self) -> measure.Runner:
        if self._runner is None:
            raise RuntimeError("programs load, run and time on the CPU within CpuDevice.session()")
        return self._runner

    def _inputs_key(self, inputs: Mapping[str, np.ndarray]) -> str:
        """The key the helper holds `inputs` under, sent the first time they are used."""
        known = self._input_keys.get(id(inputs))
        if known is not None and known[0] is inputs:
            return known[1]
        key = f"inputs-{len(self._input_keys)}"
        self._input_keys[id(inputs)] = (inputs, key)
        self._helper().put_inputs(key, dict(inputs))
        return key


# ---- CUDA ----------------------------------------------------------------------------------------


class CudaDevice:
    """A GPU through a `Driver` (compiler.backends.cuda): programs built by NVRTC for the target's
    compute capability `arch`, loaded as a GPU runtime loads them (CudaProgram: arena, launch
    plan, one CUDA graph per call layout) and timed by the driver's device clock."""

    measures = True

    def __init__(self, driver: Any, arch: str, name: str | None = None) -> None:
        self.driver = driver
        self.arch = arch
        self.name = name or f"{driver.name} ({driver.arch})"

    @property
    def fingerprint(self) -> str:
        """What measured times depend on: the GPU's name and compute capability (a kernel cache's key)."""
        return f"{self.name}|{self.arch}"

    @property
    def has_cublas(self) -> bool:
        """Whether products may run as cuBLAS calls here."""
        return self.driver.has_cublas

    def build(self, source: str) -> dict[str, bytes]:
        ptx, cubin = compile_cuda(source, self.arch)
        return {"program.ptx": ptx, "program.cubin": cubin}

    def load(self, name: str, kernel: Mapping[str, Any], weights: Mapping[str, np.ndarray], binaries: Mapping[str, bytes]) -> CudaProgram:
        return CudaProgram(kernel, weights, binaries, self.driver)

    def run(self, program: CudaProgram, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return program.run(inputs)

    def time(self, program: CudaProgram, inputs: Mapping[str, np.ndarray]) -> float:
        """Device seconds of one call (the first with a layout also captures its CUDA graph)."""
        program.run(inputs)
        return program.last_device_seconds

    def profile(self, program: CudaProgram, inputs: Mapping[str, np.ndarray]) -> list[float | None]:
        """Device seconds of each launch, the kernels launched one by one (None: nothing to compute)."""
        return program.profile(inputs)

    def memory(self) -> int | None:
        return getattr(self.driver, "memory_bytes", None)

    def close(self) -> None:
        """Gives the device back (its stream, and cuBLAS's handle and workspace)."""
        self.driver.close()


class EmulatedCudaDevice(CudaDevice):
    """The CUDA path without a GPU: the same build (NVRTC, for the artifact), the same CudaProgram,
    its launches run by the CPU emulation. Its times are the emulation's, so it does not measure."""

    measures = False

    def __init__(self, arch: str) -> None:
        from compiler.backends.cuda_emulator import EmulatedDriver  # builds with the C++ compiler

        super().__init__(EmulatedDriver(), arch, "cpu emulation")

    def memory(self) -> int | None:
        return None  # (host memory, as much as the process may take)


def cuda_device(arch: str) -> CudaDevice:
    """This machine's GPU when it is of compute capability `arch`, else the emulation."""
    driver = _gpu_of_arch(arch)
    return CudaDevice(driver, arch) if driver is not None else EmulatedCudaDevice(arch)


def _gpu_of_arch(arch: str):
    """GPU 0 through the driver API when this machine has one of that compute capability."""
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable

    try:
        driver = CudaDriver(0)
    except CudaUnavailable:
        return None
    return driver if driver.arch == arch else None


__all__ = ["CpuDevice", "CudaDevice", "Device", "EmulatedCudaDevice", "cuda_device"]
