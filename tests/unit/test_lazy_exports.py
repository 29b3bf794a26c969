"""The lazy packages (``lazy_exports``): importing ``Publisher`` loads the client and not the
stages, the store or the worker pool; each package's name table, its ``__all__`` and its
``TYPE_CHECKING`` imports name the same objects."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The packages whose public names are imported on first use.
LAZY_PACKAGES = ["broker_adapter", "broker_adapter.store", "broker_adapter.testing"]


def loaded_after(statement: str) -> list[str]:
    """The modules loaded in a fresh interpreter after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    loaded: list[str] = json.loads(res.stdout)
    return loaded


def test_importing_publisher_loads_the_client_not_the_stages_store_or_pool() -> None:
    loaded = loaded_after("from broker_adapter import Publisher")
    ours = [m for m in loaded if m == "broker_adapter" or m.startswith("broker_adapter.")]
    assert "broker_adapter.client.publisher" in ours
    heavy = ("app", "stages", "store", "console", "testing", "handler")
    assert [m for m in ours if m.split(".")[1:2] and m.split(".")[1] in heavy] == []
    assert [m for m in ("multiprocessing", "sqlite3", "psycopg") if m in loaded] == []
    assert len(ours) <= 20, ours


def test_importing_a_store_module_does_not_load_the_whole_store() -> None:
    loaded = loaded_after("import broker_adapter.store.sql")
    assert "broker_adapter.store.tasks" not in loaded
    assert "broker_adapter.store.outbox" not in loaded


def test_importing_the_testing_package_loads_no_worker() -> None:
    loaded = loaded_after("import broker_adapter.testing")
    assert [m for m in loaded if m.startswith("broker_adapter.stages")] == []


def type_checking_imports(package: str) -> dict[str, tuple[str, str]]:
    """The names the package imports under ``if TYPE_CHECKING:``, as its table spells them."""
    tree = ast.parse(inspect.getsource(importlib.import_module(package)))
    found: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                assert imp.module is not None
                for alias in imp.names:
                    found[alias.asname or alias.name] = (imp.module, alias.name)
    return found


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_table_all_and_type_checking_imports_agree(package: str) -> None:
    module = importlib.import_module(package)
    table: dict[str, tuple[str, str]] = module._EXPORTS
    assert set(table) == set(module.__all__) - {"__version__"}
    assert type_checking_imports(package) == table
    for name, (source, attribute) in table.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), attribute), name
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_unknown_name_is_an_attribute_error(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = module.no_such_name
