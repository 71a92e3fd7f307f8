"""Pure graph functions over a pipeline's steps: cycles, execution order, levels, paths.

A graph maps each step to the steps it depends on. Only known names are considered: unknown
dependencies are reported by the pipeline parser before these run. Every function is
iterative and linear in steps + edges, so 10,000-step sweeps plan in milliseconds.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence

Graph = Mapping[str, Sequence[str]]


def find_cycles(graph: Graph) -> list[list[str]]:
    """Cycles found by a depth-first search, each as a path that ends where it starts,
    read in execution order (`a → b → a`: b needs a, a needs b), each reported once."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    for root in graph:
        if root in state:
            continue
        path: list[str] = [root]
        on_path = {root: 0}
        stack: list[Iterator[str]] = [iter(graph[root])]
        state[root] = 1
        while stack:
            dep = next(stack[-1], None)
            if dep is None:
                stack.pop()
                done = path.pop()
                del on_path[done]
                state[done] = 2
                continue
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                cycle = [*path[on_path[dep]:], dep]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    cycles.append(list(reversed(cycle)))
            elif dep not in state:
                state[dep] = 1
                on_path[dep] = len(path)
                path.append(dep)
                stack.append(iter(graph[dep]))
    return cycles


def topological_order(graph: Graph) -> list[str]:
    """Steps so that each comes after its dependencies; among steps that could go next, the
    one declared first goes first. Raises ValueError on a cycle."""
    position = {name: i for i, name in enumerate(graph)}
    waiting = {name: len({d for d in deps if d in graph}) for name, deps in graph.items()}
    dependents: dict[str, list[str]] = {name: [] for name in graph}
    for name, deps in graph.items():
        for dep in {d for d in deps if d in graph}:
            dependents[dep].append(name)
    ready = [(position[n], n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for child in dependents[name]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, (position[child], child))
    if len(order) != len(graph):
        raise ValueError(f"cycle among {sorted(n for n, c in waiting.items() if c)[:10]}")
    return order


def levels(graph: Graph) -> dict[str, int]:
    """0 for steps without dependencies, else one more than the deepest dependency: the
    steps of one level can all run at the same time."""
    result: dict[str, int] = {}
    for name in topological_order(graph):
        deps = [d for d in graph[name] if d in graph]
        result[name] = 1 + max(result[d] for d in deps) if deps else 0
    return result


def critical_path(graph: Graph, weight: Mapping[str, float]) -> list[str]:
    """The chain of dependent steps with the largest total weight (e.g. expected duration):
    the shortest time the whole pipeline can take, however many GPUs it gets."""
    finish: dict[str, float] = {}
    via: dict[str, str | None] = {}
    for name in topological_order(graph):
        deps = [d for d in graph[name] if d in graph]
        best = max(deps, key=lambda d: finish[d], default=None)
        finish[name] = (finish[best] if best else 0.0) + weight.get(name, 0.0)
        via[name] = best
    if not finish:
        return []
    node: str | None = max(finish, key=lambda n: finish[n])
    path: list[str] = []
    while node is not None:
        path.append(node)
        node = via[node]
    return list(reversed(path))


def descendants(graph: Graph, name: str) -> set[str]:
    """Every step that depends on `name`, directly or not."""
    dependents: dict[str, list[str]] = {n: [] for n in graph}
    for node, deps in graph.items():
        for dep in deps:
            if dep in dependents:
                dependents[dep].append(node)
    return _reachable(dependents, name)


def ancestors(graph: Graph, name: str) -> set[str]:
    """Every step `name` depends on, directly or not."""
    return _reachable(graph, name)


def _reachable(edges: Graph, start: str) -> set[str]:
    found: set[str] = set()
    todo = [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in found:
                found.add(nxt)
                todo.append(nxt)
    return found
