"""deploy/k8s checked without a cluster.

The kustomizations are rendered here in Python by a loader of the few kustomize features they use
(it refuses any other, and agrees with `kubectl kustomize` where kubectl is installed). Every
object is validated against its schema: core Kubernetes objects with kubernetes-validate (strict:
an unknown field is an error, as the API server's strict field validation makes it), KEDA's
ScaledObject and TriggerAuthentication and the Prometheus operator's ServiceMonitor against their
CRDs' OpenAPI schemas (vendored in tests/data, made strict the same way).

Then what no schema knows, against the code: the containers run real `luminal-cloud` verbs with
LUMINAL_* settings that exist and validate; each worker's KEDA triggers count exactly the Celery
lists of the queues that worker takes, in the database and at the address of LUMINAL_REDIS_URL;
each runtime pool scales from zero on the consumer-group lag of its own device type's pool stream
(named by scheduler/wire.py, which the gateway queues on while the pool has no runtime) and stays
up on its own device type's metric; GPU pods ask for a GPU of the type their command names; probes, Services,
ServiceMonitors and deploy/prometheus.yml point at what the roles serve; grace periods cover the
drains; every pod has a disruption budget.

Not checked here: KEDA's admission webhook and its scalers' own metadata parsing, the CRDs' CEL
rules, and anything that needs a cluster (scheduling on GPU nodes, a scale from zero).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kombu.transport.redis import Channel

from api.main import create_app
from cloud.metrics import EXECUTION_SECONDS
from cloud.settings import Settings
from compiler.targets import GPU_TYPES, KNOWN_TARGETS
from luminal_cloud.cli import build_parser
from runtime.cuda import parse_device
from scheduler import wire
from scheduler.engine import Route
from scheduler.streams import choose_runtime
from worker.celery_app import (
    LARGE_PRIORITY,
    LEASE_S,
    SMALL_PRIORITY,
    compile_queue,
    make_celery,
    measured_queue,
)
from worker.devices import FoundGpu, check_targets

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
# what an operator applies: the CPU-only base, the base with H100s, the monitoring ConfigMaps
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "gpu-h100": K8S / "overlays" / "gpu-h100",
    "monitoring": K8S / "monitoring",
}
SECRETS = K8S / "secrets.example.yaml"
DATA = Path(__file__).parent / "data"
# the CRDs of the custom resources used, by (apiVersion, kind)
CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"): DATA / "keda" / "keda.sh_scaledobjects.yaml",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): DATA / "keda" / "keda.sh_triggerauthentications.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DATA
    / "prometheus-operator"
    / "monitoring.coreos.com_servicemonitors.yaml",
}
# Kubernetes releases the core objects are validated against: an older one still common, the newest
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# the role of each component, as the command's verb
VERBS = {"gateway": "serve", "worker": "worker", "runtime": "runtime"}
# nvidia.com/gpu.product (GPU feature discovery's node label) -> what the driver reports for it
GPU_PRODUCTS = {"NVIDIA-H100-80GB-HBM3": FoundGpu(0, "NVIDIA H100 80GB HBM3", "sm_90")}
GPU = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


# -- a kustomize subset --


class UnsupportedKustomization(ValueError):
    """A kustomization uses a feature the loader does not implement (so it cannot render it exactly)."""


KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "patches",
    "configMapGenerator",
    "generatorOptions",
}
CLUSTER_SCOPED = {"Namespace"}


def kustomize(directory: Path) -> list[dict]:
    """What `kustomize build directory` prints, for kustomizations made of: resources (YAML files
    and other kustomization directories), configMapGenerator from files with no name hash,
    strategic-merge patches that set map fields, and namespace. Anything else is refused."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if unknown := set(spec) - KUSTOMIZATION_FIELDS:
        raise UnsupportedKustomization(f"{directory}: {sorted(unknown)}")
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        objects += (
            kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
        )
    objects += [
        _generated_config_map(directory, g, spec.get("generatorOptions", {}))
        for g in spec.get("configMapGenerator", [])
    ]
    for patch in spec.get("patches", []):
        _apply_patch(directory, patch, objects)
    if namespace := spec.get("namespace"):
        for obj in objects:
            if obj["kind"] == "Namespace":
                if obj["metadata"]["name"] != namespace:  # kustomize renames it: not implemented
                    raise UnsupportedKustomization(
                        f"{directory}: Namespace {obj['metadata']['name']} in {namespace}"
                    )
            else:
                obj["metadata"]["namespace"] = namespace
    ids = [object_id(obj) for obj in objects]
    if len(ids) != len(set(ids)):
        raise UnsupportedKustomization(f"{directory}: an object is defined twice")
    return objects


