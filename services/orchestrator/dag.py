"""Pure graph functions over a pipeline's steps: cycles, execution order, levels.

A graph maps each step to the steps it depends on. Only known names are considered: unknown
dependencies are reported by the pipeline parser before these run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Graph = Mapping[str, Sequence[str]]


def find_cycles(graph: Graph) -> list[list[str]]:
    """Every elementary cycle found by a DFS, each as a path that ends where it starts
    (`["a", "b", "a"]`), reported once, in the order the steps are declared."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: finished
    stack: list[str] = []
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep):], dep]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(_dependency_order(cycle))
            elif state.get(dep) is None:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in graph:
        if state.get(node) is None:
            visit(node)
    return cycles


def _dependency_order(cycle: list[str]) -> list[str]:
    """DFS walks from a step to what it depends on; people read cycles as "a runs before b",
    so reverse it: `a → b → a` means b depends on a and a depends on b."""
    return list(reversed(cycle))


def topological_order(graph: Graph) -> list[str]:
    """Steps so that each comes after its dependencies; ties keep the declared order.

    Raises ValueError if the graph has a cycle (callers check `find_cycles` first)."""
    position = {name: i for i, name in enumerate(graph)}
    remaining = {name: {d for d in deps if d in graph} for name, deps in graph.items()}
    order: list[str] = []
    while remaining:
        ready = sorted((n for n, deps in remaining.items() if not deps), key=position.__getitem__)
        if not ready:
            raise ValueError(f"cycle among {sorted(remaining)}")
        for name in ready:
            order.append(name)
            del remaining[name]
        for deps in remaining.values():
            deps.difference_update(ready)
    return order


def levels(graph: Graph) -> dict[str, int]:
    """The level of each step: 0 without dependencies, else one more than its deepest
    dependency. Steps of one level can run in parallel."""
    result: dict[str, int] = {}
    for name in topological_order(graph):
        deps = [d for d in graph[name] if d in graph]
        result[name] = 1 + max(result[d] for d in deps) if deps else 0
    return result


def descendants(graph: Graph, name: str) -> set[str]:
    """Every step that depends on `name`, directly or not."""
    dependents: dict[str, list[str]] = {n: [] for n in graph}
    for node, deps in graph.items():
        for dep in deps:
            if dep in dependents:
                dependents[dep].append(node)
    found: set[str] = set()
    todo = [name]
    while todo:
        for child in dependents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
