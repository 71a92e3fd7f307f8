"""No preemption storms, by construction (docs/scheduling.md, "Thrash"). Each invariant
has a table case and a hypothesis case over generated clusters:

1. capacity freed by a preemption goes to its preemptor: a victim's backfills are stopped
   with it, nothing is lent out of a task being stopped, and a stopping task's capacity
   counts only for the task it was stopped for;
2. no task is preempted while staging, before its minimum runtime (any tier), after
   `max_fruitless_preemptions` fruitless attempts until it makes progress, or when it is
   not preemptible;
3. a paused backfill is stopped only for a waiting task, never on a timer alone;
4. an idle share goes to the ready pool before the background tier: background backfills
   in it are stopped for a waiting immediate task that will take it, never for another
   background task, never while protected, and no more of them than it needs.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.scheduler._preemption import lost_work
from m27.scheduler.model import (
    ClusterState,
    Place,
    PolicySettings,
    Preempt,
    Queued,
    Running,
)
from m27.scheduler.policy import decide, explain, protection
from m27.scheduler.tests.support import node, places, preempted, queued, running, state, waits

S = PolicySettings()
NOW = 100_000.0
OLD = NOW - 10 * S.min_runtime_s  # started long enough ago to be preempted


def _lender_with_tenants(*, tenant_tier: str = "background") -> ClusterState:
    """The livelock's shape: two background preprocessing tasks hold 0.4 GPU each, both in
    I/O; each has a backfill running in its idle share."""
    return state(node("n1", 1), running=(
        running("prep-0", "n1", (0,), 400, tier="background", preemptible=True,
                started=OLD, idle=True, gpu_memory_mb=3072),
        running("prep-1", "n1", (0,), 400, tier="background", preemptible=True,
                started=OLD, idle=True, gpu_memory_mb=3072),
        running("prep-2", "n1", (0,), 400, tier=tenant_tier,
                preemptible=tenant_tier == "background", started=OLD, idle=True,
                lender="prep-0", gpu_memory_mb=3072),
        running("prep-3", "n1", (0,), 400, tier="background", preemptible=True,
                started=OLD, idle=True, lender="prep-1", gpu_memory_mb=3072)))


# -- 1. freed capacity goes to the preemptor ---------------------------------------------

def test_a_preempted_lenders_backfills_are_stopped_with_it() -> None:
    md = queued("md-0", 1000, at=NOW, gpu_memory_mb=6144)
    decisions = decide(_lender_with_tenants(), [md], NOW)
    assert sorted(preempted(decisions)) == ["prep-0", "prep-1", "prep-2", "prep-3"]
    assert all(d.for_task == "md-0" for d in decisions if isinstance(d, Preempt))
    assert "md-0" in waits(decisions)


def test_nothing_is_lent_out_of_a_lender_that_is_being_preempted() -> None:
    """The requeued preprocessing tasks wait; before, they backfilled into the very tasks
    preempted for the MD run, inherited the share when those stopped, and round it went."""
    queue = [queued("md-0", 1000, at=NOW, gpu_memory_mb=6144),
             *(queued(f"prep-{i}", 400, at=0.0, tier="background", preemptible=True,
                      gpu_memory_mb=3072) for i in (4, 5))]
    decisions = decide(_lender_with_tenants(), queue, NOW)
    assert not [d for d in decisions if isinstance(d, Place)]
    assert {"prep-4", "prep-5"} <= set(waits(decisions))


def test_a_lender_whose_tenant_may_not_be_stopped_is_no_victim() -> None:
    """Stopping prep-0 would hand its share to prep-2 (immediate, not preemptible), not to
    md-0: prep-0 is left alone, and md-0 cannot get a whole GPU here."""
    cluster = _lender_with_tenants(tenant_tier="immediate")
    decisions = decide(cluster, [queued("md-0", 1000, at=NOW, gpu_memory_mb=6144)], NOW)
    assert not {"prep-0", "prep-2"} & set(preempted(decisions))
    assert "md-0" in waits(decisions)


def test_a_stopping_tasks_capacity_counts_only_for_the_task_it_was_stopped_for() -> None:
    cluster = state(node("n1", 1), running=(
        running("bg", "n1", (0,), 1000, tier="background", preemptible=True, started=OLD,
                stopping=True, stopping_for="first"),))
    both = [queued("first", 1000, at=10.0), queued("second", 1000, at=NOW, urgency="urgent")]
    why = waits(decide(cluster, both, NOW))
    assert "waiting for" not in why["second"]  # urgent, considered first, but not its GPU
    assert "waiting for 1 preempted task" in why["first"]
    # Once `first` is gone (cancelled, or placed elsewhere), anyone may count on it.
    only = decide(cluster, [both[1]], NOW)
    assert "waiting for 1 preempted task" in waits(only)["second"]


# -- 2. protection ------------------------------------------------------------------------

def _victim(**kw: object) -> Running:
    base: dict[str, object] = {"tier": "background", "preemptible": True, "started": OLD}
    base.update(kw)
    return running("v", "n1", (0,), 1000, **base)  # type: ignore[arg-type]


def test_protection_rules_table() -> None:
    young = NOW - S.min_runtime_s / 2
    cases: list[tuple[Running, str]] = [
        (_victim(), ""),
        (_victim(staging=True), "staging its inputs"),
        (_victim(started=young), "min runtime"),
        # min runtime counts from the end of staging, not from the start of the attempt
        (_victim(computing_since=young), "min runtime"),
        (_victim(tier="immediate", preemptible=False), "not preemptible"),
        (_victim(fruitless_preemptions=S.max_fruitless_preemptions), "without progress"),
        (_victim(fruitless_preemptions=S.max_fruitless_preemptions,
                 last_checkpoint_at=NOW - 10), ""),  # it made progress: preemptible again
        (_victim(fruitless_preemptions=S.max_fruitless_preemptions - 1), ""),
        (_victim(stopping=True), "already stopping"),
    ]
    for victim, why in cases:
        got = protection(victim, NOW, S)
        assert (why in got) if why else got == "", (victim, got)
        decisions = decide(state(node("n1", 1), running=(victim,)),
                           [queued("urgent", 1000, at=NOW, urgency="urgent")], NOW)
        assert ("v" in preempted(decisions)) == (why == ""), (victim, decisions)


# -- 3. paused backfills -----------------------------------------------------------------

def test_a_long_paused_backfill_is_preempted_only_for_a_task_that_needs_its_memory() -> None:
    cluster = state(node("n1", 1, gpu_mem=16_384), running=(
        running("main", "n1", (0,), 500, started=OLD),
        running("bf", "n1", (0,), 500, lender="main", paused=True,
                paused_at=NOW - 2 * S.max_pause_s, preemptible=True, tier="background",
                started=OLD, gpu_memory_mb=8192)))
    assert preempted(decide(cluster, [], NOW)) == []
    # The free half of the GPU has 0 GiB left beside main's 8 and bf's 8: the share's
    # memory is what the paused backfill holds.
    decisions = decide(cluster, [queued("w", 500, at=NOW, gpu_memory_mb=8192)], NOW)
    assert preempted(decisions) == ["bf"]
    recent = ClusterState(nodes=cluster.nodes, running=(
        cluster.running[0],
        running("bf", "n1", (0,), 500, lender="main", paused=True, paused_at=NOW - 10,
                preemptible=True, tier="background", started=OLD, gpu_memory_mb=8192)))
    assert preempted(decide(recent, [queued("w", 500, at=NOW, gpu_memory_mb=8192)],
                            NOW)) == []


# -- hypothesis: the invariants over generated clusters ----------------------------------

@st.composite
def busy_clusters(draw: st.DrawFn) -> tuple[ClusterState, list[Queued]]:
    """One or two nodes full of preemptible work in every state a victim can be in, some
    of it lending its idle share to backfills, and a queue that wants it."""
    nodes = [node(f"n{i}", draw(st.integers(1, 3))) for i in range(draw(st.integers(1, 2)))]
    run: list[Running] = []
    for n in nodes:
        for gpu in n.gpus:
            name = f"r-{n.node_id}-{gpu.index}"
            milli = draw(st.sampled_from([300, 500, 1000]))
            run.append(running(
                name, n.node_id, (gpu.index,), milli,
                started=NOW - draw(st.sampled_from([10.0, 200.0, 5000.0])),
                computing_since=draw(st.sampled_from([None, NOW - 30.0])),
                staging=draw(st.booleans()), idle=draw(st.booleans()),
                tier=draw(st.sampled_from(["background", "immediate"])),
                preemptible=draw(st.booleans()), urgency=draw(st.sampled_from(["low",
                                                                               "normal"])),
                fruitless_preemptions=draw(st.integers(0, 4)),
                last_checkpoint_at=draw(st.sampled_from([None, NOW - 60.0])),
                stopping=draw(st.booleans()),
                stopping_for=draw(st.sampled_from(["", "q0", "q1"]))))
            if milli < 1000 and draw(st.booleans()):
                run.append(running(
                    f"{name}-bf", n.node_id, (gpu.index,), draw(st.sampled_from([100, 300])),
                    lender=name, started=NOW - 5000.0, tier="background", preemptible=True,
                    paused=draw(st.booleans()),
                    paused_at=NOW - draw(st.sampled_from([10.0, 5000.0])),
                    gpu_memory_mb=draw(st.sampled_from([0, 2048]))))
    queue = [queued(f"q{i}", draw(st.sampled_from([300, 500, 1000, 2000])), at=0.0,
                    urgency=draw(st.sampled_from(["normal", "high", "urgent"])),
                    tier=draw(st.sampled_from(["immediate", "background"])))
             for i in range(draw(st.integers(1, 4)))]
    return ClusterState(nodes=tuple(nodes), running=tuple(run)), queue


@st.composite
def lent_clusters(draw: st.DrawFn) -> tuple[ClusterState, list[Queued]]:
    """GPUs held by user work that may not be preempted, often idle, their shares lent to
    background backfills in every state; a queue of immediate and background tasks."""
    n = node("n1", draw(st.integers(1, 3)), gpu_mem=16_384)
    run: list[Running] = []
    for gpu in n.gpus:
        if draw(st.integers(0, 4)) == 0:
            continue  # a free GPU: a ready-pool backfill may move there
        owner = f"u{gpu.index}"
        run.append(running(owner, "n1", (gpu.index,), draw(st.sampled_from([500, 1000])),
                           started=OLD, idle=draw(st.sampled_from([True, True, False])),
                           gpu_memory_mb=draw(st.sampled_from([1024, 4096]))))
        for k in range(draw(st.integers(0, 3))):
            user = draw(st.sampled_from([False, False, True]))  # a ready-pool task
            run.append(running(
                f"{owner}-bf{k}", "n1", (gpu.index,), draw(st.sampled_from([200, 300, 500])),
                lender=owner, tier="immediate" if user else "background",
                preemptible=not user, checkpoints=draw(st.booleans()),
                started=NOW - draw(st.sampled_from([60.0, 5000.0])),
                last_checkpoint_at=draw(st.sampled_from([None, NOW - 30.0, NOW - 3000.0])),
                paused=draw(st.booleans()), paused_at=NOW - 60.0,
                stopping=draw(st.sampled_from([False, False, True])),
                stopping_for=draw(st.sampled_from(["", "q0"])),
                gpu_memory_mb=draw(st.sampled_from([0, 2048, 4096]))))
    queue = [queued(f"q{i}", draw(st.sampled_from([200, 300, 500, 1000])), at=0.0,
                    tier=draw(st.sampled_from(["immediate", "immediate", "background"])),
                    gpu_memory_mb=draw(st.sampled_from([0, 2048, 8192])))
             for i in range(draw(st.integers(1, 4)))]
    return ClusterState(nodes=(n,), running=tuple(run)), queue


@settings(max_examples=200, deadline=None)
@given(st.one_of(busy_clusters(), lent_clusters()))
def test_no_protected_task_is_preempted_and_tenants_go_with_their_lender(
        case: tuple[ClusterState, list[Queued]]) -> None:
    cluster, queue = case
    decisions = decide(cluster, queue, NOW)
    by_id = {r.job.task_id: r for r in cluster.running}
    stopped = {d.task_id: d for d in decisions if isinstance(d, Preempt)}
    for task_id, d in stopped.items():
        victim = by_id[task_id]
        if d.for_task == task_id:  # a ready-pool backfill moving to capacity of its own
            assert victim.job.tier == "immediate"
            assert victim.job.checkpoints
            assert victim.lender in by_id
            assert protection(msgspec.structs.replace(victim, job=msgspec.structs.replace(
                victim.job, preemptible=True)), NOW, S) == ""
            continue
        assert protection(victim, NOW, S) == "", (victim, d.reason)
        assert d.for_task, "every preemption here is for a waiting task (no drain, no timer)"
        for tenant in (r for r in cluster.running if r.lender == task_id):
            assert tenant.job.task_id in stopped or tenant.stopping, (
                "a backfill would inherit the share freed for " + d.for_task)
        if victim.lender in by_id and victim.lender not in stopped:  # stopped on its own
            displaced = "yields it to" in d.reason
            if displaced:  # for a ready-pool task that will take the idle share
                assert victim.job.tier == "background"
                assert by_id[victim.lender].idle
                assert any(q.job.task_id == d.for_task and q.job.tier == "immediate"
                           for q in queue)
            else:
                assert victim.paused
                assert victim.paused_at is not None
                assert NOW - victim.paused_at > S.max_pause_s


@settings(max_examples=200, deadline=None)
@given(busy_clusters())
def test_nothing_is_placed_into_capacity_freed_for_another_task(
        case: tuple[ClusterState, list[Queued]]) -> None:
    cluster, queue = case
    decisions = decide(cluster, queue, NOW)
    stopped = {d.task_id for d in decisions if isinstance(d, Preempt)}
    stopped |= {r.job.task_id for r in cluster.running if r.stopping}
    freed_gpus = {(r.node_id, g) for r in cluster.running if r.job.task_id in stopped
                  for g in r.gpu_ids}
    for d in decisions:
        if isinstance(d, Place):
            assert d.lender not in stopped, f"{d.task_id} backfills into a stopping task"
            # Only the capacity that was free before (or is freed for it) is used; a
            # placement onto a GPU being freed must fit beside what still runs there.
            if any((d.node_id, g) in freed_gpus for g in d.gpu_ids) and not d.lender:
                held = sum(r.gpu_milli for r in cluster.running
                           if r.node_id == d.node_id and set(r.gpu_ids) & set(d.gpu_ids)
                           and not (r.lender and r.lender in {x.job.task_id
                                                              for x in cluster.running}))
                assert held + d.gpu_milli <= 1000


def test_a_backfill_whose_lender_ended_lends_its_own_share_like_any_task() -> None:
    """The service keeps a placement's lender name after the lender ends, the simulator
    clears it: both must decide the same (it holds its own share now)."""
    cluster = state(node("n1", 1), running=(
        running("was-bf", "n1", (0,), 500, lender="gone", idle=True, started=OLD,
                tier="background", preemptible=True, gpu_memory_mb=2048),))
    bg = queued("bg", 300, at=0.0, tier="background", gpu_memory_mb=1024)
    (place,) = [d for d in decide(cluster, [bg], NOW) if isinstance(d, Place)]
    # (it also fits in the free half; the idle share is lent only when nothing else fits)
    assert place.task_id == "bg"
    full = state(node("n1", 1), running=(
        *cluster.running, running("other", "n1", (0,), 500, started=OLD,
                                  gpu_memory_mb=2048)))
    (place,) = [d for d in decide(full, [bg], NOW) if isinstance(d, Place)]
    assert place.lender == "was-bf"


# -- 4. an idle share goes to the ready pool before the background tier ------------------

def _md_lending(*sweeps: Running) -> ClusterState:
    """A whole-GPU MD run writing its trajectory (idle), its share lent to sweeps."""
    return state(node("n1", 1, gpu_mem=16_384), running=(
        running("md", "n1", (0,), 1000, started=OLD, idle=True, gpu_memory_mb=2048),
        *sweeps))


def _sweep(name: str, **kw: object) -> Running:
    base: dict[str, object] = {"lender": "md", "tier": "background", "preemptible": True,
                               "started": OLD, "gpu_memory_mb": 4096}
    base.update(kw)
    return running(name, "n1", (0,), 500, **base)  # type: ignore[arg-type]


TRAIN = queued("train", 500, at=NOW - 600, gpu_memory_mb=8192)


def test_background_backfills_give_an_idle_share_to_a_ready_pool_task() -> None:
    """The night training that waited behind two sweeps paused in the MD run's share for
    hours: now the sweep that loses least work yields, and the training takes its place."""
    cluster = _md_lending(_sweep("sweep-a", last_checkpoint_at=NOW - 60),
                          _sweep("sweep-b", last_checkpoint_at=NOW - 900))
    decisions = decide(cluster, [TRAIN], NOW)
    assert preempted(decisions) == ["sweep-a"]  # one is enough; it loses 60 s, not 900
    (stop,) = [d for d in decisions if isinstance(d, Preempt)]
    assert stop.for_task == "train"
    assert "md's idle share" in waits(decisions)["train"]
    assert [e.action for e in explain(cluster, [TRAIN], NOW)] == ["preempt"]
    # While it checkpoints, nothing more is stopped and its share is not lent again.
    leaving = _md_lending(_sweep("sweep-a", last_checkpoint_at=NOW - 60, stopping=True,
                                 stopping_for="train"),
                          _sweep("sweep-b", last_checkpoint_at=NOW - 900))
    sweep_c = queued("sweep-c", 500, at=0.0, tier="background", gpu_memory_mb=4096)
    decisions = decide(leaving, [TRAIN, sweep_c], NOW + 30)
    assert preempted(decisions) == []
    assert not [d for d in decisions if isinstance(d, Place)]
    assert "leaving" in waits(decisions)["train"]
    assert explain(leaving, [TRAIN], NOW + 30)[0].action == "wait"
    # Once it is gone the training backfills into the MD run's idle share.
    gone = _md_lending(_sweep("sweep-b", last_checkpoint_at=NOW - 900))
    (place,) = [d for d in decide(gone, [TRAIN, sweep_c], NOW + 90) if isinstance(d, Place)]
    assert (place.task_id, place.lender) == ("train", "md")


def test_an_idle_share_is_not_taken_from_backfills_that_may_not_be_stopped() -> None:
    young = NOW - S.min_runtime_s / 2
    cases = {
        "a background task asks": (_md_lending(_sweep("s1"), _sweep("s2")),
                                   queued("bg", 500, at=0.0, tier="background",
                                          gpu_memory_mb=4096)),
        "the backfills are user work": (
            _md_lending(_sweep("s1", tier="immediate", preemptible=False),
                        _sweep("s2", tier="immediate", preemptible=False)), TRAIN),
        "they computed less than the min runtime": (
            _md_lending(_sweep("s1", started=young), _sweep("s2", started=young)), TRAIN),
        "the lender is computing (its backfills are paused)": (
            state(node("n1", 1), running=(
                running("md", "n1", (0,), 1000, started=OLD, gpu_memory_mb=2048),
                _sweep("s1", paused=True, paused_at=NOW - 60),
                _sweep("s2", paused=True, paused_at=NOW - 60))), TRAIN),
        "stopping both would not make room (GPU memory)": (
            _md_lending(_sweep("s1"), _sweep("s2")),
            queued("big", 500, at=0.0, gpu_memory_mb=15_000)),
    }
    for why, (cluster, asker) in cases.items():
        decisions = decide(cluster, [asker], NOW)
        assert preempted(decisions) == [], why
        assert asker.job.task_id in waits(decisions), why


def test_the_ready_pool_limits_who_may_take_an_idle_share() -> None:
    """Only the first `ready_pool` waiting immediate tasks may: the others wait their turn."""
    cluster = _md_lending(_sweep("s1"), _sweep("s2"))
    queue = [queued(f"t{i}", 500, at=NOW - 600 + i, gpu_memory_mb=4096) for i in range(4)]
    decisions = decide(cluster, queue, NOW, PolicySettings(ready_pool=1))
    assert len(preempted(decisions)) == 1
    assert {d.for_task for d in decisions if isinstance(d, Preempt)} == {"t0"}
    assert preempted(decide(cluster, queue, NOW, PolicySettings(ready_pool=0))) == []


@settings(max_examples=200, deadline=None)
@given(lent_clusters())
def test_backfills_are_displaced_only_as_far_as_the_ready_pool_needs(
        case: tuple[ClusterState, list[Queued]]) -> None:
    """Per lender, the backfills stopped for one task free at least the share it needs, and
    they are the cheapest ones there: none left running would have lost less work."""
    cluster, queue = case
    decisions = decide(cluster, queue, NOW)
    by_id = {r.job.task_id: r for r in cluster.running}
    asks = {q.job.task_id: q for q in queue}
    all_stopped = {d.task_id for d in decisions if isinstance(d, Preempt)}
    groups: dict[tuple[str, str], list[Running]] = {}
    for d in decisions:
        if isinstance(d, Preempt) and "yields it to" in d.reason:
            victim = by_id[d.task_id]
            assert asks[d.for_task].job.tier == "immediate"
            groups.setdefault((victim.lender, d.for_task), []).append(victim)
    for (lender, for_task), stopped in groups.items():
        share = by_id[lender].gpu_milli
        tenants = [r for r in cluster.running if r.lender == lender]
        kept = sum(r.gpu_milli for r in tenants if r not in stopped and not r.stopping)
        assert share - kept >= asks[for_task].job.gpu_milli
        dearest = max(lost_work(r, NOW) for r in stopped)
        for r in tenants:
            if (r.job.task_id not in all_stopped and not r.stopping
                    and protection(r, NOW, S) == "" and r.job.tier == "background"):
                assert lost_work(r, NOW) >= dearest, (r.job.task_id, "was cheaper to stop")


# -- 5. a ready-pool backfill keeps its place in the queue --------------------------------

def _two_gpus(*backfills: Running, second: tuple[Running, ...] = ()) -> ClusterState:
    return state(node("n1", 2, gpu_mem=16_384), running=(
        running("md", "n1", (0,), 1000, started=OLD, idle=True, gpu_memory_mb=2048),
        *backfills, *second))


def _train(**kw: object) -> Running:
    base: dict[str, object] = {"lender": "md", "started": OLD, "checkpoints": True,
                               "gpu_memory_mb": 8192, "queued_at": 10.0}
    base.update(kw)
    return running("train", "n1", (0,), 1000, **base)  # type: ignore[arg-type]


def test_a_ready_pool_backfill_moves_to_free_capacity_and_it_is_held_for_it() -> None:
    bg = queued("bg", 1000, at=0.0, tier="background")
    later = queued("later", 1000, at=NOW - 60)  # immediate, but waited less than train
    decisions = decide(_two_gpus(_train()), [bg, later], NOW)
    (stop,) = [d for d in decisions if isinstance(d, Preempt)]
    assert (stop.task_id, stop.for_task) == ("train", "train")
    assert "moves to capacity of its own (GPU 1 on n1" in stop.reason
    assert not [d for d in decisions if isinstance(d, Place)]  # GPU 1 is train's
    # While it checkpoints GPU 1 stays held for it; then it is placed there.
    stopping = _two_gpus(_train(stopping=True, stopping_for="train"))
    assert not [d for d in decide(stopping, [bg, later], NOW + 30) if isinstance(d, Place)]
    requeued = [queued("train", 1000, at=10.0, gpu_memory_mb=8192, checkpoints=True), bg,
                later]
    placed = places(decide(_two_gpus(), requeued, NOW + 60))
    assert placed["train"] == ("n1", (1,))


def test_backfills_that_stay_where_they_are() -> None:
    young = NOW - S.min_runtime_s / 2
    busy = (running("other", "n1", (1,), 1000, started=OLD),)
    cases = {
        "no capacity of its own anywhere": _two_gpus(_train(), second=busy),
        "it does not checkpoint (a move would lose its work)": _two_gpus(
            _train(checkpoints=False)),
        "background work is filler": _two_gpus(_train(tier="background", preemptible=True)),
        "it is staging": _two_gpus(_train(staging=True)),
        "it has computed less than the min runtime": _two_gpus(_train(started=young)),
        "it is stopping already": _two_gpus(_train(stopping=True, stopping_for="x")),
    }
    for why, cluster in cases.items():
        assert preempted(decide(cluster, [], NOW)) == [], why


def test_a_higher_queued_task_gets_the_free_capacity_before_a_backfill_moves() -> None:
    urgent = queued("urgent", 1000, at=0.0, urgency="urgent")
    decisions = decide(_two_gpus(_train()), [urgent], NOW)
    assert places(decisions)["urgent"] == ("n1", (1,))
    assert preempted(decisions) == []


def test_a_backfill_is_ranked_for_its_move_with_the_score_it_will_have_once_requeued() -> None:
    """Its attempt's GPU time counts as held once it is requeued; ranked without it, it
    would move ahead of a task it then ranks behind, and lose the capacity to it."""
    held_h = (NOW - OLD) / 3600.0  # train has held a whole GPU this long as a backfill
    lead_s = 0.5 * held_h * S.held_per_gpu_hour / S.aging_per_hour * 3600.0
    peer = queued("peer", 1000, at=10.0 + lead_s)  # waited less, but has held nothing
    decisions = decide(_two_gpus(_train()), [peer], NOW)
    assert places(decisions)["peer"] == ("n1", (1,))
    assert preempted(decisions) == []
    # and with less held time than that lead it moves, ahead of peer
    decisions = decide(_two_gpus(_train(started=NOW - 0.25 * (NOW - OLD))), [peer], NOW)
    assert [(d.task_id, d.for_task) for d in decisions if isinstance(d, Preempt)] == [
        ("train", "train")]


def _sweep_on_gpu1(**kw: object) -> Running:
    base: dict[str, object] = {"tier": "background", "preemptible": True, "started": OLD,
                               "checkpoints": True, "last_checkpoint_at": NOW - 60.0}
    base.update(kw)
    return running("sweep", "n1", (1,), 1000, **base)  # type: ignore[arg-type]


def test_a_backfill_preempts_what_its_queued_self_would_and_moves_once_it_is_gone() -> None:
    """A backfill is a head start, never a loss of rights: beside a background sweep that
    a queued copy of it would stop at once, it stops the sweep too (and keeps computing in
    its share until the sweep is gone), instead of crawling at its lender's I/O pace."""
    cluster = _two_gpus(_train(), second=(_sweep_on_gpu1(),))
    assert [(d.task_id, d.for_task) for d in decide(cluster, [], NOW)
            if isinstance(d, Preempt)] == [("sweep", "train")]
    itself = queued("train", 1000, at=10.0, gpu_memory_mb=8192, checkpoints=True)
    as_queued = state(node("n1", 2, gpu_mem=16_384), running=(
        cluster.running[0], _sweep_on_gpu1()))
    assert [(d.task_id, d.for_task) for d in decide(as_queued, [itself], NOW)
            if isinstance(d, Preempt)] == [("sweep", "train")]
    # While the sweep checkpoints: nothing more is stopped, and a task ranked below train
    # neither takes GPU 1 nor counts on it.
    other = queued("other", 1000, at=NOW - 60)
    leaving = _two_gpus(_train(), second=(_sweep_on_gpu1(stopping=True,
                                                          stopping_for="train"),))
    decisions = decide(leaving, [other], NOW + 30)
    assert preempted(decisions) == []
    assert places(decisions) == {}
    # Once it is gone, train moves there (held for it while it checkpoints).
    moved = decide(_two_gpus(_train()), [other], NOW + 60)
    assert [(d.task_id, d.for_task) for d in moved if isinstance(d, Preempt)] == [
        ("train", "train")]


