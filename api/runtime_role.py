"""The runtime role's wiring: a runtime built from settings (also the gateway's own, embedded),
and the runtime process of `luminal-cloud runtime`.

Apart from api/services.py, which wires the gateway, so that a runtime process starts without
importing what only a gateway uses (the database layer, the registry, the compile queue and
Celery, the request codecs), nor, on a CPU, the GPU's modules: a runtime that a request at zero
waits for starts that much sooner.
"""

from __future__ import annotations

import logging
import signal
import time

import redis
from prometheus_client import start_http_server

from cloud.errors import LuminalError, Unavailable
from cloud.metrics import REGISTRY, PrometheusObserver
from cloud.settings import Settings
from cloud.storage import ObjectStore, load_artifact, make_object_store
from compiler import Artifact
from compiler.targets import GPU_TYPES
from runtime import CpuDevice, Runtime
from runtime.cuda import parse_device

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
    from runtime.process import RuntimeConfig, RuntimeProcess

    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2)
    _wait_for_redis(client, settings.redis_url)
    runtime_store = make_object_store(settings)
    runtime = build_runtime(settings, runtime_store, device)
    config = RuntimeConfig(
        device=parse_device(device)[0],  # the device type requests are placed by
        heartbeat_s=settings.runtime_heartbeat_s,
        claim_idle_s=settings.runtime_claim_idle_s,
        max_batch_rows=settings.max_batch_rows,
        max_delay_s=settings.max_queue_delay_ms / 1000.0,
        adaptive_batching=settings.adaptive_batching,
        prices=dict(settings.price_per_second),
    )
    observer = PrometheusObserver()

    def generation():
        # the generation modules load with the first sequence, not at a runtime's cold start
        from runtime.tokenizer import CodecCache
        from scheduler.generating import GenerationService, generation_settings

        # the store the runtime fetches artifacts from gives the tokenizers too
        return GenerationService(
            {config.device: runtime}, CodecCache(runtime_store), None, config.prices, generation_settings(settings), observer
        )

    process = RuntimeProcess(client, runtime, config, observer, generation)
    signal.signal(signal.SIGTERM, process.stop)
    signal.signal(signal.SIGINT, process.stop)
    if settings.runtime_metrics_port:
        start_http_server(settings.runtime_metrics_port, registry=REGISTRY)
    process.serve()


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
