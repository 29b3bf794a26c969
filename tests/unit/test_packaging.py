"""The package as people install it: the redis-py bound matches what the code was checked
against, and the metadata a registry shows is there."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from broker_adapter.redis.internals import TESTED_REDIS_MAJORS, redis_py_major

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_installed_redis_py_is_a_major_the_internals_were_checked_against() -> None:
    major = redis_py_major()
    if major not in TESTED_REDIS_MAJORS:
        pytest.fail(
            f"redis-py {major}.x is not one of the majors broker_adapter/redis/internals.py "
            f"was checked against {TESTED_REDIS_MAJORS}: run the reader, ingest, receiver and "
            "dispatcher integration tests on it, then extend TESTED_REDIS_MAJORS and the bound"
        )


def test_the_redis_dependency_is_bounded_to_the_tested_majors() -> None:
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("redis")]
    lower = re.search(r">=(\d+)", spec)
    upper = re.search(r"<(\d+)", spec)
    assert lower is not None, spec
    assert upper is not None, spec
    assert int(lower.group(1)) == min(TESTED_REDIS_MAJORS)
    assert int(upper.group(1)) == max(TESTED_REDIS_MAJORS) + 1


def test_the_metadata_names_license_readme_and_keywords() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    assert project["readme"] == "README.md"
    assert project["keywords"]
    python = "Programming Language :: Python :: 3.11"
    assert python in project["classifiers"]


def test_the_extras_people_ask_for_exist_and_postgres_does_not_force_the_binary() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name in ("mcp", "otel", "metrics", "postgres", "postgres-binary", "demo", "dev"):
        assert name in extras, name
    assert not any("binary" in d for d in extras["postgres"])
    assert any("psycopg[binary]" in d for d in extras["postgres-binary"])


def test_the_pytest_plugin_is_registered() -> None:
    entry_points = PYPROJECT["project"]["entry-points"]["pytest11"]
    assert entry_points == {"broker_adapter": "broker_adapter.testing.pytest_plugin"}
