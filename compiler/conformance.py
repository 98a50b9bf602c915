"""Runs ONNX backend test cases through the compiler and classifies each outcome.

  passed       compiled, ran and matched the expected outputs within the case's tolerances
  unsupported  refused at prepare time with an error naming the op or attribute (by design)
  failed       compiled and ran but returned wrong numbers, shapes or dtypes (a bug)
  error        crashed somewhere other than a deliberate refusal (a bug)

Used by benchmarks/onnx_conformance.py (the per-op table) and by the test suite.
"""

from __future__ import annotations

import time
import traceback
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
import onnx.defs
from onnx import numpy_helper

from compiler.dtypes import is_float
from compiler.errors import InvalidModel, UnsupportedModel

# expected values in these formats round every intermediate to them; we compute those in float32,
# so they match within two ulps (relative)
ROUNDED_RTOL = {"float16": 2.0**-9, "bfloat16": 2.0**-6}


class Outcome(NamedTuple):
    name: str
    status: str
    detail: str
    seconds: float


def load_cases() -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow casts on purpose
        from onnx.backend.test.case.node import collect_testcases

        return collect_testcases()


def op_names() -> list[str]:
    """Every ONNX op name, longest first, for matching case names."""
    return sorted({s.name for s in onnx.defs.get_all_schemas_with_history()}, key=len, reverse=True)


def op_of(case_name: str, ops: list[str]) -> str:
    """The ONNX op a case tests, from its name (test_reduce_sum_... -> ReduceSum)."""
    flat = case_name.removeprefix("test_").replace("_", "").lower()
    for op in ops:
        if flat.startswith(op.lower()):
            return op
    return case_name.removeprefix("test_").split("_")[0]


def run_case(case) -> Outcome:
    """Prepare, run and compare one onnx.backend.test TestCase."""
    import compiler.onnx_backend as backend  # late: the backend pulls in the whole compiler

    started = time.perf_counter()
    try:
        rep = backend.prepare(case.model, "CPU")
    except (UnsupportedModel, InvalidModel) as exc:
        return Outcome(case.name, "unsupported", str(exc).splitlines()[0][:200], time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001  anything else is a compiler bug, reported with its origin
        return Outcome(case.name, "error", _crash("prepare", exc), time.perf_counter() - started)
    for inputs, expected in case.data_sets:
        inputs, expected = [_array(x) for x in inputs], [_array(x) for x in expected]
        try:
            with np.errstate(all="ignore"):
                outputs = rep.run(inputs)
        except (UnsupportedModel, InvalidModel) as exc:
            # a specializing rep compiles at first run, so it refuses there
            return Outcome(case.name, "unsupported", str(exc).splitlines()[0][:200], time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001
            return Outcome(case.name, "error", _crash("run", exc), time.perf_counter() - started)
        if len(outputs) != len(expected):
            detail = f"{len(outputs)} outputs, expected {len(expected)}"
            return Outcome(case.name, "failed", detail, time.perf_counter() - started)
        for i, (want, got) in enumerate(zip(expected, outputs)):
            problem = compare(np.asarray(want), got, case.rtol, case.atol)
            if problem:
                return Outcome(case.name, "failed", f"output {i}: {problem}", time.perf_counter() - started)
    return Outcome(case.name, "passed", "", time.perf_counter() - started)


def compare(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> str | None:
    """None when `actual` matches, else what differs (shape, dtype, NaNs or values)."""
    actual = np.asarray(actual)
    if expected.shape != actual.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    if expected.dtype != actual.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    rtol = max(rtol, ROUNDED_RTOL.get(expected.dtype.name, 0.0))
    if expected.dtype.kind == "c" or is_float(expected.dtype.name):
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


def _array(value):
    """Cases store some inputs as TensorProtos (to carry float16 and bfloat16 exactly)."""
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


def _crash(stage: str, exc: Exception) -> str:
    origin = traceback.extract_tb(exc.__traceback__)[-1]
    where = f"{Path(origin.filename).name}:{origin.lineno}"
    return f"{stage}: {type(exc).__name__}: {exc} ({where})".splitlines()[0][:300]
