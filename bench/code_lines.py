"""Lines of code in ``broker_adapter/`` at a git revision: no blank lines, comments or
docstrings, counted with Python's tokenizer, by package.

    python bench/code_lines.py [REV ...]      # default: HEAD
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from collections import Counter


def code_lines(source: str) -> int:
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skipped = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def by_package(rev: str) -> Counter[str]:
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "broker_adapter"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    counts: Counter[str] = Counter()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(
                ["git", "show", f"{rev}:{name}"], capture_output=True, text=True, check=True
            ).stdout
            parts = name.split("/")
            counts[parts[1] if len(parts) > 2 else "(base)"] += code_lines(text)
    return counts


def main(revs: list[str]) -> None:
    for rev in revs or ["HEAD"]:
        counts = by_package(rev)
        detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"{rev}: {sum(counts.values())} code lines ({detail})")


if __name__ == "__main__":
    main(sys.argv[1:])
