"""When to checkpoint and what kind to write: pure decisions, table-driven."""

from __future__ import annotations

import pytest

from m27.train._policy import Decision, Kind, Policy, decide, delta_pays, next_kind

EVERY_10 = Policy(every_steps=10)
EVERY_60S = Policy(every_seconds=60)


@pytest.mark.parametrize(("policy", "step", "now", "requests", "busy", "expected"), [
    (EVERY_10, 5, 0.0, (), False, Decision(False, "")),
    (EVERY_10, 10, 0.0, (), False, Decision(True, "every 10 steps")),
    (EVERY_10, 10, 0.0, (), True,
     Decision(False, "deferred (every 10 steps): the previous checkpoint is in flight")),
    (EVERY_60S, 1, 59.0, (), False, Decision(False, "")),
    (EVERY_60S, 1, 60.0, (), False, Decision(True, "every 60 s")),
    (Policy(), 1000, 1e9, (), False, Decision(False, "")),
    (Policy(), 1, 0.0, ("loss spike", "loss spike", "signal SIGUSR1"), False,
     Decision(True, "loss spike, signal SIGUSR1")),
])
def test_decide(policy: Policy, step: int, now: float, requests: tuple[str, ...], busy: bool,
                expected: Decision) -> None:
    assert decide(policy, step=step, now=now, last_step=0, last_time=0.0, requests=requests,
                  busy=busy) == expected


@pytest.mark.parametrize(("previous", "force", "expected"), [
    (None, False, Kind(full=True, chain=0)),
    (0, False, Kind(full=False, chain=1)),
    (8, False, Kind(full=False, chain=9)),
    (9, False, Kind(full=True, chain=0)),
    (3, True, Kind(full=True, chain=0)),
])
def test_every_tenth_checkpoint_is_full(previous: int | None, force: bool, expected: Kind
                                        ) -> None:
    assert next_kind(previous, 10, force_full=force) == expected


def test_a_delta_pays_only_when_clearly_smaller_than_plain() -> None:
    assert delta_pays(60, None)
    assert delta_pays(60, 100)
    assert not delta_pays(95, 100)
