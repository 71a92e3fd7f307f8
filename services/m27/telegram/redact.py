"""Keep the bot's token out of every log line.

The token is part of every Bot API URL (`…/bot<token>/getUpdates`), and httpx and
python-telegram-bot log URLs; an exception's text may carry one too. `redactor` is a
structlog processor (pure) that replaces the token wherever it appears in an event;
`install` puts it just before the renderer of both chains `m27.common.logging` set up
(structlog's and the one stdlib loggers go through), so no line leaves unredacted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any, Final
from urllib.parse import quote

import structlog

MASK: Final = "<telegram-token>"
#: Libraries that log request URLs (with the token in them) at INFO or DEBUG.
CHATTY: Final = ("httpx", "httpcore", "telegram", "telegram.ext", "apscheduler", "aiohttp")

Processor = Callable[[Any, str, MutableMapping[str, Any]], MutableMapping[str, Any]]


def redactor(secret: str) -> Processor:
    """A processor replacing `secret` (as is and URL-encoded) in every string of an event,
    nested ones included."""
    forms = tuple(dict.fromkeys(f for f in (secret, quote(secret, safe="")) if f))

    def scrub(value: Any) -> Any:
        if isinstance(value, str):
            for form in forms:
                value = value.replace(form, MASK)
            return value
        if isinstance(value, dict):
            return {scrub(k): scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(scrub(v) for v in value)
        if isinstance(value, BaseException):
            return scrub(repr(value))
        return value

    def processor(_logger: Any, _name: str, event: MutableMapping[str, Any]
                  ) -> MutableMapping[str, Any]:
        if not forms:
            return event
        for key in list(event):
            event[key] = scrub(event[key])
        return event

    return processor


def install(secret: str) -> None:
    """Redact `secret` from everything logged from now on (and from loggers already
    made: they share the processor lists), and quiet the libraries that log URLs."""
    processor = redactor(secret)
    chain = structlog.get_config()["processors"]
    if isinstance(chain, list):  # the list `configure` set: cached loggers share it
        chain.insert(max(len(chain) - 1, 0), processor)
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if isinstance(formatter, structlog.stdlib.ProcessorFormatter) and isinstance(
                formatter.processors, list):
            formatter.processors.insert(max(len(formatter.processors) - 1, 0), processor)
        handler.addFilter(_RecordFilter(secret))
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)


class _RecordFilter(logging.Filter):
    """Whatever formats the record next: its message rendered and redacted first."""

    def __init__(self, secret: str) -> None:
        super().__init__()
        self._scrub = redactor(secret)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            try:
                rendered = record.getMessage()
            except (TypeError, ValueError):  # arguments that do not fit: logging says so
                return True
            record.msg, record.args = self._scrub(None, "", {"m": rendered})["m"], None
        return True
