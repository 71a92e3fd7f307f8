"""Invariants of the policy core over generated clusters and queues (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.platform import (
    Platform,
    Requirements,
    any_model_matches,
    model_alternatives,
    platform_fits,
)
from m27.common.windows import blocks
from m27.scheduler._priority import attempt_gpu_s, order, running_score
from m27.scheduler.model import (
    ClusterState,
    Node,
    Place,
    PolicySettings,
    Preempt,
    Queued,
    Running,
)
from m27.scheduler.policy import decide
from m27.scheduler.tests.support import node, queued, running

MILLI = st.sampled_from([0, 100, 250, 300, 500, 700, 1000, 2000, 3000, 4000])
URGENCY = st.sampled_from(["low", "normal", "high", "urgent"])
PLATFORMS = st.builds(Platform, driver=st.sampled_from(["", "535.104", "550.54.15"]),
                      cuda=st.sampled_from(["", "12.0", "12.2", "12.4"]))


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ClusterState, list[Queued], PolicySettings]:
    """A few nodes, some work already running on them (within capacity), a queue."""
    nodes = [node(f"n{i}", draw(st.integers(0, 4)), cpu=draw(st.sampled_from([4000, 16000])),
                  gpu_mem=draw(st.sampled_from([8192, 16384])),
                  temps=tuple(draw(st.lists(st.sampled_from([None, 50.0, 85.0]),
                                            max_size=4))),
                  schedulable=draw(st.booleans()) or i == 0,
                  model=draw(st.sampled_from(["", "NVIDIA A100-SXM4-80GB", "NVIDIA A10G"])),
                  platform=draw(PLATFORMS),
                  window_in_s=draw(st.sampled_from([None, None, 0.0, 600.0, 7200.0])))
             for i in range(draw(st.integers(1, 4)))]
    run: list[Running] = []
    for n in nodes:
        for gpu in n.gpus:
            if draw(st.booleans()):
                run.append(running(f"r-{n.node_id}-{gpu.index}", n.node_id, (gpu.index,),
                                   draw(st.sampled_from([200, 500, 1000])),
                                   started=draw(st.floats(0, 5000)), urgency=draw(URGENCY),
                                   preemptible=draw(st.booleans()),
                                   stopping=draw(st.booleans())))
    queue = [queued(f"q{i}", draw(MILLI), at=draw(st.floats(0, 5000)), urgency=draw(URGENCY),
                    gpu_memory_mb=draw(st.sampled_from([0, 0, 4096, 12288])),
                    tier=draw(st.sampled_from(["immediate", "immediate", "background"])),
                    cpu_milli=draw(st.sampled_from([0, 1000, 3000])),
                    attained=draw(st.sampled_from([0.0, 0.0, 1800.0, 7200.0])),
                    gpu_model=draw(st.sampled_from(["", "", "A100", "A10|A10G"])),
                    cuda=draw(st.sampled_from(["", "", ">=12.1", "<12.3"])),
                    driver=draw(st.sampled_from(["", "", "550", "==535.104"])),
                    checkpoints=draw(st.booleans()),
                    timeout_s=draw(st.sampled_from([None, 300.0, 3600.0])))
             for i in range(draw(st.integers(0, 12)))]
    overprovision = draw(st.sampled_from([1.0, 1.5]))
    return (ClusterState(nodes=tuple(nodes), running=tuple(run)), queue,
            PolicySettings(memory_overprovision=overprovision,
                           peer_yield_gpu_h=draw(st.sampled_from([0.0, 0.25, 1.0]))))


def _gpu_mem(node: Node, gpu: int, milli: int, asked: int) -> float:
    return asked if asked else node.gpus[gpu].memory_mb * milli / 1000


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_no_gpu_goes_over_its_capacity_or_memory(
        case: tuple[ClusterState, list[Queued], PolicySettings]) -> None:
    cluster, queue, config = case
    by_node = {n.node_id: n for n in cluster.nodes}
    jobs = {q.job.task_id: q.job for q in queue}
    milli: dict[tuple[str, int], int] = {}
    mem: dict[tuple[str, int], float] = {}
    cpu: dict[str, int] = {}
    for r in cluster.running:
        cpu[r.node_id] = cpu.get(r.node_id, 0) + r.job.cpu_milli
        for g in r.gpu_ids:
            milli[(r.node_id, g)] = milli.get((r.node_id, g), 0) + r.gpu_milli
            mem[(r.node_id, g)] = mem.get((r.node_id, g), 0) + _gpu_mem(
                by_node[r.node_id], g, r.gpu_milli, r.job.gpu_memory_mb)
    before = dict(milli)
    for d in decide(cluster, queue, 6000.0, config):
        if isinstance(d, Place):
            n, j = by_node[d.node_id], jobs[d.task_id]
            assert n.schedulable
            assert not d.lender
            cpu[d.node_id] = cpu.get(d.node_id, 0) + j.cpu_milli
            for g in d.gpu_ids:
                gpu = n.gpus[g]
                assert gpu.temperature_c is None or gpu.temperature_c <= 80.0
                milli[(d.node_id, g)] = milli.get((d.node_id, g), 0) + d.gpu_milli
                mem[(d.node_id, g)] = mem.get((d.node_id, g), 0) + _gpu_mem(
                    n, g, d.gpu_milli, j.gpu_memory_mb)
                assert milli[(d.node_id, g)] <= 1000
                cap = gpu.memory_mb * config.memory_overprovision
                assert mem[(d.node_id, g)] <= cap + 1e-6
    for key, used in milli.items():
        assert used <= max(1000, before.get(key, 0))
    for node_id, used in cpu.items():
        assert used <= max(by_node[node_id].cpu_milli,
                           sum(r.job.cpu_milli for r in cluster.running if r.node_id == node_id))


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_gangs_are_all_or_nothing_on_one_node(
        case: tuple[ClusterState, list[Queued], PolicySettings]) -> None:
    cluster, queue, config = case
    jobs = {q.job.task_id: q.job for q in queue}
    for d in decide(cluster, queue, 6000.0, config):
        if isinstance(d, Place):
            want = jobs[d.task_id].gpu_milli
            if want >= 1000:
                assert d.gpu_milli == 1000
                assert len(set(d.gpu_ids)) == len(d.gpu_ids) == want // 1000
            elif want > 0:
                assert len(d.gpu_ids) == 1
                assert d.gpu_milli == want
            else:
                assert d.gpu_ids == ()


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_preemption_never_picks_a_victim_of_higher_or_equal_score(
        case: tuple[ClusterState, list[Queued], PolicySettings]) -> None:
    cluster, queue, config = case
    now = 6000.0
    scores = {q.job.task_id: s.total for q, s in order(queue, now, config)}
    classes = {q.job.task_id: s.urgency + s.level for q, s in order(queue, now, config)}
    served = {q.job.task_id: q.attained_gpu_s for q in queue}
    peer_yield_s = config.peer_yield_gpu_h * 3600.0
    run = {r.job.task_id: r for r in cluster.running}
    for d in decide(cluster, queue, now, config):
        if isinstance(d, Preempt) and d.for_task:
            victim = run[d.task_id]
            assert victim.job.preemptible or victim.job.tier == "background"
            assert not victim.stopping
            if victim.job.tier != "background":
                victim_score = running_score(victim, now, config)
                assert victim_score.total < scores[d.for_task]
                victim_class = victim_score.urgency + victim_score.level
                assert victim_class <= classes[d.for_task]
                if victim_class == classes[d.for_task]:  # a peer: least attained service
                    victim_served = victim.attained_gpu_s + attempt_gpu_s(victim, now)
                    assert served[d.for_task] < peer_yield_s <= victim_served
                assert now - victim.started_at >= config.min_runtime_s


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_same_input_same_output(
        case: tuple[ClusterState, list[Queued], PolicySettings]) -> None:
    cluster, queue, config = case
    first = decide(cluster, queue, 6000.0, config)
    assert decide(cluster, list(queue), 6000.0, config) == first
    assert decide(cluster, list(reversed(queue)), 6000.0, config) == first


@given(st.floats(0, 1e6), st.floats(1, 100), st.sampled_from(["normal", "high", "urgent"]))
def test_nothing_starves_a_low_task_outranks_newer_urgent_ones_eventually(
        queued_at: float, aging: float, newcomer: str) -> None:
    config = PolicySettings(aging_per_hour=aging)
    gap = (config.urgency_weight[newcomer] - config.urgency_weight["low"]) / aging * 3600
    now = queued_at + gap + 3600.0  # waited past the urgency gap by an hour
    old = queued("old", 500, at=queued_at, urgency="low")
    new = queued("new", 500, at=now, urgency=newcomer)
    assert [q.job.task_id for q, _ in order([new, old], now, config)] == ["old", "new"]
    # and before that point the newcomer still goes first
    early = queued_at + gap / 2
    fresh = queued("new", 500, at=early, urgency=newcomer)
    assert [q.job.task_id for q, _ in order([old, fresh], early, config)] == ["new", "old"]


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_work_goes_only_where_its_requirements_and_the_nodes_windows_allow(
        drawn: tuple[ClusterState, list[Queued], PolicySettings]) -> None:
    cluster, queue, policy_settings = drawn
    jobs = {q.job.task_id: q.job for q in queue}
    nodes = {n.node_id: n for n in cluster.nodes}
    for decision in decide(cluster, queue, 6000.0, policy_settings):
        if not isinstance(decision, Place) or decision.task_id not in jobs:
            continue
        job = jobs[decision.task_id]
        target = nodes[decision.node_id]
        needs = Requirements(gpu_model=job.gpu_model, driver=job.driver, cuda=job.cuda)
        assert platform_fits(target.platform, needs), (decision, needs)
        assert not blocks(target.window_in_s, checkpoints=job.checkpoints,
                          runs_for_s=job.timeout_s), (decision, target.window_in_s)
        if job.gpu_model:
            allowed = model_alternatives(job.gpu_model)
            for gpu in decision.gpu_ids:
                name = next(g.model for g in target.gpus if g.index == gpu)
                assert any_model_matches(name, allowed), (decision, name)