def test_a_backfill_stops_nobody_its_queued_self_may_not() -> None:
    young = NOW - S.min_runtime_s / 2
    cases = {
        "a peer of its class": _sweep_on_gpu1(tier="immediate", preemptible=True,
                                              urgency="normal"),
        "work that is not preemptible": _sweep_on_gpu1(tier="immediate", preemptible=False,
                                                       urgency="low"),
        "a sweep under its min runtime": _sweep_on_gpu1(started=young),
        "a sweep staging its inputs": _sweep_on_gpu1(staging=True),
    }
    for why, sweep in cases.items():
        assert preempted(decide(_two_gpus(_train(), second=(sweep,)), [], NOW)) == [], why
    # nor its own lender, even when the lender could be stopped by others
    lender_bg = state(node("n1", 1, gpu_mem=16_384), running=(
        running("md", "n1", (0,), 1000, started=OLD, idle=True, gpu_memory_mb=2048,
                tier="background", preemptible=True),
        _train()))
    assert preempted(decide(lender_bg, [], NOW)) == []


@st.composite
def backfill_beside_others(draw: st.DrawFn) -> tuple[ClusterState, Running]:
    """An immediate checkpointing backfill `train` in a non-preemptible lender's idle share
    on GPU 0, and on the other GPUs of the node running work in every state a victim can be
    in."""
    gpus = draw(st.integers(2, 4))
    n = node("n1", gpus, gpu_mem=16_384)
    md = running("md", "n1", (0,), 1000, started=OLD, idle=True, gpu_memory_mb=2048)
    train = _train(urgency=draw(st.sampled_from(["low", "normal", "high"])),
                   queued_at=draw(st.sampled_from([10.0, NOW - 600.0])))
    run: list[Running] = [md, train]
    for gpu in range(1, gpus):
        for k, milli in enumerate(draw(st.sampled_from([(1000,), (500,), (500, 500),
                                                        (300, 600)]))):
            run.append(running(
                f"r{gpu}-{k}", "n1", (gpu,), milli,
                started=NOW - draw(st.sampled_from([10.0, 200.0, 5000.0])),
                staging=draw(st.booleans()),
                tier=draw(st.sampled_from(["background", "immediate"])),
                preemptible=draw(st.booleans()),
                urgency=draw(st.sampled_from(["low", "normal", "high"])),
                checkpoints=draw(st.booleans()),
                last_checkpoint_at=draw(st.sampled_from([None, NOW - 60.0])),
                stopping=draw(st.sampled_from([False, False, True])),
                stopping_for=draw(st.sampled_from(["", "train"]))))
    return ClusterState(nodes=(n,), running=tuple(run)), train


