"""Our compiler against onnxruntime, OpenVINO and PyTorch eager on models of known shapes, and on a
corpus of architectures it was not tuned on, all in one run.

    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py                  # every row, 20 repeats
    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py --rows bert,gpt2 --repeats 5
    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py --corpus        # and the corpus section
    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py --corpus --rows hf --repeats 5   # the corpus alone
    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py --minilm /tmp/minilm  # and the real MiniLM
    .venv/bin/python benchmarks/compiler_vs_onnxruntime.py --write docs/performance.md

For each row (a model of benchmarks/models.py at a batch and sequence size) it compiles the model
once with our compiler for "cpu", checks our outputs against onnxruntime's (WRONG when the largest
error exceeds 1e-3 of the output's largest magnitude), and times the program alone: ours,
onnxruntime (CPUExecutionProvider), OpenVINO (its CPU plugin reading the same ONNX, latency hint,
float32 precision)
and PyTorch eager through onnx2torch where torch is importable. All of them get the same inputs and
--threads threads (default: every core): onnxruntime's intra-op threads, OpenVINO's inference
threads, and ours through OMP_NUM_THREADS, set before our first program loads.

The corpus section (--corpus) runs one export of each architecture family of the Hugging Face
corpus (tests/fixtures/hf: small random models of each architecture, which the compiler's
schedules were never tuned on) at batch 1 and at CORPUS_BATCH, at the longest sequence the fixture
script checked. --minilm FOLDER adds the real all-MiniLM-L6-v2 (its export by
benchmarks/real_minilm.py, which needs torch) at batch 1 and 8, sequence 128. Times are medians of at least --repeats runs (quick rows repeat for
about MIN_TIMED_S) after 3 warm-ups, the runtimes taking turns in ROUNDS blocks (cpu_latency's
interleaved_rounds_ms): the machine is shared, and a slow spell of a few seconds then falls on
every runtime, not on whichever ran in it. The ratios are paired: the median over the rounds of
the ratio of the two runtimes' medians in that round (a slow spell that still falls on one
runtime's block moves one round's ratio, not the row's), so they need not equal the quotient of
the two medians the table prints.

The same run measures the machine's float32 peak as the median time of a 2048x2048x2048 NumPy
matmul (the better of a measurement at its start and one at its end: the machine is shared), and
counts each row's MatMul, Gemm and Conv FLOPs from the ONNX graph at the row's sizes. For
matmul-bound rows, those whose contractions do at least MATMUL_BOUND_FLOPS_PER_WEIGHT_BYTE FLOPs
per byte of weight, it prints the fraction of that peak ours and onnxruntime achieve.

Compilation and our timing of a row run under a cap (--row-timeout): past it, the row reads
"timeout" and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np
import onnx
import onnxruntime
from onnx import shape_inference

try:
    import openvino
except ImportError:  # the benchmark extra is not installed: the column reads n/a
    openvino = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import models
from benchmarks.cpu_latency import interleaved_rounds_ms, median_ms, paired_ratio
from benchmarks.report import revision, write_section
from compiler import compile_onnx, executable
from tests.hf_corpus import CORPUS, make_inputs, manifest

RELATIVE_TOLERANCE = 1e-3
# below this many FLOPs per weight byte a row streams its weights and is memory-bound (batch 1 MLP)
MATMUL_BOUND_FLOPS_PER_WEIGHT_BYTE = 8.0
PEAK_SIZE = 2048
# the runtimes take turns in ROUNDS blocks of runs, each after SETTLE_S idle: the threads of the
# one timed before spin-wait for work a while after its last run (onnxruntime's about 60 ms), and
# on 2 cores they would take a core from the next one
ROUNDS = 5
SETTLE_S = 0.25
# a quick row repeats until each runtime's timed runs last about this long (the MLP at batch 1 runs
# in 0.1 ms: 20 runs of it are a few milliseconds of a noisy machine)
MIN_TIMED_S = 0.5
SECTION_BEGIN, SECTION_END = "<!-- compiler-benchmark:begin -->", "<!-- compiler-benchmark:end -->"
# the corpus rows' batch besides 1
CORPUS_BATCH = 8
# one export of each architecture family (dynamo's where it exported): the corpus has two or more
CORPUS_FILES = (
    "distilbert_dynamo", "roberta_dynamo", "albert_dynamo", "electra_dynamo", "t5_encoder_torchscript", "clip_text_dynamo",
    "gpt_neox_dynamo", "llama_dynamo", "qwen2_dynamo", "vit_dynamo", "convnext_dynamo", "mobilenet_v2_dynamo",
    "whisper_encoder_dynamo",
)


@dataclass(frozen=True)
class Row:
    key: str  # what --rows matches, by prefix
    label: str  # the table's first column
    model: str  # a key of models.BUILDERS, or the path of an ONNX file
    sizes: dict[str, int]  # symbolic dimension -> size at this row
    # a corpus entry (tests/hf_corpus.py's manifest) whose inputs it takes, else models.sample_inputs's
    entry: dict | None = field(default=None, compare=False, hash=False)
    section: str = "known"  # "known" shapes, or "corpus"

    def load(self) -> bytes:
        return models.BUILDERS[self.model]() if self.model in models.BUILDERS else Path(self.model).read_bytes()

    def inputs(self, data: bytes) -> dict[str, np.ndarray]:
        if self.entry is not None:
            return make_inputs(self.entry, self.sizes["batch"], self.sizes["seq"], np.random.default_rng(1))
        return models.sample_inputs(data, self.sizes)


ROWS = (
    Row("mlp-b1", "MLP 784-512-512-10, batch 1", "mlp", {"batch": 1}),
    Row("mlp-b64", "MLP 784-512-512-10, batch 64", "mlp", {"batch": 64}),
    Row("cnn-b1", "ResNet-style CNN 224x224, batch 1", "resnet_cnn", {"batch": 1}),
    Row("cnn-b8", "ResNet-style CNN 224x224, batch 8", "resnet_cnn", {"batch": 8}),
    Row("bert-b1", "BERT MiniLM-L6 shape, batch 1, seq 128", "bert_minilm", {"batch": 1, "seq": 128}),
    Row("bert-b8", "BERT MiniLM-L6 shape, batch 8, seq 128", "bert_minilm", {"batch": 8, "seq": 128}),
    Row("gpt2-b1", "GPT-2-style 4 layers, batch 1, seq 128", "gpt2_decoder", {"batch": 1, "seq": 128}),
    Row("resnet50-b1", "ResNet-50 (light zoo), batch 1", "resnet50_light", {}),
)


def corpus_rows() -> list[Row]:
    """CORPUS_FILES at batch 1 and CORPUS_BATCH, at the longest sequence the fixture script checked."""
    entries = {Path(e["file"]).stem: e for e in manifest() if e["file"]}
    rows = []
    for stem in CORPUS_FILES:
        entry = entries.get(stem)
        if entry is None:
            continue
        seq = max(seq for _, seq in entry["checks"])
        takes_seq = any("seq" in spec["shape"] for spec in entry["inputs"].values())
        for batch in (1, CORPUS_BATCH):
            label = f"{entry['class']} ({entry['exporter']}), batch {batch}" + (f", seq {seq}" if takes_seq else "")
            rows.append(Row(f"hf-{stem}-b{batch}", label, str(CORPUS / entry["file"]), {"batch": batch, "seq": seq}, entry, "corpus"))
    return rows


def minilm_rows(folder: Path) -> list[Row]:
    """The real all-MiniLM-L6-v2, as benchmarks/real_minilm.py exported it (dynamo), batch 1 and 8."""
    path = str(folder / "minilm_dynamo.onnx")
    return [
        Row(f"minilm-b{batch}", f"all-MiniLM-L6-v2 (real weights), batch {batch}, seq 128", path, {"batch": batch, "seq": 128}, None, "corpus")
        for batch in (1, 8)
    ]


@dataclass
class Result:
    row: Row
    flops: float  # MatMul, Gemm and Conv FLOPs of one run at the row's sizes
    matmul_bound: bool
    ort_ms: float = math.nan
    openvino_ms: float | None = None
    compile_s: float | None = None
    ours_ms: float | None = None
    max_error: float | None = None
    wrong: bool = False
    torch_ms: float | None = None
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)  # what went wrong, for the lines under the table
    # ours against onnxruntime and OpenVINO, paired round by round (cpu_latency.paired_ratio)
    ratio: float | None = None
    openvino_ratio: float | None = None


class RowTimeout(Exception):
    pass


# ---- measurements ----


def sgemm_peak_gflops(repeats: int) -> float:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((PEAK_SIZE, PEAK_SIZE), dtype=np.float32) for _ in range(2))
    return 2 * PEAK_SIZE**3 / (median_ms(lambda: a @ b, repeats) / 1000) / 1e9


def contraction_cost(data: bytes, sizes: dict[str, int]) -> tuple[float, float]:
    """FLOPs of the MatMul, Gemm and Conv nodes at `sizes`, and the bytes of their constant operands."""
    model = onnx.load_from_string(data)
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_value = sizes[dim.dim_param]
    model = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    # an unknown dimension stays None and fails the products below, rather than counting 0 FLOPs
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in values}
    weights = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
    shapes.update(weights)
    flops = weight_bytes = 0.0
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        a, b, out = shapes[node.input[0]], shapes[node.input[1]], shapes[node.output[0]]
        if node.op_type == "MatMul":
            depth = a[-1]
        elif node.op_type == "Gemm":
            trans_a = any(attr.name == "transA" and attr.i for attr in node.attribute)
            depth = a[0] if trans_a else a[1]
        else:
            depth = math.prod(b[1:])  # input channels per group x kernel
        flops += 2.0 * math.prod(out) * depth
        weight_bytes += sum(4.0 * math.prod(weights[name]) for name in node.input[:2] if name in weights)
    return flops, weight_bytes


def torch_runner(data: bytes) -> Callable[[dict[str, np.ndarray]], object] | None:
    """PyTorch eager through onnx2torch, fed in graph-input order; None where torch is missing."""
    try:
        import torch
        from onnx2torch import convert  # type: ignore[import-not-found]
    except ImportError:
        return None
    module = convert(onnx.load_from_string(data)).eval()

    def run(feeds: dict[str, np.ndarray]) -> object:
        with torch.inference_mode():
            return module(*(torch.from_numpy(value) for value in feeds.values()))

    return run


def openvino_runner(data: bytes, feeds: dict[str, np.ndarray], threads: int) -> Callable[[dict[str, np.ndarray]], object] | None:
    """OpenVINO's CPU plugin on the ONNX model reshaped to the feeds' sizes (its CPU plugin pays for
    dynamic shapes on every call, and a row's sizes are fixed: its best case), latency hint,
    `threads` inference threads, float32 throughout; None where openvino is not installed.

    Its CPU plugin otherwise runs products in bfloat16 wherever the CPU has it (AVX512_BF16, AMX),
    with errors near 1e-2: not the float32 work ours and onnxruntime's do."""
    if openvino is None:
        return None
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".onnx") as file:  # (read_model takes a path)
        file.write(data)
        file.flush()
        model = openvino.Core().read_model(file.name)
    model.reshape({name: list(value.shape) for name, value in feeds.items()})
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"}
    request = openvino.Core().compile_model(model, "CPU", config).create_infer_request()

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = request.infer(feeds)
        return {port.get_any_name(): value for port, value in outputs.items()}

    return run


