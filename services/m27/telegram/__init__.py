"""The Telegram bot: submit and follow runs from a chat, subscribe a chat to notifications.

Its own process (`python -m m27.telegram`, started by `m27 up` when a token is
configured), a NATS principal of its own (`telegram`: the services and subscriptions
buckets only) and a client of the m27 APIs as each chat's m27 user. Pure parts:
`allow` (who may use it, as whom), `commands` (what a message asks for: `decide`) and
`text` (what it answers). The shell: `service`, `bot` (handlers), `calls` (the APIs),
`webhook`, `redact` (the token out of every log line). docs/telegram.md.
"""

from m27.telegram.allow import AllowList, parse_allowed
from m27.telegram.commands import Decision, Incoming, decide
from m27.telegram.settings import configured

__all__ = ["AllowList", "Decision", "Incoming", "configured", "decide", "parse_allowed"]
