"""Notification rules: parsing (with errors that say where), matching and routing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.notifications import (
    CLUSTER_KINDS,
    DEFAULT_KINDS,
    NOTICE_KINDS,
    RUN_ENDS,
    Delivery,
    Notice,
    Rule,
    Subscription,
    button_data,
    kinds_of,
    matches,
    notice_buttons,
    parse_rules,
    read_button,
    route,
)


def notice(kind: str = "run_failed", user: str = "alice", run_id: str = "r-1") -> Notice:
    return Notice(id="n1", kind=kind, text="t", at=0.0, user=user,  # type: ignore[arg-type]
                  run_id=run_id)


@pytest.mark.parametrize(("text", "expected"), [
    ("run_failed -> webhook", [Rule(kinds=("run_failed",), channel="webhook")]),
    ("run_ended user=alice,bob -> email:a@lab.example",
     [Rule(kinds=RUN_ENDS, channel="email", target="a@lab.example", users=("alice", "bob"))]),
    ("training_anomaly run=sweep-* -> telegram:-100123, webhook",
     [Rule(kinds=("training_anomaly",), channel="telegram", target="-100123",
           runs=("sweep-*",)),
      Rule(kinds=("training_anomaly",), channel="webhook", runs=("sweep-*",))]),
    ("-> webhook", [Rule(kinds=DEFAULT_KINDS, channel="webhook")]),
    ("all -> webhook:https://hooks.example/x?k=1",
     [Rule(kinds=NOTICE_KINDS, channel="webhook", target="https://hooks.example/x?k=1")]),
    ("run_failed -> webhook\n\n  ; node_lost -> email", [
        Rule(kinds=("run_failed",), channel="webhook"),
        Rule(kinds=("node_lost",), channel="email")]),
    ("", []),
])
def test_rules_parse(text: str, expected: list[Rule]) -> None:
    assert list(parse_rules(text)) == expected


@pytest.mark.parametrize(("text", "says"), [
    ("run_failed webhook", "rule 1 ('run_failed webhook'): expected `KINDS"),
    ("run_faild -> webhook", "unknown notification kind 'run_faild'"),
    ("run_failed -> sms:123", "unknown channel 'sms'"),
    ("run_failed -> ", "no channel after `->`"),
    ("run_failed -> email:not-an-address", "is not an e-mail address"),
    ("run_failed -> telegram:@alice", "is not a Telegram chat id"),
    ("run_failed -> webhook:ftp://x", "a webhook target is an http(s) URL"),
    ("run_failed colour=red -> webhook", "unknown filter 'colour'"),
    ("run_failed user= -> webhook", "user= names nobody"),
    ("run_failed user=a;b -> webhook", "rule 1"),
    ("run_failed user=$(rm) -> webhook", "is not a valid user name"),
    ("x -> webhook\n" * 1, "rule 1"),
])
def test_a_bad_rule_is_named_with_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="rule") as caught:
        parse_rules(text)
    assert says in str(caught.value)


def test_too_many_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="more than 200 rules"):
        parse_rules("run_failed -> webhook\n" * 201)


@given(st.text(max_size=400))
def test_any_text_parses_or_fails_with_a_value_error(text: str) -> None:
    try:
        rules = parse_rules(text)
    except ValueError as exc:
        problem = str(exc)
        rules = ()
    else:
        problem = "(none)"
    assert problem
    for rule in rules:
        assert rule.kinds
        assert set(rule.kinds) <= set(NOTICE_KINDS)


def test_aliases_expand_in_order_without_repeats() -> None:
    assert kinds_of(["run_failed", "run_ended"], "here") == (
        "run_failed", "run_succeeded", "run_cancelled")


def test_a_user_rule_sees_only_that_users_runs_but_every_cluster_notice() -> None:
    rule = Rule(kinds=NOTICE_KINDS, channel="webhook", users=("alice",))
    assert matches(rule, notice(user="alice"))
    assert not matches(rule, notice(user="bob"))
    for kind in CLUSTER_KINDS:
        assert matches(rule, notice(kind=kind, user="", run_id=""))
    runs_only = Rule(kinds=NOTICE_KINDS, channel="webhook", runs=("sweep-*",))
    assert matches(runs_only, notice(run_id="sweep-3"))
    assert not matches(runs_only, notice(run_id="r-3"))
    assert not matches(runs_only, notice(kind="node_lost", run_id=""))


def test_a_subscription_is_its_users_rule() -> None:
    sub = Subscription(channel="telegram", target="42", user="alice")
    assert matches(sub.rule(), notice(kind="run_succeeded", user="alice"))
    assert not matches(sub.rule(), notice(kind="run_succeeded", user="bob"))
    assert not matches(sub.rule(), notice(kind="task_waiting", user="alice"))  # not default


rules = st.builds(
    Rule, kinds=st.lists(st.sampled_from(NOTICE_KINDS), min_size=1, unique=True).map(tuple),
    channel=st.sampled_from(("webhook", "email", "telegram")),
    target=st.sampled_from(("", "a", "b")), users=st.sampled_from(((), ("alice",), ("bob",))),
    runs=st.sampled_from(((), ("r-*",), ("x",))))


@given(st.lists(rules, max_size=8), st.sampled_from(NOTICE_KINDS),
       st.sampled_from(("alice", "bob", "")), st.sampled_from(("r-1", "x", "")))
def test_a_notice_goes_to_each_place_once_and_only_where_a_rule_sends_it(
        chosen: list[Rule], kind: str, user: str, run_id: str) -> None:
    n = notice(kind=kind, user=user, run_id=run_id)
    defaults = {"webhook": ("https://default",), "email": ("d@x.y",), "telegram": ()}
    places = route(n, chosen, defaults)  # type: ignore[arg-type]
    assert len({p.key for p in places}) == len(places)
    expected = set()
    for rule in chosen:
        if matches(rule, n):
            for target in (rule.target,) if rule.target else defaults[rule.channel]:
                expected.add(Delivery(channel=rule.channel, target=target).key)
    assert {p.key for p in places} == expected


@given(st.sampled_from(("status", "cancel", "retry", "report")),
       st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,60}", fullmatch=True))
def test_a_buttons_data_reads_back_and_fits_telegrams_64_bytes(action: str, run_id: str) -> None:
    data = button_data(action, run_id)  # type: ignore[arg-type]
    assert read_button(data) == (action, run_id)
    assert len(data.encode()) <= 64


@pytest.mark.parametrize("data", ["", "report", "delete:r-1", "report:", "report:a b",
                                  "report:../x", "status:" + "r" * 80])
def test_anything_else_is_no_button(data: str) -> None:
    assert read_button(data) is None


def test_a_failed_run_offers_its_report_and_a_retry_and_a_cluster_notice_nothing() -> None:
    assert notice_buttons(notice(kind="run_failed")) == (
        ("Report", "report:r-1"), ("Retry", "retry:r-1"))
    assert notice_buttons(notice(kind="run_succeeded")) == (("Report", "report:r-1"),)
    assert notice_buttons(notice(kind="training_anomaly")) == (
        ("Status", "status:r-1"), ("Cancel", "cancel:r-1"))
    assert notice_buttons(notice(kind="node_lost", run_id="")) == ()
