"""Parsing and planning of submitted documents in a child process with a time and memory
budget, so that no document can stall or exhaust the orchestrator.

Each call runs in a fresh child forked from a forkserver that has `m27.pipeline` imported
(a fork takes milliseconds). The child's address space is capped (`RLIMIT_AS`); past the
time budget it is killed. Either way the caller gets RESOURCE_EXHAUSTED naming the
budget, the event loop never blocks, and the next document gets a fresh process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import resource
from collections.abc import Callable
from typing import Any, Final, TypeVar

from m27.common.errors import ResourceExhausted
from m27.pipeline import PipelineError

T = TypeVar("T")

#: A document that takes longer than this to parse or plan is refused.
TIME_BUDGET_S: Final = 30.0
#: The child's address space: the limits on a document's size and expansion keep a valid
#: pipeline far below it (the largest one the tests plan takes ~200 MiB).
MEMORY_BUDGET_BYTES: Final = 2 * 1024**3

_CONTEXT: Final = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["m27.pipeline", "m27.orchestrator.parsing"])


def _child(conn: multiprocessing.connection.Connection, work: Callable[..., object],
           args: tuple[Any, ...], kwargs: dict[str, Any], memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        reply: tuple[Any, ...] = ("ok", work(*args, **kwargs))
    except PipelineError as exc:  # rebuilt by the parent: its __init__ takes two arguments
        reply = ("invalid", exc.source, exc.problems)
    except MemoryError:
        reply = ("memory",)
    try:
        conn.send(reply)
    except MemoryError:
        conn.send(("memory",))
    finally:
        conn.close()


async def in_child(work: Callable[..., T], *args: Any, what: str,
                   time_budget_s: float = TIME_BUDGET_S,
                   memory_budget_bytes: int = MEMORY_BUDGET_BYTES, **kwargs: Any) -> T:
    """`work(*args, **kwargs)` in a child process: its result, the PipelineError it raised,
    or ResourceExhausted when it ran past the time or the memory budget."""
    receiving, sending = _CONTEXT.Pipe(duplex=False)
    child = _CONTEXT.Process(target=_child, daemon=True, name=f"m27-{what}",
                             args=(sending, work, args, kwargs, memory_budget_bytes))
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, child.start)
    sending.close()
    arrived = asyncio.Event()
    loop.add_reader(receiving.fileno(), arrived.set)
    try:
        try:
            await asyncio.wait_for(arrived.wait(), time_budget_s)
        except TimeoutError:
            raise ResourceExhausted(
                f"{what} took longer than {time_budget_s:.0f}s and was stopped: split the "
                "pipeline or shrink its matrix") from None
        try:
            reply = receiving.recv()
        except EOFError:  # the child died without answering: killed for its memory
            reply = ("memory",)
    finally:
        loop.remove_reader(receiving.fileno())
        receiving.close()
        if child.is_alive():
            child.kill()
        await loop.run_in_executor(None, child.join)
    if reply[0] == "ok":
        return reply[1]  # type: ignore[no-any-return]
    if reply[0] == "invalid":
        raise PipelineError(reply[1], reply[2])
    raise ResourceExhausted(
        f"{what} needed more than {memory_budget_bytes / 1024**3:.0f} GiB and was stopped: "
        "split the pipeline or shrink its matrix")
