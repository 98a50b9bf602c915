"""Serving latency and throughput of a small MLP through real HTTP, in one run: the embedded path
against the distributed one (gateway + a runtime process over Redis Streams), with batching on
and with a max batch size of 1, at concurrency 1, 16 and 64; and, on the embedded path at
concurrency 64, a wide MLP whose device time dominates, where batching pays.

    .venv/bin/python benchmarks/serving.py [--seconds 5] [--redis redis://127.0.0.1:6379/13] [--no-wide]

Each configuration starts `luminal-cloud serve` (and, distributed, one `luminal-cloud runtime`)
as separate processes on one data directory, so the model compiles once. Latency is measured by
the load generator per request: one keep-alive HTTP/1.1 connection per client on uvloop, in this
process, sharing the machine with the server. "Overhead" is a request's latency minus the device
time of the batch it ran in, the time the service itself adds; "server CPU ms/req" is the CPU
time the gateway and runtime processes used per answered request. The Redis database given is
emptied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.server import free_port
from api.services import open_database
from benchmarks.models import mlp
from cloud.auth import create_key
from cloud.settings import Settings
from luminal_cloud import Client

# the model: its device time (0.1-0.3 ms) is far below what the gateway spends on a
# request, so Python in the gateway bounds its throughput, with or without batching
WIDTHS = (256, 512, 512, 10)
CONCURRENCY = (1, 16, 64)
# a model whose device time dominates (a batch-1 run reads its 64 MiB of weights): where
# batching pays, shown at the highest concurrency, on the embedded path
WIDE_WIDTHS = (256, 4096, 4096, 10)
WIDE_CONCURRENCY = (64,)


def start(args: list[str], env: dict[str, str], log: Path, ready: str, timeout: float = 120) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115  the child writes to it for its lifetime
    process = subprocess.Popen(
        [sys.executable, "-m", "luminal_cloud.cli", *args], env=env, stdout=out, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + timeout
    while ready not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{args[0]} did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return process


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


class Connection:
    """One keep-alive HTTP/1.1 connection that sends a prepared request and reads its reply: a
    load generator costing tens of microseconds a request, where httpx costs about a millisecond
    and, sharing the 2 cores with the server, would measure itself more than the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        return cls(*await asyncio.open_connection(host, port))

    async def send(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def infer_request(port: int, key: str, model: str) -> bytes:
    x = np.random.default_rng(0).standard_normal((1, WIDTHS[0])).astype(np.float32).tolist()
    body = json.dumps({"inputs": {"features": x}}).encode()
    head = (
        f"POST /v1/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def load(port: int, key: str, model: str, concurrency: int, seconds: float) -> tuple:
    """(latencies s, overheads s, batch sizes, failed requests, wall s) of `concurrency` clients
    sending back to back, each on its own connection."""
    request = infer_request(port, key, model)
    latencies, overheads, batches, errors = [], [], [], []
    connections = [await Connection.open("127.0.0.1", port) for _ in range(concurrency)]
    try:
        for connection in connections:  # warm: the model loads, connections open
            status, reply = await connection.send(request)
            if status != 200:
                raise SystemExit(f"warm-up request failed with {status}: {reply[:500]!r}")
        stop_at = time.perf_counter() + seconds

        async def client(connection: Connection) -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                try:
                    status, reply = await connection.send(request)
                except (ConnectionError, asyncio.IncompleteReadError):
                    errors.append(1)  # a dropped connection: counted, this client stops
                    return
                elapsed = time.perf_counter() - started
                if status != 200:
                    errors.append(status)
                    continue
                usage = json.loads(reply)["usage"]
                latencies.append(elapsed)
                # each request is one row: the batch ran for its share times the batch's rows
                overheads.append(elapsed - usage["exec_ms"] / 1000 * usage["batch_rows"])
                batches.append(usage["batch_size"])

        began = time.perf_counter()
        await asyncio.gather(*(client(c) for c in connections))
        wall = time.perf_counter() - began
    finally:
        for connection in connections:
            connection.close()
    return latencies, overheads, batches, errors, wall


def cpu_seconds(processes: list[subprocess.Popen]) -> float:
    """User and system CPU time the processes have used so far (Linux /proc)."""
    total = 0
    for process in processes:
        fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="load per configuration and concurrency")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13", help="a Redis database this run may empty")
    parser.add_argument("--modes", default="embedded,distributed")
    parser.add_argument(
        "--no-wide", dest="wide", action="store_false", help="skip the device-bound model's rows"
    )
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="luminal-serving-"))
    settings = Settings(data_dir=workdir / "data")
    db = open_database(settings)
    key = create_key(db, "bench")
    db.dispose()
    rows = []
    for mode in args.modes.split(","):
        for batching in (True, False):
            redis.Redis.from_url(args.redis).flushdb()
            port = free_port()
            env = {
                **os.environ,
                "LUMINAL_DATA_DIR": str(settings.data_dir),
                "LUMINAL_REDIS_URL": args.redis,
                "LUMINAL_REQUEST_QUEUE": "redis" if mode == "distributed" else "embedded",
                "LUMINAL_MAX_BATCH_ROWS": "32" if batching else "1",
                "LUMINAL_MAX_QUEUE_REQUESTS": "1024",
            }
            label = f"{mode}-{'batch' if batching else 'b1'}"
            processes = []
            try:
                if mode == "distributed":
                    processes.append(start(["runtime"], env, workdir / f"{label}-runtime.log", "serving device"))
                processes.append(
                    start(["serve", "--port", str(port)], env, workdir / f"{label}-serve.log", "Application startup complete")
                )
                models = [("mlp", WIDTHS, CONCURRENCY)]
                if mode == "embedded" and args.wide:
                    models.append(("wide-mlp", WIDE_WIDTHS, WIDE_CONCURRENCY))
                for model, widths, concurrencies in models:
                    with Client(f"http://127.0.0.1:{port}", key) as client:
                        client.deploy(mlp(widths), name=model)
                    for concurrency in concurrencies:
                        cpu_before = cpu_seconds(processes)
                        latencies, overheads, batches, errors, wall = asyncio.run(
                            load(port, key, model, concurrency, args.seconds), loop_factory=uvloop.new_event_loop
                        )
                        answered = max(1, len(latencies) + len(errors))
                        rows.append(
                            (
                                "-".join(map(str, widths)),
                                mode,
                                "on" if batching else "max 1",
                                concurrency,
                                percentile(latencies, 0.5) * 1000,
                                percentile(latencies, 0.99) * 1000,
                                len(latencies) / wall,
                                statistics.mean(batches),
                                percentile(overheads, 0.5) * 1000,
                                (cpu_seconds(processes) - cpu_before) / answered * 1000,
                                len(errors),
                            )
                        )
                        print(_row(rows[-1]), flush=True)
            finally:
                for process in reversed(processes):
                    stop(process)
    print()
    print(_table(rows))


HEADER = (
    "model", "path", "batching", "concurrency", "p50 ms", "p99 ms", "req/s", "mean batch", "p50 overhead ms",
    "server CPU ms/req", "failed",
)


def _row(row: tuple) -> str:
    model, mode, batching, concurrency, p50, p99, rate, batch, overhead, cpu, failed = row
    return (
        f"| {model} | {mode} | {batching} | {concurrency} | {p50:.2f} | {p99:.2f} | {rate:.0f} | {batch:.1f} | {overhead:.2f} "
        f"| {cpu:.2f} | {failed} |"
    )


def _table(rows: list[tuple]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + [_row(r) for r in rows])


if __name__ == "__main__":
    main()