def _generated_config_map(directory: Path, generator: dict, options: dict) -> dict:
    if unknown := set(generator) - {"name", "files", "options"}:
        raise UnsupportedKustomization(f"configMapGenerator {generator['name']}: {sorted(unknown)}")
    merged = {**options, **generator.get("options", {})}
    if unknown := set(merged) - {"disableNameSuffixHash", "labels"}:
        raise UnsupportedKustomization(f"generator options {sorted(unknown)}")
    if not merged.get("disableNameSuffixHash"):
        raise UnsupportedKustomization(
            f"configMapGenerator {generator['name']}: the name hash is not implemented"
        )
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=") if "=" in entry else (None, None, entry)
        data[key or Path(path).name] = (directory / path).read_text()
    labels = {**options.get("labels", {}), **generator.get("options", {}).get("labels", {})}
    metadata = {"name": generator["name"], **({"labels": labels} if labels else {})}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _apply_patch(directory: Path, patch: dict, objects: list[dict]) -> None:
    if set(patch) != {"path"}:
        raise UnsupportedKustomization(f"patch {patch}: only a strategic-merge patch file by path")
    change = yaml.safe_load((directory / patch["path"]).read_text())
    matches = [
        o
        for o in objects
        if (o["kind"], o["metadata"]["name"]) == (change["kind"], change["metadata"]["name"])
    ]
    if len(matches) != 1:
        raise UnsupportedKustomization(f"patch {patch['path']} matches {len(matches)} objects")
    _merge_maps(matches[0], change, patch["path"])


def _merge_maps(target: dict, change: dict, where: str) -> None:
    """A strategic merge patch of maps only: lists, nulls and $patch directives have rules of
    their own, not implemented."""
    for key, value in change.items():
        if key.startswith("$") or value is None or isinstance(value, list):
            raise UnsupportedKustomization(f"{where}: {key} needs strategic merge's list or delete rules")
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_maps(target[key], value, where)
        else:
            target[key] = copy.deepcopy(value)


