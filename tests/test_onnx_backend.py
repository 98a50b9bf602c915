"""ONNX's own backend test runner drives compiler.onnx_backend over the node test cases of the
core ops; and every one of the node suite's cases either matches the expected outputs or is
refused at prepare time (never wrong numbers). The cases listed in onnx_node_passing.txt must
pass: a refusal there is a regression (regenerate the list with
`benchmarks/onnx_conformance.py --pin tests/onnx_node_passing.txt` when more pass)."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx.backend.test
import pytest

import compiler.onnx_backend as backend
from compiler.conformance import load_cases, run_case

SUPPORTED = (
    "gemm matmul add sub mul div relu sigmoid tanh softmax reshape flatten transpose conv maxpool "
    "averagepool globalaveragepool globalmaxpool batchnorm concat constant identity dropout neg exp "
    "log sqrt reciprocal sin"
).split()

# cases of those ops that are refused on purpose (types, training mode, run-time shapes, extras)
REFUSED = [
    r"_u?int16", r"_uint(32|64)", r"div_(u?int8|int32)", r"sub_uint8", r"training", r"argmax",
    r"test_reshape_(?!allowzero_reordered$)", r"test_reshape_allowzero", r"identity_(sequence|opt)",
    r"dropout_default_mask", r"_expanded", r"constantofshape", r"concat_from_sequence",
    r"convinteger", r"convtranspose", r"matmulinteger", r"conv_with_autopad_same",
    r"softmax_cross_entropy", r"test_sce", r"transpose_all_permutations", r"constant_pad",
    r"log_softmax",
]

with warnings.catch_warnings():  # generating the cases warns about casts in onnx's own code
    warnings.simplefilter("ignore")
    backend_test = onnx.backend.test.BackendTest(backend, __name__)
for op in SUPPORTED:
    backend_test.include(rf"^test_{op}(_|$).*_cpu$")
for pattern in REFUSED:
    backend_test.exclude(pattern)

# the runner turns every case it does not select into a skipped test; keep only the selected
_case_classes = backend_test.test_cases  # a property that builds new classes on each read
for _case_class in _case_classes.values():
    for _name in [n for n, f in vars(_case_class).items() if getattr(f, "__unittest_skip__", False)]:
        delattr(_case_class, _name)
globals().update(_case_classes)


@pytest.fixture(autouse=True)
def numpy_lowering_unless_chosen(monkeypatch) -> None:
    """ONNX's runner repeats cases the node suite below covers: the NumPy lowering keeps it quick."""
    monkeypatch.setattr(backend, "candidates", ("numpy",))


CASES = load_cases()
PINNED = frozenset((Path(__file__).parent / "onnx_node_passing.txt").read_text().split())
# the count when the list was last regenerated; the list may grow, never shrink
PASSING_FLOOR = 1662


def test_pinned_cases_are_a_floor_and_exist() -> None:
    assert len(PINNED) >= PASSING_FLOOR
    assert PINNED <= {case.name for case in CASES}, sorted(PINNED - {case.name for case in CASES})[:5]


# every this-many-th case is compiled to native C only (a C build per case costs ~0.4 s, so the
# rest use the NumPy lowering here); benchmarks/onnx_conformance.py runs every case natively
NATIVE_SAMPLE_EVERY = 8


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_refused_or_correct(case, monkeypatch) -> None:
    """Every node case either matches onnx's expected outputs or is refused at prepare time, and
    the pinned ones pass."""
    native = CASES.index(case) % NATIVE_SAMPLE_EVERY == 0
    monkeypatch.setattr(backend, "candidates", ("native-blas",) if native else ("numpy",))
    outcome = run_case(case)
    allowed = ("passed",) if case.name in PINNED else ("passed", "unsupported")
    assert outcome.status in allowed, f"{outcome.status}: {outcome.detail}"
