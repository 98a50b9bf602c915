"""One runtime per device: loads artifacts on demand, runs batches, unloads idle models."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from compiler import Artifact, Signature
from compiler.kv_layout import CacheLayout
from runtime.batching import concat_requests, split_outputs
from runtime.kv_cache import KVStorage

log = logging.getLogger(__name__)

T = TypeVar("T")


class DoesNotFit(Exception):
    """A model's program does not fit in its device's memory even with every other unloaded."""


@dataclass
class LoadedProgram:
    """A program a device has loaded and what serving it needs; the artifact itself is not kept,
    so a program holds only the weights its code reads (a weight replaced by packed panels leaves)."""

    signature: Signature
    program: object
    # memory held while loaded: the weights the program reads (and a CPU program's native code)
    resident_bytes: int


class RuntimeObserver(Protocol):
    """What a runtime reports for operators' metrics (cloud/metrics.py holds the Prometheus one)."""

    def model_loaded(self, target: str, seconds: float) -> None:
        """An artifact was loaded onto a device of this type: a cold start, never billed."""

    def models_loaded_now(self, target: str, count: int) -> None:
        """How many artifacts this runtime holds after a load or an unload."""


class _NoObserver:
    def model_loaded(self, target: str, seconds: float) -> None:
        pass

    def models_loaded_now(self, target: str, count: int) -> None:
        pass


NO_OBSERVER: RuntimeObserver = _NoObserver()


@dataclass
class BatchResult:
    # one output dict per request, in the order given
    outputs: list[dict[str, np.ndarray]]
    # measured device time of the batch: the only time that is billed
    exec_seconds: float
    # time spent loading the artifact first (0 when warm); recorded, never billed
    load_seconds: float


