"""``tests/tools/check_names.py``: what it reports on a planted tree, and its verdict on
broker_adapter itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tools import check_names


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


CLEAN = {
    "broker_adapter/__init__.py": "from broker_adapter.a import LIMIT\n",
    "broker_adapter/a.py": "import logging\nlog = logging.getLogger('a')\nLIMIT = 3\n",
    "broker_adapter/b.py": (
        "import logging\nfrom broker_adapter.a import LIMIT\n"
        "log = logging.getLogger('b')\nTWICE = 2 * LIMIT\n"
    ),
    "tests/test_b.py": "from broker_adapter import LIMIT\nfrom broker_adapter.b import TWICE\n",
}


def test_a_clean_tree_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = plant(tmp_path, CLEAN)
    assert check_names.findings(root) == []
    assert check_names.main(["check_names.py", str(root)]) == 0
    assert "every name is defined once" in capsys.readouterr().out


def test_a_name_defined_in_two_modules_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = plant(tmp_path, CLEAN | {"broker_adapter/c.py": "LIMIT = 3\n"})
    assert check_names.findings(root) == [
        "LIMIT is defined in 2 modules: broker_adapter.a, broker_adapter.c"
    ]
    assert check_names.main(["check_names.py", str(root)]) == 1
    assert "LIMIT is defined in 2 modules" in capsys.readouterr().out


def test_a_role_or_a_type_variable_may_be_defined_in_every_module(tmp_path: Path) -> None:
    twice = "from typing import TypeVar\nT = TypeVar('T')\nSCHEMA_VERSION = 1\n"
    root = plant(tmp_path, CLEAN | {"broker_adapter/c.py": twice, "broker_adapter/d.py": twice})
    assert check_names.findings(root) == []


def test_a_private_name_crossing_a_module_fails(tmp_path: Path) -> None:
    root = plant(
        tmp_path,
        CLEAN
        | {
            "broker_adapter/a.py": "_SECRET = 1\nLIMIT = 3\n",
            "broker_adapter/c.py": "from broker_adapter.a import _SECRET\n",
            "broker_adapter/d.py": "from broker_adapter import a\nX = a._SECRET\n",
        },
    )
    assert check_names.findings(root) == [
        "broker_adapter.c imports broker_adapter.a._SECRET",
        "broker_adapter.d reads a._SECRET",
    ]


def test_a_name_taken_from_a_module_that_only_imports_it_fails(tmp_path: Path) -> None:
    root = plant(tmp_path, CLEAN | {"tests/test_c.py": "from broker_adapter.b import LIMIT\n"})
    assert check_names.findings(root) == [
        "tests.test_c imports LIMIT from broker_adapter.b, which only re-exports it"
    ]


def test_broker_adapter_defines_every_name_once() -> None:
    root = Path(__file__).resolve().parents[2]
    assert check_names.findings(root) == []
