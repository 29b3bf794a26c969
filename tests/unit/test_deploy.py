"""The deployment examples: the alert rules and the dashboard's queries parse (``promtool``
when the binary is installed, Debian's ``prometheus`` package) and name only metrics the
code exports; the alerts the operations guide promises exist; the compose file's
``observability`` profile wires the adapter, Prometheus and Grafana together while a plain
``docker compose up`` still starts only Redis (the YAML is checked, not run: no Docker
here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker_adapter.metric_fields import declared
from broker_adapter.protocol.signing import Keyring
from broker_adapter.redis.reader_config import ReaderStats
from broker_adapter.stages.ingest.config import IngestStats
from broker_adapter.stages.receiver.receiver import ReceiverStats
from broker_adapter.stages.shared.publish import DispatcherStats
from broker_adapter.stages.worker.config import WorkerStats

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "broker-adapter.json"
COMPOSE = ROOT / "docker-compose.yml"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
SUFFIXES = ("_total", "_bucket", "_count", "_sum")
METRIC = re.compile(r"\bba_[a-z_]+")
PROFILE = "observability"


def _exported_names() -> set[str]:
    """Every metric family name written in ``broker_adapter/app/metrics.py`` or declared on
    a field of a stats dataclass it exports (``metric_fields``)."""
    source = (ROOT / "broker_adapter" / "app" / "metrics.py").read_text(encoding="utf-8")
    declared_on_fields = {
        d.family.name
        for stats in (IngestStats, ReaderStats, ReceiverStats, DispatcherStats, WorkerStats)
        for _, d in declared(stats)
    }
    return set(re.findall(r'"(ba_[a-z_]+)"', source)) | declared_on_fields


def _family(name: str) -> str:
    """A sample name without its suffix (``ba_x_total`` of counter ``ba_x``,
    ``ba_h_bucket`` of histogram ``ba_h``)."""
    return next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)


def _unknown(named: set[str]) -> set[str]:
    """The names in ``named`` that are no exported family, with or without a sample
    suffix."""
    exported = _exported_names()
    return {name for name in named if _family(name) not in exported and name not in exported}


def _dashboard() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return board


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out: list[dict[str, Any]] = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _queries(board: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target."""
    return [t["expr"] for p in _panels(board) for t in p.get("targets", [])]


def _variable_queries(board: dict[str, Any]) -> list[str]:
    out = []
    for var in board["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def _promtool_rules(exprs: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` of ``exprs`` written as recording rules: it parses each."""
    rules = [{"record": name, "expr": expr} for name, expr in exprs.items()]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    return subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")


# -- alert rules --------------------------------------------------------------------------------


def test_alert_rules_name_only_exported_metrics() -> None:
    named = set(METRIC.findall(ALERTS.read_text(encoding="utf-8")))
    assert named, "no metric named in the rules"
    unknown = _unknown(named)
    assert not unknown, f"alert rules name metrics the code does not export: {unknown}"


def test_alert_rules_cover_what_an_operator_is_paged_for() -> None:
    """Backlog growing, oldest unsent reply, dead replies, Redis data loss, stale-fence
    refusals, no ready adapter (docs/OPERATIONS.md lists what to do for each)."""
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    by_name = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    expected = {
        "BrokerAdapterBacklogGrowing": "ba_tasks",
        "BrokerAdapterOldestUnsentReply": "ba_outbox_oldest_unsent_age_seconds",
        "BrokerAdapterDeadReplies": "ba_outbox_replies",
        "BrokerAdapterRedisDataLoss": "ba_redis_data_loss_alarms_total",
        "BrokerAdapterStaleFenceRefusals": "ba_stale_fence_refusals_total",
        "BrokerAdapterNoReadyAdapter": "ba_ready",
        "BrokerAdapterClockSkew": "ba_clock_skew_seconds",
    }
    assert set(by_name) >= set(expected)
    for alert, metric in expected.items():
        assert metric in METRIC.findall(by_name[alert]["expr"]), alert
        assert by_name[alert]["labels"]["severity"] in ("warning", "critical"), alert
        assert by_name[alert]["annotations"]["description"], alert
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text(encoding="utf-8")
    missing = [alert for alert in by_name if alert not in operations]
    assert not missing, f"docs/OPERATIONS.md says nothing about {missing}"


@needs_promtool
@pytest.mark.parametrize(("skew_s", "fires"), [(5.5, True), (-5.5, True), (4.5, False)])
def test_clock_skew_alert_fires_above_its_bound_only(
    tmp_path: Path, skew_s: float, fires: bool
) -> None:
    """``promtool test rules``: a host clock 5 s or less from the server's for 15 min
    raises nothing; above it, ``BrokerAdapterClockSkew`` fires after its 10 min."""
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    (rule,) = [
        r for g in rules["groups"] for r in g["rules"] if r["alert"] == "BrokerAdapterClockSkew"
    ]
    annotations = {
        name: text.replace("{{ $labels.instance }}", "a:9464").replace(
            "{{ $value }}", f"{abs(skew_s):g}"
        )
        for name, text in rule["annotations"].items()
    }
    labels = {"severity": "warning", "instance": "a:9464", "job": "broker-adapter"}
    alerts = [{"exp_labels": labels, "exp_annotations": annotations}] if fires else []
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'ba_clock_skew_seconds{instance="a:9464",job="broker-adapter"}',
                        "values": f"{skew_s}x15",
                    }
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "15m",
                        "alertname": "BrokerAdapterClockSkew",
                        "exp_alerts": alerts,
                    }
                ],
            }
        ],
    }
    path = tmp_path / "skew_test.yml"
    path.write_text(yaml.safe_dump(test))
    res = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


