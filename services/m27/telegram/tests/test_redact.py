"""The bot's token never reaches a log line: not in structlog events, not in library
log records (httpx logs every URL, the token is in each), not in exceptions."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
import structlog

from m27.common.logging import configure, get_logger
from m27.telegram.redact import MASK, install, redactor

TOKEN = "123456:AAbb-cc_DDeeffGGhhIIjjKKllMMnnOOpp"  # noqa: S105 - made up


def test_the_processor_replaces_the_token_everywhere_in_an_event() -> None:
    event = {"event": f"GET /bot{TOKEN}/getMe", "nested": {"url": [f"x{TOKEN}"]},
             "encoded": TOKEN.replace(":", "%3A"), "n": 3,
             "exc": ValueError(f"bad {TOKEN}")}
    scrubbed = redactor(TOKEN)(None, "info", event)
    assert TOKEN not in repr(scrubbed)
    assert "%3A" not in repr(scrubbed)
    assert scrubbed["event"] == f"GET /bot{MASK}/getMe"
    assert scrubbed["n"] == 3
    assert redactor("")(None, "info", {"event": "x"}) == {"event": "x"}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture
def logged() -> Iterator[Terminal]:
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    out = Terminal()
    configure("telegram", "debug", json=True, stream=out)
    yield out
    structlog.configure(**saved)
    root.handlers[:], root.level = handlers, level
    for name in ("httpx", "httpcore", "telegram", "telegram.ext", "apscheduler", "aiohttp"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_installed_it_redacts_service_and_library_logs(logged: Terminal) -> None:
    log = get_logger()
    log.info("before", url=f"/bot{TOKEN}/x")  # a logger made (and cached) before install
    install(TOKEN)
    log.info("after", url=f"/bot{TOKEN}/x")
    logging.getLogger("some.library").warning("POST %s failed", f"https://h/bot{TOKEN}/m")
    try:
        raise RuntimeError(f"https://h/bot{TOKEN}/getUpdates")
    except RuntimeError:
        log.exception("failed")
        logging.getLogger("other").exception("failed too")
    logging.getLogger("httpx").info("HTTP Request: POST https://h/bot%s/getMe", TOKEN)
    lines = logged.getvalue().splitlines()
    assert TOKEN in lines[0]  # only what was logged before it was installed
    assert all(TOKEN not in line for line in lines[1:])
    assert len(lines) == 5  # httpx's INFO is quieted
    assert MASK in lines[1]
