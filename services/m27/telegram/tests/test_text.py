"""What the bot says: within Telegram's limits (counted in UTF-16 units, as Telegram
counts), a monospaced block placed by offset (no markup to escape), runs and plans
shown as on a phone."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from m27.client import RunSummary
from m27.common.model import RunRecord, StepRecord
from m27.common.notifications import Subscription
from m27.telegram import text
from m27.telegram.text import CUT_MARK, MESSAGE_LIMIT, compose, cut, utf16_len

RUN = "r-20261201-081500-a1b2c3"


def test_cut_keeps_short_text_and_marks_what_it_cut() -> None:
    assert cut("hello", 10) == "hello"
    assert cut("x" * 20, 10) == "xx" + CUT_MARK
    assert utf16_len(cut("😀" * 3000, MESSAGE_LIMIT)) <= MESSAGE_LIMIT  # 2 units each


@given(st.text(max_size=9000), st.text(max_size=9000))
def test_a_composed_message_always_fits_and_its_block_is_where_it_says(
        head: str, block: str) -> None:
    message = compose(head, block)
    assert 0 < utf16_len(message.text) <= MESSAGE_LIMIT
    if message.pre is not None:
        start, length = message.pre
        encoded = message.text.encode("utf-16-le")
        inside = encoded[2 * start:2 * (start + length)].decode("utf-16-le")
        assert inside.strip("\n") == inside
        assert start + length == utf16_len(message.text)


def test_markup_in_user_text_stays_plain_text() -> None:
    message = compose("<b>*run*</b> _x_ [a](http://e)", "`code` <i>")
    assert message.text.startswith("<b>*run*</b> _x_ [a](http://e)\n`code` <i>")


def step(name: str, state: str, **more: object) -> StepRecord:
    return StepRecord(name=name, type="cpu", command="true", state=state,  # type: ignore[arg-type]
                      **more)  # type: ignore[arg-type]


def test_a_run_status_lists_its_steps() -> None:
    run = RunRecord(run_id=RUN, name="md", user="alice", urgency="normal", state="failed",
                    created_at=100.0, ended_at=160.0, reason="step b failed", steps=(
                        step("a", "succeeded", node_id="node-1", started_at=101.0,
                             ended_at=111.0),
                        step("b", "failed", exit_code=3, attempt=2)))
    message = text.status_text(run, now=200.0)
    assert message.text.splitlines()[:2] == [f"❌ {RUN} (md) by alice: failed — 1m00s",
                                             "step b failed"]
    assert "a: succeeded on node-1 10s" in message.text
    assert "b: failed exit 3 (attempt 2)" in message.text
    assert text.run_buttons(RUN, ended=True) == (("Status", f"status:{RUN}"),
                                                 ("Report", f"report:{RUN}"))
    assert ("Cancel", f"cancel:{RUN}") in text.run_buttons(RUN, ended=False)


def test_runs_submitted_and_rejected() -> None:
    summary = RunSummary(run_id=RUN, name="md", user="alice", state="running",
                         created_at=100.0, ended_at=None, steps_total=3, steps_succeeded=1,
                         steps_failed=0)
    assert text.runs_text([summary], "alice", now=160.0) == (
        f"Recent runs of alice:\n▶ {RUN} md — running, 1/3 steps, 1m00s ago")
    assert "no runs yet" in text.runs_text([], "alice", now=0.0)
    submitted = text.submitted_text(RUN, "plan for md: 1 steps")
    assert submitted.text == f"Submitted: {RUN}\n/status {RUN}\nplan for md: 1 steps"
    rejected = text.rejected_text("bad.yaml: 1 problem:\n  bad.yaml:3:5: unknown key")
    assert rejected.text.endswith("m27: bad.yaml: 1 problem:\n  bad.yaml:3:5: unknown key")


def test_subscriptions_and_failures_are_one_line() -> None:
    sub = Subscription(channel="telegram", target="42", user="alice",
                       kinds=("run_failed",), runs=("sweep-*",))
    assert text.subscribed_text(sub) == (
        "This chat now gets notices about alice's runs of runs matching sweep-*: "
        "run_failed. /unsubscribe stops them.")
    assert text.failed_text("cannot reach X\ntraceback…", down=True) == (
        "m27 cannot be reached right now (cannot reach X); try again in a minute.")
    assert text.failed_text("", down=False) == "no details"
    assert "Telegram id 5" in text.refusal(5)
