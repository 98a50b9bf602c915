"""Dependencies point one way (DESIGN.md, "Packages"): the compiler uses nothing of ours, the
runtime only the compiler, the scheduler the runtime and the compiler; the runtime and the
scheduler are given their ledger and metrics (api/services.py wires them) and import of the
shared plumbing only its error hierarchy. Read from the source with ast, imports inside functions
included, so a lazy import cannot slip past."""

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
    "scheduler": {"scheduler", "runtime", "compiler", "cloud.errors"},
    "registry": {"registry", "cloud", "compiler"},
    # the ledger records the scheduler's Usage: the adapter depends on the port, not the reverse
    "cloud": {"cloud", "compiler", "scheduler.pricing"},
    # compile jobs (and the GPU they compile on, named as a runtime names it): the gateway's API is not theirs to use
    "worker": {"worker", "registry", "cloud", "compiler", "runtime"},
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
        for module in sorted(imported_modules(path.read_text(), package_dir.name)):
            # `from cloud.errors import Unavailable` reads cloud.errors.Unavailable: within cloud.errors
            if not within(module, allowed):
                found.append(f"{path.relative_to(package_dir.parent)} imports {module}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    assert violations(ROOT / package, ALLOWED[package]) == []


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
