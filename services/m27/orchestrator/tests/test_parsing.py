"""Parsing in a child with a budget: answers, refusals and runaways (real processes)."""

from __future__ import annotations

import time

import pytest

from m27.common.errors import ResourceExhausted
from m27.orchestrator.parsing import in_child
from m27.pipeline import PipelineError, load_pipeline


def hog(megabytes: int) -> int:
    """Holds more memory than the budget allows."""
    held = [bytearray(1024 * 1024) for _ in range(megabytes)]
    return len(held)


def stall(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


async def test_a_document_is_parsed_in_a_child_and_its_problems_come_back() -> None:
    spec = await in_child(load_pipeline, "pipeline:\n  - name: a\n    command: echo\n", {},
                          what="parsing", source="p.yaml")
    assert [step.name for step in spec.steps] == ["a"]
    with pytest.raises(PipelineError) as refused:
        await in_child(load_pipeline, "pipeline:\n  - name: a\n", {}, what="parsing",
                       source="bad.yaml")
    assert refused.value.source == "bad.yaml"
    assert "command" in str(refused.value)


async def test_a_runaway_is_stopped_at_its_memory_or_time_budget() -> None:
    with pytest.raises(ResourceExhausted, match="needed more than 1 GiB"):
        await in_child(hog, 2048, what="parsing", memory_budget_bytes=1024**3)
    started = time.monotonic()
    with pytest.raises(ResourceExhausted, match="took longer than 1s"):
        await in_child(stall, 60.0, what="planning", time_budget_s=1.0)
    assert time.monotonic() - started < 20
    assert await in_child(stall, 0.0, what="planning") == 0.0  # the next call is served
