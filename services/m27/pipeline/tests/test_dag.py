"""Graph functions: cycles, order, levels, descendants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.pipeline import dag


@pytest.mark.parametrize(("graph", "cycles"), [
    ({"a": [], "b": ["a"]}, []),
    ({"a": ["a"]}, [["a", "a"]]),
    ({"a": ["b"], "b": ["a"]}, [["a", "b", "a"]]),
    ({"a": ["c"], "b": ["a"], "c": ["b"], "d": []}, [["a", "b", "c", "a"]]),
    ({"a": ["missing"]}, []),
])
def test_find_cycles(graph: dict[str, list[str]], cycles: list[list[str]]) -> None:
    assert dag.find_cycles(graph) == cycles


def test_topological_order_keeps_declared_order_among_equals() -> None:
    graph = {"z": [], "a": [], "m": ["z", "a"], "b": ["a"]}
    assert dag.topological_order(graph) == ["z", "a", "m", "b"]


def test_topological_order_refuses_cycles() -> None:
    with pytest.raises(ValueError, match="cycle"):
        dag.topological_order({"a": ["b"], "b": ["a"]})


def test_levels_group_parallel_steps() -> None:
    graph = {"prep": [], "train1": ["prep"], "train2": ["prep"], "report": ["train1", "train2"]}
    assert dag.levels(graph) == {"prep": 0, "train1": 1, "train2": 1, "report": 2}


def test_descendants() -> None:
    graph = {"a": [], "b": ["a"], "c": ["b"], "d": []}
    assert dag.descendants(graph, "a") == {"b", "c"}
    assert dag.descendants(graph, "d") == set()


@given(st.lists(st.lists(st.integers(0, 19), max_size=4), min_size=1, max_size=20))
def test_any_acyclic_graph_orders_dependencies_first(edges: list[list[int]]) -> None:
    # Edges only to earlier nodes: acyclic by construction.
    graph = {f"s{i}": [f"s{d}" for d in deps if d < i] for i, deps in enumerate(edges)}
    assert dag.find_cycles(graph) == []
    order = dag.topological_order(graph)
    assert sorted(order) == sorted(graph)
    seen: set[str] = set()
    for name in order:
        assert set(graph[name]) <= seen
        seen.add(name)
