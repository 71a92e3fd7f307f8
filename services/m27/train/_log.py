"""How m27.train logs: through the standard `logging` module of the user's program, logger
`m27.train`, never printing on its own. With no logging configured, Python shows warnings
and errors on stderr (its last-resort handler) and drops the rest; a program that calls
`logging.basicConfig(level=logging.INFO)` sees every line. Each line reads
"event key=value …"; the fields are also on the record as `record.m27` (a dict)."""

from __future__ import annotations

import logging
from typing import Any, Final

NAME: Final = "m27.train"


class TrainLog:
    def __init__(self, name: str = NAME) -> None:
        self.logger = logging.getLogger(name)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self.logger.isEnabledFor(level):
            text = " ".join([event, *(f"{key}={value}" for key, value in fields.items())])
            self.logger.log(level, text, extra={"m27": {"event": event, **fields}},
                            stacklevel=3)


log: Final = TrainLog()
