"""docs/ARCHITECTURE.md's module list names every module of the tree, and no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "broker_adapter"
TOP_PACKAGES = (
    "testing",
    "app",
    "console",
    "stages",
    "client",
    "handler",
    "redis",
    "store",
    "protocol",
)


def listed_modules() -> dict[str, set[str]]:
    """The module list's entries, by package: ``{"stages.worker": {"worker.py", ...}}``.

    A line that starts with ``broker_adapter.X`` (or ``base``) opens package X; an indented
    ``.Y`` line opens its sub-package ``X.Y``; ``name/`` names a sub-package as a whole.
    """
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    start = text.index("\nbroker_adapter.testing")
    block = text[start : text.index("```", start)]
    listed: dict[str, set[str]] = {}
    package = sub = ""
    for line in block.splitlines():
        head = re.match(r"(broker_adapter\.(\w+)|base)\s", line)
        nested = re.match(r"  \.(\w+)\s", line)
        if head:
            package, sub = (head.group(2) or ""), ""
        elif nested:
            sub = nested.group(1)
        key = f"{package}.{sub}" if sub else package
        names = listed.setdefault(key, set())
        names.update(re.findall(r"\b(\w+\.py)\b", line))
        names.update(f"{d}/" for d in re.findall(r"\b(\w+)/(?!\w)", line))
    return listed


def tree_modules(directory: Path) -> set[str]:
    files = {p.name for p in directory.glob("*.py") if p.name != "__init__.py"}
    subpackages = {
        f"{p.name}/" for p in directory.iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    return files | subpackages


def test_every_module_is_listed_and_every_listed_module_exists() -> None:
    listed = listed_modules()
    expected: dict[str, set[str]] = {"": tree_modules(PACKAGE) - {f"{p}/" for p in TOP_PACKAGES}}
    for name in TOP_PACKAGES:
        directory = PACKAGE / name
        subs = {p.name for p in directory.iterdir() if (p / "__init__.py").exists()}
        described = {s for s in subs if f"{name}.{s}" in listed}
        expected[name] = tree_modules(directory) - {f"{s}/" for s in described}
        for s in described:
            expected[f"{name}.{s}"] = tree_modules(directory / s)
    for key in sorted(set(expected) | set(listed)):
        shown = listed.get(key, set())
        if key in expected and not expected[key] and not shown:
            continue
        assert shown == expected.get(key), (
            f"docs/ARCHITECTURE.md, package {key or 'base'}: "
            f"missing {sorted(expected.get(key, set()) - shown)}, "
            f"gone {sorted(shown - expected.get(key, set()))}"
        )
