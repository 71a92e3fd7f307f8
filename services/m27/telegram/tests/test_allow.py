"""The allow list: who may use the bot, as whom; hostile input is refused with a reason,
never a crash, and never lets anyone in by accident."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.tokens import USER_NAME
from m27.telegram.allow import MAX_ENTRIES, AllowList, parse_allowed


@pytest.mark.parametrize(("text", "expected"), [
    ("", {}),
    ("123456789:alice", {123456789: "alice"}),
    (" 1:alice , 2:bob.smith@lab ", {1: "alice", 2: "bob.smith@lab"}),
    ("1:alice;2:bob\n3:carol", {1: "alice", 2: "bob", 3: "carol"}),
    ("1:alice,1:alice", {1: "alice"}),
])
def test_entries_map_telegram_ids_to_m27_users(text: str, expected: dict[int, str]) -> None:
    allow = parse_allowed(text)
    assert allow.users == expected
    assert all(allow.user_of(k) == v for k, v in expected.items())
    assert allow.user_of(999) is None


@pytest.mark.parametrize(("text", "said"), [
    ("alice", "expected <telegram user id>:<m27 user>"),
    ("abc:alice", "is not a Telegram user id"),
    ("-5:alice", "is not a Telegram user id"),
    ("0:alice", "is not a Telegram user id"),
    ("12345678901234567890:alice", "is not a Telegram user id"),
    ("1:", "is not an m27 user name"),
    ("1:al ice", "expected <telegram user id>"),  # a blank separates entries
    ("1:a/b", "is not an m27 user name"),
    ("1:alice,1:bob", "listed as both 'alice' and 'bob'"),
    ("１:alice", "is not a Telegram user id"),  # a full-width digit
])
def test_malformed_entries_are_refused_with_the_reason(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_allowed(text)


def test_too_many_entries_are_refused() -> None:
    with pytest.raises(ValueError, match="more than"):
        parse_allowed(",".join(f"{i}:u{i}" for i in range(1, MAX_ENTRIES + 2)))


@given(st.text(max_size=300))
def test_any_text_parses_or_is_refused_with_a_value_error(text: str) -> None:
    try:
        allow = parse_allowed(text)
    except ValueError as exc:
        said = str(exc)
    else:
        said = ""
    assert len(said) < 400  # hostile input is not echoed at length
    if said:
        return
    for telegram_id, user in allow.users.items():
        assert telegram_id > 0
        assert USER_NAME.fullmatch(user)
        assert f"{telegram_id}:{user}" in text


@given(st.dictionaries(st.integers(1, 2**52), st.from_regex(USER_NAME, fullmatch=True),
                       max_size=20))
def test_a_written_list_reads_back_the_same(users: dict[int, str]) -> None:
    text = ", ".join(f"{k}:{v}" for k, v in users.items())
    assert parse_allowed(text) == AllowList(users=users)