class Runtime:
    def __init__(
        self,
        device,
        fetch_artifact: Callable[[str], Artifact],
        max_loaded: int = 8,
        idle_unload_s: float = 600.0,
        memory_budget_bytes: int | None = None,
        observer: RuntimeObserver = NO_OBSERVER,
    ) -> None:
        self.device = device
        self.observer = observer
        self._fetch = fetch_artifact
        self._max_loaded = max_loaded
        self._idle_unload_s = idle_unload_s
        # loaded programs' weights may take this much; the least recently used leave first
        self.memory_budget_bytes = memory_budget_bytes
        # artifact key -> (loaded program, last used); most recently used last
        self._loaded: OrderedDict[str, tuple[object, float]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        # batches under way per loaded program (by id), and programs unloaded while in use: the
        # device releases a program (a GPU's memory) only once no batch uses it
        self._users: dict[int, int] = {}
        self._retired: dict[int, object] = {}
        # one batch at a time on the device, so measured time is the batch's alone
        self._device_lock = threading.Lock()
        self._load_lock = threading.Lock()

    @property
    def loaded_keys(self) -> list[str]:
        return list(self._loaded)

    @property
    def loaded_bytes(self) -> int:
        return sum(self._sizes.values())

    def _ensure_loaded(self, key: str) -> tuple[object, float]:
        """The loaded program, counted as in use until _done_with."""
        with self._load_lock:
            program, load_seconds = self._load(key)
            self._users[id(program)] = self._users.get(id(program), 0) + 1
            return program, load_seconds

    def _done_with(self, program: object) -> None:
        with self._load_lock:
            self._users[id(program)] -= 1
            if not self._users[id(program)]:
                del self._users[id(program)]
                if self._retired.pop(id(program), None) is not None:
                    self.device.release(program)

    def _drop_unused(self, keep: str) -> bool:
        """Unloads the least recently used program other than `keep` that no batch is using
        (under _load_lock); False when there is none."""
        for key, (program, _) in self._loaded.items():
            if key != keep and not self._users.get(id(program)):
                self._drop(key)
                self.observer.models_loaded_now(self.device.target, len(self._loaded))
                return True
        return False

    def _drop(self, key: str) -> None:
        """Forget a loaded program (under _load_lock); released now, or after its last batch."""
        program, _ = self._loaded.pop(key)
        self._sizes.pop(key, None)
        if self._users.get(id(program)):
            self._retired[id(program)] = program
        else:
            self.device.release(program)

    def _load(self, key: str) -> tuple[object, float]:
        """The loaded program and the seconds its loading took (0 when it was loaded), under
        _load_lock; the least recently used leave past the count or the memory budget."""
        if key in self._loaded:
            program, _ = self._loaded.pop(key)
            self._loaded[key] = (program, time.monotonic())
            return program, 0.0
        started = time.perf_counter()
        artifact = self._fetch(key)
        fetched = time.perf_counter()
        while True:
            try:
                program = self.device.load(artifact)
                break
            except MemoryError as exc:
                # room made by unloading the least recently used programs no batch is using
                if not self._drop_unused(keep=key):
                    raise DoesNotFit(f"model {key!r} does not fit in this device's free memory: {exc}") from None
        load_seconds = time.perf_counter() - started
        log.info("loaded %s: fetched in %.3f s, loaded onto %s in %.3f s", key, fetched - started,
                 self.device.target, load_seconds - (fetched - started))
        self._loaded[key] = (program, time.monotonic())
        self._sizes[key] = program.resident_bytes
        while len(self._loaded) > 1 and (
            len(self._loaded) > self._max_loaded
            or (self.memory_budget_bytes is not None and self.loaded_bytes > self.memory_budget_bytes)
        ):
            self._drop(next(iter(self._loaded)))
        self.observer.model_loaded(self.device.target, load_seconds)
        self.observer.models_loaded_now(self.device.target, len(self._loaded))
        return program, load_seconds

    def unload_idle(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._load_lock:
            idle = [k for k, (_, used) in self._loaded.items() if now - used >= self._idle_unload_s]
            for key in idle:
                self._drop(key)
            self.observer.models_loaded_now(self.device.target, len(self._loaded))
        return idle

    def unload(self, key: str) -> None:
        with self._load_lock:
            if key in self._loaded:
                self._drop(key)
            self.observer.models_loaded_now(self.device.target, len(self._loaded))

    def signature(self, key: str):
        """The loaded program's signature (loading it if need be)."""
        program, _ = self._ensure_loaded(key)
        try:
            return program.signature
        finally:
            self._done_with(program)

    def run_batch(
        self, key: str, requests: Sequence[Mapping[str, np.ndarray]], rows: Sequence[int], busy: bool = False
    ) -> BatchResult:
        """`busy`: more requests are waiting for the device (a program then keeps its threads
        for large work only, leaving the CPU to the server taking those requests)."""
        program, load_seconds = self._ensure_loaded(key)
        try:
            signature = program.signature
            batch = concat_requests(signature, requests)
            with self._device_lock:
                while True:
                    try:
                        outputs, exec_seconds = self.device.execute(program, batch, busy=busy)
                        break
                    except MemoryError:
                        # a GPU's batch memory is its program's arena: other programs' weights
                        # leave first; with none left to unload, the batch is too large
                        with self._load_lock:
                            if not self._drop_unused(keep=key):
                                raise
        finally:
            self._done_with(program)
        return BatchResult(split_outputs(signature, outputs, rows), exec_seconds, load_seconds)

    def run_on_device(self, key: str, work: Callable[[object], T]) -> T:
        """`work(program)` on the loaded program (the device's own: a CudaProgram on a GPU), the
        program held loaded and the device to itself: a generation step whose inputs already lie
        in device memory (runtime.cuda.DeviceKVStorage.run_paged)."""
        loaded, _ = self._ensure_loaded(key)
        try:
            with self._device_lock:
                while True:
                    try:
                        return work(loaded.program)
                    except MemoryError:
                        # as in run_batch: other programs' weights leave first
                        with self._load_lock:
                            if not self._drop_unused(keep=key):
                                raise
        finally:
            self._done_with(loaded)

    def kv_storage(self, layout: CacheLayout, pool_slots: int) -> KVStorage:
        """A generative model's KV cache pools in this device's memory (the device's kv_storage:
        a GPU's own, a CPU's host memory, which its programs read in place)."""
        return self.device.kv_storage(layout, pool_slots, self._device_lock)
