"""Container health checks for the image's three roles (docker-compose.yml runs them):

    python deploy/healthcheck.py gateway [--port 8000]   the gateway answers /readyz
    python deploy/healthcheck.py runtime                 the runtime answers /metrics (LUMINAL_RUNTIME_METRICS_PORT)
    python deploy/healthcheck.py worker                  this container's Celery worker answers a ping

Exits 0 when healthy, 1 otherwise."""

from __future__ import annotations

import argparse
import socket
import sys
import urllib.request

from cloud.settings import Settings

TIMEOUT_S = 5.0


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200
    except OSError:
        return False


def worker_answers(settings: Settings) -> bool:
    # a ping needs the broker alone: the worker's own app (worker.celery_app) would import the
    # compiler, seconds of every check
    from celery import Celery

    # a worker names itself compile-<targets>@<hostname>-<pid>; the hostname is this container's
    mine = f"@{socket.gethostname()}-"
    replies = Celery("luminal", broker=settings.redis_url).control.ping(timeout=TIMEOUT_S)
    return any(mine in name for reply in replies for name in reply)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["gateway", "runtime", "worker"])
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port")
    args = parser.parse_args()
    settings = Settings()
    if args.role == "gateway":
        healthy = answers(f"http://127.0.0.1:{args.port}/readyz")
    elif args.role == "runtime":
        healthy = bool(settings.runtime_metrics_port) and answers(
            f"http://127.0.0.1:{settings.runtime_metrics_port}/metrics"
        )
    else:
        healthy = worker_answers(settings)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
