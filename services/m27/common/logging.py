"""structlog set-up shared by every service: JSON lines when not on a terminal.

`run_id`, `task_id` and `node_id` are bound with `bind_contextvars` and appear on every line
logged inside that context.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Protocol

import structlog
from structlog.contextvars import bind_contextvars, bound_contextvars, clear_contextvars

__all__ = ["bind_contextvars", "bound_contextvars", "clear_contextvars", "configure", "get_logger"]


class Stream(Protocol):
    """Where log lines go: stderr, a StringIO, a `RotatingLog`."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...

    def isatty(self) -> bool: ...


def configure(service: str, level: str = "info", *, json: bool | None = None,
              stream: Stream | None = None) -> None:
    """Route structlog, and stdlib logging from libraries (nats-py, grpc, asyncio), to
    `stream` (stderr) through the same processors: every line is JSON (or console text on
    a terminal) with the service, level, time and the bound context."""
    out = stream or sys.stderr
    use_json = (not out.isatty()) if json is None else json
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # libraries are chatty at info: only their warnings and errors
    root.setLevel(max(numeric, logging.WARNING))
    logging.captureWarnings(True)  # `warnings.warn` lines come out the same way


def _add_service(service: str) -> Any:
    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return processor


def get_logger(**initial: Any) -> Any:
    return structlog.get_logger(**initial)
