"""The `luminal-cloud` command as a script sees it, run as a subprocess against a live server:
tables, --json that parses, exit codes (0 ok, 1 server error, 2 usage, 3 unreachable), one-line
messages instead of tracebacks, help on every option, and a demo that leaves ~/.luminal-cloud alone."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from api.server import BackgroundServer, free_port
from luminal_cloud import Client
from luminal_cloud.cli import build_parser
from tests.onnx_models import mlp

V1, V2 = mlp(seed=0).SerializeToString(), mlp(seed=1).SerializeToString()


def cli(*args: str, url: str | None = None, key: str | None = None, env: dict | None = None, timeout: float = 120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
    if url:
        base["LUMINAL_URL"] = url
    if key:
        base["LUMINAL_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "luminal_cloud.cli", *args],
        check=False, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )


def one_line_error(result, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def server(settings, keys):
    with BackgroundServer(settings) as running:
        yield running


@pytest.fixture
def deployed(server, keys) -> str:
    """Model "m" with v1 and v2 ready; returns the server's URL."""
    with Client(server.url, keys["alice"]) as client:
        client.deploy(V1, "m", progress=False)
        client.deploy(V2, "m", progress=False)
    return server.url


def test_tables_and_json_for_models_versions_status_promote_rollback_usage(deployed, keys, tmp_path) -> None:
    run = lambda *args: cli(*args, url=deployed, key=keys["alice"])

    models = run("models")
    assert models.returncode == 0, models.stderr
    header, row = models.stdout.splitlines()
    assert header.split() == ["NAME", "VERSIONS", "LATEST", "STATUS", "CREATED"]
    assert row.split()[:4] == ["m", "2", "2", "ready"]
    assert json.loads(run("models", "--json").stdout)[0]["name"] == "m"

    promoted = run("promote", "m", "prod", "1")
    assert (promoted.returncode, promoted.stdout.strip()) == (0, "m: prod -> v1")
    promoted = run("promote", "m", "prod", "2")
    assert promoted.stdout.strip() == "m: prod -> v2 (rollback goes to v1)"

    table = run("versions", "m").stdout.splitlines()
    assert table[0].split() == ["VERSION", "STATUS", "TARGET", "CREATED", "ALIASES", "ERROR"]
    assert [line.split()[:3] for line in table[1:]] == [["1", "ready", "cpu"], ["2", "ready", "cpu"]]
    assert table[2].split()[-1] == "prod"
    listed = json.loads(run("versions", "m", "--json").stdout)
    assert [v["aliases"] for v in listed["versions"]] == [[], ["prod"]]

    status = run("status", "m", "--version", "prod").stdout
    assert re.search(r"^version\s+2$", status, re.MULTILINE)
    assert re.search(r"^aliases\s+prod$", status, re.MULTILINE)
    assert re.search(r"^precision\s+exported$", status, re.MULTILINE)
    assert re.search(r"^compiled\s+\S+ s, chosen ", status, re.MULTILINE)
    assert json.loads(run("status", "m", "--json").stdout)["status"] == "ready"

    rolled = run("rollback", "m", "prod", "--json")
    assert rolled.returncode == 0 and json.loads(rolled.stdout)["version"] == 1
    refused = one_line_error(run("rollback", "m", "prod"), 1)
    assert "409" in refused and "no earlier version" in refused
    refused = one_line_error(run("delete", "m", "--version", "1"), 1)
    assert "alias 'prod'" in refused

    x = tmp_path / "x.npy"
    np.save(x, np.ones((2, 8), np.float32))
    predicted = run("predict", "m", "--input", f"x={x}", "--version", "prod", "--json")
    assert predicted.returncode == 0, predicted.stderr
    assert json.loads(predicted.stdout)["y"]["shape"] == [2, 3]

    usage = run("usage")
    assert usage.returncode == 0, usage.stderr
    lines = usage.stdout.splitlines()
    assert lines[0].split()[:2] == ["MODEL", "VERSION"] and lines[1].split()[:4] == ["m", "1", "cpu", "1"]
    assert lines[-1].startswith("total: ")
    assert json.loads(run("usage", "--json", "--group-by", "model").stdout)["items"][0]["model"] == "m"


