"""The demo: a real server on 127.0.0.1, a sample model, concurrent requests, and the bill."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

from api.server import BackgroundServer
from api.services import open_database
from cloud.auth import create_key
from cloud.settings import Settings
from luminal_cloud import Client


def sample_mlp(seed: int = 0) -> onnx.ModelProto:
    """A 16 -> 64 -> 64 -> 10 classifier with a symbolic batch dimension."""
    rng = np.random.default_rng(seed)
    sizes = [16, 64, 64, 10]
    nodes, inits, prev = [], [], "features"
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal(n_out) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"h{i}"]))
        prev = f"h{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [prev], [f"r{i}"]))
            prev = f"r{i}"
    nodes.append(helper.make_node("Softmax", [prev], ["probabilities"], axis=1))
    graph = helper.make_graph(
        nodes,
        "demo_mlp",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    # IR version 10: what both onnxruntime and the onnx checker accept
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def batches_by_size(batch_sizes: list[int]) -> dict[int, int]:
    """How many batches ran with each number of requests, from what each request was told (a
    batch of k requests tells each of its k requests k)."""
    return {size: count // size for size, count in sorted(Counter(batch_sizes).items())}


def leave_sample(sample_dir: Path, model: onnx.ModelProto) -> tuple[Path, Path]:
    """The sample model and an input for it, for the commands of the README's "Using it"."""
    sample_dir.mkdir(parents=True, exist_ok=True)
    model_path, input_path = sample_dir / "demo-mlp.onnx", sample_dir / "features.npy"
    onnx.save(model, model_path)
    np.save(input_path, np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32))
    return model_path, input_path


def run_demo(settings: Settings, port: int = 0, requests: int = 24, sample_dir: Path | None = None) -> None:
    db = open_database(settings)
    key = create_key(db, "demo")
    db.dispose()
    demo_dir = settings.data_dir / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    model_path = demo_dir / "mlp.onnx"
    model = sample_mlp()
    onnx.save(model, model_path)
    reference = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    rng = np.random.default_rng(1)
    payloads = [rng.standard_normal((1 + i % 3, 16)).astype(np.float32) for i in range(requests)]

    with BackgroundServer(settings, port) as server, Client(server.url, key) as client:
        print(f"server: {server.url}   data: {settings.data_dir}")
        started = time.perf_counter()
        version = client.deploy(model_path, name="demo-mlp")
        print(f"deployed demo-mlp v{version['version']}: {version['status']} in "
              f"{time.perf_counter() - started:.2f}s; signature inputs {version['signature']['inputs']}")

        def call(x: np.ndarray):
            t0 = time.perf_counter()
            reply = client.infer("demo-mlp", {"features": x})
            return reply, time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(call, payloads))

        worst = 0.0
        for x, (reply, _) in zip(payloads, results):
            got = np.asarray(reply["outputs"]["probabilities"], dtype=np.float32)
            want = reference.run(None, {"features": x})[0]
            worst = max(worst, float(np.max(np.abs(got - want))))
        if worst > 1e-4:
            raise SystemExit(f"outputs differ from onnxruntime by {worst:.3g}")

        first_reply = results[0][0]
        print(f"\nfirst request ({payloads[0].shape[0]} row) -> probabilities:")
        print(np.round(np.asarray(first_reply["outputs"]["probabilities"]), 4))
        batches = batches_by_size([r["usage"]["batch_size"] for r, _ in results])
        latencies = sorted(t for _, t in results)
        print(f"\n{requests} concurrent requests: all match onnxruntime (max abs diff {worst:.2e})")
        print(f"they ran in {sum(batches.values())} batches: "
              + ", ".join(f"{n} of {size} request{'s' if size > 1 else ''}" for size, n in batches.items()))
        print(f"latency per request: median {statistics.median(latencies) * 1000:.1f} ms, "
              f"max {latencies[-1] * 1000:.1f} ms")

        bill = client.usage()
        print(f"\nbill for tenant {bill['tenant']!r}:")
        print(f"{'model':<12}{'version':>8}{'requests':>10}{'rows':>6}{'billed s':>12}{'$/s':>10}{'cost $':>14}")
        for item in bill["items"]:
            print(f"{item['model']:<12}{item['version']:>8}{item['requests']:>10}{item['rows']:>6}"
                  f"{item['billed_seconds']:>12.6f}{item['price_per_second']:>10.5f}{item['cost']:>14.10f}")
        print(f"total: {bill['total_billed_seconds']:.6f} s billed, ${bill['total_cost']:.10f}")
    if sample_dir is not None:
        model_path, input_path = leave_sample(sample_dir, model)
        print(f"\nleft for you: {model_path} (input 'features', [batch, 16]) and {input_path} (2 rows);")
        print(f"  luminal-cloud deploy {model_path} --name mlp")
        print(f"  luminal-cloud predict mlp --input features={input_path}")
