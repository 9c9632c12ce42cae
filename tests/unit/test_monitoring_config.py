"""Prometheus and Grafana of the compose deployment, checked without Docker (no `docker compose config`)
and without a running Prometheus: every scrape target is a compose service on its metrics port, every
PromQL expression of the Grafana dashboard and the alert rules names a metric gpuherd really exports
(taken from a live ``ServiceMetrics`` registry, not from a list kept here), the provisioning fits the
compose mounts, and ``promtool`` checks the config and every expression where it is installed."""

from __future__ import annotations

import fnmatch
import importlib.resources
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from apps import registry
from gpuherd import events as ev
from gpuherd.fold import ClusterState
from gpuherd.metrics import ServiceMetrics
from tests.compose_file import INFRA, load_compose, published

PROMETHEUS_DIR = INFRA / "prometheus"
GRAFANA_DIR = INFRA / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "gpuherd.json"
# Series Prometheus makes itself for every target: an expression may use them beside gpuherd's own.
PROMETHEUS_SERIES = frozenset({"up"})
# What the issue asks the Grafana dashboard to show, as the series that carry it.
REQUIRED_SERIES = frozenset(
    {
        "gpuherd_gpus",  # GPUs by state
        "gpuherd_jobs",  # queue depth (pending jobs; no per-VC series exists yet)
        "gpuherd_decisions_total",  # placements/s
        "gpuherd_decision_latency_seconds_bucket",  # decision latency p50/p99
        "gpuherd_consumer_lag_events",
        "gpuherd_intake_submissions_total",  # intake verdicts
        "gpuherd_dead_letters_total",
        "gpuherd_nats_connected",  # NATS health as gpuherd sees it
    }
)
# Sample names prometheus_client writes for each family type (counters' family names drop "_total").
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


# -- helpers -----------------------------------------------------------------------------------------


def exported_series() -> set[str]:
    """Every series name a gpuherd service can export, from its registry (labelled families included:
    they have no samples until a label value is used, so names come from each family's type)."""
    metrics = ServiceMetrics("monitoring-test")
    metrics.watch_cluster(ClusterState)  # the cluster gauges are collected only from a state
    metrics.watch_usage(dict)  # (the scheduler's GPU-seconds by VC and user)
    metrics.count_relayed()  # (the report relay's)
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
    }
)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label matchers,
    ranges and grouping clauses are gone, that are neither functions (followed by "(") nor keywords."""
    text = _GROUPING.sub(" ", _RANGE.sub(" ", _MATCHERS.sub(" ", _STRING.sub('""', expr))))
    return {name for name in _IDENT.findall(text) if name.lower() not in _KEYWORDS}


def label_values(expr: str, label: str) -> set[str]:
    """Values an expression's matchers give ``label`` (``=`` or ``=~`` with plain alternatives)."""
    values: set[str] = set()
    for match in re.finditer(rf'\b{label}\s*=~?\s*"([^"]*)"', expr):
        values.update(match.group(1).split("|"))
    return values


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's bind mounts as {host path as written: container path}."""
    return {v.split(":")[0]: v.split(":")[1] for v in service.get("volumes", []) if v.startswith("./")}


def _targets(config: dict[str, Any]) -> list[tuple[str, str, str, dict[str, str]]]:
    """(job, host, port, labels) of every static scrape target."""
    out = []
    for job in config["scrape_configs"]:
        for group in job.get("static_configs", []):
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                out.append((job["job_name"], host, port, group.get("labels", {})))
    return out


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]


