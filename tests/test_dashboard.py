"""The operators' Grafana dashboard charts only what /metrics really exports: every query's
metric names and labels are checked against the exposition of a live server that has deployed
a model and served requests (issue 12 part 7)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.server import BackgroundServer
from api.services import open_database
from cloud.auth import create_key
from tests.conftest import auth, make_settings, upload, wait_for
from tests.onnx_models import mlp

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "dashboards" / "luminal-cloud.json"

# PromQL's functions and aggregations the dashboard may call: a name before "(" must be one
FUNCTIONS = frozenset(
    ["abs", "avg", "ceil", "clamp_max", "clamp_min", "count", "delta", "deriv", "floor", "histogram_quantile", "increase", "irate", "label_values", "max", "min", "quantile", "rate", "round", "sort", "sort_desc", "sum", "topk", "bottomk", "vector"]
)
KEYWORDS = frozenset(["by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"])
# labels Prometheus adds to every scraped series
SCRAPE_LABELS = frozenset({"instance", "job"})
# histogram and counter series names, by the family's type
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
# families the test's traffic need not produce a sample of (only a full queue does)
QUIET = frozenset({"luminal_queue_rejections"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_VARIABLE = re.compile(r"\$\{?\w+\}?")  # Grafana's $__rate_interval, $tenant, ...
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_:][\w:]*")


def parse(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names a PromQL expression uses."""
    expr = _VARIABLE.sub("", _STRING.sub('""', expr))
    expr = _RANGE.sub("[]", expr)
    labels = {name.strip() for group in _GROUPING.findall(expr) for name in group.split(",") if name.strip()}
    expr = _GROUPING.sub("", expr)
    for matchers in _MATCHERS.findall(expr):
        labels |= {m.group(1) for m in re.finditer(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)}
    expr = _MATCHERS.sub("{}", expr)
    metrics = set()
    for match in _IDENTIFIER.finditer(expr):
        name = match.group()
        if expr[match.end():].lstrip().startswith("("):
            assert name in FUNCTIONS, f"{name}( is not a PromQL function the dashboard may use"
        elif name not in KEYWORDS:
            metrics.add(name)
    return metrics, labels


def test_the_tokenizer_finds_metrics_and_labels() -> None:
    metrics, labels = parse(
        'histogram_quantile(0.99, sum by (le, model) (rate(luminal_x_seconds_bucket{tenant=~"$t", a!="b"}'
        "[$__rate_interval]))) / on (model) sum(rate(luminal_y_total[5m])) > 1e-3"
    )
    assert metrics == {"luminal_x_seconds_bucket", "luminal_y_total"}
    assert labels == {"le", "model", "tenant", "a"}


def expressions(dashboard: dict) -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels it needs besides its own) of every panel target and template
    variable; a variable's label_values(metric, label) is its metric, needing the label."""
    found = [(panel["title"], t["expr"], set()) for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable["query"]
        query = query["query"] if isinstance(query, dict) else query
        metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query).groups()
        found.append((f"${variable['name']}", metric, {label}))
    return found


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> dict[str, list]:
    """Series name -> samples of a live server's /metrics after a deploy and some requests,
    including a queue too small for them (rejections)."""
    data = tmp_path_factory.mktemp("dashboard") / "data"
    settings = make_settings(data, max_queue_requests=1)
    db = open_database(settings)
    try:
        key = create_key(db, "dash")
    finally:
        db.dispose()
    with BackgroundServer(settings) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        upload(client, key, "dashmlp", mlp().SerializeToString())
        assert wait_for(client, key, "dashmlp", 1)["status"] == "ready"

        def infer(rows: int) -> int:
            body = {"inputs": {"x": [[0.25] * 8] * rows}}
            return client.post("/v1/models/dashmlp/infer", headers=auth(key), json=body).status_code

        assert infer(2) == 200
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(infer, [1, 2, 3, 4] * 4))
        assert set(statuses) <= {200, 429}
        assert client.post("/v1/models/dashmlp/infer", headers=auth(key), json={"inputs": {}}).status_code == 400
        response = client.get("/metrics")
        assert response.status_code == 200
    series: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            series.setdefault(family.name + suffix, [])
        for sample in family.samples:
            series.setdefault(sample.name, []).append(sample)
    return series


def test_every_query_charts_metrics_and_labels_that_metrics_exports(exposition) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    charted = set()
    for where, expr, needed in expressions(dashboard):
        metrics, labels = parse(expr)
        labels |= needed
        assert metrics, f"{where}: no metric in {expr!r}"
        for metric in metrics:
            assert metric in exposition, f"{where}: {metric} is not in /metrics ({expr})"
        charted |= metrics
        sampled = [s for m in metrics for s in exposition[m]]
        if sampled:
            known = SCRAPE_LABELS | {label for sample in sampled for label in sample.labels}
            assert labels <= known, f"{where}: labels {sorted(labels - known)} not on {sorted(metrics)}"
    # the traffic above produced a series for every family the dashboard charts but the quiet ones
    empty = {m for m in charted if not exposition[m] and not any(m.startswith(q) for q in QUIET)}
    assert not empty, f"charted but no sample after traffic: {sorted(empty)}"
    # and the model's own series exist, labelled with its name and tenant
    requests = exposition["luminal_inference_requests_total"]
    assert {"ok", "400"} <= {s.labels["status"] for s in requests if s.labels["model"] == "dashmlp"}


def test_the_dashboard_covers_the_serving_path() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    charted = {m for _, expr, _ in expressions(dashboard) for m in parse(expr)[0]}
    for needed in (
        "luminal_inference_requests_total",
        "luminal_inference_latency_seconds_bucket",
        "luminal_queue_wait_seconds_bucket",
        "luminal_batch_size_requests_bucket",
        "luminal_execution_seconds_total",
        "luminal_billed_seconds_total",
        "luminal_model_load_seconds_count",
        "luminal_loaded_models",
        "luminal_compiles_total",
        "luminal_compile_seconds_bucket",
        "luminal_queue_rejections_total",
    ):
        assert needed in charted, needed


def test_panels_have_unique_titles_ids_and_a_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
        assert panel.get("description"), panel["title"]
