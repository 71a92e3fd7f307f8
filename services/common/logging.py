"""structlog set-up shared by every service: JSON lines when not on a terminal.

`run_id`, `task_id` and `node_id` are bound with `bind_contextvars` and appear on every line
logged inside that context.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.contextvars import bind_contextvars, bound_contextvars, clear_contextvars

__all__ = ["bind_contextvars", "bound_contextvars", "clear_contextvars", "configure", "get_logger"]


def configure(service: str, level: str = "info", *, json: bool | None = None,
              stream: TextIO | None = None) -> None:
    """Route structlog (and stdlib logging from libraries) to `stream` (stderr)."""
    out = stream or sys.stderr
    use_json = (not out.isatty()) if json is None else json
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_service(service),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=out,
                        format="%(levelname)s %(name)s: %(message)s")


def _add_service(service: str) -> Any:
    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return processor


def get_logger(**initial: Any) -> Any:
    return structlog.get_logger(**initial)
