"""``promtool test rules`` on the alert rules of ``deploy/prometheus/alerts.yml``.

The rules are copied without their annotations (text for people, with templates promtool
would make every test restate): the expressions, ``for`` and labels are the ones shipped.
``alert_test`` builds one promtool test from input series and the alerts expected to fire
(or not) at given times, and returns promtool's answer.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

#: Whether ``promtool`` (Debian's ``prometheus`` package) is installed.
HAVE_PROMTOOL = shutil.which("promtool") is not None
needs_promtool = pytest.mark.skipif(not HAVE_PROMTOOL, reason="no promtool")


def shipped_rules() -> dict[str, dict[str, Any]]:
    """The alert rules, by name."""
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"]}


def alert_test(
    tmp_path: Path,
    series: dict[str, str],
    expect: list[tuple[str, str, list[dict[str, str]]]],
    interval: str = "1m",
) -> subprocess.CompletedProcess[str]:
    """Run ``promtool test rules`` on the shipped rules.

    Args:
        series: input series (``'name{labels}'``) -> promtool's expanding values notation.
        expect: ``(eval_time, alertname, [labels of each firing alert])``; ``[]``: none
            fires. The labels are the alert's own (``severity``) and the series' kept by
            the expression.
    """
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules_file = tmp_path / "alerts-under-test.yml"
    rules_file.write_text(yaml.safe_dump(rules), encoding="utf-8")
    test = {
        "rule_files": [str(rules_file)],
        "evaluation_interval": interval,
        "tests": [
            {
                "interval": interval,
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": [
                    {
                        "eval_time": at,
                        "alertname": name,
                        "exp_alerts": [{"exp_labels": labels} for labels in firing],
                    }
                    for at, name, firing in expect
                ],
            }
        ],
    }
    test_file = tmp_path / "alerts-test.yml"
    test_file.write_text(yaml.safe_dump(test), encoding="utf-8")
    return subprocess.run(
        ["promtool", "test", "rules", str(test_file)], capture_output=True, text=True, timeout=120
    )
