"""Dependencies point one way (DESIGN.md, "Packages"): the compiler and the shared plumbing
(cloud/) use nothing of ours above them, the runtime only the compiler, the scheduler the runtime
and the compiler; the runtime and the scheduler are given their ledger and metrics
(api/services.py wires them) and import of the shared plumbing only its error hierarchy and the
usage record. The exceptions: the runtime process of the distributed mode, which serves the
scheduler's streams, and the registry's check of a tokenizer bundle, which uses the runtime's reader. Read from the source with ast, imports inside functions included, so a lazy
import cannot slip past."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = {"api", "cloud", "compiler", "luminal_cloud", "registry", "runtime", "scheduler", "worker"}

# package -> what of ours it may import (a module and everything under it)
ALLOWED = {
    "compiler": {"compiler"},
    "runtime": {"runtime", "compiler"},
    "scheduler": {"scheduler", "runtime", "compiler", "cloud.errors", "cloud.usage"},
    "registry": {"registry", "cloud", "compiler"},
    # plumbing only: importing the settings must not import the compiler (tests/test_import_hygiene.py)
    "cloud": {"cloud"},
    # compile jobs (and the GPU they compile on, named as a runtime names it): the gateway's API is not theirs to use
    "worker": {"worker", "registry", "cloud", "compiler", "runtime"},
}
# a module -> what of ours it may import instead of its package's ALLOWED: the runtime process
# (`luminal-cloud runtime`) serves the scheduler's Redis streams with its batching policy, wire
# messages and priced runs; nothing else in runtime/ imports it, so the scheduler can use the runtime
MODULE_ALLOWED = {
    "runtime/process.py": {"runtime", "compiler", "scheduler", "cloud.errors", "cloud.usage"},
    # a generative upload's tokenizer is checked by the reader the runtime loads it with, so a
    # bundle that is accepted is one that serves
    "registry/bundle.py": {"registry", "cloud", "compiler", "runtime.tokenizer"},
}


def imported_modules(source: str, package: str) -> set[str]:
    """Every module of ours the source imports; `from a import b` counts as a.b, since b may be
    a module (from cloud import metrics)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            # a relative import stays inside its package
            module = package if node.level else node.module or ""
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in OURS}


def within(module: str, allowed: set[str]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in allowed)


def violations(package_dir: Path, allowed: set[str]) -> list[str]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        name = path.relative_to(package_dir.parent).as_posix()
        for module in sorted(imported_modules(path.read_text(), package_dir.name)):
            # `from cloud.errors import Unavailable` reads cloud.errors.Unavailable: within cloud.errors
            if not within(module, MODULE_ALLOWED.get(name, allowed)):
                found.append(f"{name} imports {module}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    assert violations(ROOT / package, ALLOWED[package]) == []


def test_neither_the_runtime_nor_the_scheduler_imports_the_runtime_process() -> None:
    """The process imports the scheduler, which imports the runtime package: an import of the
    process from either would make them import each other."""
    importers = [
        path.relative_to(ROOT).as_posix()
        for package in ("runtime", "scheduler")
        for path in sorted((ROOT / package).rglob("*.py"))
        if any(within(module, {"runtime.process"}) for module in imported_modules(path.read_text(), package))
    ]
    assert importers == []


def test_the_check_catches_a_forbidden_import_even_inside_a_function(tmp_path: Path) -> None:
    scheduler = tmp_path / "scheduler"
    scheduler.mkdir()
    (scheduler / "engine.py").write_text(
        "from cloud.errors import Unavailable\n"
        "from scheduler import policy\n"
        "def meter():\n"
        "    from cloud import metrics\n"
        "    import cloud.metering\n"
        "    from registry import Registry\n"
    )
    assert violations(scheduler, ALLOWED["scheduler"]) == [
        "scheduler/engine.py imports cloud.metering",
        "scheduler/engine.py imports cloud.metrics",
        "scheduler/engine.py imports registry.Registry",
    ]
