"""Service processes the integration tests start for real: each in its own process group, its
output in a log file the test can read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from api.server import free_port
from cloud.settings import Settings

__all__ = ["ServiceProcess", "flushed_redis", "free_port", "settings_env"]


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings (the ones tests change)."""
    return {
        **os.environ,
        "LUMINAL_DATA_DIR": str(settings.data_dir),
        "LUMINAL_DATABASE_URL": settings.database_url,
        "LUMINAL_REDIS_URL": settings.redis_url,
        "LUMINAL_COMPILE_BACKEND": settings.compile_backend,
        "LUMINAL_REQUEST_QUEUE": settings.request_queue,
        "LUMINAL_COMPILE_CANDIDATES": '["native-blas"]',
        "LUMINAL_COMPILE_TIMEOUT_S": str(settings.compile_timeout_s),
        "LUMINAL_TARGETS": '["' + '","'.join(settings.targets) + '"]',
        "LUMINAL_MAX_BATCH_ROWS": str(settings.max_batch_rows),
        "LUMINAL_MAX_QUEUE_DELAY_MS": str(settings.max_queue_delay_ms),
        "LUMINAL_RUNTIME_MEMORY_BYTES": str(settings.runtime_memory_bytes),
        "LUMINAL_RUNTIME_HEARTBEAT_S": str(settings.runtime_heartbeat_s),
        "LUMINAL_RUNTIME_CLAIM_IDLE_S": str(settings.runtime_claim_idle_s),
        "LUMINAL_WORKER_METRICS_PORT": str(settings.worker_metrics_port),
    }


class ServiceProcess:
    """`luminal-cloud <args>` in its own process group."""

    def __init__(self, settings: Settings, log: Path, *args: str, ready_text: str) -> None:
        self.log = log
        self.ready_text = ready_text
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "luminal_cloud.cli", *args],
                env=settings_env(settings), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_text in self.text():
                return
            if self.process.poll() is not None:
                raise AssertionError(f"the process exited ({self.process.returncode}):\n{self.text()}")
            time.sleep(0.1)
        raise AssertionError(f"the process was not ready in {timeout} s:\n{self.text()}")

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole group: no handler runs, nothing is cleaned up."""
        self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def flushed_redis(db: int) -> Iterator[str]:
    """For a fixture: the URL of the local Redis's database `db`, emptied before and after (a
    test module's own database, so queues, leases and streams start empty)."""
    url = f"redis://127.0.0.1:6379/{db}"
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.flushdb()
    except redis.exceptions.ConnectionError as exc:
        pytest.fail(f"these tests need the local Redis at {url}, which is unreachable: {exc}")
    yield url
    client.flushdb()
    client.close()
