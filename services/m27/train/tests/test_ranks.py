"""The pure half of checkpointing ranks (`m27.train._ranks`): entry names, what each rank
reads, the gang's manifest, the layout check, and the agreement every rank reaches."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.checkpoint_format import Entry, Manifest
from m27.common.checkpoint_storage import LocalStore
from m27.train import Checkpointer, RestoreError
from m27.train._persist import FORMAT
from m27.train._policy import Decision
from m27.train._ranks import (
    Failed,
    Part,
    Vote,
    combine,
    entry_name,
    layout_problem,
    merge,
    must_agree,
    rank_of,
    reads,
    settle,
    settle_commit,
    step_due,
)


@pytest.mark.parametrize(("path", "rank", "sharded", "name"), [
    ("model/0.weight", 0, False, "model/0.weight"),  # replicated: saved once, by rank 0
    ("optimizer/state/0/exp_avg", 0, False, "optimizer/state/0/exp_avg"),
    ("scheduler/last_epoch", 1, False, "scheduler/last_epoch"),
    ("rng/torch", 0, False, "rank0/rng/torch"),  # every rank's own
    ("extras/best", 1, False, "rank1/extras/best"),
    ("sampler/seed", 1, False, "rank1/sampler/seed"),
    ("model/0.weight", 1, True, "rank1/model/0.weight"),  # sharded: every rank's own
    ("scaler/scale", 0, True, "rank0/scaler/scale"),
])
def test_entry_names_put_what_differs_per_rank_under_its_prefix(
        path: str, rank: int, sharded: bool, name: str) -> None:
    assert entry_name(path, rank, sharded) == name


@pytest.mark.parametrize(("name", "rank"), [
    ("model/rank3.weight", None), ("rank12/meta", 12), ("rank0/model/x", 0), ("ranks/x", None),
])
def test_rank_of_an_entry(name: str, rank: int | None) -> None:
    assert rank_of(name) == rank


NAMES = ["model/w", "optimizer/state/0/exp_avg", "rank0/meta", "rank0/packed",
         "rank0/extras/big", "rank1/meta", "rank1/packed", "rank1/extras/big",
         "rank1/model/w"]


@pytest.mark.parametrize(("rank", "sharded", "shared", "own"), [
    (0, False, ("rank0/", ["model/w", "optimizer/state/0/exp_avg", "rank0/meta",
                           "rank0/packed", "rank0/extras/big"]), None),
    (1, False, ("rank0/", ["model/w", "optimizer/state/0/exp_avg"]),
     ("rank1/", ["rank1/meta", "rank1/packed", "rank1/extras/big", "rank1/model/w"])),
    (1, True, ("rank1/", ["rank1/meta", "rank1/packed", "rank1/extras/big",
                          "rank1/model/w"]), None),
])
def test_each_rank_reads_only_the_entries_it_restores(
        rank: int, sharded: bool, shared: tuple[str, list[str]],
        own: tuple[str, list[str]] | None) -> None:
    """A DDP rank other than 0 reads rank 0's skeleton for the replicated state (its small
    tensors are in rank 0's "packed") but none of rank 0's own entries."""
    first, second = reads(rank, sharded)
    assert (first.prefix, [n for n in NAMES if first.wanted(n)]) == shared
    if own is None:
        assert second is first
    else:
        assert (second.prefix, [n for n in NAMES if second.wanted(n)]) == own


def part(rank: int, step: int = 4, *, full: bool = True, chain: int = 0) -> Manifest:
    entries: tuple[Entry, ...] = (
        Entry(name=f"rank{rank}/meta", kind="bytes", size=10 + rank, chunks=()),)
    if rank == 0:
        entries += (Entry(name="model/w", kind="tensor", size=100, chunks=()),)
    return Manifest(task_id="t", attempt=2, name=f"step-{step}", step=step, epoch=0,
                    cursor={"epoch": 0, "batch": step, "step": step}, entries=entries,
                    full=full, chain=chain, metadata={"format": FORMAT, "reason": "r"},
                    size_bytes=sum(e.size for e in entries), new_bytes=5 * (rank + 1))


def test_the_gang_manifest_holds_every_ranks_entries_and_its_layout() -> None:
    merged = merge([part(0, full=False, chain=3), part(1, full=True, chain=0)], sharded=False)
    assert [e.name for e in merged.entries] == ["rank0/meta", "model/w", "rank1/meta"]
    assert merged.metadata == {"format": FORMAT, "reason": "r", "ranks": "2",
                               "state": "replicated"}
    assert (merged.full, merged.chain) == (False, 3)  # a restore follows the longest chain
    assert (merged.size_bytes, merged.new_bytes) == (10 + 100 + 11, 5 + 10)
    assert (merged.task_id, merged.attempt, merged.step) == ("t", 2, 4)


@pytest.mark.parametrize(("parts", "error"), [
    ([part(0, step=4), part(1, step=6)], "different steps"),
    ([part(0), part(0)], "more than one rank"),
])
def test_parts_that_do_not_belong_together_are_not_merged(
        parts: list[Manifest], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        merge(parts, sharded=True)
    outcome = settle_commit([Part(msgspec.json.encode(p)) for p in parts], sharded=True)
    assert isinstance(outcome, Failed)
    assert error in outcome.error


def test_one_failed_part_fails_the_whole_checkpoint_naming_the_rank() -> None:
    outcome = settle_commit([Part(msgspec.json.encode(part(0))), Failed("disk full")],
                            sharded=False)
    assert outcome == Failed("rank 1: disk full")


def test_a_checkpoint_is_restored_only_by_as_many_ranks_as_wrote_it() -> None:
    gang = merge([part(0), part(1)], sharded=False)
    problem = layout_problem(gang, 4, sharded=False)
    assert "written by 2 ranks" in problem
    assert "this run has 4" in problem
    assert "resume with 2 ranks" in problem
    assert "written by 2 ranks; this run has 1" in layout_problem(gang, 1, sharded=False)
    assert "sharded=True" in layout_problem(gang, 2, sharded=True)
    assert layout_problem(gang, 2, sharded=False) == ""
    alone = part(0)  # written by one process: no layout recorded
    assert layout_problem(alone, 1, sharded=False) == ""
    assert "written by 1 rank; this run has 2" in layout_problem(alone, 2, sharded=False)


def test_a_single_process_refuses_a_gangs_checkpoint_with_both_sizes(tmp_path: Path) -> None:
    """No silent partial restore: the RestoreError names both sizes."""
    store = LocalStore(tmp_path / "store")
    store.commit(merge([part(0), part(1)], sharded=False))
    model = torch.nn.Linear(2, 2)
    ckpt = Checkpointer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        store=store, task_id="t", signal=False, stop_signal=False,
                        environ={"M27_CONFIG": str(tmp_path / "none")})
    with pytest.raises(RestoreError, match=r"written by 2 ranks; this run has 1"):
        ckpt.resume()
    ckpt.close()


# ------------------------------------------------------------------ agreement


@given(st.lists(st.builds(Vote, st.sampled_from([0, 1, 2]), st.booleans(),
                          st.sampled_from([0, 10, 15]),
                          st.integers(0, 10**6), st.integers(0, 10**6),
                          st.integers(0, 10**6)), min_size=1, max_size=8))
def test_the_gangs_vote_is_the_most_urgent_due_any_busy_the_highest_signal_and_the_steps(
        votes: list[Vote]) -> None:
    gang = combine(votes)
    assert gang == combine(list(reversed(votes)))
    assert gang.due == max(v.due for v in votes)
    assert gang.busy == any(v.busy for v in votes)
    assert gang.stop == max(v.stop for v in votes)
    assert (gang.low_step, gang.step) == (min(v.low_step for v in votes),
                                          max(v.step for v in votes))
    assert Vote.decode(gang.encode()) == gang


@pytest.mark.parametrize(("vote", "reason", "decision", "pending", "next_step", "urgent"), [
    (Vote(step=10, low_step=10, step_us=1000), "", Decision(False, ""), False, 110, False),
    (Vote(due=1, step=10, low_step=10, step_us=1000), "every 2 steps",
     Decision(True, "every 2 steps"), False, 110, False),
    (Vote(due=2, step=10, low_step=10), "", Decision(True, "due on another rank"), False, 11,
     True),
    (Vote(due=2, busy=True, step=10, low_step=10, step_us=1000), "signal SIGUSR1",
     Decision(False, "deferred (signal SIGUSR1): the previous checkpoint is in flight"),
     True, 11, True),
    (Vote(step=10, low_step=10, step_us=1), "", Decision(False, ""), False, 1010, False),
    (Vote(step=10, low_step=10, step_us=10**7), "", Decision(False, ""), False, 11, False),
])
def test_after_a_vote_every_rank_saves_defers_or_waits_alike(
        vote: Vote, reason: str, decision: Decision, pending: bool, next_step: int,
        urgent: bool) -> None:
    """(The next vote comes `every_s` of the slowest rank's step time later, 1 to
    `max_gap` steps; a request on any rank makes the save urgent on all.)"""
    agreed = settle(vote, reason=reason, step=10, every_s=0.1, max_gap=1000)
    assert (agreed.decision, agreed.pending, agreed.next_step, agreed.urgent, agreed.error) \
        == (decision, pending, next_step, urgent, "")


def test_a_stop_signal_on_one_rank_stops_every_rank() -> None:
    agreed = settle(combine([Vote(step=3, low_step=3), Vote(stop=15, step=3, low_step=3)]),
                    reason="", step=3)
    assert agreed.stop == 15


def test_ranks_at_different_steps_are_an_error_not_a_hang() -> None:
    agreed = settle(combine([Vote(step=3, low_step=3), Vote(step=4, low_step=4)]),
                    reason="", step=3)
    assert "different steps (3 to 4)" in agreed.error


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**32), st.sampled_from([None, 1, 3, 7]))
def test_ranks_with_their_own_triggers_and_commit_times_decide_alike_and_serve_requests(
        ranks: int, seed: int, every_steps: int | None) -> None:
    """Simulated gang: requests and step times differ per rank, commits end at different
    steps on each rank. At every step all ranks vote or not together and take the same
    decision, and a request is served within the gap once nothing is in flight."""
    rng = random.Random(seed)
    vote_at, pending, last_step = 0, False, 0
    inflight = [0] * ranks  # steps until this rank's commit returns
    asked: list[int | None] = [None] * ranks  # the step a request arrived at, per rank
    for step in range(1, 300):
        for r in range(ranks):
            inflight[r] = max(0, inflight[r] - 1)
            if asked[r] is None and rng.random() < 0.03:
                asked[r] = step
        due_here = step_due(every_steps, step, last_step)
        if not must_agree(step, next_step=vote_at, pending=pending, step_due=due_here):
            continue
        votes = [Vote(due=2 if asked[r] is not None else int(due_here), busy=inflight[r] > 0,
                      step=step, low_step=step, step_us=rng.randrange(500, 5000))
                 for r in range(ranks)]
        outcomes = {settle(combine(votes), reason="why" if votes[r].due else "", step=step)
                    for r in range(ranks)}
        assert len({(o.decision.save, o.pending, o.next_step) for o in outcomes}) == 1
        agreed = outcomes.pop()
        assert agreed.next_step - step <= 1000
        vote_at, pending = agreed.next_step, agreed.pending
        if any(a is not None for a in asked) and not any(inflight):
            assert agreed.decision.save  # a request is served at the first free vote
        if agreed.decision.save:
            assert not any(inflight)  # never two checkpoints in flight on a rank
            last_step = step
            asked = [None] * ranks
            inflight = [rng.randrange(1, 6) for _ in range(ranks)]
        elif any(a is not None for a in asked) or due_here:
            assert agreed.pending  # it waits for the one in flight, voting every step