@settings(max_examples=200, deadline=None)
@given(backfill_beside_others())
def test_a_backfill_has_the_rights_of_its_queued_self(
        case: tuple[ClusterState, Running]) -> None:
    """Whatever its queued copy would do for capacity of its own (start there, or stop
    victims for it), the backfill does too: it moves, or stops the same kind of victims;
    and it never stops anything its queued copy could not."""
    cluster, train = case
    decisions = decide(cluster, [], NOW)
    mine = [d for d in decisions if isinstance(d, Preempt) and d.for_task == "train"]
    others = state(*cluster.nodes, running=tuple(
        r for r in cluster.running if r.job.task_id != "train"))
    itself = Queued(job=train.job, queued_at=train.queued_at,
                    attained_gpu_s=(NOW - train.started_at) * train.gpu_milli / 1000)
    as_queued = decide(others, [itself], NOW)
    acts = [d for d in as_queued if (isinstance(d, Place) and not d.lender)
            or (isinstance(d, Preempt) and d.for_task == "train")]  # capacity of its own
    assert bool(mine) == bool(acts) or (
        not mine and any(r.stopping and r.stopping_for == "train" for r in cluster.running)
    ), (mine, acts)
    by_id = {r.job.task_id: r for r in cluster.running}
    for d in mine:
        if d.task_id == "train":
            continue  # its own move
        victim = by_id[d.task_id]
        assert protection(victim, NOW, S) == "", (victim, d.reason)
        assert victim.job.task_id != "md", "never its own lender"
