"""docker-compose.yml and deploy/, checked without a Docker engine: the YAML loads; every build
context, Dockerfile, mounted file and COPY source exists; the gateway, worker and runtime run real
`luminal-cloud` verbs (parsed by the command's own parser) with LUMINAL_* settings that exist and
validate; every service has a health check and waits only on health checks that exist; Prometheus
scrapes the gateway and the runtimes where they listen; Grafana's provisioning points at the
dashboards, whose metrics exist in cloud/metrics.py. And deploy/healthcheck.py tells up from down."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from luminal_cloud.cli import build_parser

from api.server import BackgroundServer
from cloud.metrics import REGISTRY
from cloud.settings import Settings
from tests.conftest import make_settings
from tests.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
# the services that run our image, and the verb each runs
ROLES = {"gateway": "serve", "worker": "worker", "runtime": "runtime"}
# ${NAME:-default} and ${NAME:?message}: compose's interpolation of the operator's environment
INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)?\}")


def interpolated(value: str) -> str:
    """The value as compose gives it with the operator's variables unset (a required one set)."""
    return INTERPOLATION.sub(lambda m: m.group(2) if m.group(2) is not None else f"{m.group(1).lower()}-set", value)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {name: interpolated(str(value)) for name, value in env.items()}


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(host path, container path) of each volume entry that is a file or folder of the repository."""
    mounts = []
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append((source, target))
    return mounts


def dockerfile(service: dict) -> Path:
    build = service["build"]
    return ROOT / build["context"] / build.get("dockerfile", "Dockerfile")


def instructions(path: Path, name: str) -> list[str]:
    """The arguments of every `name` instruction of a Dockerfile (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.split(None, 1)[1] for line in text.splitlines() if line.strip().upper().startswith(name + " ")]


