"""``tests/tools/check_cycles.py``: the circles it finds in an import graph, and its verdict
on broker_adapter's own graph."""

from __future__ import annotations

import grimp
import pytest

from tests.tools import check_cycles


def graph_of(*imports: tuple[str, str]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in imports:
        graph.add_import(importer=importer, imported=imported)
    return graph


def test_a_chain_without_a_circle_has_none() -> None:
    assert check_cycles.circles(graph_of(("p.a", "p.b"), ("p.b", "p.c"), ("p.a", "p.c"))) == []


def test_direct_and_indirect_circles_are_found_apart() -> None:
    graph = graph_of(
        ("p.a", "p.b"),
        ("p.b", "p.a"),  # direct
        ("p.c", "p.d"),
        ("p.d", "p.e"),
        ("p.e", "p.c"),  # through a third module
        ("p.e", "p.f"),  # out of the circle
    )
    assert check_cycles.circles(graph) == [["p.a", "p.b"], ["p.c", "p.d", "p.e"]]
    path = check_cycles.closing_path(graph, ["p.c", "p.d", "p.e"])
    assert path == ["p.c", "p.d", "p.e", "p.c"]


def test_every_pair_of_a_circle_imports_the_other() -> None:
    assert check_cycles.pairs(["x", "y", "z"]) == {
        frozenset(("x", "y")),
        frozenset(("x", "z")),
        frozenset(("y", "z")),
    }


def test_a_circle_outside_the_allowed_pairs_fails_and_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = graph_of(("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"))
    monkeypatch.setattr(grimp, "build_graph", lambda *a, **k: graph)
    assert check_cycles.main() == 1
    out = capsys.readouterr().out
    assert "p.a -> p.b -> p.c -> p.a" in out
    assert "p.a <-> p.c" in out
    monkeypatch.setattr(
        check_cycles, "ALLOWED", frozenset(check_cycles.pairs(["p.a", "p.b", "p.c"]))
    )
    assert check_cycles.main() == 0


def test_broker_adapter_has_no_circle_outside_the_allowed_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert check_cycles.main() == 0, capsys.readouterr().out
