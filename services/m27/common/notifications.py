"""Notifications: what can be notified, the rules that route it, a chat's subscription.

The contract between whoever subscribes (`~/.m2config`'s `[notify] rules`, the Telegram
bot's `/subscribe`) and the report service's notifier (`m27.report.notify`). Pure.

A rule reads `KINDS [user=A,B] [run=GLOB,GLOB] -> CHANNEL[:TO], ...`:

    run_failed run_cancelled -> webhook
    training_anomaly user=alice -> email:alice@lab.example
    run_ended run=sweep-* -> telegram:123456789

KINDS are `NOTICE_KINDS`, or `run_ended` (succeeded, failed, cancelled), or `all`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Final, Literal, get_args

import msgspec

NoticeKind = Literal["run_succeeded", "run_failed", "run_cancelled", "training_anomaly",
                     "node_lost", "task_waiting", "gpu_hot", "gpu_memory_leak",
                     "node_platform", "node_maintenance"]
NOTICE_KINDS: Final[tuple[NoticeKind, ...]] = get_args(NoticeKind)
RUN_ENDS: Final[tuple[NoticeKind, ...]] = ("run_succeeded", "run_failed", "run_cancelled")
#: Names that stand for several kinds.
ALIASES: Final[dict[str, tuple[NoticeKind, ...]]] = {"run_ended": RUN_ENDS,
                                                     "all": NOTICE_KINDS}
#: What a rule or subscription with no kinds named gets.
DEFAULT_KINDS: Final[tuple[NoticeKind, ...]] = (*RUN_ENDS, "training_anomaly", "node_lost",
                                                "gpu_memory_leak", "node_platform",
                                                "node_maintenance")
#: Kinds about the cluster, not one user's run (`matches`).
CLUSTER_KINDS: Final[frozenset[NoticeKind]] = frozenset({"node_lost", "gpu_hot",
                                                         "node_platform",
                                                         "node_maintenance"})

ChannelKind = Literal["webhook", "email", "telegram"]
CHANNELS: Final[tuple[ChannelKind, ...]] = get_args(ChannelKind)

MAX_RULES: Final = 200
MAX_PATTERNS: Final = 50
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+-]{0,127}")
_GLOB: Final = re.compile(r"[A-Za-z0-9_.*?\[\]!-]{1,128}")


class Rule(msgspec.Struct, frozen=True, kw_only=True):
    """Notices of `kinds` (for runs of `users`, matching `runs`; empty: any) go to
    `channel`, at `target` (empty: the channel's configured default)."""

    kinds: tuple[NoticeKind, ...]
    channel: ChannelKind
    target: str = ""
    users: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()


class Subscription(msgspec.Struct, frozen=True, kw_only=True):
    """One chat's subscription (`subjects.SUBSCRIPTIONS_BUCKET`, key
    `subjects.subscription_key(channel, target)`): notices of `kinds` about the runs of
    `user` (the m27 user the chat is allowed as), or only those of `runs` (globs)."""

    channel: ChannelKind
    target: str  # a Telegram chat id
    user: str
    kinds: tuple[NoticeKind, ...] = DEFAULT_KINDS
    runs: tuple[str, ...] = ()
    created_at: float = 0.0

    def rule(self) -> Rule:
        return Rule(kinds=self.kinds, channel=self.channel, target=self.target,
                    users=(self.user,), runs=self.runs)


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """One thing worth telling someone, before it is routed. `id` is the same for the
    same happening however often its event is delivered or repeated: deliveries are
    deduplicated on it."""

    id: str
    kind: NoticeKind
    text: str
    at: float
    run_id: str = ""
    user: str = ""
    state: str = ""
    step: str = ""
    node_id: str = ""
    duration_s: float | None = None
    metrics: dict[str, float] = {}
    link: str = ""


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """One notice to one place."""

    channel: ChannelKind
    target: str

    @property
    def key(self) -> str:
        return f"{self.channel}:{self.target}"


def kinds_of(words: Iterable[str], where: str) -> tuple[NoticeKind, ...]:
    """Notice kinds from names and aliases, in order, without repeats; ValueError names
    the unknown one and `where` it was."""
    found: list[NoticeKind] = []
    for word in words:
        expanded = ALIASES.get(word) or ((word,) if word in NOTICE_KINDS else None)
        if expanded is None:
            raise ValueError(f"{where}: unknown notification kind {word!r} (known: "
                             f"{', '.join((*NOTICE_KINDS, *ALIASES))})")
        found.extend(kind for kind in expanded if kind not in found)
    return tuple(found)


def parse_rules(text: str) -> tuple[Rule, ...]:
    """`[notify] rules` → rules; ValueError naming the rule (by number) and what is wrong."""
    rules: list[Rule] = []
    lines = [line.strip() for line in re.split(r"[;\n]", text)]
    for number, line in enumerate((line for line in lines if line), start=1):
        if number > MAX_RULES:
            raise ValueError(f"more than {MAX_RULES} rules")
        rules.extend(_parse_rule(line, f"rule {number} ({line[:60]!r})"))
    return tuple(rules)


def _parse_rule(line: str, where: str) -> list[Rule]:
    left, arrow, right = line.partition("->")
    if not arrow:
        raise ValueError(f"{where}: expected `KINDS [user=..] [run=..] -> CHANNEL[:TO]`")
    words: list[str] = []
    users: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    for word in left.split():
        name, eq, value = word.partition("=")
        if not eq:
            words.append(word)
        elif name == "user":
            users = _names(value, where, "user", _NAME)
        elif name == "run":
            runs = _names(value, where, "run", _GLOB)
        else:
            raise ValueError(f"{where}: unknown filter {name!r} (known: user=, run=)")
    kinds = kinds_of(words, where) if words else DEFAULT_KINDS
    targets = [item.strip() for item in right.split(",") if item.strip()]
    if not targets:
        raise ValueError(f"{where}: no channel after `->` (one of {', '.join(CHANNELS)})")
    rules = []
    for item in targets:
        channel, _, target = item.partition(":")
        if channel not in CHANNELS:
            raise ValueError(f"{where}: unknown channel {channel!r} (known: "
                             f"{', '.join(CHANNELS)})")
        problem = target_problem(channel, target.strip())
        if problem:
            raise ValueError(f"{where}: {problem}")
        rules.append(Rule(kinds=kinds, channel=channel,
                          target=target.strip(), users=users, runs=runs))
    return rules


def _names(value: str, where: str, what: str, shape: re.Pattern[str]) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(",") if name.strip())
    if not names:
        raise ValueError(f"{where}: {what}= names nobody")
    if len(names) > MAX_PATTERNS:
        raise ValueError(f"{where}: more than {MAX_PATTERNS} {what} names")
    for name in names:
        if not shape.fullmatch(name):
            raise ValueError(f"{where}: {what}={name[:60]!r} is not a valid {what} name")
    return names


