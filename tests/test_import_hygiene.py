"""cloud/ is plumbing (DESIGN.md, "Packages"): importing the settings, the object store or the
ledger loads none of our packages above it and none of the compiler's dependencies, so that a
container's health check (deploy/healthcheck.py) starts in a few tenths of a second, not the
second and more the compiler's ~50 modules, egglog and the CUDA bindings took. Each import is
measured in a fresh interpreter. The names the settings no longer check against the compiler
(targets, compile candidates) are checked where compiles are set up, with messages as clear."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dependencies import imported_modules

ROOT = Path(__file__).resolve().parent.parent
HEALTHCHECK = "deploy/healthcheck.py"
# top-level modules none of the plumbing may load: ours above it, and what the compiler brings
FORBIDDEN = {
    "api", "compiler", "registry", "runtime", "scheduler", "worker",
    "cuda", "egglog", "ml_dtypes", "numpy", "onnx", "onnxruntime",
}
# the slowest an import of the settings or the health check may take, the best of RUNS: on the
# shared 2-core test machine cloud.settings takes 0.31 s (pydantic-settings is most of it), the
# health check the same; both took 1.2 s while the settings imported the compiler (0.77 s was seen
# once with the machine under load: the bound keeps room for that)
IMPORT_BOUND_S = 1.0
RUNS = 3

PROBE = """
import json, runpy, sys, time
started = time.perf_counter()
{load}
seconds = time.perf_counter() - started
loaded = sorted(name for name in sys.modules if name.split(".")[0] in {forbidden!r})
print(json.dumps({{"seconds": seconds, "loaded": loaded}}))
"""


def load_statement(target: str) -> str:
    if target == HEALTHCHECK:  # as `python deploy/healthcheck.py` runs it, short of main()
        return f"runpy.run_path({target!r}, run_name='healthcheck')"
    return f"import {target}"


def import_fresh(target: str) -> dict:
    """Imports `target` (a module, or the health-check script) in a new interpreter: its import
    seconds and the forbidden modules it loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(load=load_statement(target), forbidden=FORBIDDEN)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "target",
    ["cloud.settings", "cloud.storage", "cloud.metering", "cloud.db", "cloud.auth", "cloud.metrics", HEALTHCHECK],
)
def test_importing_the_plumbing_loads_no_compiler_and_nothing_above_it(target: str) -> None:
    assert import_fresh(target)["loaded"] == []


@pytest.mark.parametrize("target", ["cloud.settings", HEALTHCHECK])
def test_the_settings_and_the_health_check_import_in_a_fraction_of_a_second(target: str) -> None:
    best = min(import_fresh(target)["seconds"] for _ in range(RUNS))
    assert best < IMPORT_BOUND_S, f"importing {target} took {best:.2f} s (bound: {IMPORT_BOUND_S} s)"


def test_no_module_of_the_plumbing_imports_a_package_above_it() -> None:
    """Read from the source, imports inside functions included: a lazy import is still an arrow."""
    above = {"api", "compiler", "registry", "runtime", "scheduler", "worker"}
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "cloud").rglob("*.py"))
        for module in sorted(imported_modules(path.read_text(), "cloud"))
        if module.split(".")[0] in above
    ]
    assert found == []


def test_the_plumbing_spells_the_default_precision_as_the_compiler_does() -> None:
    from cloud.db import ModelVersion
    from compiler.targets import EXPORTED

    column = ModelVersion.__table__.c.precision
    assert column.default.arg == EXPORTED
    assert column.server_default.arg == EXPORTED


def test_a_target_the_compiler_does_not_know_is_named_with_the_setting_and_the_choices() -> None:
    from compiler.targets import KNOWN_TARGETS
    from worker.devices import known_targets

    assert known_targets(["cpu", "h100"]) == ("cpu", "h100")
    with pytest.raises(ValueError) as caught:
        known_targets(["cpu", "tpu", "h10"])
    assert str(caught.value) == f"unknown targets ['h10', 'tpu'] in LUMINAL_TARGETS; known: {list(KNOWN_TARGETS)}"


def test_compile_candidates_default_to_the_compilers_and_an_unknown_one_is_named() -> None:
    from compiler import pipeline
    from compiler.tuning import KNOWN_CANDIDATES
    from worker.compile import compile_candidates

    assert compile_candidates(()) == pipeline.CANDIDATES
    assert compile_candidates(["numpy", "native-loops"]) == ("numpy", "native-loops")
    with pytest.raises(ValueError) as caught:
        compile_candidates(["numpy", "native-fast"])
    assert str(caught.value) == (
        f"unknown compile candidates ['native-fast'] in LUMINAL_COMPILE_CANDIDATES; known: {list(KNOWN_CANDIDATES)}"
    )


@pytest.mark.parametrize(
    ("command", "setting", "value", "message"),
    [
        ("serve", "LUMINAL_TARGETS", '["cpu", "tpu"]', "unknown targets ['tpu'] in LUMINAL_TARGETS; known: "),
        (
            "worker", "LUMINAL_COMPILE_CANDIDATES", '["native-fast"]',
            "unknown compile candidates ['native-fast'] in LUMINAL_COMPILE_CANDIDATES; known: ",
        ),
    ],
)
def test_a_role_refuses_to_start_on_a_name_the_compiler_does_not_know(
    tmp_path: Path, command: str, setting: str, value: str, message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
    env |= {"LUMINAL_DATA_DIR": str(tmp_path / "data"), setting: value}
    result = subprocess.run(
        [sys.executable, "-m", "luminal_cloud.cli", command],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().startswith(f"luminal-cloud {command}: {message}"), result.stderr


def test_running_an_artifact_imports_no_pipeline_and_no_e_graph():
    """A runtime process imports the artifact format and `executable` (compiler/runnable.py),
    not the pipeline with the search, egglog and the renderers' choices: most of a cold start's
    process start was that import. compile_onnx still comes from `compiler` on first use."""
    probe = (
        "import json, sys\nfrom compiler import Artifact, executable\n"
        "before = sorted(m for m in sys.modules if m == 'egglog' or m.startswith(('compiler.pipeline', 'compiler.search')))\n"
        "from compiler import compile_onnx\n"
        "import compiler\n"
        "print(json.dumps([before, compile_onnx.__module__, callable(compiler.executable)]))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    before, module, callable_after = json.loads(result.stdout.strip().splitlines()[-1])
    assert before == [] and module == "compiler.pipeline"
    # (the pipeline's import of its module must not leave a module where the function was)
    assert callable_after