def test_exit_codes_and_one_line_messages(deployed, keys, tmp_path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    message = one_line_error(cli("models", url=down, key="lc_whatever"), 3)
    assert down in message

    message = one_line_error(cli("models", url=deployed, key="lc_not_a_key"), 1)
    assert "refused the API key" in message

    message = one_line_error(cli("models", url=deployed), 2)
    assert "no API key" in message

    message = one_line_error(cli("deploy", str(tmp_path / "missing.onnx"), "--name", "m", url=deployed, key="k"), 2)
    assert "no such file" in message and "missing.onnx" in message

    message = one_line_error(cli("predict", "m", "--input", f"x={tmp_path / 'none.npy'}", url=deployed, key="k"), 2)
    assert "no such file" in message

    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"this is not numpy")
    message = one_line_error(cli("predict", "m", "--input", f"x={garbage}", url=deployed, key=keys["alice"]), 2)
    assert "garbage.npy (input 'x') is not a .npy array file" in message and "pickle" not in message

    pickled = tmp_path / "objects.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    message = one_line_error(cli("predict", "m", "--input", f"x={pickled}", url=deployed, key=keys["alice"]), 2)
    assert "objects.npy" in message and "holds Python objects" in message and "pickle" not in message

    message = one_line_error(cli("status", "nope", url=deployed, key=keys["alice"]), 1)
    assert "404" in message and "'nope'" in message

    model = tmp_path / "m.onnx"
    model.write_bytes(V1)
    half = cli("deploy", str(model), "--name", "half", "--precision", "float16", url=deployed, key=keys["alice"])
    message = one_line_error(half, 1)
    assert "400" in message and "precision 'float16' runs on GPU targets" in message

    assert cli("promote", "m", "prod", "not-a-number").returncode == 2  # argparse's own usage error


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command and sub-command: (its words, its parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _verbs(sub, (*path, name))


def _undocumented(help_text: str) -> list[str]:
    """The arguments that --help lists without a description."""
    missing, section = [], False
    lines = help_text.splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            section = line in ("options:", "positional arguments:")
            continue
        if not section or not line.startswith("  ") or line.startswith("   "):
            continue
        if re.search(r"\S {2,}\S", line.strip()):
            continue  # described on the same line
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if following.startswith("    ") and following.strip():
            continue  # described on the next line, further in
        missing.append(line.strip())
    return missing


def test_every_option_of_every_verb_has_help() -> None:
    verbs = dict(_verbs(build_parser()))
    assert {("models",), ("status",), ("versions",), ("promote",), ("rollback",), ("usage",), ("demo",)} <= set(verbs)
    missing = {" ".join(words): _undocumented(sub.format_help()) for words, sub in verbs.items()}
    assert {k: v for k, v in missing.items() if v} == {}
    # and as a script sees it: the same help, with the exit codes
    shown = cli("versions", "--help")
    assert shown.returncode == 0 and not _undocumented(shown.stdout)
    assert "exit codes:" in shown.stdout and "3  the server cannot be reached" in shown.stdout
    assert "exit codes:" in cli("--help").stdout


def test_demo_runs_in_a_temporary_data_directory(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    sample = tmp_path / "sample"
    result = cli("demo", "--requests", "2", "--sample-dir", str(sample), env={"HOME": str(home)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "all match onnxruntime" in result.stdout
    assert not (home / ".luminal-cloud").exists()
    assert sorted(p.name for p in sample.iterdir()) == ["demo-mlp.onnx", "features.npy"]


def test_admin_keys_and_serve_share_a_data_dir_given_by_option(tmp_path: Path) -> None:
    data, home = tmp_path / "data", tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}  # nothing may fall back to ~/.luminal-cloud
    admin = lambda *args: cli("admin", *args, "--data-dir", str(data), env=env)
    made = admin("create-key", "--tenant", "acme")
    assert made.returncode == 0, made.stderr
    key = made.stdout.split()[-1]
    assert str(data) in made.stdout  # says where, since serve must use the same
    other = admin("create-key", "--tenant", "acme").stdout.split()[-1]
    admin("create-key", "--tenant", "bob")

    listed = admin("list-keys")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["ID", "PREFIX", "TENANT", "CREATED"]
    assert [row.split()[1:3] for row in rows] == [[key[:10], "acme"], [other[:10], "acme"], [rows[2].split()[1], "bob"]]
    assert key not in listed.stdout
    assert [row.split()[2] for row in admin("list-keys", "--tenant", "bob").stdout.splitlines()[1:]] == ["bob"]
    assert "no tenant named 'nobody'" in one_line_error(admin("list-keys", "--tenant", "nobody"), 1)

    port, log = free_port(), tmp_path / "serve.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
    with log.open("w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "luminal_cloud.cli", "serve", "--data-dir", str(data), "--port", str(port)],
            env={**base, **env, "LUMINAL_AUTH_CACHE_TTL_S": "0"}, stdout=log_file, stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not _answers(f"{url}/healthz"):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200  # the key made with --data-dir

        ambiguous = one_line_error(admin("revoke-key", "lc_"), 1)
        assert "matches 3 tenant keys" in ambiguous and key[:10] in ambiguous and "bob" in ambiguous
        revoked = admin("revoke-key", key[:10])
        assert revoked.returncode == 0, revoked.stderr
        assert f"Revoked key {key[:10]}" in revoked.stdout and "acme" in revoked.stdout
        # this server caches no key (LUMINAL_AUTH_CACHE_TTL_S=0): refused on the next request
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {other}"}).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert "no tenant key matches" in one_line_error(admin("revoke-key", key[:10]), 1)
    assert "add --admin" in one_line_error(admin("revoke-key", "lca_abc"), 1)
    operator = admin("create-key", "--admin", "--name", "ops").stdout.split()[-1]
    assert admin("list-keys", "--admin").stdout.splitlines()[1].split()[1:3] == [operator[:10], "ops"]
    assert admin("revoke-key", "--admin", operator[:10]).returncode == 0
    assert not (home / ".luminal-cloud").exists()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False
