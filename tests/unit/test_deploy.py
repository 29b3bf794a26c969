"""The deployment examples: the alert rules parse (``promtool check rules`` when the
binary is installed, Debian's ``prometheus`` package) and name only metrics the code
exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _exported_names() -> set[str]:
    """Every metric family name written in ``broker_adapter/app/metrics.py``."""
    source = (ROOT / "broker_adapter" / "app" / "metrics.py").read_text(encoding="utf-8")
    return set(re.findall(r'"(ba_[a-z_]+)"', source))


def test_alert_rules_name_only_exported_metrics() -> None:
    named = set(re.findall(r"\bba_[a-z_]+", ALERTS.read_text(encoding="utf-8")))
    assert named, "no metric named in the rules"
    exported = _exported_names()
    unknown = set()
    for name in named:
        family = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
        if family not in exported and name not in exported:
            unknown.add(name)
    assert not unknown, f"alert rules name metrics the code does not export: {unknown}"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_alert_rules_pass_promtool() -> None:
    res = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
