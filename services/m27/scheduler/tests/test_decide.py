"""The policy core, rule by rule: score, packing, preemption, temperature, tiers and backfill,
maintenance. Each case builds its own tiny cluster."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from m27.common.platform import Platform
from m27.scheduler.model import (
    Pause,
    Place,
    PolicySettings,
    Preempt,
    Resume,
    Stage,
)
from m27.scheduler.policy import decide, explain
from m27.scheduler.tests.support import (
    node,
    places,
    preempted,
    queued,
    running,
    state,
    waits,
)

S = PolicySettings()
HOUR = 3600.0


# -- 1. score --------------------------------------------------------------------------

@pytest.mark.parametrize(("urgency", "user", "level", "waited_h", "held_gpu_h"), [
    ("low", "ann", "student", 0.0, 0.0),
    ("normal", "bob", "staff", 2.0, 0.0),
    ("urgent", "pia", "pi", 0.5, 3.0),
    ("high", "nobody", "student", 10.0, 1.0),  # unknown user: default level
])
def test_score_is_urgency_plus_level_plus_aging_minus_held(
        urgency: str, user: str, level: str, waited_h: float, held_gpu_h: float) -> None:
    settings = PolicySettings(user_levels={"ann": "student", "bob": "staff", "pia": "pi"})
    now = 100 * HOUR
    q = queued("t", 500, at=now - waited_h * HOUR, attained=held_gpu_h * HOUR,
               urgency=urgency, user=user)
    (e,) = explain(state(node("n", 0)), [q], now, settings)
    expected = (settings.urgency_weight[urgency] + settings.level_weight[level]
                + settings.aging_per_hour * waited_h
                - settings.held_per_gpu_hour * held_gpu_h)
    assert e.score.total == pytest.approx(expected)
    assert e.score.user_level == level
    assert e.score.aging == pytest.approx(settings.aging_per_hour * waited_h)
    assert e.score.held == pytest.approx(settings.held_per_gpu_hour * held_gpu_h)


def test_explain_says_why_a_share_waits_with_the_largest_free_slice() -> None:
    cluster = state(node("n1", 1), node("n2", 2), running=(
        running("a", "n1", (0,), 900), running("b", "n2", (0,), 1000),
        running("c", "n2", (1,), 700)))
    q = queued("t", 500, gpu_memory_mb=12_288)
    (e,) = explain(cluster, [q], 10.0)
    assert e.action == "wait"
    assert e.reason == ("needs 0.50 GPU with 12 GiB; largest free slice is 0.30 "
                        "(GPU 1 on n2)")


def test_higher_score_goes_first_and_ties_go_to_the_longest_waiting() -> None:
    queue = [queued("late", 1000, at=50), queued("early", 1000, at=10),
             queued("urgent", 1000, at=90, urgency="urgent")]
    decisions = decide(state(node("n1", 2)), queue, 100.0)
    assert set(places(decisions)) == {"urgent", "early"}
    assert set(waits(decisions)) == {"late"}


# -- 2. packing ------------------------------------------------------------------------

def test_a_share_fills_a_partly_used_gpu_rather_than_breaking_a_free_one() -> None:
    cluster = state(node("n1", 2), running=(running("a", "n1", (1,), 500),))
    assert places(decide(cluster, [queued("t", 500)], 10.0)) == {"t": ("n1", (1,))}


@pytest.mark.parametrize(("gpus_per_node", "want", "expect"), [
    ((1, 1, 3), 2000, {"t": ("n3", (0, 1))}),
    ((1, 1), 2000, {}),  # 2 free GPUs in the cluster, but not on one node
])
def test_gangs_go_to_one_node_all_or_nothing(
        gpus_per_node: tuple[int, ...], want: int,
        expect: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    cluster = state(*(node(f"n{i + 1}", g) for i, g in enumerate(gpus_per_node)))
    decisions = decide(cluster, [queued("t", want)], 10.0)
    assert places(decisions) == expect
    assert (not expect) == ("t" in waits(decisions))


def test_a_small_gang_leaves_the_big_node_whole_for_a_big_one() -> None:
    cluster = state(node("n1", 4), node("n2", 2))
    decisions = decide(cluster, [queued("a-small", 2000), queued("b-big", 4000)], 10.0)
    assert places(decisions) == {"a-small": ("n2", (0, 1)), "b-big": ("n1", (0, 1, 2, 3))}


def test_gpu_model_constraint() -> None:
    cluster = state(node("a", 2, model="T4"), node("b", 2, model="V100"))
    assert places(decide(cluster, [queued("t", 1000, gpu_model="V100")], 1.0)) == {
        "t": ("b", (0,))}
    assert "t" in waits(decide(cluster, [queued("t", 1000, gpu_model="A100")], 1.0))


def test_driver_and_cuda_requirements_and_gpu_model_words() -> None:
    new = Platform(driver="550.54.15", cuda="12.4")
    cluster = state(node("old", 2, model="NVIDIA A100-PCIE-40GB",
                         platform=Platform(driver="535.104.05", cuda="12.2")),
                    node("new", 2, model="NVIDIA A100-SXM4-80GB", platform=new),
                    node("cheap", 2, model="NVIDIA A10G", platform=new))
    assert places(decide(cluster, [queued("t", 1000, gpu_model="A100", cuda=">=12.4")],
                         1.0)) == {"t": ("new", (0,))}
    assert places(decide(cluster, [queued("t", 1000, gpu_model="A10")], 1.0)) == {}
    assert places(decide(cluster, [queued("t", 2000, driver="<550")], 1.0)) == {
        "t": ("old", (0, 1))}
    reason = waits(decide(cluster, [queued("t", 500, cuda=">=12.5")], 1.0))["t"]
    assert "cuda >=12.5" in reason
    assert "no node meets its requirements" in reason
    assert "old: cuda 12.2, needs >=12.5" in reason
    reason = waits(decide(cluster, [queued("t", 500, gpu_model="H100")], 1.0))["t"]
    assert "cheap: GPUs NVIDIA A10G" in reason


def test_a_node_that_does_not_know_its_cuda_meets_no_cuda_requirement() -> None:
    cluster = state(node("sim", 2))
    reason = waits(decide(cluster, [queued("t", 1000, cuda=">=11")], 1.0))["t"]
    assert "sim: cuda unknown, needs >=11" in reason
    assert places(decide(cluster, [queued("t", 1000)], 1.0)) == {"t": ("sim", (0,))}


@pytest.mark.parametrize(("overprovision", "fits"), [(1.0, False), (1.5, True)])
def test_gpu_memory_limits_sharing_unless_overprovisioned(overprovision: float,
                                                          fits: bool) -> None:
    cluster = state(node("n1", 1), running=(
        running("a", "n1", (0,), 300, gpu_memory_mb=12_288),))
    settings = PolicySettings(memory_overprovision=overprovision)
    decisions = decide(cluster, [queued("t", 300, gpu_memory_mb=8192)], 1.0, settings)
    assert ("t" in places(decisions)) is fits


def test_a_share_without_memory_gets_its_proportion_of_gpu_memory() -> None:
    # 0.6 of a 16 GiB GPU holds ~9.8 GiB: a 0.3 share asking 8 GiB no longer fits.
    cluster = state(node("n1", 1), running=(running("a", "n1", (0,), 600),))
    assert "t" in waits(decide(cluster, [queued("t", 300, gpu_memory_mb=8192)], 1.0))
    assert "t" in places(decide(cluster, [queued("t", 300)], 1.0))


def test_cpu_and_host_memory_limit_placement() -> None:
    cluster = state(node("n1", 2, cpu=4000, mem=8192))
    assert "t" in waits(decide(cluster, [queued("t", 500, cpu_milli=6000)], 1.0))
    assert "t" in waits(decide(cluster, [queued("t", 500, memory_mb=9000)], 1.0))
    assert "t" in places(decide(cluster, [queued("t", 500, cpu_milli=4000)], 1.0))


# -- 3. preemption ---------------------------------------------------------------------

NOW = 10_000.0


@pytest.mark.parametrize(("victim_kw", "task_urgency", "task_at", "preempts"), [
    ({"preemptible": True, "urgency": "low"}, "urgent", NOW, True),
    ({"preemptible": False, "urgency": "low"}, "urgent", NOW, False),  # not preemptible
    ({"preemptible": True, "urgency": "urgent"}, "urgent", NOW, False),  # higher score
    ({"preemptible": True, "urgency": "low", "started": NOW - 60}, "urgent", NOW,
     False),  # too young
    ({"preemptible": True, "urgency": "low"}, "low", NOW, False),  # no lower score
    ({"preemptible": True, "urgency": "normal"}, "normal", NOW - 10 * HOUR,
     False),  # aged past it, but a peer: aging orders the queue, it does not preempt
    ({"preemptible": True, "urgency": "normal"}, "high", NOW, True),  # a higher class
    ({"preemptible": True, "urgency": "normal", "queued_at": NOW - 100 * HOUR}, "high", NOW,
     False),  # a higher class, but the victim's score has aged above the task's
])
def test_preemption_rules(victim_kw: dict[str, Any], task_urgency: str, task_at: float,
                          preempts: bool) -> None:
    kw: dict[str, Any] = {"started": NOW - 1000, "queued_at": NOW - 1000, **victim_kw}
    cluster = state(node("n1", 1), running=(running("v", "n1", (0,), 1000, **kw),))
    decisions = decide(cluster, [queued("t", 1000, at=task_at, urgency=task_urgency)],
                       NOW)
    assert (preempted(decisions) == ["v"]) is preempts
    assert "t" in waits(decisions)
    if preempts:
        (p,) = [d for d in decisions if isinstance(d, Preempt)]
        assert p.grace_s == S.preempt_grace_s
        assert p.for_task == "t"
        assert waits(decisions)["t"] == "waiting for 1 preempted task(s) to checkpoint on n1"


@pytest.mark.parametrize(("started_h", "queued_h", "task_held_h", "peer_yield_h", "preempts"), [
    (3.0, 3.0, 0.0, 1.0, True),  # held 3 GPU-h, the newcomer none: the long holder yields
    (3.0, 3.0, 2.0, 1.0, False),  # the newcomer has had its share too: peers never take turns
    (3.0, 3.0, 0.0, 0.0, False),  # peer yield off: only lower classes are preempted
    (0.5, 0.5, 0.0, 1.0, False),  # the victim has held only 0.5 GPU-h
    (3.0, 10.0, 0.0, 1.0, False),  # it waited 7 h before starting: its score is higher
])
def test_a_peer_that_has_held_its_share_yields_to_a_newcomer(
        started_h: float, queued_h: float, task_held_h: float, peer_yield_h: float,
        preempts: bool) -> None:
    """Least-attained-service among equals (Tiresias's two queues): a running task's aging
    stops when it starts, so its score falls as it holds GPUs; a newcomer that has held
    less than `peer_yield_gpu_h` may preempt a preemptible peer that has held more."""
    victim = running("v", "n1", (0,), 1000, started=NOW - started_h * HOUR,
                     queued_at=NOW - queued_h * HOUR, preemptible=True)
    task = queued("t", 1000, at=NOW - 600, attained=task_held_h * HOUR)
    settings = PolicySettings(peer_yield_gpu_h=peer_yield_h)
    decisions = decide(state(node("n1", 1), running=(victim,)), [task], NOW, settings)
    assert (preempted(decisions) == ["v"]) is preempts


def test_victims_lose_the_least_work_then_are_fewest() -> None:
    common: dict[str, Any] = {"preemptible": True, "urgency": "low", "started": NOW - 5000}
    cluster = state(node("n1", 1), node("n2", 1), node("n3", 2), running=(
        running("fresh-ckpt", "n1", (0,), 1000, checkpoints=True,
                last_checkpoint_at=NOW - 30, **common),
        running("no-ckpt", "n2", (0,), 1000, **common),
        running("half1", "n3", (0,), 1000, checkpoints=True, last_checkpoint_at=NOW - 100,
                **common),
        running("half2", "n3", (1,), 1000, checkpoints=True, last_checkpoint_at=NOW - 100,
                **common)))
    one = decide(cluster, [queued("t", 1000, urgency="urgent")], NOW)
    assert preempted(one) == ["fresh-ckpt"]
    two = decide(cluster, [queued("t", 2000, urgency="urgent")], NOW)
    assert sorted(preempted(two)) == ["half1", "half2"]


def test_stopping_tasks_count_as_held_and_are_waited_for() -> None:
    cluster = state(node("n1", 1), running=(
        running("v", "n1", (0,), 1000, stopping=True, preemptible=True, urgency="low"),
        running("w", "n1", (0,), 0, preemptible=True, urgency="low", started=0.0)))
    decisions = decide(cluster, [queued("t", 1000, urgency="urgent")], NOW)
    assert preempted(decisions) == []
    assert waits(decisions)["t"] == "waiting for 1 preempted task(s) to checkpoint on n1"


# -- 4. temperature --------------------------------------------------------------------

@pytest.mark.parametrize(("temps", "throttled", "expect"), [
    ((85.0, 60.0), (), (1,)),  # GPU 0 too hot
    ((50.0, 60.0), (0,), (1,)),  # GPU 0 throttled
    ((70.0, 40.0), (), (1,)),  # both fine: the cooler one
    ((40.0, 70.0), (), (0,)),
])
def test_hot_or_throttled_gpus_get_no_work_and_cooler_ones_are_preferred(
        temps: tuple[float, float], throttled: tuple[int, ...],
        expect: tuple[int, ...]) -> None:
    cluster = state(node("n1", 2, temps=temps, throttled=throttled))
    assert places(decide(cluster, [queued("t", 1000)], 1.0)) == {"t": ("n1", expect)}


def test_all_gpus_hot_means_waiting_with_the_reason() -> None:
    cluster = state(node("n1", 1, temps=(90.0,)))
    reason = waits(decide(cluster, [queued("t", 500)], 1.0))["t"]
    assert "too hot or throttled" in reason


# -- 5. tiers, ready pool, backfill ----------------------------------------------------

def test_background_only_takes_leftovers() -> None:
    queue = [queued("bg", 1000, at=0.0, tier="background", urgency="urgent"),
             queued("imm", 1000, at=50.0, urgency="low")]
    decisions = decide(state(node("n1", 1)), queue, 100.0)
    assert places(decisions) == {"imm": ("n1", (0,))}
    assert waits(decisions)["bg"].startswith("background tier")


def test_an_immediate_job_preempts_background_once_past_its_minimum_runtime() -> None:
    """Background is the first victim whatever its urgency, but a young one is protected
    like any task: min runtime holds for every tier (no thrash of short filler work)."""
    for age, victims in ((5.0, []), (S.min_runtime_s + 1, ["bg"])):
        cluster = state(node("n1", 1), running=(
            running("bg", "n1", (0,), 1000, tier="background", urgency="urgent",
                    started=NOW - age),))
        decisions = decide(cluster, [queued("imm", 1000, at=NOW, urgency="low")], NOW)
        assert preempted(decisions) == victims


def test_the_ready_pool_is_staged_once_on_each_likely_node() -> None:
    cluster = state(node("n1", 1), node("n2", 1), running=(
        running("a", "n1", (0,), 1000), running("b", "n2", (0,), 600)))
    queue = [queued(f"w{i}", 1000, at=float(i)) for i in range(4)]
    stages = [d for d in decide(cluster, queue, 10.0, PolicySettings(ready_pool=2))
              if isinstance(d, Stage)]
    # the node with the most free capacity of its kind first
    assert [(s.task_id, s.node_id) for s in stages] == [
        ("w0", "n2"), ("w0", "n1"), ("w1", "n2"), ("w1", "n1")]
    queue[0] = msgspec.structs.replace(queue[0], staged_on=("n2", "n1"))
    queue[1] = msgspec.structs.replace(queue[1], staged_on=("n1",))
    stages = [d for d in decide(cluster, queue, 10.0, PolicySettings(ready_pool=2))
              if isinstance(d, Stage)]
    assert [(s.task_id, s.node_id) for s in stages] == [("w1", "n2")]


def test_stage_nodes_bounds_the_nodes_one_task_is_staged_on() -> None:
    cluster = state(*(node(f"n{i}", 1) for i in range(6)), running=tuple(
        running(f"r{i}", f"n{i}", (0,), 1000) for i in range(6)))
    queue = [queued("w", 1000)]
    for count in (1, 3, 10):
        stages = [d for d in decide(cluster, queue, 10.0, PolicySettings(stage_nodes=count))
                  if isinstance(d, Stage)]
        assert len(stages) == min(count, 6)
        assert len({s.node_id for s in stages}) == len(stages)
    staged = msgspec.structs.replace(queue[0], staged_on=("n0", "n1", "n2"))
    assert not [d for d in decide(cluster, [staged], 10.0, PolicySettings(stage_nodes=3))
                if isinstance(d, Stage)]


def test_background_tasks_take_the_ready_pool_slots_no_immediate_task_wants() -> None:
    """A start is a start: a background sweep that stages its inputs on the GPU wastes the
    share as much as a user's job would. Immediate tasks still come first."""
    cluster = state(node("n1", 1), running=(running("a", "n1", (0,), 1000),))
    bg = [queued(f"bg{i}", 1000, at=0.0, tier="background") for i in range(3)]
    one = [queued("imm", 1000, at=5.0)]
    settings = PolicySettings(ready_pool=2, backfill_pool=0)
    staged = [d.task_id for d in decide(cluster, [*bg, *one], 10.0, settings)
              if isinstance(d, Stage)]
    assert staged == ["imm", "bg0"]
    staged = [d.task_id for d in decide(cluster, bg, 10.0, settings)
              if isinstance(d, Stage)]
    assert staged == ["bg0", "bg1"]
    assert not [d for d in decide(cluster, bg, 10.0,
                                  PolicySettings(ready_pool=0, backfill_pool=0))
                if isinstance(d, Stage)]


def _staged(decisions: list[Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in decisions:
        if isinstance(d, Stage):
            out.setdefault(d.task_id, []).append(d.node_id)
    return out


def test_the_backfill_pool_stages_the_first_waiting_tasks_of_each_share_asked() -> None:
    """An idle share goes to the first waiting task that fits it: with one list in score
    order, whole-GPU sweeps filled it while half-GPU sweeps took the idle half shares
    unstaged and spent them copying their inputs."""
    cluster = state(node("n1", 1), running=(running("a", "n1", (0,), 1000),))
    whole = [queued(f"w{i}", 1000, at=float(i), tier="background") for i in range(4)]
    half = [queued(f"h{i}", 500, at=10.0 + i, tier="background") for i in range(4)]
    gang = [queued("g", 2000, at=0.5, tier="background")]
    settings = PolicySettings(ready_pool=0, backfill_pool=2)
    assert list(_staged(decide(cluster, [*whole, *gang, *half], 20.0, settings))) == [
        "w0", "w1", "h0", "h1"]  # never a gang: it is never lent an idle share
    assert not _staged(decide(cluster, whole, 20.0,
                              PolicySettings(ready_pool=0, backfill_pool=0)))
    assert not _staged(decide(cluster, whole, 20.0, PolicySettings(
        ready_pool=0, backfill_pool=2, backfill=False)))
    # immediate work is the ready pool's, never the backfill pool's
    assert not _staged(decide(cluster, [queued("imm", 1000)], 20.0, settings))
    # at most 4 × backfill_pool in all, however many sizes wait
    sizes = [queued(f"s{m}", m, at=float(m), tier="background") for m in range(100, 1001, 100)]
    assert len(_staged(decide(cluster, sizes, 20.0, PolicySettings(
        ready_pool=0, backfill_pool=1)))) == 4
    # a task already staged on `stage_nodes` nodes gets no more
    done = [msgspec.structs.replace(q, staged_on=("n1",)) for q in whole]
    assert not _staged(decide(cluster, done, 20.0, PolicySettings(
        ready_pool=0, backfill_pool=2, stage_nodes=1)))


def test_the_backfill_pool_stages_first_where_shares_it_fits_are_idle_or_lent() -> None:
    cluster = state(node("n1", 2), node("n2", 1), node("n3", 1), node("n4", 1), running=(
        running("a", "n2", (0,), 1000, idle=True),  # idle: lends now
        running("b", "n3", (0,), 1000), running("t", "n3", (0,), 500, lender="b"),  # lends
        running("c", "n4", (0,), 300, idle=True)))  # too small a share for 0.5 GPU
    bg = [queued("bg", 500, at=0.0, tier="background", gpu_memory_mb=20_000)]  # fits nowhere
    for count, expected in ((1, ["n2"]), (2, ["n2", "n3"]), (3, ["n2", "n3", "n1"])):
        found = _staged(decide(cluster, bg, 20.0, PolicySettings(
            ready_pool=0, stage_nodes=count)))
        assert found == {"bg": expected}


def test_a_staged_task_starts_on_its_staged_node_when_it_fits() -> None:
    cluster = state(node("n1", 2), node("n2", 2))
    assert places(decide(cluster, [queued("t", 1000, staged_on=("n2",))], 1.0))["t"][0] == "n2"
    # staged on several: one of them where it fits (n2 is full), never the unstaged n1
    cluster = state(node("n1", 2), node("n2", 2), node("n3", 2), running=(
        running("x", "n2", (0,), 1000), running("y", "n2", (1,), 1000)))
    placed = places(decide(cluster, [queued("t", 1000, staged_on=("n2", "n3"))], 1.0))
    assert placed["t"][0] == "n3"


def test_a_backfill_prefers_an_idle_share_where_its_inputs_are_staged() -> None:
    """It computes at once there; elsewhere it would first read its inputs in the share."""
    cluster = state(node("n1", 1), node("n2", 1), running=(
        running("a", "n1", (0,), 1000, idle=True, gpu_memory_mb=4096),
        running("b", "n2", (0,), 1000, idle=True, gpu_memory_mb=4096)))
    for staged, lender in (((), "a"), (("n2",), "b"), (("n1", "n2"), "a")):
        task = queued("bg", 500, tier="background", staged_on=staged)
        (place,) = [d for d in decide(cluster, [task], 1.0) if d.task_id == "bg"]
        assert isinstance(place, Place)
        assert place.lender == lender


def test_idle_share_is_backfilled_by_background_work() -> None:
    cluster = state(node("n1", 1), running=(
        running("main", "n1", (0,), 1000, idle=True, gpu_memory_mb=4096),))
    decisions = decide(cluster, [queued("bg", 500, tier="background")], 1.0)
    (place,) = [d for d in decisions if d.task_id == "bg"]
    assert place == msgspec.structs.replace(place, node_id="n1", gpu_ids=(0,),
                                            lender="main")
    busy = state(node("n1", 1), running=(running("main", "n1", (0,), 1000,
                                                 gpu_memory_mb=4096),))
    assert "bg" in waits(decide(busy, [queued("bg", 500, tier="background")], 1.0))


def test_no_backfill_when_the_idle_task_holds_all_gpu_memory() -> None:
    cluster = state(node("n1", 1), running=(running("main", "n1", (0,), 1000, idle=True),))
    assert "bg" in waits(decide(cluster, [queued("bg", 500, tier="background")], 1.0))


@pytest.mark.parametrize(("lender_idle", "paused", "paused_at", "expect"), [
    (False, False, None, Pause),
    (True, True, 0.0, Resume),
    (False, True, NOW - 10_000, None),  # paused long, but nobody needs its memory
    (False, True, NOW - 10, None),  # paused a short while: stays paused
    (True, False, None, None),  # lender still idle: keeps running
])
def test_backfill_follows_its_lender(lender_idle: bool, paused: bool,
                                     paused_at: float | None, expect: type | None) -> None:
    cluster = state(node("n1", 1), running=(
        running("main", "n1", (0,), 1000, idle=lender_idle),
        running("bf", "n1", (0,), 500, lender="main", paused=paused, paused_at=paused_at,
                preemptible=True, tier="background")))
    kinds = [type(d) for d in decide(cluster, [], NOW) if d.task_id == "bf"]
    assert kinds == ([expect] if expect else [])


@pytest.mark.parametrize("lender", ["", "gone"])
def test_a_paused_backfill_whose_lender_ended_resumes(lender: str) -> None:
    """The lender finished while its backfill was paused: the backfill now holds that share
    and must run, whether the shell still names the lender (the service) or has cleared
    the name (the simulator). Otherwise it sits paused on its GPU for ever."""
    cluster = state(node("n1", 1), running=(
        running("bf", "n1", (0,), 1000, lender=lender, paused=True, paused_at=NOW - 50,
                preemptible=True, tier="background"),))
    assert [type(d) for d in decide(cluster, [], NOW) if d.task_id == "bf"] == [Resume]


def test_a_backfill_whose_lender_ended_can_be_preempted() -> None:
    cluster = state(node("n1", 1), running=(
        running("bf", "n1", (0,), 1000, lender="gone", started=NOW - 1000,
                preemptible=True, tier="background"),))
    assert preempted(decide(cluster, [queued("t", 1000, at=NOW - 10)], NOW)) == ["bf"]


def test_one_idle_share_takes_several_backfills_up_to_its_size() -> None:
    cluster = state(node("n1", 1), running=(
        running("main", "n1", (0,), 1000, idle=True, gpu_memory_mb=2048),))
    queue = [queued(f"bg{i}", 400, at=float(i), tier="background", gpu_memory_mb=2048)
             for i in range(3)]
    decisions = decide(cluster, queue, NOW)
    lent = {d.task_id: d.lender for d in decisions if isinstance(d, Place)}
    assert lent == {"bg0": "main", "bg1": "main"}  # 0.4 + 0.4 of 1.0; a third won't fit
    assert "bg2" in waits(decisions)
    already = state(node("n1", 1), running=(
        running("main", "n1", (0,), 1000, idle=True, gpu_memory_mb=2048),
        running("bg0", "n1", (0,), 400, lender="main", gpu_memory_mb=2048,
                tier="background")))
    more = decide(already, [queued("bg1", 700, tier="background", gpu_memory_mb=2048),
                            queued("bg2", 600, tier="background", gpu_memory_mb=2048)], NOW)
    assert {d.task_id: d.lender for d in more if isinstance(d, Place)} == {"bg2": "main"}


# -- 6. maintenance --------------------------------------------------------------------

def test_cordoned_nodes_take_no_work() -> None:
    cluster = state(node("n1", 2, schedulable=False))
    reason = waits(decide(cluster, [queued("t", 500)], 1.0))["t"]
    assert "no node takes new work" in reason


def test_drain_moves_checkpointing_tasks_and_lets_others_finish() -> None:
    cluster = state(node("n1", 2, schedulable=False, draining=True), node("n2", 2),
                    running=(running("ck", "n1", (0,), 1000, checkpoints=True),
                             running("plain", "n1", (1,), 1000)))
    decisions = decide(cluster, [], 1.0)
    assert preempted(decisions) == ["ck"]
    (p,) = [d for d in decisions if isinstance(d, Preempt)]
    assert p.reason.startswith("drain n1")


@pytest.mark.parametrize("stopping", [False, True])
def test_capacity_freed_for_a_waiting_task_is_not_refilled_by_lower_work(
        stopping: bool) -> None:
    """A whole-GPU task preempts the background task holding half a GPU: the other half
    (free now) and the half being freed stay reserved for it, in this cycle and while the
    victim checkpoints — otherwise another background task takes the free half, the GPU
    never becomes whole, and the preemption repeats every grace period (a livelock the
    simulator found)."""
    victim = running("b1", "n1", (0,), 500, started=NOW - 1000, tier="background",
                     preemptible=True, stopping=stopping)
    cluster = state(node("n1", 1), running=(victim,))
    queue = [queued("t", 1000, at=NOW - 10),
             queued("b2", 500, at=NOW - 5000, tier="background", preemptible=True)]
    decisions = decide(cluster, queue, NOW)
    assert preempted(decisions) == ([] if stopping else ["b1"])
    assert "t" in waits(decisions)
    assert "b2" in waits(decisions)
    assert places(decisions) == {}


def test_ahead_of_a_maintenance_window_only_work_that_ends_or_checkpoints_in_time_goes_there(
        ) -> None:
    cluster = state(node("soon", 1, window_in_s=600.0), node("later", 1))
    busy_later = state(node("soon", 1, window_in_s=600.0), node("later", 1),
                       running=(running("r", "later", (0,), 1000),))
    assert places(decide(busy_later, [queued("plain", 1000)], 1.0)) == {}
    assert "plain" in waits(decide(busy_later, [queued("plain", 1000)], 1.0))
    assert places(decide(busy_later, [queued("ckpt", 1000, checkpoints=True)], 1.0)) == {
        "ckpt": ("soon", (0,))}
    assert places(decide(busy_later, [queued("short", 1000, timeout_s=300.0)], 1.0)) == {
        "short": ("soon", (0,))}
    assert places(decide(busy_later, [queued("long", 1000, timeout_s=900.0)], 1.0)) == {}
    # with room elsewhere, work that would be cut short goes elsewhere
    assert places(decide(cluster, [queued("plain", 1000)], 1.0)) == {"plain": ("later", (0,))}


def test_a_node_evacuated_for_its_window_stops_all_its_work() -> None:
    cluster = state(node("n1", 2, schedulable=False, draining=True, evacuating=True),
                    node("n2", 2),
                    running=(running("ckpt", "n1", (0,), 1000, checkpoints=True),
                             running("plain", "n1", (1,), 1000),
                             running("other", "n2", (0,), 1000)))
    decisions = decide(cluster, [], 10_000.0)
    assert sorted(preempted(decisions)) == ["ckpt", "plain"]
    reasons = {d.task_id: d.reason for d in decisions if isinstance(d, Preempt)}
    assert reasons["plain"] == "maintenance window on n1: stopped, runs again on another node"
    # an ordinary drain leaves work that does not checkpoint to finish
    drained = state(node("n1", 2, schedulable=False, draining=True), node("n2", 2),
                    running=(running("ckpt", "n1", (0,), 1000, checkpoints=True),
                             running("plain", "n1", (1,), 1000)))
    assert preempted(decide(drained, [], 10_000.0)) == ["ckpt"]