def output_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, bool]:
    """The largest absolute error over all outputs, and whether any output is wrong."""
    worst, wrong = 0.0, False
    for name, expected in want.items():
        if name not in got or got[name].shape != expected.shape:
            return math.inf, True
        error = float(np.abs(got[name].astype(np.float64) - expected).max())
        worst = math.nan if math.isnan(error) or math.isnan(worst) else max(worst, error)
        wrong |= not error <= RELATIVE_TOLERANCE * float(np.abs(expected).max())
    return worst, wrong


class Timer:
    """Raises RowTimeout in the main thread once `seconds` have passed (between NumPy calls)."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self) -> Self:
        def expire(signum: int, frame: object) -> None:
            raise RowTimeout

        signal.signal(signal.SIGALRM, expire)
        signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.alarm(0)


def run_row(row: Row, data: bytes, programs: dict, repeats: int, timeout: int, threads: int) -> Result:
    feeds = row.inputs(data)
    try:
        flops, weight_bytes = contraction_cost(data, row.sizes)
    except Exception:  # noqa: BLE001 -- a graph whose shapes ONNX cannot infer: no FLOP count, no % of peak
        flops, weight_bytes = math.nan, math.inf
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    runners: dict[str, Callable[[], object]] = {"ort": lambda: session.run(None, feeds)}
    result = Result(row, flops, flops >= MATMUL_BOUND_FLOPS_PER_WEIGHT_BYTE * weight_bytes)
    try:
        with Timer(timeout):
            if row.model not in programs:  # one compile per model: the program serves every size
                started = time.perf_counter()
                programs[row.model] = (executable(compile_onnx(data, "cpu")), time.perf_counter() - started)
            program, result.compile_s = programs[row.model]
            result.max_error, result.wrong = output_error(program.run(feeds), want)
            runners["ours"] = lambda: program.run(feeds)
    except RowTimeout:
        result.timed_out = True
        result.notes.append(f"timeout ({timeout} s)")
    except Exception as error:  # noqa: BLE001 -- a row that fails to compile must not end the run
        result.notes.append(f"{type(error).__name__}: {str(error)[:120]}")
    if result.wrong:
        result.notes.append("WRONG")
    try:
        run_openvino = openvino_runner(data, feeds, threads)
        if run_openvino is not None:
            error, wrong = output_error(run_openvino(feeds), want)
            if wrong:  # a runtime that answers differently is not doing the same work
                result.notes.append(f"OpenVINO off by {error:.2g}")
            runners["openvino"] = lambda: run_openvino(feeds)
    except Exception as error:  # noqa: BLE001 -- a model OpenVINO cannot read must not end the run
        result.notes.append(f"OpenVINO: {type(error).__name__}: {str(error)[:120]}")
    try:
        run_torch = torch_runner(data)
        if run_torch is not None:
            run_torch(feeds)
            runners["torch"] = lambda: run_torch(feeds)
    except Exception as error:  # noqa: BLE001 -- onnx2torch converts fewer ops than onnxruntime runs
        result.notes.append(f"torch: {type(error).__name__}: {str(error)[:120]}")
    rounds = interleaved_rounds_ms(runners, repeats, rounds=ROUNDS, settle_s=SETTLE_S, min_seconds=MIN_TIMED_S)
    medians = {name: statistics.median(t for block in blocks for t in block) for name, blocks in rounds.items()}
    result.ort_ms, result.ours_ms, result.torch_ms = medians["ort"], medians.get("ours"), medians.get("torch")
    result.openvino_ms = medians.get("openvino")
    if "ours" in rounds:
        result.ratio = paired_ratio(rounds["ours"], rounds["ort"])
        if "openvino" in rounds:
            result.openvino_ratio = paired_ratio(rounds["ours"], rounds["openvino"])
    return result


# ---- report ----


def _ms(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "n/a"


def _peak_share(result: Result, ms: float | None, peak: float) -> str:
    if not result.matmul_bound or ms is None or math.isnan(result.flops):
        return "-"
    return f"{result.flops / (ms / 1000) / 1e9 / peak:.1%}"


def _times(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def table(results: list[Result], peak: float, threads: int) -> list[str]:
    columns = [
        "row", "compile s", "max abs error", "ours ms", "onnxruntime ms", "OpenVINO ms", "torch ms", "ours/ort",
        "ours/OpenVINO", "GFLOP", "ours % of peak", "ort % of peak",
    ]
    lines = [
        f"All runtimes on {threads} threads ({os.cpu_count()} cores here).",
        "",
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
    ]
    for r in results:
        error = "n/a" if r.max_error is None else f"{r.max_error:.1e}"
        ours = _ms(r.ours_ms) if r.ours_ms is not None else "timeout" if r.timed_out else "error"
        compile_s = f"{r.compile_s:.2f}" if r.compile_s is not None else "-"
        flagged = " **WRONG**" if r.wrong else ""
        lines.append(
            f"| {r.row.label}{flagged} | {compile_s} | {error} | {ours} | {r.ort_ms:.2f} | {_ms(r.openvino_ms)} "
            f"| {_ms(r.torch_ms)} | {_times(r.ratio)} | {_times(r.openvino_ratio)} | {"n/a" if math.isnan(r.flops) else f"{r.flops / 1e9:.3g}"} "
            f"| {_peak_share(r, r.ours_ms, peak)} | {_peak_share(r, r.ort_ms, peak)} |"
        )
    return lines


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(results: list[Result]) -> list[str]:
    lines = []
    for name, ratio in (("ort", lambda r: r.ratio), ("OpenVINO", lambda r: r.openvino_ratio)):
        timed = [r for r in results if ratio(r) is not None]
        if timed:
            worst = max(timed, key=ratio)
            lines.append(f"Geometric mean of ours/{name} over {len(timed)} rows: {_geomean([ratio(r) for r in timed]):.1f}x; "
                         f"worst row: {worst.row.label} ({ratio(worst):.1f}x).")
    for r in results:
        if r.notes:
            lines.append(f"{r.row.label}: {'; '.join(r.notes)}.")
    return lines


def report_lines(results: list[Result], peak: float, threads: int) -> list[str]:
    """The known-shape table and its summary, then the corpus's, where it ran."""
    lines = []
    for section, heading in (("known", []), ("corpus", ["", "### Models the compiler was not tuned on", ""])):
        chosen = [r for r in results if r.row.section == section]
        if chosen:
            lines += [*heading, *table(chosen, peak, threads), "", *summary(chosen)]
    return lines


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def section_body(
    command: str, commit: str, load: float, lines: list[str], peaks: tuple[float, float], repeats: int,
    seconds: float,
) -> list[str]:
    today = datetime.date.today().isoformat()
    return [
        "## Compiler against onnxruntime and OpenVINO on models of known shapes",
        "",
        "The models of `benchmarks/models.py` (random weights from a fixed seed; BERT with",
        "all-MiniLM-L6-v2's shape and a 1000-word vocabulary), each compiled once and run at every size of",
        f"its rows. Times are medians of at least {repeats} runs (more for quick rows: about {MIN_TIMED_S:g} s of runs",
        f"each) after 3 warm-ups, the runtimes taking turns in {ROUNDS} blocks, each after {SETTLE_S:g} s idle (so a",
        "slow spell of the shared machine falls on all of them alike), the program alone; a ratio is the",
        "median over the rounds of the ratio of the two runtimes' medians in that round (a slow spell that",
        "falls on one runtime's block moves one round's ratio), so it need not equal the quotient of the",
        "two medians printed; onnxruntime",
        "(CPUExecutionProvider) and OpenVINO (CPU plugin, latency hint, float32 inference precision: it",
        "would run products in bfloat16 on CPUs that have it; reading the same ONNX) get the same",
        "inputs and as many threads as ours. The PyTorch column (eager, through",
        "onnx2torch) reads n/a where torch is not importable, as in the project's environment. The % of",
        "peak columns divide the MatMul, Gemm and Conv FLOPs counted from the graph, per second, by the",
        "float32 peak measured in the same run as a NumPy (OpenBLAS) matmul: onnxruntime's own kernels can",
        "beat it. The batch-1 MLP streams its weights (memory-bound) and reads `-` there. The machine is",
        "shared with other work: a load average near the number of cores before the run, or a peak well",
        "under the quiet one, means the run was disturbed.",
        "",
        f"    {command}",
        "",
        f"Measured {today} on {os.cpu_count()} cores ({cpu_model()}), onnxruntime {onnxruntime.__version__},",
        f"OpenVINO {openvino.__version__ if openvino is not None else 'not installed'},",
        f"numpy {np.__version__}, at commit {commit}; sgemm peak {max(peaks):.0f} GFLOP/s ({PEAK_SIZE}^3",
        f"NumPy matmul: {peaks[0]:.0f} at the run's start, {peaks[1]:.0f} at its end); the whole run took",
        f"{seconds:.0f} s; the 1-minute load average was {load:.2f} just before it.",
        "",
        *lines,
    ]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=20)
    keys = ", ".join(row.key for row in ROWS)
    parser.add_argument("--rows", default="", help=f"comma-separated prefixes of {keys}")
    parser.add_argument("--row-timeout", type=int, default=120, help="seconds for compiling and timing ours")
    parser.add_argument("--write", type=Path, help="replace the marked section of this markdown file")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every runtime (default: every core)")
    parser.add_argument("--corpus", action="store_true", help="also the corpus section (rows hf-*: architectures not tuned on)")
    parser.add_argument("--minilm", type=Path, help="a folder with benchmarks/real_minilm.py's export: rows minilm-b1, minilm-b8")
    args = parser.parse_args()
    # ours reads it when its first program loads (libgomp's thread count)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    prefixes = [p for p in args.rows.split(",") if p]
    candidates = [*ROWS, *(corpus_rows() if args.corpus else []), *(minilm_rows(args.minilm) if args.minilm else [])]
    rows = [row for row in candidates if not prefixes or any(row.key.startswith(p) for p in prefixes)]
    if not rows:
        parser.error(f"--rows {args.rows!r} matches none of {', '.join(row.key for row in candidates)}")

    started, commit = time.perf_counter(), revision()  # before other work can change the tree
    load = os.getloadavg()[0]
    onnxruntime.set_default_logger_severity(3)  # the light zoo's unused initializers warn on every session
    peak_at_start = sgemm_peak_gflops(repeats=max(args.repeats, 10))
    print(f"sgemm peak: {peak_at_start:.0f} GFLOP/s on {os.cpu_count()} cores ({cpu_model()})", flush=True)
    built: dict[str, bytes] = {}
    programs: dict[str, tuple[object, float]] = {}
    results = []
    for index, row in enumerate(rows):
        if row.model not in built:
            built[row.model] = row.load()
        data = built[row.model]
        result = run_row(row, data, programs, args.repeats, args.row_timeout, args.threads)
        results.append(result)
        print(f"{row.key}: ours {_ms(result.ours_ms)} ms, onnxruntime {result.ort_ms:.2f} ms, "
              f"OpenVINO {_ms(result.openvino_ms)} ms, torch {_ms(result.torch_ms)} ms {' '.join(result.notes)}", flush=True)
        if all(later.model != row.model for later in rows[index + 1:]):  # free the model's weights
            built.pop(row.model)
            programs.pop(row.model, None)
    # the machine is shared: the better of two measurements is closer to what it can do
    peaks = peak_at_start, sgemm_peak_gflops(repeats=max(args.repeats, 10))
    lines = report_lines(results, max(peaks), args.threads)
    seconds = time.perf_counter() - started
    print("\n" + "\n".join(lines) + f"\n\ntotal {seconds:.0f} s")
    if args.write:
        command = " ".join([".venv/bin/python benchmarks/compiler_vs_onnxruntime.py", *sys.argv[1:]])
        body = section_body(command, commit, load, lines, peaks, args.repeats, seconds)
        write_section(args.write, body, SECTION_BEGIN, SECTION_END)
        print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
