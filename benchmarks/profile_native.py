"""Where a generated native program spends its time, kernel by kernel.

    .venv/bin/python benchmarks/profile_native.py bert_minilm --sizes batch=1,seq=128
    .venv/bin/python benchmarks/profile_native.py resnet_cnn --sizes batch=1 --top 15
    .venv/bin/python benchmarks/profile_native.py tests/fixtures/hf/mobilenet_v2_dynamo.onnx --sizes batch=8
    .venv/bin/python benchmarks/profile_native.py tests/fixtures/hf/vit_dynamo.onnx --sizes batch=8 --searched-graph --fuse-attention

Lowers a model of benchmarks/models.py the way the compiler's native-blas candidate does, renders
it with per-kernel timers, runs it --repeats times and prints the kernels that took the most
time: their kind (loop nest, reduction, GEMM), shape, work, and the primitive node they compute.
The total of the kernels is compared with onnxruntime's time for the same inputs in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import models
from compiler.backends import native_cpu
from compiler.frontends.onnx import load_graph
from compiler.kernels.attention import fuse_attention
from compiler.kernels.fusion import fuse
from compiler.kernels.ir import AttentionCall, GemmCall, LoopKernel
from compiler.kernels.lower import lower
from compiler.reference import bind_symbols
from compiler.render.c import (
    ATTENTION_HEAD_MAX,
    GEMM_KINDS,
    LOOP_FORMS,
    depthwise_of,
    prepack_weights,
    render,
    transposed_packable,
)
from compiler.search.extract import search_graph
from compiler.shape import evaluate


def describe(kernel: LoopKernel | GemmCall | AttentionCall, graph, bindings: dict[str, int]) -> tuple[str, str, float]:
    """(kind, shape, multiply-adds or elements) of a kernel at these sizes."""
    size = lambda dims: [evaluate(d, bindings) for d in dims]
    if isinstance(kernel, GemmCall):
        batch, m, n, k = size(kernel.batch), *size((kernel.m, kernel.n, kernel.k))
        count = float(np.prod(batch)) if batch else 1.0
        flags = ("T" if kernel.trans_a else "N") + ("T" if kernel.trans_b else "N")
        return f"gemm {flags}", f"{batch}x[{m}x{k}]@[{k}x{n}]", count * m * n * k
    if isinstance(kernel, AttentionCall):  # (multiply-adds of its two products)
        scores = kernel.scores
        batch, m, n = size(scores.batch), *size((scores.m, scores.n))
        count = float(np.prod(batch)) if batch else 1.0
        return "attention", f"{batch}x[{m}x{n}] heads {scores.k}, {kernel.values.n}", count * m * n * (scores.k + kernel.values.n)
    shape = size(kernel.shape)
    work = float(np.prod(shape)) if shape else 1.0
    if kernel.reduce is not None:
        extents = size(kernel.reduce[1])
        work *= float(np.prod(extents)) if extents else 1.0
        return f"{kernel.reduce[0]}-reduce", f"{shape} over {extents}", work
    return "loop", str(shape), work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help=f"one of {sorted(models.BUILDERS)}, or the path of an .onnx file")
    parser.add_argument("--sizes", default="batch=1,seq=128", help="symbolic dims, e.g. batch=8,seq=128")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--searched-graph", action="store_true", help="lower the graph the compiler's e-graph search rewrote, as a compile does")
    parser.add_argument("--threads", type=int, default=0, help="threads for both runtimes (0: their defaults)")
    parser.add_argument("--gemm", choices=GEMM_KINDS, default="blas", help="how float32 GEMMs run")
    parser.add_argument("--fuse-attention", action="store_true", help="each attention the kernel rules find as one kernel (online softmax)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read when the program loads OpenMP
    sizes = {k: int(v) for k, v in (item.split("=") for item in args.sizes.split(",") if item)}
    if args.model in models.BUILDERS:
        data = models.BUILDERS[args.model]()
    elif args.model.endswith(".onnx") and Path(args.model).is_file():
        data = Path(args.model).read_bytes()
    else:
        parser.error(f"{args.model!r} is neither a model of benchmarks/models.py nor an .onnx file")
    graph = load_graph(data)
    inputs = models.sample_inputs(data, sizes, int_high=args.vocab)
    if args.searched_graph:
        graph, _ = search_graph(graph, True)
    program = fuse(lower(graph))  # as the compiler's candidates are
    if args.fuse_attention:  # as the native-searched-attention candidate has it
        program = fuse_attention(program, ATTENTION_HEAD_MAX)
    gemm = args.gemm
    if args.gemm == "transposed":  # the products whose A is a weight transposed, the others by panels
        chosen = [n for n, k in enumerate(program.kernels) if transposed_packable(program, k)]
        program = prepack_weights(program, transposed=chosen)
        gemm = {n: "transposed" if n in chosen else "panels" for n, k in enumerate(program.kernels) if isinstance(k, GemmCall)}
    elif args.gemm == "depthwise":  # depthwise convolutions' products plane by plane, the others by OpenBLAS
        gemm = {n: "depthwise" for n, k in enumerate(program.kernels) if depthwise_of(k) is not None}
    elif args.gemm not in ("blas", *LOOP_FORMS):  # as the compiler's generated candidates do
        program = prepack_weights(program)
    if gemm in LOOP_FORMS:  # the products that have a loop form run it, the others call OpenBLAS
        gemm = {n: args.gemm for n, k in enumerate(program.kernels) if isinstance(k, GemmCall) and k.loops is not None}
    library = native_cpu.build(render(program, profile=True, gemm=gemm))
    runner = native_cpu.NativeProgram(native_cpu.describe(program, graph.size_limits), program.weights, library)
    runner.run(inputs)
    seconds = (ctypes.c_double * max(1, len(program.kernels))).in_dll(runner._library, "lc_kernel_seconds")
    ctypes.memset(seconds, 0, ctypes.sizeof(seconds))
    began = time.perf_counter()
    for _ in range(args.repeats):
        runner.run(inputs)
    wall_ms = (time.perf_counter() - began) * 1000 / args.repeats

    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    session.run(None, inputs)
    began = time.perf_counter()
    for _ in range(args.repeats):
        session.run(None, inputs)
    ort_ms = (time.perf_counter() - began) * 1000 / args.repeats

    bindings = bind_symbols(graph, {k: v for k, v in inputs.items()})
    rows = []
    for n, kernel in enumerate(program.kernels):
        kind, shape, work = describe(kernel, graph, bindings)
        node = graph.nodes[kernel.node].op.value if kernel.node >= 0 else "-"
        rows.append((seconds[n] * 1000 / args.repeats, n, kind, shape, work, node))
    total = sum(r[0] for r in rows)
    by_kind: dict[str, float] = {}
    for ms, _, kind, *_ in rows:
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    print(f"{args.model} {sizes}: {len(program.kernels)} kernels, {total:.2f} ms in kernels, "
          f"{wall_ms:.2f} ms a call, onnxruntime {ort_ms:.2f} ms")
    print("by kind: " + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(by_kind.items(), key=lambda t: -t[1])))
    print(f"{'ms':>8} {'%':>5} {'#':>4}  {'kind':<12} {'node':<11} {'GFLOP/s|Gel/s':>13}  shape")
    for ms, n, kind, shape, work, node in sorted(rows, reverse=True)[: args.top]:
        rate = work / (ms / 1000) / 1e9 * (2 if kind.startswith(("gemm", "attention")) else 1) if ms > 0 else 0.0
        print(f"{ms:8.3f} {100 * ms / total:5.1f} {n:4d}  {kind:<12} {node:<11} {rate:13.2f}  {shape}")


if __name__ == "__main__":
    main()
