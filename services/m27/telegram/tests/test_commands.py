"""What a chat message asks for (`commands.decide`): commands and their arguments, the
allow list applied first, and every malformed message answered with a sentence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common.notifications import DEFAULT_KINDS, RUN_ENDS
from m27.telegram.allow import AllowList
from m27.telegram.commands import (
    MAX_DOCUMENT_BYTES,
    Act,
    Document,
    Help,
    Incoming,
    Nodes,
    OnRun,
    Queue,
    Refuse,
    Runs,
    Say,
    Submit,
    Subscribe,
    Unsubscribe,
    decide,
    decode_pipeline,
    parse,
    safe_file_name,
    unfence,
)

RUN = "r-20261201-081500-a1b2c3"
ALLOW = AllowList(users={42: "alice"})
YAML = "pipeline:\n  - name: a\n    command: echo {{X}}\n"


def doc(name: str = "p.yaml", size: int | None = 100) -> Document:
    return Document(file_id="f1", file_name=name, file_size=size)


@pytest.mark.parametrize(("message", "expected"), [
    ("/help", Help()),
    ("/start", Help(start=True)),
    ("/HELP", Help()),
    ("/help@m27_bot", Help()),
    ("/runs", Runs()),
    ("/runs 5", Runs(limit=5)),
    (f"/status {RUN}", OnRun(action="status", run_id=RUN)),
    (f"  /cancel   {RUN} ", OnRun(action="cancel", run_id=RUN)),
    (f"/retry {RUN}", OnRun(action="retry", run_id=RUN)),
    (f"/report@m27_bot {RUN}", OnRun(action="report", run_id=RUN)),
    ("/nodes", Nodes()),
    ("/queue", Queue()),
    ("/unsubscribe", Unsubscribe()),
    ("/subscribe", Subscribe(kinds=DEFAULT_KINDS)),
    ("/subscribe run_ended node_lost",
     Subscribe(kinds=(*RUN_ENDS, "node_lost"))),
    ("/subscribe run_failed run=sweep-*,r-2026*",
     Subscribe(kinds=("run_failed",), runs=("sweep-*", "r-2026*"))),
    (f"/submit X=1 Y='a b'\n{YAML}",
     Submit(variables={"X": "1", "Y": "a b"}, pipeline=YAML.rstrip("\n"))),
    (f"/submit\n```yaml\n{YAML}```", Submit(variables={}, pipeline=YAML.rstrip("\n"))),
    (f"/submit --no-cache\n{YAML}",
     Submit(variables={}, pipeline=YAML.rstrip("\n"), no_cache=True)),
])
def test_commands_and_their_arguments(message: str, expected: object) -> None:
    assert parse(message, bot_username="m27_bot") == expected


@pytest.mark.parametrize(("message", "said"), [
    ("/status", "needs one run id"),
    ("/status a b", "needs one run id"),
    ("/status r-1", "Not a run id: 'r-1'"),
    ("/runs 0", "/runs takes at most one number"),
    ("/runs many", "/runs takes at most one number"),
    ("/nodes now", "/nodes takes no arguments"),
    ("/frobnicate", "Unknown command /frobnicate"),
    ("/subscribe everything", "unknown notification kind 'everything'"),
    ("/subscribe user=bob", "unknown filter 'user'"),
    ("/subscribe run=a/b", "/subscribe: run='a/b' is not a valid run name"),
    ("/submit", "/submit needs a pipeline"),
    ("/submit X=1", "/submit needs a pipeline"),
    (f"/submit 1X=2\n{YAML}", "expected NAME=VALUE, got '1X=2'"),
    (f"/submit X\n{YAML}", "expected NAME=VALUE, got 'X'"),
    (f"/submit X='a\n{YAML}", "cannot read the arguments"),
])
def test_malformed_commands_get_a_sentence(message: str, said: str) -> None:
    answer = parse(message)
    assert isinstance(answer, str)
    assert said in answer


def test_no_command_is_none_and_another_bots_command_is_not_ours() -> None:
    assert parse("hello") is None
    assert parse("/help@other_bot", bot_username="m27_bot") is None
    assert parse("/helpme") == "Unknown command /helpme; send /help for what I understand."


def test_a_document_goes_with_submit_only_and_within_its_size() -> None:
    assert parse("/submit SEED=3", doc("my pipe.yaml")) == Submit(
        variables={"SEED": "3"}, document=doc("my pipe.yaml"), source_name="my_pipe.yaml")
    assert parse("/submit", doc(size=None)) == Submit(variables={}, document=doc(size=None),
                                                     source_name="p.yaml")
    assert "with /submit as its caption" in str(parse("", doc()))
    assert "takes no file" in str(parse("/status", doc()))
    too_big = parse("/submit", doc(size=MAX_DOCUMENT_BYTES + 1))
    assert isinstance(too_big, str)
    assert "may be at most 1024 KiB" in too_big
    assert "not both" in str(parse(f"/submit\n{YAML}", doc()))


def test_decide_refuses_strangers_before_reading_anything() -> None:
    stranger = decide(Incoming(user_id=7, chat_id=7, text=f"/cancel {RUN}"), ALLOW)
    assert isinstance(stranger, Refuse)
    assert "Telegram id 7" in stranger.text
    assert RUN not in stranger.text
    button = decide(Incoming(user_id=7, chat_id=7, text=f"cancel:{RUN}", button=True), ALLOW)
    assert isinstance(button, Refuse)


def test_decide_acts_as_the_allowed_user_only() -> None:
    decision = decide(Incoming(user_id=42, chat_id=-100, text=f"/status {RUN}"), ALLOW)
    assert decision == Act(user="alice", command=OnRun(action="status", run_id=RUN))
    assert decide(Incoming(user_id=42, chat_id=42, text=f"report:{RUN}", button=True),
                  ALLOW) == Act(user="alice", command=OnRun(action="report", run_id=RUN))
    assert isinstance(decide(Incoming(user_id=42, chat_id=42, text="retry:x", button=True),
                             ALLOW), Say)
    assert isinstance(decide(Incoming(user_id=42, chat_id=42, text="hi"), ALLOW), Say)


@given(st.text(max_size=500), st.booleans(), st.integers(-(2**40), 2**40))
def test_any_message_is_decided_without_raising(message: str, button: bool,
                                                user_id: int) -> None:
    decision = decide(Incoming(user_id=user_id, chat_id=1, text=message, button=button),
                      AllowList(users={user_id: "alice"} if user_id > 0 else {}))
    assert isinstance(decision, Refuse | Say | Act)
    if user_id <= 0:
        assert isinstance(decision, Refuse)


def test_pasted_code_blocks_and_file_names() -> None:
    assert unfence("```\na: 1\n```") == "a: 1"
    assert unfence("```yaml\na: 1\n```") == "a: 1"
    assert unfence("a: 1") == "a: 1"
    assert safe_file_name("../../etc/passwd") == "passwd"
    assert safe_file_name("ä b\n.yaml") == "b_.yaml"
    assert safe_file_name("") == "pipeline.yaml"


def test_documents_are_decoded_as_utf8_or_said_what_they_are() -> None:
    assert decode_pipeline("a: ü\n".encode(), "p.yaml") == "a: ü\n"
    with pytest.raises(ValueError, match=r"p.yaml: not UTF-8 text \(byte 3\)"):
        decode_pipeline(b"a: \xff", "p.yaml")
    with pytest.raises(ValueError, match="larger than 1024 KiB"):
        decode_pipeline(b"a" * (MAX_DOCUMENT_BYTES + 1), "p.yaml")
