"""Our CUDA programs against PyTorch on one GPU, eager and torch.compile (mode reduce-overhead,
which replays CUDA graphs), in float32 with TF32 off and in float16, all measured in one run.

    python3 benchmarks/cuda_vs_torch.py                          # every model, both precisions
    python3 benchmarks/cuda_vs_torch.py --models mlp,bert --precisions float16 --repeats 30
    python3 benchmarks/cuda_vs_torch.py --write docs/performance.md
    python3 benchmarks/cuda_vs_torch.py --dry-run                # no GPU: tiny models, the CPU emulation

It needs torch, torchvision and transformers besides the project (the GPU machines' image has
them). The models: an MLP 256-512-512-10 (batch 1 and 64); ResNet-50 (torchvision, 224x224, batch
1 and 8); a BERT encoder of all-MiniLM-L6-v2's shape (transformers' BertModel: 6 layers, 384 wide,
12 heads; sequence 128, batch 1, 8 and 32); GPT-2 small (GPT2LMHeadModel: 12 layers, 768 wide;
sequence 128, batch 1 and 8, no KV cache). Weights are random (seed 0): speed does not depend on them.

Each model is exported once to ONNX (torch.onnx.export with dynamic batch and sequence) and
compiled by our compiler for this GPU's type once per precision: float32 is the upload option
precision="exported", float16 is precision="float16" (weights and intermediates in float16,
products on tensor cores, float32 sums). The compile races its schedules on this GPU, cuBLAS's
among them (`--no-cublas` leaves it out).

Every row times the same work on both sides, on two bases, in one run:
- device-resident: inputs already on the GPU and outputs left there. PyTorch runs the module
  (`.half()` for float16, on half inputs) on tensors made once; ours is `CudaProgram.run_on_device`
  on the same kind of tensors (addresses and shapes: no host copy either way), its launch plan
  replayed as one CUDA graph.
- serving: NumPy in, NumPy out, as a request is served. PyTorch does `torch.from_numpy(x).cuda()`
  per input (and `.half()` in float16), runs, and `.float().cpu().numpy()` (the model's interface
  is float32 in both precisions, ours too); ours is `CudaProgram.run`: inputs copied in and outputs
  copied out through page-locked staging blocks, the outputs returned as views of a lent block.
Both bases against torch eager and torch.compile (mode reduce-overhead, which replays CUDA graphs).

Times are medians of synchronized wall-clock per call after warm-ups; for ours also the CUDA-event
time around the graph launch (what is billed: `ours events`). `ours/compile` divides our wall time
by torch.compile's on the same basis (below 1 is faster). `max err` compares our outputs with
eager's at the same precision, relative to eager's largest magnitude. Compile seconds: ours is the
whole compile (search, NVRTC, verification and timing on this GPU) once per model and precision;
torch.compile's is its first call at each size (it compiles per shape).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import revision, write_section

SECTION_BEGIN, SECTION_END = "<!-- cuda-benchmark:begin -->", "<!-- cuda-benchmark:end -->"
WARMUPS = 3
SEQUENCE = 128


@dataclass(frozen=True)
class Model:
    """A torch module to build, its inputs at a batch size, and the batch sizes measured."""

    name: str
    build: Callable[[bool], object]
    inputs: Callable[[int, bool], dict[str, np.ndarray]]
    batches: tuple[int, ...]
    # the ONNX input axes that are dynamic: {input: {axis: symbol}}
    dynamic: dict[str, dict[int, str]]


def _mlp(tiny: bool):
    from torch import nn

    widths = (16, 32, 32, 10) if tiny else (256, 512, 512, 10)
    layers: list = []
    for index in range(len(widths) - 1):
        layers.append(nn.Linear(widths[index], widths[index + 1]))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _resnet50(tiny: bool):
    import torchvision

    # a dry run emulates every thread on the CPU: ResNet-18's blocks, not ResNet-50's wide ones
    return torchvision.models.resnet18(weights=None, num_classes=10) if tiny else torchvision.models.resnet50(weights=None)


def _bert(tiny: bool):
    from torch import nn
    from transformers import BertConfig, BertModel

    if tiny:
        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    else:  # all-MiniLM-L6-v2's shape
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    config._attn_implementation = "eager"  # exports to plain ops; sdpa's export differs by version

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(config, add_pooling_layer=False)

        def forward(self, input_ids, attention_mask):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return Encoder()


def _gpt2(tiny: bool):
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        config = GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    else:  # GPT-2 small
        config = GPT2Config()
    config._attn_implementation = "eager"

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = GPT2LMHeadModel(config)

        def forward(self, input_ids):
            return self.gpt2(input_ids=input_ids, use_cache=False).logits

    return Decoder()


def _sequence(tiny: bool) -> int:
    return 8 if tiny else SEQUENCE


def _ids(batch: int, tiny: bool, vocab: int) -> np.ndarray:
    return np.random.default_rng(batch).integers(0, 100 if tiny else vocab, (batch, _sequence(tiny)), dtype=np.int64)


MODELS = {
    "mlp": Model(
        "mlp", _mlp, lambda b, tiny: {"x": np.random.default_rng(b).standard_normal((b, 16 if tiny else 256), dtype=np.float32)},
        (1, 64), {"x": {0: "batch"}},
    ),
    "resnet50": Model(
        "resnet50", _resnet50,
        lambda b, tiny: {"image": np.random.default_rng(b).standard_normal((b, 3, *((32, 32) if tiny else (224, 224))), dtype=np.float32)},
        (1, 8), {"image": {0: "batch"}},
    ),
    "bert": Model(
        "bert", _bert,
        lambda b, tiny: {"input_ids": _ids(b, tiny, 30522), "attention_mask": np.ones((b, _sequence(tiny)), np.int64)},
        (1, 8, 32), {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
    ),
    "gpt2": Model("gpt2", _gpt2, lambda b, tiny: {"input_ids": _ids(b, tiny, 50257)}, (1, 8), {"input_ids": {0: "batch", 1: "seq"}}),
}


def export_onnx(module, example: dict[str, np.ndarray], dynamic: dict[str, dict[int, str]]) -> bytes:
    """The module as ONNX bytes with its dynamic axes (the dynamo exporter; TorchScript's if it fails)."""
    import io

    import onnx
    import torch
    from torch.export import Dim

    args = tuple(torch.from_numpy(v) for v in example.values())
    dims = {symbol: Dim(symbol, min=1, max=1024) for axes in dynamic.values() for symbol in axes.values()}
    try:
        program = torch.onnx.export(
            module, args, input_names=list(example), output_names=["output"], dynamo=True,
            dynamic_shapes=tuple({axis: dims[symbol] for axis, symbol in dynamic[name].items()} for name in example),
        )
        return program.model_proto.SerializeToString()
    except Exception as exc:  # noqa: BLE001 - the older exporter is the fallback
        print(f"  dynamo export failed ({type(exc).__name__}: {str(exc)[:200]}); TorchScript exporter", flush=True)
    buffer = io.BytesIO()
    torch.onnx.export(
        module, args, buffer, input_names=list(example), output_names=["output"], opset_version=17, dynamo=False,
        dynamic_axes={name: dict(axes) for name, axes in dynamic.items()},
    )
    return onnx.load_from_string(buffer.getvalue()).SerializeToString()


def median_ms(run: Callable[[], object], repeats: int, synchronize: Callable[[], None]) -> float:
    """The median milliseconds of `run` (synchronized) after WARMUPS calls."""
    for _ in range(WARMUPS):
        run()
    synchronize()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def kernel_breakdown(program, source: str, feeds: dict[str, np.ndarray]) -> str:
    """Our device time by kind of kernel, each launched alone (CUDA events between launches):
    where the time goes, for the next round of schedules."""
    seconds = program.profile(feeds)
    by_kind: dict[str, list[float]] = {}
    for (function, *_), spent in zip(program.launches, seconds):
        if spent is None:
            continue
        if function == "cublas" or function.endswith("_windows"):  # (a product's im2col before cuBLAS)
            by_kind.setdefault("cublas product" if function == "cublas" else "windows", []).append(spent)
            continue
        body = source[source.index(f" {function}(const lc_symbols S") :]
        body = body[: body.find('extern "C"') if 'extern "C"' in body else len(body)]
        kind = (
            "attention" if "lc_qs[" in body else "product" if "lc_as[" in body
            else "reduction" if "__shfl_down_sync" in body else "elementwise"
        )
        by_kind.setdefault(kind, []).append(spent)
    ranked = sorted(by_kind.items(), key=lambda item: -sum(item[1]))
    return ", ".join(f"{kind} {1000 * sum(times):.3f} ms ({len(times)})" for kind, times in ranked)


@dataclass
class Basis:
    """One basis's medians (ms): ours (wall clock, and CUDA events around the graph), eager and
    torch.compile (nan where it did not run: a dry run)."""

    ours: float
    ours_events: float
    eager: float
    compiled: float


@dataclass
class Row:
    model: str
    batch: int
    precision: str
    device: Basis  # inputs and outputs on the GPU
    serving: Basis  # NumPy in, NumPy out
    error: float
    ours_compile_s: float
    torch_compile_s: float


@dataclass(frozen=True)
class Setup:
    """Where and how a run measures: timed calls a row, whether it is a dry run (tiny models on
    the CPU), torch's device, our driver and GPU type, and how to wait for torch's work."""

    repeats: int
    dry_run: bool
    device: object
    driver: object
    target: str
    synchronize: Callable[[], None]


def measure_model(spec: Model, precisions: list[str], setup: Setup, failures: list[str]) -> list[Row]:
    import torch

    torch.manual_seed(0)
    module = spec.build(setup.dry_run).eval()
    started = time.perf_counter()
    data = export_onnx(module, spec.inputs(2, setup.dry_run), spec.dynamic)
    print(f"{spec.name}: exported in {time.perf_counter() - started:.1f} s ({len(data) / 1e6:.1f} MB)", flush=True)
    rows = []
    for precision in precisions:
        try:
            rows += _measure_precision(spec, module, data, precision, setup)
        except Exception as exc:  # noqa: BLE001 - one precision failing leaves the others' rows
            failures.append(f"{spec.name} {precision}: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
    return rows


def _measure_precision(spec: Model, module, data: bytes, precision: str, setup: Setup) -> list[Row]:
    import torch

    from compiler import compile_onnx
    from compiler.backends.cuda import CudaProgram

    rows = []
    started = time.perf_counter()
    artifact = compile_onnx(data, setup.target, precision="exported" if precision == "float32" else precision)
    ours_compile_s = time.perf_counter() - started
    report = artifact.report
    print(
        f"  ours {precision}: compiled in {ours_compile_s:.1f} s ({report['functions']} functions, {report['kernels']} kernels;"
        f" schedule {report['chosen']}, {report['fused_attention']} fused attention, product tiles {report['product_tiles']})",
        flush=True,
    )
    program = CudaProgram(artifact.kernels[0], artifact.all_weights(), artifact.binaries, setup.driver)
    # a copy per precision: half() in place would round the float32 run's weights too
    torch_module = copy.deepcopy(module).to(setup.device)
    torch_module = torch_module.half() if precision == "float16" else torch_module
    compiled = torch.compile(torch_module, mode="reduce-overhead") if not setup.dry_run else None
    try:
        for batch in spec.batches[:2] if setup.dry_run else spec.batches:
            rows.append(_measure_batch(spec, batch, artifact, program, torch_module, compiled, precision, setup, ours_compile_s))
    finally:
        program.close()
    return rows


def _torch_inputs(feeds: dict[str, np.ndarray], precision: str, device) -> list:
    """The feeds as torch tensors on `device`, floats in half for float16 (what the module takes)."""
    import torch

    tensors = [torch.from_numpy(v).to(device) for v in feeds.values()]
    return [t.half() if precision == "float16" and t.is_floating_point() else t for t in tensors]


def _serving(module, precision: str, device) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    """torch as a server runs it: NumPy in, host to device, the module, device to host, NumPy out
    in the model's float32 interface."""

    def serve(feeds: dict[str, np.ndarray]) -> np.ndarray:
        output = module(*_torch_inputs(feeds, precision, device))
        return (output.float() if output.is_floating_point() else output).cpu().numpy()

    return serve


def _device_tensors(program, feeds: dict[str, np.ndarray], device) -> tuple[dict, list]:
    """Our program's inputs on torch's device in its interface dtypes, as DeviceTensors (and the
    torch tensors that own them, to keep alive)."""
    import torch

    from compiler.backends.cuda import DeviceTensor
    from compiler.dtypes import numpy_dtype

    placed, owners = {}, []
    for buffer in (b for b in program.buffers if b.role == "input"):
        tensor = torch.from_numpy(np.ascontiguousarray(feeds[buffer.name], numpy_dtype(buffer.dtype))).to(device).contiguous()
        owners.append(tensor)
        placed[buffer.name] = DeviceTensor(tensor.data_ptr(), tuple(tensor.shape), buffer.dtype)
    return placed, owners


def _ours_ms(call: Callable[[], object], program, repeats: int) -> tuple[float, float]:
    """Our wall-clock and CUDA-event medians for `call` (it returns once its work is done)."""
    events: list[float] = []

    def run() -> None:
        call()
        events.append(program.last_device_seconds)

    wall_ms = median_ms(run, repeats, lambda: None)
    return wall_ms, 1000 * statistics.median(events[WARMUPS:])


def _measure_batch(spec: Model, batch: int, artifact, program, torch_module, compiled, precision: str, setup: Setup, ours_compile_s: float) -> Row:
    import torch

    feeds = spec.inputs(batch, setup.dry_run)
    tensors = _torch_inputs(feeds, precision, setup.device)
    placed, owners = _device_tensors(program, feeds, setup.device)
    setup.synchronize()  # (our launches go on the driver's own stream: the inputs must be written)
    nan = math.nan
    device, serving = Basis(nan, nan, nan, nan), Basis(nan, nan, nan, nan)
    with torch.inference_mode():
        want = torch_module(*tensors).float().cpu().numpy()
        device.eager = median_ms(lambda: torch_module(*tensors), setup.repeats, setup.synchronize)
        serve_eager = _serving(torch_module, precision, setup.device)
        serving.eager = median_ms(lambda: serve_eager(feeds), setup.repeats, setup.synchronize)
        torch_compile_s = nan
        if compiled is not None:
            began = time.perf_counter()
            compiled(*tensors)
            setup.synchronize()
            torch_compile_s = time.perf_counter() - began
            device.compiled = median_ms(lambda: compiled(*tensors), setup.repeats, setup.synchronize)
            serve_compiled = _serving(compiled, precision, setup.device)
            serving.compiled = median_ms(lambda: serve_compiled(feeds), setup.repeats, setup.synchronize)
    got = program.run(feeds)["output"]
    error = float(np.abs(got.astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))
    del got  # (its staging block goes back to the program's pool)
    device.ours, device.ours_events = _ours_ms(lambda: program.run_on_device(placed), program, setup.repeats)
    serving.ours, serving.ours_events = _ours_ms(lambda: program.run(feeds), program, setup.repeats)
    del owners
    print(f"    kernels one by one: {kernel_breakdown(program, artifact.kernels[0]['source'], feeds)}", flush=True)
    row = Row(spec.name, batch, precision, device, serving, error, ours_compile_s, torch_compile_s)
    print("  " + " | ".join(_cells(row)), flush=True)
    return row


HEADER = [
    "model", "batch", "precision",
    "device: ours ms", "ours events ms", "eager ms", "torch.compile ms", "ours/compile", "ours/eager",
    "serving: ours ms", "eager ms", "torch.compile ms", "ours/compile", "ours/eager",
    "max err", "compile s ours / torch",
]


def _ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}"


def _ratio(a: float, b: float) -> str:
    return "n/a" if not (b > 0 and math.isfinite(a) and math.isfinite(b)) else f"{a / b:.2f}"


def _cells(row: Row) -> list[str]:
    d, s = row.device, row.serving
    return [
        row.model, str(row.batch), row.precision,
        _ms(d.ours), _ms(d.ours_events), _ms(d.eager), _ms(d.compiled), _ratio(d.ours, d.compiled), _ratio(d.ours, d.eager),
        _ms(s.ours), _ms(s.eager), _ms(s.compiled), _ratio(s.ours, s.compiled), _ratio(s.ours, s.eager),
        f"{row.error:.1e}",
        f"{row.ours_compile_s:.1f} / " + ("n/a" if math.isnan(row.torch_compile_s) else f"{row.torch_compile_s:.1f}"),
    ]


def table(rows: list[Row]) -> list[str]:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return lines


def summary(rows: list[Row]) -> list[str]:
    """Per basis, the geometric mean of ours / torch.compile (else / eager, in a dry run) and the
    worst row; then the longest compile."""
    lines = []
    for label, basis in (("device-resident", lambda r: r.device), ("serving", lambda r: r.serving)):
        for against, pick in (("torch.compile", lambda b: b.compiled), ("eager", lambda b: b.eager)):
            ratios = [(basis(r).ours / pick(basis(r)), r) for r in rows if pick(basis(r)) > 0 and math.isfinite(basis(r).ours)]
            if not ratios:
                continue
            geomean = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
            worst, row = max(ratios, key=lambda item: item[0])
            lines.append(
                f"{label}: ours / {against} geometric mean over {len(ratios)} rows **{geomean:.2f}x** (goal <= 1.0);"
                f" worst {row.model} batch {row.batch} {row.precision} ({worst:.2f}x)."
            )
            break  # torch.compile where it ran, else eager
    if rows:
        slowest = max(rows, key=lambda r: r.ours_compile_s)
        lines.append(f"Longest compile of ours: {slowest.ours_compile_s:.1f} s ({slowest.model}, {slowest.precision}; goal < 60 s).")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--precisions", default="float32,float16", help="float32 (TF32 off), float16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dry-run", action="store_true", help="tiny models, torch eager on the CPU, ours on the CPU emulation")
    parser.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    parser.add_argument("--no-cublas", action="store_true", help="race the generated products alone (no cuBLAS schedule)")
    args = parser.parse_args()
    import torch

    from compiler.targets import GPU_TYPES

    if args.dry_run:
        from compiler.backends.cuda_emulator import EmulatedDriver

        device, driver, target, gpu = torch.device("cpu"), EmulatedDriver(), "h100", "the CPU emulation (dry run)"
        args.repeats = min(args.repeats, 3)
    else:
        from compiler.backends.cuda_driver import CudaDriver

        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32: the rule
        torch.backends.cudnn.allow_tf32 = False
        if args.no_cublas:
            CudaDriver.has_cublas = False  # (a property: every driver the compiles make says no)
        device, driver = torch.device("cuda"), CudaDriver(0)
        # the GPU type by name (an H200 is "h200"), else the first of its compute capability
        types = [t for t, g in GPU_TYPES.items() if t != "cuda" and g.arch == driver.arch]
        target = next((t for t in types if t in driver.name.lower()), types[0] if types else "cuda")
        gpu = f"{driver.name} ({driver.arch}, compiled for target {target!r})"
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    setup = Setup(args.repeats, args.dry_run, device, driver, target, synchronize)
    started = time.perf_counter()
    rows: list[Row] = []
    failures: list[str] = []
    for name in args.models.split(","):
        try:
            rows += measure_model(MODELS[name], args.precisions.split(","), setup, failures)
        except Exception as exc:  # noqa: BLE001 - one model failing leaves the others' rows
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        if args.write:  # after every model: a run cut short still leaves the rows it measured
            _write(args, rows, failures, gpu, time.perf_counter() - started)
    print("\n".join(table(rows) + [""] + summary(rows) + [f"Failed: {f}" for f in failures]))


def _write(args: argparse.Namespace, rows: list[Row], failures: list[str], gpu: str, seconds: float) -> None:
    import torch
    import transformers

    body = [
        "## The CUDA target against PyTorch eager and torch.compile",
        "",
        "What `benchmarks/cuda_vs_torch.py` measures (its docstring says how). This run:",
        "",
        f"    python3 benchmarks/cuda_vs_torch.py {' '.join(sys.argv[1:])}",
        "",
        f"Measured {datetime.date.today().isoformat()} on {gpu}, torch {torch.__version__}, transformers",
        f"{transformers.__version__}, at commit {revision()}, {args.repeats} timed calls a row after {WARMUPS} warm-ups;",
        f"the run so far took {seconds:.0f} s.",
        "",
        *table(rows),
        "",
        *summary(rows),
        *(["", "Failed in this run:", "", *(f"- {failure}" for failure in failures)] if failures else []),
    ]
    write_section(args.write, body, SECTION_BEGIN, SECTION_END)

if __name__ == "__main__":
    main()
