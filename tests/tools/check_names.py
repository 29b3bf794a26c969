"""Fail when a name is defined in two modules of broker_adapter, or a private name crosses one.

A rule written in two places drifts: a constant, a helper or a class declared twice is how
it starts. This check reads every module's top level (functions, classes, assignments) and
reports each name more than one module defines, except the per-module roles in
``ROLES`` (each module's own logger, type variables, a command module's hooks). It also
reports every private name (a leading underscore) one module imports from another, or
reads from a module it imported, and every name a module (of broker_adapter or tests)
imports from another module that only imports it too (a re-export: the importer should name
the defining module; a package's ``__init__`` may re-export, that is its job).
``make test`` runs it:

    python tests/tools/check_names.py

Exit status 1 when it finds anything.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "broker_adapter"

#: Names every module may define for itself: they are roles, not rules.
ROLES: frozenset[str] = frozenset(
    {
        "log",  # the module's logger
        "COMMANDS",  # a CLI module's command names (app/*_cli.py)
        "add_commands",  # a CLI module's hook that adds its sub-commands
        "LIBRARY",  # a Redis Function module's library name
        "SOURCE",  # a Lua module's source text
        "_EXPORTS",  # a package __init__'s table of lazy exports (lazy_exports.py)
        # Each store engine's schema history: store.migrations (SQLite) and
        # store.postgres.schema (PostgreSQL) count their own versions and hold their own
        # DDL, which differs by dialect.
        "MIGRATIONS",
        "SCHEMA_VERSION",
    }
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_names(tree: ast.Module) -> Iterator[str]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    yield target.id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id


def is_type_variable(tree: ast.Module, name: str) -> bool:
    """``T = TypeVar("T")`` and the like: local to the module by nature."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id in {"TypeVar", "ParamSpec", "TypeVarTuple"}
        ):
            return True
    return False


def private_crossings(tree: ast.Module, module: str) -> Iterator[str]:
    imported_modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{module} imports {node.module}.{alias.name}"
                imported_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    imported_modules.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in imported_modules
        ):
            yield f"{module} reads {node.value.id}.{node.attr}"


def package_imports(tree: ast.Module) -> Iterator[tuple[str, str]]:
    """``(module, name)`` of every ``from broker_adapter... import name`` in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                yield node.module or "", alias.name


def re_exports(trees: dict[str, tuple[ast.Module, bool]]) -> Iterator[str]:
    """Importers that take a name from a module (not a package) that imports it itself."""
    imported: dict[str, set[str]] = {
        module: {name for _, name in package_imports(tree)} for module, (tree, _) in trees.items()
    }
    packages = {module for module, (_, is_package) in trees.items() if is_package}
    for importer, (tree, _) in trees.items():
        for source, name in package_imports(tree):
            if source not in packages and name in imported.get(source, set()):
                yield f"{importer} imports {name} from {source}, which only re-exports it"


def parse_tree(root: Path, folder: str) -> dict[str, tuple[ast.Module, bool]]:
    return {
        module_name(path, root): (
            ast.parse(path.read_text(encoding="utf-8"), str(path)),
            path.name == "__init__.py",
        )
        for path in sorted((root / folder).rglob("*.py"))
    }


def findings(root: Path) -> list[str]:
    defined: dict[str, list[str]] = defaultdict(list)
    found: list[str] = []
    package = parse_tree(root, PACKAGE)
    for module, (tree, _) in package.items():
        for name in set(top_level_names(tree)):
            if name.startswith("__") or name in ROLES or is_type_variable(tree, name):
                continue
            defined[name].append(module)
        found.extend(private_crossings(tree, module))
    importers = dict(package)
    if (root / "tests").is_dir():  # the tests import the package's names too
        importers.update(parse_tree(root, "tests"))
    found.extend(re_exports(importers))
    for name, modules in sorted(defined.items()):
        if len(modules) > 1:
            found.append(f"{name} is defined in {len(modules)} modules: {', '.join(modules)}")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2]
    found = findings(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} names defined twice or private names crossing modules")
        return 1
    print("every name is defined once; no private name crosses a module")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
