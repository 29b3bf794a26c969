"""Fail when two modules of broker_adapter import each other, directly or through others.

The import-linter contracts (``lint-imports``) check layers between packages; they do not
see a circle inside one package. This check reads the same import graph (grimp, without
the imports made under ``if TYPE_CHECKING:``), finds its strongly connected components,
and prints every circle with one path that closes it. ``make test`` runs it:

    python tests/tools/check_cycles.py

Exit status 1 when a pair of modules in a circle is not in ``ALLOWED``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import grimp

PACKAGE = "broker_adapter"

#: Pairs of modules that may import each other: none. Do not add to it.
ALLOWED: frozenset[frozenset[str]] = frozenset()


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted, in order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    # Tarjan's algorithm, iterative: (module, the imports of it not yet visited).
    work: list[tuple[str, list[str]]] = []

    def enter(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        work.append((module, sorted(graph.find_modules_directly_imported_by(module))))

    for root in sorted(graph.modules):
        if root in index:
            continue
        enter(root)
        while work:
            module, pending = work[-1]
            if pending:
                target = pending.pop()
                if target not in index:
                    enter(target)
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def pairs(component: Iterable[str]) -> set[frozenset[str]]:
    """Every pair of modules of one circle: each imports the other, directly or not."""
    members = sorted(component)
    return {frozenset((a, b)) for i, a in enumerate(members) for b in members[i + 1 :]}


def closing_path(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """One path through ``component`` from its first module back to it."""
    first = component[0]
    for imported in sorted(graph.find_modules_directly_imported_by(first)):
        if imported in component:
            chain = graph.find_shortest_chain(importer=imported, imported=first)
            if chain is not None:
                return [first, *chain]
    return component


def main() -> int:
    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)
    found = circles(graph)
    refused = 0
    seen: set[frozenset[str]] = set()
    for component in found:
        component_pairs = pairs(component)
        seen |= component_pairs
        new = component_pairs - ALLOWED
        refused += len(new)
        verdict = "NOT ALLOWED" if new else "allowed for now"
        print(f"import circle ({verdict}): {', '.join(component)}")
        print(f"    for example: {' -> '.join(closing_path(graph, component))}")
        for pair in sorted(sorted(p) for p in new):
            print(f"    {pair[0]} <-> {pair[1]}")
    gone = ALLOWED - seen
    if gone:
        print(f"{len(gone)} allowed pair(s) no longer in a circle: remove them from ALLOWED")
    if refused:
        print(f"{refused} pair(s) of modules import each other: break the circle")
        return 1
    print(f"no import circle ({len(graph.modules)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
