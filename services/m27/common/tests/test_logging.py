"""Every line a service logs is JSON with its context, its libraries' stdlib lines too."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from m27.common.logging import bound_contextvars, configure, get_logger


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.mark.usefixtures("restore_logging")
def test_structlog_and_stdlib_lines_are_json_with_the_bound_context() -> None:
    out = io.StringIO()
    configure("scheduler", "info", json=True, stream=out)
    with bound_contextvars(node_id="n1", task_id="r/a"):
        get_logger().info("task.placed", gpus=1)
        logging.getLogger("nats.aio.client").warning("reconnecting to %s", "127.0.0.1:4222")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("grpc").exception("handler failed")
    logging.getLogger("asyncio").info("below the libraries' level: not shown")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == [
        "task.placed", "reconnecting to 127.0.0.1:4222", "handler failed"]
    for line in lines:
        assert (line["service"], line["node_id"], line["task_id"]) == ("scheduler", "n1", "r/a")
        assert "timestamp" in line
    assert (lines[1]["level"], lines[1]["logger"]) == ("warning", "nats.aio.client")
    assert lines[2]["level"] == "error"
    assert "ValueError: boom" in lines[2]["exception"]