def object_id(obj: dict) -> tuple[str, str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


@cache
def _rendered(name: str) -> tuple[dict, ...]:
    return tuple(kustomize(KUSTOMIZATIONS[name]))


def rendered(name: str) -> list[dict]:
    """The kustomization's objects (copies: a test may change them)."""
    return copy.deepcopy(list(_rendered(name)))


def secrets() -> list[dict]:
    return [d for d in yaml.safe_load_all(SECRETS.read_text()) if d]


def everything() -> list[dict]:
    """Every object an operator applies, once each."""
    objects = {object_id(o): o for name in KUSTOMIZATIONS for o in rendered(name)}
    return [*objects.values(), *secrets()]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    (found,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def app_objects(name: str) -> list[dict]:
    """An application kustomization's objects, with the Secrets the operator applies beside it."""
    return [*rendered(name), *secrets()]


APPS = ("base", "gpu-h100")


# -- the pods: commands, settings --


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def component(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def command_args(deployment: dict) -> argparse.Namespace:
    """The container's command as `luminal-cloud`'s own parser reads it, each option spelt out
    (argparse would take an abbreviation such as --target for --targets)."""
    command = container(deployment)["command"]
    assert command[0] == "luminal-cloud", command
    parser = build_parser()
    args = parser.parse_args(command[1:])
    (verbs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = {o for action in verbs.choices[args.command]._actions for o in action.option_strings}
    assert {word for word in command[2:] if word.startswith("-")} <= options, command
    return args


def pod_environment(deployment: dict, objects: list[dict]) -> dict[str, str]:
    """The container's LUMINAL_* environment: its ConfigMaps, its literal values and the Secrets'
    (placeholder) values, each reference checked to exist."""
    spec = container(deployment)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{deployment['metadata']['name']}: envFrom {source}"
        env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in spec.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = named(objects, "Secret", ref["name"])
        assert ref["key"] in secret["stringData"], (
            f"{deployment['metadata']['name']}: Secret {ref['name']} lacks {ref['key']}"
        )
        env[entry["name"]] = secret["stringData"][ref["key"]]
    return env


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with the given LUMINAL_* variables instead of its own."""
    others = {k: v for k, v in os.environ.items() if not k.startswith("LUMINAL_")}
    with mock.patch.dict(os.environ, {**others, **env}, clear=True):
        yield


def pod_settings(deployment: dict, objects: list[dict]) -> Settings:
    """The Settings the container's process builds from its environment."""
    with environment(pod_environment(deployment, objects)):
        return Settings()


def deployments(name: str) -> list[dict]:
    return of_kind(rendered(name), "Deployment")


def scaled_object_of(deployment: dict, objects: list[dict]) -> dict:
    (found,) = [
        s
        for s in of_kind(objects, "ScaledObject")
        if s["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    ]
    return found


def gpu_type(deployment: dict) -> str | None:
    """The GPU type the container's command needs: a runtime's device type, a worker's GPU target."""
    args = command_args(deployment)
    if args.command == "runtime":
        device = parse_device(args.device)[0]
        return device if device in GPU_TYPES else None
    if args.command == "worker":
        gpus = [t for t in (args.targets or "").split(",") if t in GPU_TYPES]
        assert len(gpus) <= 1, f"{deployment['metadata']['name']}: one GPU type per worker pool"
        return gpus[0] if gpus and args.device != "cpu" else None
    return None


# -- schemas --


def strict(schema: object) -> object:
    """The schema with unknown fields refused wherever it lists the fields of an object and does
    not keep unknown ones, as the API server's strict field validation does for custom resources."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRDS[(api_version, kind)].read_text())
    group, version = api_version.split("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def schema_errors(obj: dict, kubernetes_version: str) -> list[str]:
    """What is wrong with the object by its schema; an object of no known schema is an error."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    key = (obj["apiVersion"], obj["kind"])
    if key in CRDS:
        return [
            f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(*key).iter_errors(obj)
        ]
    try:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [f"{where}: no schema: {exc.message}"]
    return []


# -- the loader --


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_the_loader_renders_as_kubectl_kustomize_does(name: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the loader's output is not compared with kustomize's")
    flags = ["--load-restrictor", "LoadRestrictionsNone"] if name == "monitoring" else []
    out = subprocess.run(
        [kubectl, "kustomize", *flags, str(KUSTOMIZATIONS[name])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=object_id)
    assert sorted(rendered(name), key=object_id) == theirs


def test_the_loader_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n")
    (tmp_path / "p.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: [1]}\n")
    cases = {
        "images: [{name: x, newTag: '1'}]\nresources: [cm.yaml]\n": "images",
        "resources: [cm.yaml]\npatches: [{path: p.yaml}]\n": "list or delete rules",
        "configMapGenerator: [{name: y, files: [cm.yaml]}]\n": "name hash",
        "resources: [cm.yaml, cm.yaml]\n": "defined twice",
    }
    for text, why in cases.items():
        (tmp_path / "kustomization.yaml").write_text(text)
        with pytest.raises(UnsupportedKustomization, match=why):
            kustomize(tmp_path)


# -- schemas --


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_by_its_schema(version: str) -> None:
    errors = [e for obj in everything() for e in schema_errors(obj, version)]
    assert not errors, "\n".join(errors)


def test_the_schemas_refuse_broken_objects() -> None:
    """The validation above is not vacuous: a misspelt field, a wrong type, a missing field fail."""
    objects = everything()
    version = KUBERNETES_VERSIONS[-1]
    breakages = []
    scaled = copy.deepcopy(of_kind(objects, "ScaledObject")[0])
    scaled["spec"]["minReplicas"] = scaled["spec"].pop("minReplicaCount")  # misspelt
    breakages.append(scaled)
    scaled = copy.deepcopy(of_kind(objects, "ScaledObject")[0])
    scaled["spec"]["triggers"][0]["metadata"]["listLength"] = 1  # metadata values are strings
    breakages.append(scaled)
    auth = copy.deepcopy(of_kind(objects, "TriggerAuthentication")[0])
    del auth["spec"]["secretTargetRef"][0]["key"]
    breakages.append(auth)
    monitor = copy.deepcopy(of_kind(objects, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["bearerToken"] = "x"  # not a field
    breakages.append(monitor)
    deployment = copy.deepcopy(of_kind(objects, "Deployment")[0])
    container(deployment)["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    breakages.append(deployment)
    budget = copy.deepcopy(of_kind(objects, "PodDisruptionBudget")[0])
    budget["spec"]["selector"] = "gateway"
    breakages.append(budget)
    for broken in breakages:
        assert schema_errors(broken, version), broken


# -- what the schemas cannot know --


def test_everything_lives_in_one_namespace() -> None:
    namespaces = {o["metadata"]["name"] for o in everything() if o["kind"] == "Namespace"}
    assert len(namespaces) == 1
    assert {
        o["metadata"].get("namespace") for o in everything() if o["kind"] not in CLUSTER_SCOPED
    } == namespaces


@pytest.mark.parametrize("name", APPS)
def test_each_container_runs_a_luminal_cloud_verb_of_the_image(name: str) -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for deployment in deployments(name):
        args = command_args(deployment)  # the command's own parser: exits on a flag it lacks
        assert args.command == VERBS[component(deployment)], deployment["metadata"]["name"]
        assert container(deployment)["image"].split(":")[0] == "luminal-cloud"  # deploy/Dockerfile's image
    # the image holds the health check the worker probes run, where they run it
    assert "WORKDIR /app" in dockerfile and "COPY deploy/healthcheck.py ./deploy/healthcheck.py" in dockerfile


@pytest.mark.parametrize("name", APPS)
def test_env_names_are_settings_and_their_values_validate(name: str) -> None:
    objects = app_objects(name)
    fields = {f"LUMINAL_{field.upper()}" for field in Settings.model_fields}
    for config in [*of_kind(objects, "ConfigMap"), *of_kind(objects, "Secret")]:
        if config["metadata"]["name"] != "luminal-cloud":
            continue
        keys = set(config.get("data", config.get("stringData", {})))
        assert keys <= fields, (
            f"{config['kind']} {config['metadata']['name']}: not settings: {sorted(keys - fields)}"
        )
    for deployment in of_kind(objects, "Deployment"):
        env = pod_environment(deployment, objects)
        assert set(env) <= fields, (
            f"{deployment['metadata']['name']}: not settings: {sorted(set(env) - fields)}"
        )
        settings = pod_settings(deployment, objects)  # pydantic validates each value
        assert set(settings.targets) <= set(KNOWN_TARGETS), settings.targets
        adapters = (settings.compile_backend, settings.request_queue, settings.object_store)
        assert adapters == ("celery", "redis", "s3"), adapters
        assert settings.database_url or component(deployment) == "runtime", (
            "the gateway and workers share PostgreSQL"
        )
        if (gpu := gpu_type(deployment)) is not None:
            assert gpu in settings.targets, (
                f"{deployment['metadata']['name']}: {gpu} is not in LUMINAL_TARGETS"
            )
    # the gateway accepts uploads for every device type a pool serves
    (gateway,) = [d for d in of_kind(objects, "Deployment") if component(d) == "gateway"]
    served = {gpu_type(d) or "cpu" for d in of_kind(objects, "Deployment") if component(d) == "runtime"}
    assert served == set(pod_settings(gateway, objects).targets)


def test_every_keda_object_targets_what_exists() -> None:
    for name in APPS:
        objects = app_objects(name)
        auths = {a["metadata"]["name"]: a for a in of_kind(objects, "TriggerAuthentication")}
        names = {d["metadata"]["name"] for d in of_kind(objects, "Deployment")}
        for scaled in of_kind(objects, "ScaledObject"):
            assert scaled["spec"]["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
            assert scaled["spec"]["scaleTargetRef"]["name"] in names, scaled["metadata"]["name"]
            for trigger in scaled["spec"]["triggers"]:
                if "authenticationRef" in trigger:
                    assert trigger["authenticationRef"]["name"] in auths, scaled["metadata"]["name"]
        for auth in auths.values():
            for ref in auth["spec"]["secretTargetRef"]:
                assert ref["key"] in named(objects, "Secret", ref["name"])["stringData"], ref


@pytest.mark.parametrize("name", APPS)
def test_keda_scales_every_pool_and_owns_its_count(name: str) -> None:
    objects = rendered(name)
    for deployment in of_kind(objects, "Deployment"):
        scaled = scaled_object_of(deployment, objects)
        # a replicas field would put the count back at each apply
        assert "replicas" not in deployment["spec"], deployment["metadata"]["name"]
        if component(deployment) == "gateway":
            assert scaled["spec"]["minReplicaCount"] >= 1
        elif component(deployment) == "worker":
            assert scaled["spec"]["minReplicaCount"] == 0, "an idle compile pool is none"
        else:
            assert scaled["spec"]["minReplicaCount"] == 0, "an idle runtime pool is none"
        assert scaled["spec"]["maxReplicaCount"] >= max(1, scaled["spec"]["minReplicaCount"])


def celery_list(queue: str, priority: int, steps: list[int]) -> str:
    """The Redis list holding a queue's messages of that priority, named by kombu's own code."""
    channel = SimpleNamespace(priority_steps=steps, sep=Channel.sep)
    channel.priority = lambda n: Channel.priority(channel, n)
    return Channel._q_for_pri(channel, queue, priority)


@pytest.mark.parametrize("name", APPS)
def test_worker_triggers_count_the_celery_lists_of_the_queues_the_worker_takes(name: str) -> None:
    objects = app_objects(name)
    for deployment in [d for d in of_kind(objects, "Deployment") if component(d) == "worker"]:
        args = command_args(deployment)
        settings = pod_settings(deployment, objects)
        targets = tuple(t for t in (args.targets or ",".join(settings.targets)).split(",") if t)
        products = deployment["spec"]["template"]["spec"].get("nodeSelector", {})
        node_gpu = GPU_PRODUCTS.get(products.get(GPU_PRODUCT_LABEL, ""))

        def probe(ordinal: int, node_gpu: FoundGpu | None = node_gpu) -> FoundGpu:
            assert node_gpu is not None, "a GPU target on a node without a GPU"
            return node_gpu

        # what `luminal-cloud worker` decides on its node, and the queues run_worker then takes
        check = check_targets(targets, args.device, probe, settings.allow_unmeasured_compile)
        assert not check.refused, check.refused
        queues = [compile_queue(t) for t in check.accepted] + [
            measured_queue(t) for t in check.measured if t in GPU_TYPES
        ]
        steps = make_celery(settings).conf.broker_transport_options["priority_steps"]
        lists = {celery_list(q, p, steps) for q in queues for p in (SMALL_PRIORITY, LARGE_PRIORITY)}
        triggers = scaled_object_of(deployment, objects)["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"redis"}
        assert {t["metadata"]["listName"] for t in triggers} == lists, deployment["metadata"]["name"]


def test_keda_reads_the_redis_of_LUMINAL_REDIS_URL() -> None:
    objects = app_objects("gpu-h100")
    url = urlsplit(named(objects, "Secret", "luminal-cloud")["stringData"]["LUMINAL_REDIS_URL"])
    keda = named(objects, "Secret", "luminal-cloud-keda")["stringData"]
    assert keda["redis-address"] == f"{url.hostname}:{url.port or 6379}"
    assert keda["redis-password"] == (url.password or "")
    database = url.path.strip("/") or "0"
    for scaled in of_kind(objects, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            if trigger["type"] in ("redis", "redis-streams"):
                assert trigger["metadata"]["databaseIndex"] == database, scaled["metadata"]["name"]


EXECUTION_QUERY = re.compile(
    r"^sum\(rate\((?P<metric>\w+)\{(?P<label>\w+)=\"(?P<value>[\w-]+)\"\}\[\d+[smh]\]\)\)$"
)


def runtime_triggers(deployment: dict, objects: list[dict]) -> dict[str, dict]:
    """A runtime pool's KEDA triggers by type, one of each."""
    triggers = scaled_object_of(deployment, objects)["spec"]["triggers"]
    by_type = {t["type"]: t for t in triggers}
    assert len(by_type) == len(triggers), f"{deployment['metadata']['name']}: one trigger of each type"
    return by_type


@pytest.mark.parametrize("name", APPS)
def test_runtime_pools_stay_up_and_grow_on_their_own_device_time(name: str) -> None:
    objects = app_objects(name)
    (metric,) = EXECUTION_SECONDS.describe()
    for deployment in [d for d in of_kind(objects, "Deployment") if component(d) == "runtime"]:
        device_type = parse_device(command_args(deployment).device)[0]
        trigger = runtime_triggers(deployment, objects)["prometheus"]
        query = EXECUTION_QUERY.match(trigger["metadata"]["query"])
        assert query, trigger["metadata"]["query"]
        assert query["metric"] == f"{metric.name}_total" and query["label"] in EXECUTION_SECONDS._labelnames
        assert query["value"] == device_type, deployment["metadata"]["name"]
        float(trigger["metadata"]["threshold"])


@pytest.mark.parametrize("name", APPS)
def test_runtime_pools_scale_from_zero_on_the_lag_of_their_device_types_pool_stream(name: str) -> None:
    objects = app_objects(name)
    for deployment in [d for d in of_kind(objects, "Deployment") if component(d) == "runtime"]:
        device_type = parse_device(command_args(deployment).device)[0]
        trigger = runtime_triggers(deployment, objects)["redis-streams"]
        metadata = trigger["metadata"]
        # the stream and group the gateway queues on for a pool with no runtime, and runtimes read
        assert metadata["stream"] == wire.pool_stream(device_type), deployment["metadata"]["name"]
        assert metadata["consumerGroup"] == wire.RUNTIME_GROUP
        # lagCount: KEDA scales on the group's lag (not its pending entries, nor the stream's
        # length); a batch's worth of waiting requests per runtime, and the first one starts one
        settings = pod_settings(deployment, objects)
        assert set(metadata) >= {"lagCount", "databaseIndex"} and not {"pendingEntriesCount", "streamLength"} & set(metadata)
        assert int(metadata["lagCount"]) == settings.max_batch_rows
        assert int(metadata.get("activationLagCount", "0")) == 0
        assert trigger["authenticationRef"]["name"] == "luminal-redis"


@pytest.mark.parametrize("name", APPS)
def test_runtime_pools_go_to_zero_only_because_the_gateway_queues_for_an_empty_pool(name: str) -> None:
    objects = rendered(name)
    for deployment in [d for d in of_kind(objects, "Deployment") if component(d) == "runtime"]:
        device_type = parse_device(command_args(deployment).device)[0]
        route = Route(1, 1, "tenant", "model", 1, device_type, "artifact", batchable=True)
        # no runtime of the type: the gateway queues on the pool stream rather than refusing
        # (were it Unavailable, a pool at zero would answer 503 and never start)
        assert choose_runtime(route, [], set()) is None
        assert scaled_object_of(deployment, objects)["spec"]["minReplicaCount"] == 0
        # a request waits for the pool within its deadline; the lag is read several times meanwhile
        scaled = scaled_object_of(deployment, objects)["spec"]
        assert scaled["pollingInterval"] * 5 <= pod_settings(deployment, app_objects(name)).request_timeout_s


def gpu_requests(deployment: dict) -> tuple[object, object]:
    resources = container(deployment).get("resources", {})
    return resources.get("limits", {}).get(GPU), resources.get("requests", {}).get(GPU)


@pytest.mark.parametrize("name", APPS)
def test_gpu_pods_ask_for_the_gpu_their_command_names(name: str) -> None:
    gpu_pools = 0
    for deployment in deployments(name):
        pod = deployment["spec"]["template"]["spec"]
        selector = pod.get("nodeSelector", {})
        if (gpu := gpu_type(deployment)) is None:
            assert gpu_requests(deployment) == (None, None) and GPU_PRODUCT_LABEL not in selector
            continue
        gpu_pools += 1
        # the device plugin allocates by limits; requests, when given, must equal them
        assert gpu_requests(deployment)[0] == 1 and gpu_requests(deployment)[1] in (None, 1)
        found = GPU_PRODUCTS[selector[GPU_PRODUCT_LABEL]]
        assert found.arch == GPU_TYPES[gpu].arch, f"{deployment['metadata']['name']}: {gpu} on a {found.name}"
        assert any(t["key"] == GPU and t["operator"] == "Exists" for t in pod.get("tolerations", []))
    assert gpu_pools == (2 if name == "gpu-h100" else 0)


def named_port(deployment: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container(deployment)["ports"] if p["name"] == port]
    return number


def http_probes(deployment: dict) -> dict[str, dict]:
    probes = {k: container(deployment).get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    return {k: p["httpGet"] for k, p in probes.items() if p and "httpGet" in p}


@pytest.mark.parametrize("name", APPS)
def test_probes_ask_what_each_role_serves(name: str, tmp_path: Path) -> None:
    objects = app_objects(name)
    paths = create_app(Settings(data_dir=tmp_path)).openapi()["paths"]
    routes = {path for path, methods in paths.items() if "get" in methods}
    healthcheck = (ROOT / "deploy" / "healthcheck.py").read_text()
    roles = re.search(r'"role", choices=\[([^\]]*)\]', healthcheck)[1]  # deploy/healthcheck.py's roles
    for deployment in of_kind(objects, "Deployment"):
        role, spec = component(deployment), container(deployment)
        assert "livenessProbe" in spec, deployment["metadata"]["name"]
        probes = http_probes(deployment)
        if role == "gateway":
            assert (
                probes["readinessProbe"]["path"] == "/readyz"
                and probes["livenessProbe"]["path"] == "/healthz"
            )
            assert {p["path"] for p in probes.values()} <= routes
            assert {named_port(deployment, p["port"]) for p in probes.values()} == {
                command_args(deployment).port
            }
        elif role == "runtime":  # /metrics, on the port the setting opens (deploy/healthcheck.py runtime)
            port = pod_settings(deployment, objects).runtime_metrics_port
            assert port and {(p["path"], named_port(deployment, p["port"])) for p in probes.values()} == {
                ("/metrics", port)
            }
        else:  # this pod's Celery worker answers a ping
            for kind in ("startupProbe", "livenessProbe"):
                command = spec[kind]["exec"]["command"]
                assert command == ["python", "/app/deploy/healthcheck.py", "worker"] and '"worker"' in roles
            assert pod_settings(deployment, objects).worker_metrics_port == named_port(deployment, "metrics")


def pre_stop_seconds(deployment: dict) -> float:
    hook = container(deployment).get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    command = hook["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("name", APPS)
def test_grace_periods_cover_the_drains(name: str) -> None:
    objects = app_objects(name)
    for deployment in of_kind(objects, "Deployment"):
        settings, name = pod_settings(deployment, objects), deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"] - pre_stop_seconds(deployment)
        if component(deployment) == "runtime":
            # a gateway waits on a started request this long before giving it up (scheduler/streams.py)
            assert grace >= settings.request_timeout_s + settings.runtime_claim_idle_s, name
        elif component(deployment) == "worker":
            # Celery's warm shutdown waits for the compile, which its sandbox ends by then
            assert grace >= settings.compile_timeout_s + LEASE_S, name
        else:  # the gateway's requests in flight
            assert grace >= settings.request_timeout_s, name


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", APPS)
def test_every_pod_has_a_disruption_budget_that_lets_drains_proceed(name: str) -> None:
    objects = rendered(name)
    for deployment in of_kind(objects, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (budget,) = [
            b for b in of_kind(objects, "PodDisruptionBudget") if selects(b["spec"]["selector"], labels)
        ]
        assert budget["spec"]["selector"] == deployment["spec"]["selector"], budget["metadata"]["name"]
        spec, least = budget["spec"], scaled_object_of(deployment, objects)["spec"]["minReplicaCount"]
        # a budget no eviction can meet would stop every node drain
        assert spec.get("maxUnavailable", 0) >= 1 or spec["minAvailable"] < least, budget["metadata"]["name"]


@pytest.mark.parametrize("name", APPS)
def test_services_and_service_monitors_reach_the_pods(name: str) -> None:
    objects = app_objects(name)
    pods = of_kind(objects, "Deployment")
    services = of_kind(objects, "Service")
    for service in services:
        chosen = [
            d
            for d in pods
            if selects(
                {"matchLabels": service["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert chosen, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            for deployment in chosen:
                named_port(deployment, port["targetPort"])  # each pod has the port
                env = pod_environment(deployment, objects)
                setting = {"runtime": "LUMINAL_RUNTIME_METRICS_PORT", "worker": "LUMINAL_WORKER_METRICS_PORT"}
                if (role := component(deployment)) in setting:
                    container_port = named_port(deployment, port["targetPort"])
                    assert int(env[setting[role]]) == port["port"] == container_port, service["metadata"]
    for monitor in of_kind(objects, "ServiceMonitor"):
        (service,) = [s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
            assert endpoint["path"] == "/metrics"
    # the gateway's /metrics takes the token the gateway is given
    (gateway,) = [d for d in pods if component(d) == "gateway"]
    (endpoint,) = named(objects, "ServiceMonitor", "gateway")["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    (token,) = [e for e in container(gateway)["env"] if e["name"] == "LUMINAL_METRICS_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == credentials
    assert {monitor["metadata"]["name"] for monitor in of_kind(objects, "ServiceMonitor")} == set(VERBS)


def test_the_monitoring_config_maps_are_the_deploy_files() -> None:
    spec = yaml.safe_load((KUSTOMIZATIONS["monitoring"] / "kustomization.yaml").read_text())
    for generator in spec["configMapGenerator"]:
        for entry in generator["files"]:
            path = (KUSTOMIZATIONS["monitoring"] / entry.rpartition("=")[2]).resolve()
            assert path.is_file(), path
            # the files compose mounts, not copies under deploy/k8s
            assert path.is_relative_to(ROOT / "deploy") and not path.is_relative_to(K8S), path
    objects = rendered("monitoring")
    dashboards = named(objects, "ConfigMap", "luminal-grafana-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboards["data"]["luminal-cloud.json"])["uid"] == "luminal-cloud"
    config = named(objects, "ConfigMap", "luminal-prometheus-config")["data"]["prometheus.yml"]
    assert config == (ROOT / "deploy" / "prometheus.yml").read_text()


def test_the_prometheus_config_finds_the_services() -> None:
    """deploy/prometheus.yml, meant for compose, also works in the namespace: its static targets
    and DNS names are the base's Services and their ports (headless where it asks for each pod)."""
    objects = rendered("gpu-h100")
    config = yaml.safe_load(
        named(rendered("monitoring"), "ConfigMap", "luminal-prometheus-config")["data"]["prometheus.yml"]
    )
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.split(":")
                assert int(port) in {p["port"] for p in named(objects, "Service", host)["spec"]["ports"]}, (
                    target
                )
        for dns in job.get("dns_sd_configs", []):
            for host in dns["names"]:
                service = named(objects, "Service", host)
                assert service["spec"].get("clusterIP") == "None", (
                    f"{host}: A records of every pod need a headless Service"
                )
                assert dns["port"] in {p["port"] for p in service["spec"]["ports"]}, host