_EMAIL: Final = re.compile(r"[^@\s,<>]{1,64}@[A-Za-z0-9.-]{1,253}")
_CHAT: Final = re.compile(r"-?[0-9]{1,20}")


def target_problem(channel: ChannelKind, target: str) -> str | None:
    """Why `target` cannot be an address on `channel` (empty: the configured default)."""
    if not target:
        return None
    if channel == "email" and not _EMAIL.fullmatch(target):
        return f"{target[:80]!r} is not an e-mail address"
    if channel == "telegram" and not _CHAT.fullmatch(target):
        return f"{target[:80]!r} is not a Telegram chat id (a number)"
    if channel == "webhook" and not target.startswith(("http://", "https://")):
        return f"a webhook target is an http(s) URL, not {target[:80]!r}"
    return None


def matches(rule: Rule, notice: Notice) -> bool:
    """Does `notice` fall under `rule`? A rule with users or runs sees only notices about
    those runs; a cluster notice (`CLUSTER_KINDS`: no run, nobody's) goes to every rule
    that names its kind, whatever its users, unless the rule names runs."""
    if notice.kind not in rule.kinds:
        return False
    if notice.kind in CLUSTER_KINDS:
        return not rule.runs
    if rule.users and notice.user not in rule.users:
        return False
    return not rule.runs or (bool(notice.run_id) and any(
        fnmatch.fnmatchcase(notice.run_id, glob) for glob in rule.runs))


def route(notice: Notice, rules: Iterable[Rule], defaults: dict[ChannelKind, tuple[str, ...]]
          ) -> tuple[Delivery, ...]:
    """Where `notice` goes: every matching rule's target (a rule without one: the
    channel's `defaults`), each place once, in rule order."""
    seen: dict[str, Delivery] = {}
    for rule in rules:
        if not matches(rule, notice):
            continue
        targets = (rule.target,) if rule.target else defaults.get(rule.channel, ())
        for target in targets:
            delivery = Delivery(channel=rule.channel, target=target)
            seen.setdefault(delivery.key, delivery)
    return tuple(seen.values())


def subscription_rules(subscriptions: Iterable[Subscription]) -> tuple[Rule, ...]:
    """The rules the stored chat subscriptions stand for."""
    return tuple(sub.rule() for sub in subscriptions)


# ---------------------------------------------------------------- Telegram buttons

#: What a chat button under a run's message does; its callback data is `<action>:<run_id>`
#: (the bot's messages and the notifier's notices both use these, and the bot reads them).
ButtonAction = Literal["status", "cancel", "retry", "report"]
BUTTON_ACTIONS: Final[tuple[ButtonAction, ...]] = get_args(ButtonAction)
_RUN_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,60}")


def button_data(action: ButtonAction, run_id: str) -> str:
    """A button's callback data (Telegram allows 64 bytes)."""
    return f"{action}:{run_id}"


def read_button(data: str) -> tuple[ButtonAction, str] | None:
    """(action, run id) of a button's callback data; None for anything else."""
    action, _, run_id = data.partition(":")
    for known in BUTTON_ACTIONS:
        if action == known and _RUN_ID.fullmatch(run_id):
            return known, run_id
    return None


def notice_buttons(notice: Notice) -> tuple[tuple[str, str], ...]:
    """The buttons under a notice in a chat (label, callback data): a run's end offers
    its report (and a retry when it did not succeed), a running task's trouble its
    status and a cancel."""
    if not notice.run_id:
        return ()
    if notice.kind in RUN_ENDS:
        buttons = [("Report", button_data("report", notice.run_id))]
        if notice.kind != "run_succeeded":
            buttons.append(("Retry", button_data("retry", notice.run_id)))
        return tuple(buttons)
    return (("Status", button_data("status", notice.run_id)),
            ("Cancel", button_data("cancel", notice.run_id)))

