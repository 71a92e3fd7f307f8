"""The supervisor's restart policy (pure): backoff that doubles up to a cap, starts over
after a stable run, and gives up on a crash loop — never restarting for ever in silence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.embedded.restarts import History, RestartPolicy, decide, describe_exit, duration

DEFAULT = RestartPolicy()


def run(policy: RestartPolicy, uptimes: list[float], gaps: list[float] | None = None
        ) -> list[tuple[bool, float]]:
    """A process that stays up `uptimes[i]` after each start; the supervisor starts it
    again when told, `gaps[i]` later still (default: at once). (restart?, delay) of each
    exit, until it is given up on."""
    return [(restart, delay) for _, restart, delay in timeline(policy, uptimes, gaps)]


def timeline(policy: RestartPolicy, uptimes: list[float], gaps: list[float] | None = None
             ) -> list[tuple[float, bool, float]]:
    """`run`, with how long each start stayed up as the policy saw it (`now - started_at`
    in floating point, which may differ from `uptimes[i]` in the last bits)."""
    history, now, decisions = History(), 0.0, []
    for i, up in enumerate(uptimes):
        started, now = now, now + up
        history, decision = decide(policy, history, started_at=started, now=now)
        decisions.append((now - started, decision.restart, decision.delay))
        if not decision.restart:
            break
        now = decision.at + (gaps[i] if gaps else 0.0)
    return decisions


def test_quick_exits_back_off_1_2_4_then_it_gives_up_at_the_fifth() -> None:
    assert run(DEFAULT, [0.5] * 6) == [(True, 1.0), (True, 2.0), (True, 4.0), (True, 8.0),
                                       (False, 0.0)]


def test_the_backoff_is_capped() -> None:
    never = RestartPolicy(give_up_after=0)
    assert [delay for _, delay in run(never, [0.1] * 9)] == [1, 2, 4, 8, 16, 30, 30, 30, 30]


def test_an_exit_after_a_stable_run_starts_over_at_the_first_backoff() -> None:
    policy = RestartPolicy(give_up_after=0)
    assert [delay for _, delay in run(policy, [1, 1, 1, 120, 1, 1])] == [1, 2, 4, 1, 2, 4]


def test_exits_spread_wider_than_the_window_never_give_up() -> None:
    policy = RestartPolicy(stable_after=1000.0)  # never stable: the backoff reaches its cap
    decisions = run(policy, [200.0] * 20)
    assert all(restart for restart, _ in decisions)
    assert len(decisions) == 20


def test_the_reason_says_what_was_decided() -> None:
    history, first = decide(DEFAULT, History(), started_at=0.0, now=3.0)
    assert first.reason == "restart in 1s (exit 1 within 10m)"
    assert (first.at, first.delay) == (4.0, 1.0)
    policy = RestartPolicy(give_up_after=2)
    _, last = decide(policy, history, started_at=4.0, now=5.0)
    assert last.reason == "gave up after 2 exits within 10m"
    assert not last.restart


@pytest.mark.parametrize(("code", "text"), [
    (-9, "SIGKILL"), (-15, "SIGTERM"), (-11, "SIGSEGV"), (0, "exit code 0"),
    (2, "exit code 2"), (None, "exited"), (-200, "signal 200")])
def test_an_exit_is_described_by_its_signal_or_code(code: int | None, text: str) -> None:
    assert describe_exit(code) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (0.2, "0.2s"), (1.0, "1s"), (30.0, "30s"), (59.5, "59.5s"), (60.0, "1m"),
    (600.0, "10m"), (90.0, "1m30s"), (5400.0, "1h30m")])
def test_durations_are_short(seconds: float, text: str) -> None:
    assert duration(seconds) == text


policies = st.builds(
    RestartPolicy,
    restart_backoff=st.floats(0.0, 100.0),
    restart_backoff_max=st.floats(0.0, 1000.0),
    stable_after=st.floats(0.0, 1000.0),
    give_up_after=st.integers(0, 10),
    give_up_window=st.floats(0.0, 10_000.0))
uptimes = st.lists(st.floats(0.0, 2000.0), min_size=1, max_size=60)


@given(policies, uptimes, st.lists(st.floats(0.0, 500.0), min_size=60, max_size=60))
def test_every_delay_lies_between_the_first_backoff_and_the_cap(
        policy: RestartPolicy, ups: list[float], gaps: list[float]) -> None:
    for restart, delay in run(policy, ups, gaps):
        if restart:
            low = min(policy.restart_backoff, policy.restart_backoff_max)
            assert low <= delay <= policy.restart_backoff_max


@given(policies, uptimes, st.lists(st.floats(0.0, 500.0), min_size=60, max_size=60))
def test_it_gives_up_exactly_when_the_window_holds_too_many_exits(
        policy: RestartPolicy, ups: list[float], gaps: list[float]) -> None:
    history, now, exits = History(), 0.0, []
    for up, gap in zip(ups, gaps, strict=False):
        started, now = now, now + up
        exits.append(now)
        history, decision = decide(policy, history, started_at=started, now=now)
        # the earlier exits less than the window ago, and this one
        recent = [*(t for t in exits[:-1] if now - t < policy.give_up_window), now]
        too_many = policy.give_up_after > 0 and len(recent) >= policy.give_up_after
        assert decision.restart is not too_many
        assert history.exits == tuple(recent)  # the window's exits, oldest first
        if not decision.restart:
            assert decision.reason.startswith("gave up after ")
            break
        assert decision.at == now + decision.delay
        now = decision.at + gap


@given(policies, st.lists(st.floats(0.0, 2000.0), min_size=2, max_size=30))
def test_quick_exits_never_shorten_the_backoff_and_a_stable_run_resets_it(
        policy: RestartPolicy, ups: list[float]) -> None:
    policy = RestartPolicy(restart_backoff=policy.restart_backoff,
                           restart_backoff_max=policy.restart_backoff_max,
                           stable_after=policy.stable_after, give_up_after=0)
    first = min(policy.restart_backoff, policy.restart_backoff_max)
    seen = timeline(policy, ups)
    for i, (up, _, delay) in enumerate(seen):
        if up >= policy.stable_after:
            assert delay == first
        elif i > 0:
            assert delay >= seen[i - 1][2]