@needs_promtool
def test_alert_rules_pass_promtool() -> None:
    res = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


# -- the Grafana dashboard ----------------------------------------------------------------------


def test_dashboard_names_only_exported_metrics() -> None:
    board = _dashboard()
    named = {m for q in _queries(board) + _variable_queries(board) for m in METRIC.findall(q)}
    assert len(named) >= 20, "the dashboard shows few metrics"
    unknown = _unknown(named)
    assert not unknown, f"dashboard panels name metrics the code does not export: {unknown}"


def test_dashboard_shows_every_alerted_metric() -> None:
    """What pages an operator is on the dashboard too."""
    shown = {_family(m) for q in _queries(_dashboard()) for m in METRIC.findall(q)}
    alerted = {_family(m) for m in METRIC.findall(ALERTS.read_text(encoding="utf-8"))}
    assert alerted <= shown, f"alerted, not on the dashboard: {alerted - shown}"


def test_dashboard_is_well_formed() -> None:
    board = _dashboard()
    panels = _panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert board["uid"] == "broker-adapter"
    assert board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels:
        grid = p["gridPos"]
        assert 0 <= grid["x"] < grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p.get("description"), p["title"]
        for target in p["targets"]:
            # every query follows the adapter picker
            assert 'instance=~"$instance"' in target["expr"], (p["title"], target["expr"])
    titles = {p["title"] for p in panels if p["type"] == "row"}
    assert {"Received: ingest", "Processing: workers", "Delivery: replies"} <= titles


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    queries = {
        f"dashboard:query_{i}": q.replace("$instance", ".*")
        for i, q in enumerate(_queries(_dashboard()))
    }
    res = _promtool_rules(queries, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


# -- Prometheus and the compose profile ---------------------------------------------------------


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    return compose


def test_plain_compose_up_still_starts_only_redis() -> None:
    services = _compose()["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == {"redis"}
    assert services["redis"]["ports"] == ["127.0.0.1:6390:6379"]


def test_observability_profile_runs_adapter_prometheus_and_grafana() -> None:
    compose = _compose()
    services = compose["services"]
    profiled = {name for name, s in services.items() if PROFILE in s.get("profiles", [])}
    assert profiled == {"adapter", "prometheus", "grafana"}
    adapter = services["adapter"]
    env = adapter["environment"]
    assert env["BA_REDIS_URL"] == "redis://redis:6379/0"
    assert env["BA_METRICS_HOST"] == "0.0.0.0"  # reachable from the Prometheus container
    assert {"BA_DB", "BA_KEYRING", "BA_HANDLER"} <= set(env)
    assert adapter["depends_on"]["redis"]["condition"] == "service_healthy"
    assert (ROOT / adapter["build"]["context"] / adapter["build"]["dockerfile"]).is_file()
    named_volumes = set(compose["volumes"])
    for name in profiled:
        for mount in services[name].get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, not in the repo"
            else:
                assert source in named_volumes, f"{name} mounts undeclared volume {source}"
        for port in services[name].get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"


def test_prometheus_scrapes_the_adapter_of_the_profile_with_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    services = _compose()["services"]
    port = services["adapter"]["environment"]["BA_METRICS_PORT"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "broker-adapter"]
    assert job["static_configs"][0]["targets"] == [f"adapter:{port}"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in services["prometheus"]["volumes"]}
    config_file = Path("/etc/prometheus/prometheus.yml")
    assert mounts[str(config_file)] == "./deploy/prometheus/prometheus.yml"
    for rule_file in config["rule_files"]:  # relative to the config file, in both places
        assert (PROMETHEUS.parent / rule_file).is_file()
        assert mounts[str(config_file.parent / rule_file)] == f"./deploy/prometheus/{rule_file}"
    # the alert that pages when no adapter is ready selects this job
    assert 'job="broker-adapter"' in ALERTS.read_text(encoding="utf-8")


def test_grafana_provisions_the_dashboard_and_the_data_source() -> None:
    grafana = _compose()["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"]}
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yml").read_text(encoding="utf-8")
    )["datasources"]
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "broker-adapter.yml").read_text(encoding="utf-8")
    )["providers"]
    dashboards = Path(provider["options"]["path"])
    assert mounts[str(dashboards / DASHBOARD.name)] == "./deploy/grafana/broker-adapter.json"


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    res = subprocess.run(
        ["promtool", "check", "config", str(PROMETHEUS)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_image_entrypoint_makes_a_keyring_the_adapter_accepts(tmp_path: Path) -> None:
    """No secret in the repository: the adapter container makes its keyring on first
    start, private and long enough for ``Keyring.load``, and keeps it on later starts."""
    keyring = tmp_path / "keyring.json"
    env = dict(os.environ, BA_KEYRING=str(keyring))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")

    def start() -> bytes:
        res = subprocess.run(
            ["sh", str(ENTRYPOINT), "--version"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("broker-adapter ")
        return keyring.read_bytes()

    assert start() == start()
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o600
    assert Keyring.load(keyring).key_ids("agent") == ("agent-1",)
