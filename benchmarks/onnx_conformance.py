"""Runs ONNX's backend node test suite through the compiler and reports what passes.

    .venv/bin/python benchmarks/onnx_conformance.py                 # all 1884 cases, summary
    .venv/bin/python benchmarks/onnx_conformance.py --write docs/onnx-coverage.md
    .venv/bin/python benchmarks/onnx_conformance.py -k reduce --show failed,error

Each case is one of:
  passed       compiled, ran and matched the expected outputs within the case's tolerances
  unsupported  refused at prepare time with an error naming the op or attribute (by design)
  failed       compiled and ran but returned wrong numbers, shapes or dtypes (a bug)
  error        crashed somewhere other than a deliberate refusal (a bug)
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load_cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators overflow casts on purpose
        from onnx.backend.test.case.node import collect_testcases

        return collect_testcases()


def _op_names() -> list[str]:
    import onnx.defs

    return sorted({s.name for s in onnx.defs.get_all_schemas_with_history()}, key=len, reverse=True)


def op_of(case_name: str, ops: list[str]) -> str:
    """The ONNX op a case tests, from its name (test_reduce_sum_... -> ReduceSum)."""
    flat = case_name.removeprefix("test_").replace("_", "").lower()
    for op in ops:
        if flat.startswith(op.lower()):
            return op
    return case_name.removeprefix("test_").split("_")[0]


def _compare(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> str | None:
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    if expected.dtype != actual.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if expected.dtype.kind in "fc" or expected.dtype.name == "bfloat16":
        e, a = expected.astype(np.float64), actual.astype(np.float64)
        if not np.array_equal(np.isnan(e), np.isnan(a)):
            return "NaNs differ"
        ok = np.isclose(a, e, rtol=rtol, atol=atol) | (np.isnan(e) & np.isnan(a))
        if not ok.all():
            worst = float(np.nanmax(np.abs(a - e)))
            return f"{int((~ok).sum())} of {ok.size} values off (max abs diff {worst:.3g})"
        return None
    if not np.array_equal(expected, actual):
        return f"{int((expected != actual).sum())} of {expected.size} values differ"
    return None


def run_case(index: int) -> tuple[str, str, str, float]:
    """(case name, outcome, detail, seconds) for case number `index`."""
    import compiler.onnx_backend as backend
    from compiler.errors import InvalidModel, UnsupportedModel

    case = _CASES[index]
    started = time.perf_counter()
    try:
        rep = backend.prepare(case.model, "CPU")
    except (UnsupportedModel, InvalidModel) as exc:
        return case.name, "unsupported", str(exc).splitlines()[0][:200], time.perf_counter() - started
    except Exception as exc:  # anything else is a compiler bug, reported with its origin
        origin = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(origin.filename).name}:{origin.lineno}"
        detail = f"prepare: {type(exc).__name__}: {exc} ({where})".splitlines()[0][:300]
        return case.name, "error", detail, time.perf_counter() - started
    for inputs, expected in case.data_sets:
        try:
            with np.errstate(all="ignore"):
                outputs = rep.run(inputs)
        except Exception as exc:
            origin = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(origin.filename).name}:{origin.lineno}"
            detail = f"run: {type(exc).__name__}: {exc} ({where})".splitlines()[0][:300]
            return case.name, "error", detail, time.perf_counter() - started
        if len(outputs) != len(expected):
            return case.name, "failed", f"{len(outputs)} outputs, expected {len(expected)}", 0.0
        for i, (want, got) in enumerate(zip(expected, outputs)):
            problem = _compare(np.asarray(want), got, case.rtol, case.atol)
            if problem:
                return case.name, "failed", f"output {i}: {problem}", time.perf_counter() - started
    return case.name, "passed", "", time.perf_counter() - started


_CASES: list = []


def _init() -> None:
    global _CASES
    warnings.simplefilter("ignore")
    _CASES = _load_cases()


def write_table(path: Path, results: list[tuple[str, str, str, float]], ops: list[str]) -> None:
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: dict[str, set[str]] = collections.defaultdict(set)
    for name, outcome, detail, _ in results:
        op = op_of(name, ops)
        by_op[op][outcome] += 1
        if outcome != "passed":
            reasons[op].add(re.sub(r"\d+(\.\d+)?", "N", detail)[:120])
    totals = collections.Counter(outcome for _, outcome, _, _ in results)
    import onnx

    lines = [
        "# ONNX node test coverage",
        "",
        f"Generated by `benchmarks/onnx_conformance.py --write {path}` against onnx {onnx.__version__}"
        f" ({len(results)} node test cases from `onnx.backend.test.case.node.collect_testcases`).",
        "",
        f"**passed {totals['passed']}, unsupported {totals['unsupported']}, "
        f"failed {totals['failed']}, error {totals['error']}**",
        "",
        "`unsupported` means the compiler refused the model at prepare time with an error naming the",
        "op or attribute; `failed` (wrong numbers) and `error` (a crash) are bugs.",
        "",
        "| op | cases | passed | unsupported | failed | error | why not |",
        "|---|---|---|---|---|---|---|",
    ]
    for op in sorted(by_op):
        c = by_op[op]
        why = "; ".join(sorted(reasons[op])[:2]).replace("|", "/")
        lines.append(
            f"| {op} | {sum(c.values())} | {c['passed']} | {c['unsupported']} | {c['failed']} "
            f"| {c['error']} | {why} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", "--filter", default="", help="regex over case names")
    parser.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    parser.add_argument("--show", default="failed,error", help="outcomes to list case by case")
    parser.add_argument("--write", type=Path, help="write the per-op markdown table here")
    args = parser.parse_args()

    _init()
    pattern = re.compile(args.filter)
    indices = [i for i, c in enumerate(_CASES) if pattern.search(c.name)]
    started = time.perf_counter()
    # fresh worker processes, recycled, so one pathological case cannot poison the rest
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, initializer=_init, maxtasksperchild=200) as pool:
        results = sorted(pool.imap_unordered(run_case, indices, chunksize=4))
    elapsed = time.perf_counter() - started

    show = set(args.show.split(","))
    for name, outcome, detail, _ in results:
        if outcome in show:
            print(f"{outcome:12s} {name}: {detail}")
    totals = collections.Counter(outcome for _, outcome, _, _ in results)
    print(
        f"\n{len(results)} cases in {elapsed:.0f}s: passed {totals['passed']}, "
        f"unsupported {totals['unsupported']}, failed {totals['failed']}, error {totals['error']}"
    )
    slowest = sorted(results, key=lambda r: -r[3])[:3]
    print("slowest: " + ", ".join(f"{n} {s:.1f}s" for n, _, _, s in slowest))
    if args.write:
        write_table(args.write, results, _op_names())
        print(f"wrote {args.write}")
    return 1 if totals["failed"] or totals["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
