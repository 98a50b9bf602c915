"""The one settings class. Every environment variable is declared here (prefix LUMINAL_).

Importing it imports no compiler (a container's health check reads it): names the compiler owns,
the targets and compile candidates, are checked where compiles are set up (worker/queue.py).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    return Path.home() / ".luminal-cloud"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LUMINAL_", extra="ignore")

    # where embedded state lives: the object store folder and the SQLite database
    data_dir: Path = Field(default_factory=_default_data_dir)
    # SQLAlchemy URL; empty means SQLite inside data_dir
    database_url: str = ""
    # "local" keeps objects under data_dir/objects; "s3" in the bucket below (S3, MinIO)
    object_store: Literal["local", "s3"] = "local"
    # the S3 endpoint; empty means AWS itself (MinIO in compose: http://minio:9000)
    s3_endpoint_url: str = ""
    # the bucket holding graphs and artifacts, created at start when missing
    s3_bucket: str = "luminal-cloud"
    # the bucket's region (AWS needs it to sign requests; MinIO accepts any)
    s3_region: str = "us-east-1"
    # credentials; both empty means boto3's own chain (environment, instance role)
    s3_access_key_id: str = ""
    s3_secret_access_key: SecretStr = SecretStr("")
    # "embedded" compiles in child processes of the server; "celery" sends each compile to the
    # Celery workers (`luminal-cloud worker`) through the broker at redis_url
    compile_backend: Literal["embedded", "celery"] = "embedded"
    # the Redis of the distributed mode: Celery's broker and result backend
    redis_url: str = "redis://127.0.0.1:6379/0"
    # a compile that meets a storage or database outage is retried this often, with backoff
    compile_max_retries: int = 5
    # compiles at a time, taken round-robin across tenants
    compile_workers: int = 1
    # of those, how many one tenant may hold at once (0: half, rounded up), so that one tenant's
    # long compiles leave the others a slot
    compile_slots_per_tenant: int = Field(default=0, ge=0)
    # one more compile slot, for graphs smaller than this many bytes only, so that a small model
    # never waits behind a giant (0: no such slot); on Celery these go first in their queue
    compile_small_graph_bytes: int = Field(default=10 * 1024 * 1024, ge=0)
    # each compile's limits: wall time, and address space of its process
    compile_timeout_s: float = 600.0
    compile_memory_bytes: int = 8 * 1024**3
    # the programs each cpu compile builds, verifies and times, keeping the fastest (names of
    # compiler/tuning.py's KNOWN_CANDIDATES); empty: the compiler's default, its CANDIDATES
    compile_candidates: tuple[str, ...] = ()
    # whether cpu compiles run the search (an e-graph that removes work) before generating code
    compile_search: bool = True
    # seconds the schedule search may spend measuring a model's kernels after every kernel's first
    # alternative (winners are cached by kernel and device: a second model pays for new kernels only)
    compile_search_seconds: float = Field(default=30.0, ge=0)
    # device types a model may be provisioned for: "cpu" and GPU types of compiler/targets.py
    # ("cuda", the default GPU type, "h100", "h200", "a100", "l4"), checked against its
    # KNOWN_TARGETS where compiles are set up; a GPU type is compiled where its GPU is (below) and
    # served by GPU runtimes
    targets: tuple[str, ...] = ("cpu",)
    # a GPU type is compiled where a GPU of its compute capability is (a worker's --device, GPU 0
    # for the embedded server); true lets a process without one compile it anyway: the default
    # schedule, verified in a CPU emulation, not timed, its report labelled "unmeasured" until a
    # worker holding that GPU starts and compiles it again
    allow_unmeasured_compile: bool = False
    # largest accepted upload, in bytes
    max_upload_bytes: int = 200 * 1024 * 1024
    # uploads one tenant may have in flight at once on a gateway (one more gets 429 with
    # Retry-After before its body is read), and all tenants together
    max_uploads_per_tenant: int = Field(default=2, ge=1)
    max_concurrent_uploads: int = Field(default=8, ge=1)
    # quotas: models a tenant may keep, and versions one model may keep (403 past them; 0: none)
    max_models_per_tenant: int = Field(default=100, ge=0)
    max_versions_per_model: int = Field(default=100, ge=0)
    # largest inference request body, in bytes (JSON); far below uploads, since it is decoded whole
    max_infer_body_bytes: int = 32 * 1024 * 1024
    # request bodies and responses at least this large are decoded and rendered in child
    # processes (this many), so a big JSON parse never holds the server's interpreter lock
    codec_process_above_bytes: int = 1024 * 1024
    codec_workers: int = 1
    # a request body that sends no bytes for this long gets 408 and its connection is closed; it
    # is idle time per chunk, not a total, so a large upload at any steady pace is never cut off
    body_read_timeout_s: float = Field(default=30.0, gt=0)
    # a gateway remembers a key's tenant this long: a key revoked through another gateway or the
    # command line keeps working here for at most this long (through this gateway: at once)
    auth_cache_ttl_s: float = Field(default=5.0, ge=0)
    # batching policy, per model version
    max_batch_rows: int = 32
    max_queue_delay_ms: float = 5.0
    # wait for company only while requests arrive faster than a batch runs (and no longer than a
    # batch takes); false: every partial batch waits max_queue_delay_ms
    adaptive_batching: bool = True
    max_queue_requests: int = 256
    # a request still queued or running after this long gets 504
    request_timeout_s: float = 30.0
    # hint sent with 429 when a queue is full
    retry_after_s: int = 1
    # largest tensor a request may carry or produce, in elements
    max_request_elements: int = 16 * 1024 * 1024
    # largest size a request may give a symbolic dimension: the batch symbol, every other
    # symbol (sequence lengths and the like), and overrides by symbol name ({"seq": 512})
    max_batch_dim: int = 256
    max_sequence_dim: int = 4096
    dim_limits: dict[str, int] = {}
    # working memory one request may need while it runs; a model's dim limits are lowered until
    # its largest request fits, and a request estimated above it gets 413 before running
    max_request_memory_bytes: int = 4 * 1024**3
    # price of one second of execution, per device type
    price_per_second: dict[str, float] = {
        "cpu": 0.00002, "cuda": 0.0004, "h100": 0.0004, "h200": 0.0005, "a100": 0.0003, "l4": 0.0001,
    }
    # generation (language models): each loaded generative model's KV cache takes this much of
    # its runtime's memory, in blocks of this many tokens; a step feeds at most this many tokens
    # (decodes first, then prompt chunks of at most generation_prefill_tokens) for at most
    # generation_max_sequences sequences; more wait in the model's queue for blocks
    generation_kv_cache_bytes: int = Field(default=256 * 1024**2, ge=1024)
    generation_block_tokens: int = Field(default=16, ge=1, le=1024)
    generation_step_tokens: int = Field(default=512, ge=1)
    generation_prefill_tokens: int = Field(default=256, ge=1)
    generation_max_sequences: int = Field(default=64, ge=1)
    # a generation's sequences waiting for the cache beyond this many get 429
    generation_max_waiting: int = Field(default=256, ge=0)
    # compiled models kept loaded per runtime, and how long an idle one stays
    max_loaded_models: int = 8
    idle_unload_s: float = 600.0
    # "embedded" runs models in the server's own runtime; "redis" queues each request on a Redis
    # stream per model version, served by `luminal-cloud runtime` processes (the gateway runs none)
    request_queue: Literal["embedded", "redis"] = "embedded"
    # a runtime process's memory for loaded programs (least recently used leave first); a model
    # larger than every runtime's budget is refused with 503
    runtime_memory_bytes: int = 8 * 1024**3
    # a runtime renews its announcement this often; one silent for three periods is dead
    runtime_heartbeat_s: float = 1.0
    # a request taken by a runtime and left unanswered this long is taken over by another
    runtime_claim_idle_s: float = 10.0
    # port of a runtime process's /metrics (0: none)
    runtime_metrics_port: int = 0
    # port of a Celery compile worker's /metrics: its compile counts and times (0: none)
    worker_metrics_port: int = 0
    # bearer token an operator's scraper sends to /metrics; empty serves /metrics only to clients
    # on this machine (the metrics name tenants and their billed seconds)
    metrics_token: str = ""
    # a log line per HTTP request from the gateway; off by default, as in Triton: at thousands of
    # requests a second it costs a tenth of a small request, and /metrics already counts them
    access_log: bool = False

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_dir / 'luminal.db'}"

    @property
    def objects_dir(self) -> Path:
        return self.data_dir / "objects"


@lru_cache
def get_settings() -> Settings:
    return Settings()
