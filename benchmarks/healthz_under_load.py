"""How long /healthz takes while large inference bodies arrive and are decoded.

    .venv/bin/python benchmarks/healthz_under_load.py [--body-mb 16] [--requests 6] [--concurrency 2]

Starts `luminal-cloud serve` as its own process on a temporary data directory, deploys a model
whose input is [batch, 8192] float32, then sends `--requests` bodies of about `--body-mb` MB
(`--concurrency` at a time) while another thread asks /healthz every 20 ms. Prints the /healthz
latency (median, p99, max) and the large requests' latency, twice in one run: with the default
codec (large bodies decoded in a child process) and with every body decoded in a server thread.
The issue's bar: /healthz within 100 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.server import free_port

WIDTH = 8192


def row_sum_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        "row_sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def probe(url: str, stop, results) -> None:
    """Asks /healthz every 20 ms until stopped; puts the latencies in ms."""
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/healthz").raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(0.02)
    results.put(latencies)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--body-mb", type=float, default=16.0)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    print("| decoded in | what | median ms | p99 ms | max ms | samples |")
    print("|---|---|---|---|---|---|")
    for label, threshold in (("child process", None), ("server thread", str(2**40))):
        measure(args, label, threshold)


def measure(args: argparse.Namespace, label: str, codec_threshold: str | None) -> None:
    cli = str(Path(sys.executable).with_name("luminal-cloud"))
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "LUMINAL_DATA_DIR": data_dir}
        if codec_threshold is not None:
            env["LUMINAL_CODEC_PROCESS_ABOVE_BYTES"] = codec_threshold
        created = subprocess.run(
            [cli, "admin", "create-key", "--tenant", "bench"], env=env, capture_output=True, check=True
        )
        key = created.stdout.decode().split()[-1]
        port = free_port()
        server = subprocess.Popen([cli, "serve", "--port", str(port)], env=env, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            run(url, key, args, label)
        finally:
            server.terminate()
            server.wait(timeout=30)


def run(url: str, key: str, args: argparse.Namespace, label: str) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=120) as client:
        deadline = time.monotonic() + 60
        while True:
            try:
                client.get("/healthz")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        reply = client.post(
            "/v1/models", headers=headers, files={"file": ("m.onnx", row_sum_model())}, data={"name": "rows"}
        )
        reply.raise_for_status()
        while client.get("/v1/models/rows", headers=headers).json()["versions"][-1]["status"] != "ready":
            time.sleep(0.1)
        rows = max(1, int(args.body_mb * 1e6 / (WIDTH * 20)))  # a float32 as JSON: about 20 characters
        x = np.random.default_rng(0).random((rows, WIDTH), dtype=np.float32)
        body = json.dumps({"inputs": {"x": x.tolist()}}).encode()
        expected = x.sum(axis=1, keepdims=True)
        # a small request first, so the decoder's first start is not counted
        client.post("/v1/models/rows/infer", headers=headers, content=body).raise_for_status()

        def send(_: int) -> float:
            started = time.perf_counter()
            reply = client.post("/v1/models/rows/infer", headers=headers, content=body)
            reply.raise_for_status()
            got = np.asarray(reply.json()["outputs"]["y"], np.float32)
            np.testing.assert_allclose(got, expected, rtol=1e-4)
            return (time.perf_counter() - started) * 1000

        # the prober is its own process: in this one, the senders' interpreter lock would delay it
        context = multiprocessing.get_context("spawn")
        stop, results = context.Event(), context.Queue()
        prober = context.Process(target=probe, args=(url, stop, results))
        prober.start()
        with ThreadPoolExecutor(args.concurrency) as pool:
            infer_ms = list(pool.map(send, range(args.requests)))
        stop.set()
        health = results.get(timeout=60)
        prober.join()
    what = f"infer ({len(body) / 1e6:.1f} MB body, {args.concurrency} at a time)"
    for name, values in (("/healthz", health), (what, infer_ms)):
        print(
            f"| {label} | {name} | {statistics.median(values):.1f} | {percentile(values, 0.99):.1f} "
            f"| {max(values):.1f} | {len(values)} |"
        )


if __name__ == "__main__":
    main()
