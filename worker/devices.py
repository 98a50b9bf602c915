"""Which targets a compile may be run for here, given the device this process holds.

A GPU target's compile picks its schedule by timing candidates on a GPU of that type, so a worker
takes a GPU target's queue only when its device (`luminal-cloud worker --device cuda:0`) has that
type's compute capability. Without one the target is refused, unless
LUMINAL_ALLOW_UNMEASURED_COMPILE lets this process compile it anyway: the default schedule,
verified in the CPU emulation, never timed. Such a version's report says so under UNMEASURED, and
a worker holding the device compiles it again when it starts (worker/celery_app.py).

`check_targets` is the whole decision, over a GpuProbe: tests hand it a fake one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from compiler.targets import GPU_TYPES, KNOWN_TARGETS, is_gpu
from registry import UNMEASURED
from runtime.cuda import parse_device

log = logging.getLogger(__name__)

# the setting that lets a process without a target's GPU compile it anyway (cloud/settings.py)
ALLOW_UNMEASURED_SETTING = "LUMINAL_ALLOW_UNMEASURED_COMPILE"


@dataclass(frozen=True)
class FoundGpu:
    """The GPU a probe found at an ordinal."""

    ordinal: int
    # as the driver names it: "NVIDIA H100 80GB HBM3"
    name: str
    # its compute capability as NVRTC's architecture: "sm_90"
    arch: str


class NoGpu(Exception):
    """There is no usable GPU at the ordinal asked; the message says why."""


# GPU ordinal -> the GPU there, or NoGpu naming why there is none
type GpuProbe = Callable[[int], FoundGpu]


def probe_cuda(ordinal: int) -> FoundGpu:
    """The GPU at `ordinal`, asked through the CUDA driver (opened and closed again)."""
    from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable

    try:
        driver = CudaDriver(ordinal)
    except CudaUnavailable as exc:
        raise NoGpu(str(exc)) from None
    try:
        return FoundGpu(ordinal, driver.name, driver.arch)
    finally:
        driver.close()


@dataclass(frozen=True)
class TargetCheck:
    """What a process may compile, target by target, in the order they were asked for."""

    # compiled on the device they are for: cpu, and GPU types whose GPU this process holds
    measured: tuple[str, ...] = ()
    # GPU types compiled without their GPU, as the setting allows: the default schedule, untimed
    unmeasured: tuple[str, ...] = ()
    # target -> why this process refuses it
    refused: dict[str, str] = field(default_factory=dict)
    # the GPU ordinal the measured GPU targets' compiles run on (None: no GPU target is measured)
    gpu_ordinal: int | None = None

    @property
    def accepted(self) -> tuple[str, ...]:
        return (*self.measured, *self.unmeasured)


def known_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """`targets` (settings.targets); ValueError naming the setting and the choices for one the
    compiler has no device type for: checked here, where the compiler is, not in
    cloud/settings.py, whose import must not import the compiler."""
    unknown = sorted(set(targets) - set(KNOWN_TARGETS))
    if unknown:
        raise ValueError(f"unknown targets {unknown} in LUMINAL_TARGETS; known: {list(KNOWN_TARGETS)}")
    return tuple(targets)


def check_targets(
    targets: Sequence[str], device: str | None, probe: GpuProbe, allow_unmeasured: bool
) -> TargetCheck:
    """Sorts `targets` by what `device` can do for them. `device` is "cpu", a GPU and its ordinal
    ("cuda:0", "h100:1"), or None for GPU 0 (the one the compiler times on) when a GPU target is
    asked for. A GPU target is measured when that GPU's compute capability is the target type's,
    else unmeasured when `allow_unmeasured`, else refused with a message naming the target, what
    was found and the setting. ValueError for a device that is not one of those forms."""
    ordinal = _gpu_ordinal(device)
    gpu_targets = [t for t in targets if is_gpu(t)]
    found: FoundGpu | None = None
    missing = "this process was given no GPU (--device cpu)"
    if gpu_targets and ordinal is not None:
        try:
            found = probe(ordinal)
        except NoGpu as exc:
            missing = f"this process found no GPU at cuda:{ordinal} ({exc})"
    measured: list[str] = []
    unmeasured: list[str] = []
    refused: dict[str, str] = {}
    for target in targets:
        if not is_gpu(target) or (found is not None and found.arch == GPU_TYPES[target].arch):
            measured.append(target)
        elif allow_unmeasured:
            unmeasured.append(target)
        else:
            refused[target] = _refusal(target, found, missing)
    gpu_measured = any(is_gpu(t) for t in measured)
    return TargetCheck(tuple(measured), tuple(unmeasured), refused, ordinal if gpu_measured else None)


def _gpu_ordinal(device: str | None) -> int | None:
    if device is None:
        return 0
    kind, ordinal = parse_device(device)
    if kind == "cpu":
        return None
    if kind not in GPU_TYPES:
        raise ValueError(
            f"device {device!r} is not known; use cpu, or a GPU type ({', '.join(GPU_TYPES)}) and its ordinal: cuda:0"
        )
    return ordinal


def _refusal(target: str, found: FoundGpu | None, missing: str) -> str:
    arch = GPU_TYPES[target].arch
    where = missing if found is None else f"the GPU at cuda:{found.ordinal} is a {found.name} ({found.arch})"
    return (
        f"target {target!r} is compiled on a GPU of its compute capability ({arch}), and {where}. Compile it "
        f"where such a GPU is (luminal-cloud worker --targets {target} --device cuda:N), or set "
        f"{ALLOW_UNMEASURED_SETTING}=true to compile it without one (the default schedule, not timed; compiled "
        f"again when a worker holding an {arch} GPU starts)"
    )


def unmeasured_label(target: str) -> dict[str, str]:
    """What the report of a version compiled without its GPU says, under UNMEASURED."""
    arch = GPU_TYPES[target].arch
    return {
        "why": f"compiled where there is no {target} GPU ({arch}), as {ALLOW_UNMEASURED_SETTING} allows: the "
        "default schedule, verified in a CPU emulation, not timed",
        "recompile_when": f"a worker holding an {arch} GPU for {target} starts",
    }


def is_unmeasured(report: dict[str, Any] | None) -> bool:
    return bool(report) and UNMEASURED in report


def show_only_gpu(ordinal: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Makes GPU `ordinal` the only one this process's children see: the compiler times on GPU 0,
    which is then the worker's own (when CUDA_VISIBLE_DEVICES is set already: its `ordinal`th entry)."""
    if ordinal == 0:
        return
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[ordinal] if visible else str(ordinal)
