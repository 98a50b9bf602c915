"""The runtime role's wiring: a runtime built from settings (also the gateway's own, embedded),
and the runtime process of `luminal-cloud runtime`.

Apart from api/services.py, which wires the gateway, so that a runtime process starts without
importing what only a gateway uses (the database layer, the registry, the compile queue and
Celery, the request codecs): a runtime that a request at zero waits for starts that much sooner.
For the same reason the compiler and the runtime are imported inside the functions, after a
starting process has begun reading the artifacts of the requests already waiting for it
(PrefetchingStore): the download and the imports overlap.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import redis

from cloud.errors import LuminalError, Unavailable
from cloud.settings import Settings
from cloud.storage import ObjectStore, load_artifact, make_object_store
from scheduler import wire

if TYPE_CHECKING:
    from runtime import Runtime

log = logging.getLogger(__name__)

# the share of a GPU's memory loaded programs' weights may take (the rest: arenas, CUDA graphs)
GPU_WEIGHTS_FRACTION = 0.8
# how long a runtime process waits for Redis to answer at start before it gives up
REDIS_WAIT_S = 5.0


def build_runtime(settings: Settings, store: ObjectStore, device: str = "cpu") -> Runtime:
    """The runtime of a device ("cpu", or a GPU type and ordinal: "cuda:0", "h100:1"), in the
    gateway (embedded) or a runtime process: artifacts from the object store, at most
    max_loaded_models within its memory budget (runtime_memory_bytes on a CPU, a share of the
    GPU's memory on a GPU), idle ones gone after idle_unload_s (the engine's janitor or the
    runtime process's heartbeat calls unload_idle). A GPU that cannot be used is a LuminalError
    naming why."""
    from cloud.metrics import PrometheusObserver
    from compiler import Artifact
    from compiler.targets import GPU_TYPES
    from runtime import CpuDevice, Runtime
    from runtime.cuda import parse_device

    def fetch(key: str) -> Artifact:
        return load_artifact(store, key, Artifact.from_files)

    target, ordinal = parse_device(device)
    if target == "cpu":
        device_object, budget = CpuDevice(), settings.runtime_memory_bytes
    elif target in GPU_TYPES:
        # the GPU's modules only where a GPU is used: they import the compiler's CUDA renderer
        from compiler.backends.cuda_driver import CudaDriver, CudaUnavailable
        from runtime import CudaDevice

        try:
            driver = CudaDriver(ordinal)
        except CudaUnavailable as exc:
            raise LuminalError(f"device {device!r} cannot be used: {exc}") from None
        device_object, budget = CudaDevice(target, driver), int(driver.memory_bytes * GPU_WEIGHTS_FRACTION)
    else:
        raise LuminalError(f"device {device!r} is not known; use cpu or a GPU type ({', '.join(GPU_TYPES)}) and ordinal")
    return Runtime(
        device_object,
        fetch,
        settings.max_loaded_models,
        settings.idle_unload_s,
        budget,
        observer=PrometheusObserver(),
    )


def run_runtime_process(settings: Settings, device: str) -> None:
    """`luminal-cloud runtime`: a runtime process built from settings, serving until SIGTERM or
    SIGINT; its /metrics on runtime_metrics_port when one is set. Unavailable, naming it, when
    Redis or the object store cannot be reached at start."""
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2)
    _wait_for_redis(client, settings.redis_url)
    device_type = device.partition(":")[0]
    store = PrefetchingStore(make_object_store(settings), waiting_artifacts(client, device_type))
    # the heavy imports, while the artifacts of the requests waiting for this runtime download
    from prometheus_client import start_http_server

    from cloud.metrics import REGISTRY, PrometheusObserver
    from runtime.process import RuntimeConfig, RuntimeProcess

    runtime = build_runtime(settings, store, device)
    config = RuntimeConfig(
        device=device_type,  # the device type requests are placed by
        heartbeat_s=settings.runtime_heartbeat_s,
        claim_idle_s=settings.runtime_claim_idle_s,
        max_batch_rows=settings.max_batch_rows,
        max_delay_s=settings.max_queue_delay_ms / 1000.0,
        adaptive_batching=settings.adaptive_batching,
        prices=dict(settings.price_per_second),
    )
    process = RuntimeProcess(client, runtime, config, PrometheusObserver())
    signal.signal(signal.SIGTERM, process.stop)
    signal.signal(signal.SIGINT, process.stop)
    if settings.runtime_metrics_port:
        start_http_server(settings.runtime_metrics_port, registry=REGISTRY)
    process.serve()


def waiting_artifacts(client: redis.Redis, device_type: str, most: int = 2) -> list[str]:
    """The artifact keys of the oldest requests waiting in the device type's pool stream (a pool
    at zero starting its first runtime), the first `most` distinct ones."""
    keys: list[str] = []
    try:
        entries = client.xrange(wire.pool_stream(device_type), count=64)
    except redis.RedisError:
        return keys
    for _, fields in entries:
        try:
            key = json.loads(fields[b"meta"])["route"]["artifact_key"]
        except (KeyError, ValueError, TypeError):
            continue
        if key not in keys:
            keys.append(key)
        if len(keys) == most:
            break
    return keys


class PrefetchingStore:
    """A starting runtime process's object store: the files of the given artifacts are read in a
    thread meanwhile (their manifest, then the files it lists), and handed out once each; every
    other read, and any the thread failed, goes to the store itself."""

    def __init__(self, store: ObjectStore, artifact_keys: list[str]) -> None:
        self.store = store
        self._keys = artifact_keys
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._prefetch, name="prefetch", daemon=True)
        if artifact_keys:
            self._thread.start()

    def _prefetch(self) -> None:
        for key in self._keys:
            try:
                manifest = self.store.get(f"{key}/manifest.json")
                self._keep(f"{key}/manifest.json", manifest)
                for name in json.loads(manifest).get("files", []):
                    if name != "manifest.json":
                        self._keep(f"{key}/{name}", self.store.get(f"{key}/{name}"))
            except Exception as exc:  # noqa: BLE001  a cache: the runtime reads it itself, with its errors
                log.info("prefetching %s stopped (%s); it is read on first use", key, exc)
                return

    def _keep(self, key: str, data: bytes) -> None:
        with self._lock:
            self._files[key] = data

    def get(self, key: str) -> bytes:
        if any(key.startswith(f"{prefetched}/") for prefetched in self._keys):
            self._thread.join()  # rather than reading it twice
        with self._lock:
            data = self._files.pop(key, None)
        return self.store.get(key) if data is None else data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def _wait_for_redis(client: redis.Redis, url: str) -> None:
    deadline = time.monotonic() + REDIS_WAIT_S
    while True:
        try:
            client.ping()
            return
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                from cloud.db import masked_url  # the one masker; its database layer only on this failure

                raise Unavailable(f"Redis at {masked_url(url)} is unreachable: {exc}") from None
            time.sleep(0.5)
