"""Loading artifacts onto a device and executing batches on it, timing the device work alone.

    cpu.py       the CPU device (load, execute)
    cuda.py      a GPU device: CUDA programs on one GPU through a compiler.backends.cuda Driver
    batching.py  joining requests into one batch and splitting the outputs back
    runtime.py   one runtime per device: loads artifacts on demand, evicts idle ones
    process.py   the runtime process of the distributed mode (`luminal-cloud runtime`): a
                 runtime serving its versions' Redis streams with the scheduler's batching policy
                 and wire messages (not imported here: the scheduler imports this package)
"""

from runtime.cpu import CpuDevice
from runtime.runtime import BatchResult, Runtime

__all__ = ["BatchResult", "CpuDevice", "CudaDevice", "Runtime"]


def __getattr__(name: str) -> object:
    # the GPU device on first use: its CUDA programs import the compiler's CUDA renderer and,
    # through it, the search and egglog, which a CPU runtime process has no use for at its start
    if name == "CudaDevice":
        from runtime.cuda import CudaDevice

        return CudaDevice
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
