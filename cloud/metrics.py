"""The one metrics registry. Everything exported at /metrics is declared here.

Series about a tenant's models carry the tenant; the model label only ever holds names of
models that exist (UNKNOWN_MODEL otherwise), so random names cannot grow the registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

UNKNOWN_MODEL = "(unknown)"
# the tenant label of a request made with no tenant's key (operators' routes, refused keys)
NO_TENANT = "(none)"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter(
    "luminal_inference_requests_total",
    "Inference requests by tenant, model and outcome",
    ["tenant", "model", "status"],
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "luminal_inference_latency_seconds",
    "End-to-end inference latency at the gateway",
    ["tenant", "model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
# what a client did, not the server: kept apart so that it never reads as a server error
CLIENT_EVENTS = Counter(
    "luminal_client_events_total",
    "Requests whose client left mid-body (client_disconnected) or whose body stalled (body_timeout), "
    "by route kind (infer, upload, other)",
    ["tenant", "route", "event"],
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "luminal_queue_wait_seconds",
    "Time a request waited in the batching queue (never billed)",
    ["tenant", "model"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "luminal_batch_size_requests",
    "Requests per executed batch",
    ["tenant", "model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    registry=REGISTRY,
)
EXECUTION_SECONDS = Counter(
    "luminal_execution_seconds_total",
    "Measured device time of executed batches",
    ["tenant", "model", "target"],
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "luminal_generation_tokens_total",
    "Tokens of finished generations: kind=prompt (read) or completion (generated)",
    ["tenant", "model", "kind"],
    registry=REGISTRY,
)
BILLED_SECONDS = Counter(
    "luminal_billed_seconds_total",
    "Execution seconds billed, by tenant",
    ["tenant"],
    registry=REGISTRY,
)
MODEL_LOAD_SECONDS = Histogram(
    "luminal_model_load_seconds",
    "Time to load an artifact onto a device (cold start, never billed)",
    ["target"],
    registry=REGISTRY,
)
COLD_START_SECONDS = Histogram(
    "luminal_cold_start_seconds",
    "Cold start of an answered request (never billed): waiting for a runtime of its device type to "
    "start when its pool was at zero, and loading its model",
    ["tenant", "model", "target"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30, 60),
    registry=REGISTRY,
)
LOADED_MODELS = Gauge(
    "luminal_loaded_models", "Artifacts loaded on devices", ["target"], registry=REGISTRY
)
COMPILES = Counter(
    "luminal_compiles_total", "Compile jobs by outcome (ready, cached, failed)", ["status"], registry=REGISTRY
)
COMPILE_SECONDS = Histogram(
    "luminal_compile_seconds",
    "Compile job duration (never billed)",
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
    registry=REGISTRY,
)
QUEUE_REJECTIONS = Counter(
    "luminal_queue_rejections_total", "Requests refused because a queue was full", ["tenant", "model"],
    registry=REGISTRY,
)


class PrometheusObserver:
    """The runtime's, the scheduler's and the compile worker's observer
    (runtime.runtime.RuntimeObserver, scheduler.observer.SchedulerObserver,
    worker.observer.CompileObserver) as the series above; built where they are wired."""

    def model_loaded(self, target: str, seconds: float) -> None:
        MODEL_LOAD_SECONDS.labels(target).observe(seconds)

    def models_loaded_now(self, target: str, count: int) -> None:
        LOADED_MODELS.labels(target).set(count)

    def batch_executed(
        self, tenant: str, model: str, target: str, requests: int, exec_seconds: float, billed_seconds: float
    ) -> None:
        BATCH_SIZE.labels(tenant, model).observe(requests)
        EXECUTION_SECONDS.labels(tenant, model, target).inc(exec_seconds)
        BILLED_SECONDS.labels(tenant).inc(billed_seconds)

    def queue_waited(self, tenant: str, model: str, seconds: float) -> None:
        QUEUE_WAIT.labels(tenant, model).observe(seconds)

    def request_rejected(self, tenant: str, model: str) -> None:
        QUEUE_REJECTIONS.labels(tenant, model).inc()

    def cold_started(self, tenant: str, model: str, target: str, seconds: float) -> None:
        COLD_START_SECONDS.labels(tenant, model, target).observe(seconds)

    def generation_finished(
        self, tenant: str, model: str, target: str, prompt_tokens: int, completion_tokens: int, billed_seconds: float
    ) -> None:
        GENERATED_TOKENS.labels(tenant, model, "prompt").inc(prompt_tokens)
        GENERATED_TOKENS.labels(tenant, model, "completion").inc(completion_tokens)
        EXECUTION_SECONDS.labels(tenant, model, target).inc(billed_seconds)
        BILLED_SECONDS.labels(tenant).inc(billed_seconds)

    def compile_finished(self, status: str, seconds: float) -> None:
        COMPILES.labels(status).inc()
        COMPILE_SECONDS.observe(seconds)