def metric_names() -> set[str]:
    """Every series name the one registry exports."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in REGISTRY.collect() for suffix in suffixes[family.type]}


def test_every_service_has_an_image_or_a_build_whose_files_exist() -> None:
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            assert (ROOT / service["build"]["context"]).is_dir(), name
            assert dockerfile(service).is_file(), name


def test_every_mounted_file_exists() -> None:
    for name, service in SERVICES.items():
        for source, _ in bind_mounts(service):
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is missing"


def test_named_volumes_and_secrets_are_declared() -> None:
    for name, service in SERVICES.items():
        for entry in service.get("volumes", []):
            source = entry.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in COMPOSE["volumes"], f"{name} uses the undeclared volume {source}"
        for secret in service.get("secrets", []):
            assert secret in COMPOSE["secrets"], f"{name} uses the undeclared secret {secret}"


def test_every_dockerfile_copies_sources_that_exist() -> None:
    for name in ROLES:
        service = SERVICES[name]
        context = ROOT / service["build"]["context"]
        copies = instructions(dockerfile(service), "COPY")
        assert copies, name
        for arguments in copies:
            *sources, _ = [word for word in shlex.split(arguments) if not word.startswith("--")]
            for source in sources:
                assert (context / source).exists(), f"{dockerfile(service)} copies {source}, which is missing"


def test_every_role_runs_a_real_luminal_cloud_verb() -> None:
    parser = build_parser()  # with the server's commands, as the installed command builds it
    for name, verb in ROLES.items():
        program, *args = SERVICES[name]["command"]
        assert program == "luminal-cloud", name
        assert args[0] == verb, name
        parser.parse_args(args)  # argparse exits on an unknown verb or option
    for arguments in instructions(dockerfile(SERVICES["gateway"]), "CMD"):
        program, *args = json.loads(arguments)
        assert program == "luminal-cloud"
        parser.parse_args(args)


def test_every_luminal_setting_exists_and_validates(monkeypatch) -> None:
    dockerfile_env = dict(
        pair.split("=", 1) for line in instructions(dockerfile(SERVICES["gateway"]), "ENV") for pair in line.split()
    )
    for name in ROLES:
        env = {**dockerfile_env, **environment(SERVICES[name])}
        luminal = {key: value for key, value in env.items() if key.startswith("LUMINAL_")}
        unknown = {key.removeprefix("LUMINAL_").lower() for key in luminal} - set(Settings.model_fields)
        assert not unknown, f"{name} sets LUMINAL_ names that cloud/settings.py does not declare: {unknown}"
        for key, value in luminal.items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        assert (settings.compile_backend, settings.request_queue, settings.object_store) == ("celery", "redis", "s3")
        for key in luminal:
            monkeypatch.delenv(key)


def test_every_service_has_a_healthcheck_and_waits_only_on_ones_that_exist() -> None:
    one_shot = {
        dependency
        for service in SERVICES.values()
        for dependency, rule in service.get("depends_on", {}).items()
        if rule["condition"] == "service_completed_successfully"
    }
    for name, service in SERVICES.items():
        assert "healthcheck" in service or name in one_shot, f"{name} has no healthcheck"
        for dependency, rule in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on the unknown service {dependency}"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], f"{name} waits on {dependency}'s missing healthcheck"


def test_role_healthchecks_run_the_script_the_image_copies() -> None:
    workdir = instructions(dockerfile(SERVICES["gateway"]), "WORKDIR")[-1]
    for name in ROLES:
        test = SERVICES[name]["healthcheck"]["test"]
        script = next(word for word in test if word.endswith(".py"))
        assert (ROOT / Path(script).relative_to(workdir)).is_file(), f"{name}'s healthcheck runs {script}"
        assert test[test.index(script) + 1] == name


def test_prometheus_scrapes_the_gateway_and_every_runtime_and_worker() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway_port = SERVICES["gateway"]["command"][SERVICES["gateway"]["command"].index("--port") + 1]
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway_port}"]
    secret = Path(jobs["gateway"]["authorization"]["credentials_file"])
    assert secret.parent == Path("/run/secrets") and secret.name in SERVICES["prometheus"]["secrets"]
    assert "LUMINAL_METRICS_TOKEN" in environment(SERVICES["gateway"])
    runtime_port = int(environment(SERVICES["runtime"])["LUMINAL_RUNTIME_METRICS_PORT"])
    assert jobs["runtime"]["dns_sd_configs"] == [{"names": ["runtime"], "type": "A", "port": runtime_port}]
    worker_port = int(environment(SERVICES["worker"])["LUMINAL_WORKER_METRICS_PORT"])
    assert jobs["worker"]["dns_sd_configs"] == [{"names": ["worker"], "type": "A", "port": worker_port}]
    mounted = dict(bind_mounts(SERVICES["prometheus"]))
    assert mounted["./deploy/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_grafana_loads_the_dashboards_whose_metrics_exist() -> None:
    mounted = dict(bind_mounts(SERVICES["grafana"]))
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    assert mounted["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "luminal.yml").read_text())["providers"]
    assert mounted["./deploy/grafana/dashboards"] == provider["options"]["path"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"

    known = metric_names()
    dashboards = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
        assert expressions, path.name
        for expression in expressions:
            for metric in re.findall(r"\bluminal_\w+", expression):
                assert metric in known, f"{path.name} charts {metric}, which cloud/metrics.py does not export"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == datasource["uid"], f"{path.name}: {panel['title']}"


def run_healthcheck(*args: str, env: dict[str, str] | None = None) -> int:
    command = [sys.executable, str(ROOT / "deploy" / "healthcheck.py"), *args]
    return subprocess.run(command, check=False, env=env, capture_output=True, timeout=60).returncode


def test_the_gateway_healthcheck_tells_a_ready_gateway_from_none(tmp_path) -> None:
    assert run_healthcheck("gateway", "--port", str(free_port())) == 1
    with BackgroundServer(make_settings(tmp_path / "data")) as server:
        assert run_healthcheck("gateway", "--port", str(server.port)) == 0


@pytest.mark.parametrize("port", ["0", "free"])
def test_the_runtime_healthcheck_fails_without_metrics(port: str) -> None:
    metrics_port = str(free_port()) if port == "free" else port
    env = {**os.environ, "LUMINAL_RUNTIME_METRICS_PORT": metrics_port}
    assert run_healthcheck("runtime", env=env) == 1
