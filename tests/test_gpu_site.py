"""scripts/gpu-site: the packages a GPU machine needs come from what .venv has installed, and a
missing one stops it with its name (it used to die silently on a package .venv never had)."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-site"


def _list(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), "--list"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def test_the_site_list_is_the_installed_closure_of_what_the_compiler_and_server_import():
    listed = _list()
    assert listed.returncode == 0, listed.stderr
    pins = dict(line.split("==") for line in listed.stdout.split())
    for needed in ("egglog", "black", "pytokens", "fastapi", "starlette", "pydantic", "pydantic-core", "sqlalchemy", "alembic"):
        assert needed in pins, f"{needed} missing from {sorted(pins)}"
    for name, version in pins.items():
        assert metadata.version(name) == version  # installed here at that version
    # the GPU machine's own (torch's numpy), and egglog's notebook widgets, are not shipped
    assert not {"numpy", "typing-extensions", "ipython", "anywidget"} & set(pins)


def test_a_package_that_is_not_installed_stops_the_script_with_its_name():
    listed = _list(GPU_SITE_ROOTS="egglog luminal-no-such-package")
    assert listed.returncode != 0
    assert "not installed in .venv: luminal-no-such-package" in listed.stderr
