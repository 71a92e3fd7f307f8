"""Who may use the bot, and as which m27 user: `[telegram] allowed_users` (pure).

    allowed_users = 123456789:alice, 987654321:bob

A Telegram user id maps to exactly one m27 user; every call the bot makes for that person
carries a token for that user, so a chat can never act as anyone else. Nobody else may use
the bot.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from m27.common.tokens import USER_NAME

MAX_ENTRIES: Final = 1000
#: Telegram user ids are positive and fit in 52 bits (Bot API docs); be generous.
_TELEGRAM_ID: Final = re.compile(r"[0-9]{1,19}")
_SEPARATORS: Final = re.compile(r"[,;\s]+")


class AllowList(msgspec.Struct, frozen=True):
    """Telegram user id → m27 user."""

    users: dict[int, str] = {}

    def user_of(self, telegram_id: int) -> str | None:
        """The m27 user this Telegram user acts as, or None: not allowed."""
        return self.users.get(telegram_id)

    def __len__(self) -> int:
        return len(self.users)


def parse_allowed(text: str) -> AllowList:
    """`<telegram user id>:<m27 user>, …` (commas, semicolons or blanks between entries)
    → the allow list; ValueError naming the entry that is wrong and why."""
    users: dict[int, str] = {}
    entries = [entry for entry in _SEPARATORS.split(text) if entry]
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"more than {MAX_ENTRIES} entries")
    for entry in entries:
        telegram_id, user = _entry(entry)
        known = users.setdefault(telegram_id, user)
        if known != user:
            raise ValueError(f"Telegram user {telegram_id} is listed as both {known!r} and "
                             f"{user!r}: one Telegram user acts as one m27 user")
    return AllowList(users=users)


def _entry(entry: str) -> tuple[int, str]:
    shown = repr(entry[:60]) + ("…" if len(entry) > 60 else "")
    number, colon, user = entry.partition(":")
    if not colon:
        raise ValueError(f"{shown}: expected <telegram user id>:<m27 user>")
    if not _TELEGRAM_ID.fullmatch(number) or int(number) == 0:
        raise ValueError(f"{shown}: {number[:30]!r} is not a Telegram user id (a positive "
                         "number; the bot tells people theirs)")
    if not USER_NAME.fullmatch(user):
        raise ValueError(f"{shown}: {user[:60]!r} is not an m27 user name (letters, digits, "
                         "`_`, `.`, `@`, `-`)")
    return int(number), user
