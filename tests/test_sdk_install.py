"""The SDK installs light: `pip install` of sdk/ into a fresh virtual environment, with its
dependencies from the package index, brings the client and none of the server's libraries."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SDK = Path(__file__).parent.parent / "sdk"
SERVER_ONLY = {"fastapi", "celery", "egglog", "boto3", "sqlalchemy", "onnxruntime", "uvicorn", "redis"}


def run(*args: str | Path, timeout: float = 120) -> str:
    result = subprocess.run(
        [str(a) for a in args], check=False, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.timeout(600)
def test_the_sdk_installs_without_the_server(tmp_path) -> None:
    # built from a copy, so the checkout gets no build/ or egg-info from it
    source = tmp_path / "sdk"
    shutil.copytree(SDK, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    run(sys.executable, "-m", "venv", tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", source, timeout=480)

    installed = {p["name"].lower() for p in json.loads(run(python, "-m", "pip", "list", "--format=json"))}
    assert {"luminal-cloud-sdk", "httpx", "numpy", "onnx"} <= installed
    assert not installed & SERVER_ONLY, f"the SDK pulled in server libraries: {installed & SERVER_ONLY}"
    assert "torch" not in installed

    check = (
        "import luminal_cloud, sys\n"
        "assert luminal_cloud.Client and luminal_cloud.AsyncClient and luminal_cloud.Graph\n"
        "assert not {'api', 'cloud', 'compiler', 'fastapi'} & set(sys.modules), sorted(sys.modules)\n"
        "print(luminal_cloud.__file__)\n"
    )
    assert "site-packages" in run(python, "-c", check)
    # the command works alone: its own verbs, and none of the server's
    usage = run(tmp_path / "venv" / "bin" / "luminal-cloud", "--help")
    verbs = set(re.findall(r"^    (\w[\w-]*)\s", usage, re.MULTILINE))  # the listed commands
    assert {"deploy", "predict"} <= verbs and "serve" not in verbs, usage