def _rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in sorted((PROMETHEUS_DIR / "rules").glob("*.yml")):
        for group in _load(path)["groups"]:
            out.extend((rule.get("alert") or rule["record"], rule["expr"]) for rule in group["rules"])
    return out


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return _load(PROMETHEUS_DIR / "prometheus.yml")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    sources = _load(GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert len(sources) == 1 and sources[0]["type"] == "prometheus"
    return sources[0]


# -- the PromQL reader itself ------------------------------------------------------------------------


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, service) (rate(gpuherd_decision_latency_seconds_bucket{service=~"a|b"}'
        "[$__rate_interval] offset 5m))) / on (service) group_left max(gpuherd_leader) and up"
    )
    assert metric_names(expr) == {"gpuherd_decision_latency_seconds_bucket", "gpuherd_leader", "up"}
    assert label_values(expr, "service") == {"a", "b"}
    names = exported_series()
    assert {"gpuherd_decisions_total", "gpuherd_decision_latency_seconds_bucket", "gpuherd_gpus"} <= names
    assert "gpuherd_decisions" not in names, "a counter is exported with _total"


# -- Grafana ------------------------------------------------------------------------------------------


def test_dashboard_structure_and_its_data_source(dashboard: dict[str, Any], datasource: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    panels = _panels(dashboard)
    assert len([p for p in panels if p["type"] != "row"]) >= 8
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": datasource["uid"]}, panel["title"]
        targets = panel["targets"]
        assert targets, f"{panel['title']}: no query"
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_every_dashboard_expression_uses_exported_metrics(dashboard: dict[str, Any]) -> None:
    exported = exported_series()
    used: set[str] = set()
    for title, expr in _exprs(dashboard):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - exported - PROMETHEUS_SERIES
        assert not unknown, f"{title}: {sorted(unknown)} not exported by gpuherd (libs/gpuherd/metrics.py)"
        used |= names
    assert used >= REQUIRED_SERIES, f"the dashboard lacks {sorted(REQUIRED_SERIES - used)}"
    quantiles = " ".join(expr for _, expr in _exprs(dashboard) if "histogram_quantile" in expr)
    assert "histogram_quantile(0.5," in quantiles and "histogram_quantile(0.99," in quantiles


def test_dashboard_label_values_exist(dashboard: dict[str, Any], prometheus: dict[str, Any]) -> None:
    """A typo in a label value selects nothing, silently: services must be scrape labels, decision
    types event classes."""
    services = {labels.get("service") for _, _, _, labels in _targets(prometheus)}
    jobs = [job["job_name"] for job in prometheus["scrape_configs"]]
    for title, expr in _exprs(dashboard) + _rule_exprs():
        assert label_values(expr, "service") <= services, title
        for kind in label_values(expr, "type"):
            assert isinstance(getattr(ev, kind, None), type) and issubclass(getattr(ev, kind), ev.Event), title
        for job in label_values(expr, "job"):
            assert any(re.fullmatch(job, name) for name in jobs), title


def test_grafana_provisioning_matches_the_compose_mounts(
    compose: dict[str, Any], prometheus: dict[str, Any], datasource: dict[str, Any]
) -> None:
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = _load(GRAFANA_DIR / "provisioning" / "dashboards" / "gpuherd.yml")["providers"]
    assert [p["options"]["path"] for p in providers] == [mounts["./grafana/dashboards"]]
    prom = compose["services"]["prometheus"]
    container_port = {port for _, port in published(prom)}
    assert datasource["url"] in {f"http://prometheus:{port}" for port in container_port}
    assert any(host == "prometheus" for _, host, _, _ in _targets(prometheus)), "Prometheus scrapes itself"


# -- compose ------------------------------------------------------------------------------------------


def test_monitoring_services_are_pinned_and_local_only(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("prometheus", "grafana", "dashboard"):
        service = services[name]
        ports = published(service)
        assert ports and all(host == "127.0.0.1" for host, _ in ports), f"{name}: {ports}"
        assert "healthcheck" in service, name
    assert re.fullmatch(r"prom/prometheus:v3\.\d+\.\d+", services["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", services["grafana"]["image"])
    prom = services["prometheus"]
    assert _mounts(prom)["./prometheus"] == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert any(v.split(":")[0] in compose["volumes"] for v in prom["volumes"]), "Prometheus keeps its data"
    assert any(v.split(":")[0] in compose["volumes"] for v in services["grafana"]["volumes"])


def test_grafana_admin_password_is_a_generated_secret(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env, "no password in the compose file"
    assert "env_file" not in grafana, "secrets.env holds every NATS password: not for Grafana"
    secret = env["GF_SECURITY_ADMIN_PASSWORD__FILE"].removeprefix("/run/secrets/")
    assert grafana["secrets"] == [secret] and compose["secrets"][secret]["file"] == f"./secrets/{secret}"
    made = (INFRA / "make-secrets.sh").read_text()
    assert re.search(rf'OTHERS="[^"]*\b{secret}\b', made), "make-secrets.sh must make it"


def test_dashboard_is_read_only_unless_the_operator_file_is_added(compose: dict[str, Any]) -> None:
    dashboard = compose["services"]["dashboard"]
    command = dashboard["command"]
    assert command[:2] == ["serve", "dashboard"] and "--operator-token-file" not in command
    assert command[command.index("--port") + 1] == "8080" and command[command.index("--host") + 1] == "0.0.0.0"
    assert dashboard["environment"]["NATS_USER"] == "dashboard"
    operator = load_compose("docker-compose.operator.yml")
    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(operator))
    assert not errors, [e.message for e in errors[:5]]
    override = operator["services"]["dashboard"]
    token = override["command"][override["command"].index("--operator-token-file") + 1]
    assert override["command"] == [*command, "--operator-token-file", token]
    registry.spec("dashboard").parser().parse_args(override["command"][2:])  # exits on an unknown option
    secret = token.removeprefix("/run/secrets/")
    assert set(override["secrets"]) == {*dashboard["secrets"], secret}
    assert operator["secrets"][secret]["file"] == f"./secrets/{secret}"
    assert re.search(rf'OTHERS="[^"]*\b{secret}\b', (INFRA / "make-secrets.sh").read_text())


# -- Prometheus ---------------------------------------------------------------------------------------


def test_every_scrape_target_is_a_compose_service_on_its_metrics_port(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    services = compose["services"]
    targets = _targets(prometheus)
    assert len({(host, port) for _, host, port, _ in targets}) == len(targets), "a target scraped twice"
    for job, host, port, _labels in targets:
        assert host in services, f"{job}: {host} is not a service of infra/docker-compose.yml"
        env = services[host].get("environment", {})
        expected = env.get("GPUHERD_METRICS_PORT") or {p for _, p in published(services[host])}
        assert port in expected, f"{job}: {host}:{port}, the service listens on {expected}"
    scraped = {host for _, host, _, _ in targets}
    processes = {name for name, s in services.items() if s.get("command", [""])[0] == "serve"}
    assert processes <= scraped, f"not scraped: {sorted(processes - scraped)}"


def test_rule_files_exist_and_use_exported_metrics(prometheus: dict[str, Any]) -> None:
    files = [p.name for p in (PROMETHEUS_DIR / "rules").iterdir()]
    for pattern in prometheus.get("rule_files", []):
        assert fnmatch.filter(files, Path(pattern).name), f"{pattern} matches no file"
    exported = exported_series()
    for name, expr in _rule_exprs():
        unknown = metric_names(expr) - exported - PROMETHEUS_SERIES
        assert metric_names(expr) and not unknown, f"{name}: {sorted(unknown)}"


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not on PATH (Debian's prometheus package; .ci/run installs it as root)"
)


@needs_promtool
def test_promtool_checks_the_config_and_its_rules() -> None:
    result = subprocess.run(
        [str(PROMTOOL), "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rule files found" in result.stdout + result.stderr, "the alert rules were checked too"


@needs_promtool
def test_promtool_parses_every_dashboard_expression(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """Each panel's query as a recording rule, Grafana's variables given values, for promtool's parser."""
    grafana_vars = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
    rules = []
    for n, (_, expr) in enumerate(_exprs(dashboard)):
        for var, value in grafana_vars.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
        rules.append({"record": f"gpuherd_dashboard:check_{n}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
