"""The agent's ledger: what survives a restart, and how orphans are reported."""

from __future__ import annotations

from pathlib import Path

from m27.node_agent._ledger import (
    MAX_SEEN,
    LedgerState,
    LedgerTask,
    ledger_path,
    load,
    orphan_exit,
    remember,
    save,
)

ENTRY = LedgerTask(task_id="r-20250101-120000-abcdef/train", run_id="r-20250101-120000-abcdef",
                   step="train", attempt=1, pid=4242, started_at=10.0,
                   stdout_path="/x/train.1.out", stderr_path="/x/train.1.err")


def test_save_then_load_round_trips(tmp_path: Path) -> None:
    path = ledger_path(tmp_path, "n1")
    state = LedgerState(node_id="n1", seen={"a/b": 2}, running=(ENTRY,))
    save(path, state)
    assert load(path, "n1") == state
    assert not list(path.parent.glob(".*.tmp"))


def test_missing_corrupt_or_foreign_ledgers_start_empty(tmp_path: Path) -> None:
    path = ledger_path(tmp_path, "n1")
    assert load(path, "n1") == LedgerState(node_id="n1")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert load(path, "n1") == LedgerState(node_id="n1")
    save(path, LedgerState(node_id="n2", seen={"a/b": 1}))
    assert load(path, "n1") == LedgerState(node_id="n1")


def test_remember_keeps_the_newest_attempts_and_forgets_the_oldest() -> None:
    seen: dict[str, int] = {}
    remember(seen, "t0", 1)
    for i in range(1, MAX_SEEN + 5):
        remember(seen, f"t{i}", 1)
    remember(seen, "t6", 3)
    assert len(seen) == MAX_SEEN
    assert "t0" not in seen
    assert seen["t6"] == 3
    assert list(seen)[-1] == "t6"


def test_orphan_that_was_killed_reads_as_sigkill() -> None:
    event = orphan_exit(ENTRY, "n1", killed=2, now=99.0, stderr_tail="boom")
    assert (event.exit_code, event.signal, event.started) == (137, 9, True)
    assert "restarted" in event.reason
    assert event.stderr_tail == "boom"
    assert event.started_at == 10.0


def test_orphan_that_ended_unseen_has_an_unknown_status() -> None:
    event = orphan_exit(ENTRY, "n1", killed=0, now=99.0)
    assert event.exit_code is None
    assert event.signal is None
    assert "unknown" in event.reason
