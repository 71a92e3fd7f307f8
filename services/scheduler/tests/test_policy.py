"""Placement policy: who goes where, in what order, and why others wait."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from m27.common.events import EnqueueTask
from m27.common.model import TENTHS_PER_GPU, GpuInfo, Resources, Urgency
from m27.scheduler.policy import (
    Node,
    Place,
    Placement,
    QueuedTask,
    Wait,
    is_alive,
    schedule,
)


def gpus(n: int) -> tuple[GpuInfo, ...]:
    return tuple(GpuInfo(index=i, name="sim", uuid=f"u{i}", memory_total_mb=16384,
                         simulated=True) for i in range(n))


def node(name: str, n_gpus: int = 2, cpus: int = 4, up: bool = True) -> Node:
    return Node(node_id=name, gpus=gpus(n_gpus), cpu_slots=cpus, last_heartbeat=100.0, up=up)


def task(name: str, gpu: float = 0.0, urgency: Urgency = "normal", at: float = 0.0,
         cpus: int = 1) -> QueuedTask:
    enqueue = EnqueueTask(at=at, task_id=f"r/{name}", run_id="r", step=name, attempt=1,
                          step_type="gpu" if gpu >= 1 else "gpu_light" if gpu else "cpu",
                          resources=Resources(gpus=gpu, cpus=cpus), urgency=urgency,
                          user="u", command="x")
    return QueuedTask(task=enqueue, queued_at=at)


def places(decisions: list[Place | Wait]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    return {d.placement.task_id.split("/")[1]: (d.placement.node_id, d.placement.gpu_ids,
                                                d.placement.gpu_tenths)
            for d in decisions if isinstance(d, Place)}


def test_each_kind_of_step_gets_its_kind_of_capacity() -> None:
    decisions = schedule([node("n1")], [], [task("c"), task("g", 1.0), task("l", 0.5)])
    assert places(decisions) == {"c": ("n1", (), 0), "g": ("n1", (0,), 10),
                                 "l": ("n1", (1,), 5)}


def test_fractions_pack_onto_the_fullest_gpu_that_fits() -> None:
    held = [Placement(task_id="x/a", attempt=1, node_id="n1", gpu_ids=(1,), gpu_tenths=6,
                      cpus=1)]
    decisions = schedule([node("n1")], held, [task("l", 0.3)])
    assert places(decisions)["l"] == ("n1", (1,), 3)
    assert "keeps 0.1 GPU free" in decisions[0].reason


def test_whole_gpu_steps_need_a_fully_free_gpu() -> None:
    held = [Placement(task_id="x/a", attempt=1, node_id="n1", gpu_ids=(0,), gpu_tenths=1,
                      cpus=1),
            Placement(task_id="x/b", attempt=1, node_id="n1", gpu_ids=(1,), gpu_tenths=5,
                      cpus=1)]
    (decision,) = schedule([node("n1")], held, [task("g", 1.0)])
    assert isinstance(decision, Wait)
    assert decision.reason == ("needs 1 whole GPU(s) on one node; the most fully free GPUs "
                               "on a node is 0")


def test_multi_gpu_steps_are_placed_all_on_one_node_or_not_at_all() -> None:
    decisions = schedule([node("n1", 1), node("n2", 1), node("n3", 3)], [], [task("g", 2.0)])
    assert places(decisions) == {"g": ("n3", (0, 1), 10)}
    (wait,) = schedule([node("n1", 1), node("n2", 1)], [], [task("g", 2.0)])
    assert isinstance(wait, Wait)


def test_more_urgent_then_older_tasks_go_first() -> None:
    queue = [task("late", 1.0, at=5), task("early", 1.0, at=1), task("urgent", 1.0,
                                                                         "urgent", at=9)]
    decisions = schedule([node("n1", 2)], [], queue)
    assert set(places(decisions)) == {"urgent", "early"}
    assert [d.task_id for d in decisions if isinstance(d, Wait)] == ["r/late"]


def test_fraction_waits_with_the_largest_free_share_in_its_reason() -> None:
    held = [Placement(task_id="x/a", attempt=1, node_id="n1", gpu_ids=(0,), gpu_tenths=8,
                      cpus=1)]
    (decision,) = schedule([node("n1", 1)], held, [task("l", 0.5)])
    assert isinstance(decision, Wait)
    assert decision.reason == "needs 0.5 GPU; the largest free share is 0.2 (GPU 0 on n1)"


def test_down_nodes_get_nothing() -> None:
    (decision,) = schedule([node("n1", up=False)], [], [task("c")])
    assert decision == Wait(task_id="r/c", reason="no node is up")


def test_cpu_steps_go_to_the_node_with_most_free_slots() -> None:
    decisions = schedule([node("n1", cpus=2), node("n2", cpus=8)], [], [task("c", cpus=2)])
    assert places(decisions)["c"][0] == "n2"


def test_liveness_follows_heartbeats() -> None:
    n = node("n1")
    assert is_alive(n, 110.0, 15.0)
    assert not is_alive(n, 116.0, 15.0)
    assert not is_alive(node("n2", up=False), 100.0, 15.0)


@given(st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 1.0, 2.0]), max_size=30),
       st.lists(st.integers(0, 4), min_size=1, max_size=4))
def test_no_gpu_or_cpu_is_ever_over_allocated(requests: list[float], gpu_counts: list[int]
                                              ) -> None:
    nodes = [node(f"n{i}", n, cpus=6) for i, n in enumerate(gpu_counts)]
    queue = [task(f"t{i}", g, at=i) for i, g in enumerate(requests)]
    used: dict[tuple[str, int], int] = {}
    cpus: dict[str, int] = {}
    for decision in schedule(nodes, [], queue):
        if isinstance(decision, Place):
            p = decision.placement
            cpus[p.node_id] = cpus.get(p.node_id, 0) + p.cpus
            for gpu in p.gpu_ids:
                used[(p.node_id, gpu)] = used.get((p.node_id, gpu), 0) + p.gpu_tenths
    assert all(v <= TENTHS_PER_GPU for v in used.values())
    assert all(v <= 6 for v in cpus.values())
    known = {(n.node_id, g.index) for n in nodes for g in n.gpus}
    assert set(used) <= known
