"""The threads that encode a checkpoint's entries.

Low-priority workers (SCHED_IDLE by default: they run only on cores nothing else wants)
always take part. One helper at normal priority joins when a checkpoint is urgent (the
agent's signal, the monitor's request: the job may be about to be stopped) or is still
not durable after `durable_within` seconds — on a machine whose cores training keeps busy,
idle-priority work might otherwise never finish. The helper only takes entries nobody
has started; a checkpoint's entries are independent.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class WorkList(Generic[T, R]):
    """Items any number of threads take one at a time; results keep the items' order."""

    def __init__(self, items: list[T], action: Callable[[T], R]) -> None:
        self._items, self._action = items, action
        self._next, self._left = 0, len(items)
        self._results: list[R | None] = [None] * len(items)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.finished = threading.Event()
        self.helped = False  # a normal-priority helper took part
        if not items:
            self.finished.set()

    def work(self) -> None:
        while True:
            with self._lock:
                if self._next >= len(self._items) or self._error is not None:
                    return
                index = self._next
                self._next += 1
            try:
                self._results[index] = self._action(self._items[index])
            except BaseException as exc:
                self._error = exc
            with self._lock:
                self._left -= 1
                if self._left == 0 or self._error is not None:
                    self.finished.set()

    def wait(self) -> list[R]:
        self.finished.wait()
        if self._error is not None:
            raise self._error
        return [r for r in self._results if r is not None]


Job = tuple[WorkList[object, object], float | None] | None


class Crew:
    def __init__(self, idle_workers: int, lower_priority: Callable[[], None]) -> None:
        self._lower = lower_priority
        self._idle = [self._start(self._idle_loop, f"m27-ckpt-encode-{i}")
                      for i in range(idle_workers)]
        # Started from the thread that makes the crew (the training loop's): it keeps that
        # thread's normal priority.
        self._helper = self._start(self._helper_loop, "m27-ckpt-helper")

    def _start(self, loop: Callable[[queue.Queue[Job]], None], name: str
               ) -> tuple[threading.Thread, queue.Queue[Job]]:
        jobs: queue.Queue[Job] = queue.Queue()
        thread = threading.Thread(target=loop, args=(jobs,), name=name, daemon=True)
        thread.start()
        return thread, jobs

    def run(self, work: WorkList[T, R], help_after: float | None) -> list[R]:
        """Work on `work` with every idle worker and this thread; the helper joins after
        `help_after` seconds (0: at once; None: never)."""
        for _, jobs in self._idle:
            jobs.put((work, None))  # type: ignore[arg-type]
        if help_after is not None:
            self._helper[1].put((work, help_after))  # type: ignore[arg-type]
        work.work()
        return work.wait()

    def close(self) -> None:
        for thread, jobs in (*self._idle, self._helper):
            jobs.put(None)
            thread.join()

    def _idle_loop(self, jobs: queue.Queue[Job]) -> None:
        self._lower()
        while (job := jobs.get()) is not None:
            job[0].work()

    def _helper_loop(self, jobs: queue.Queue[Job]) -> None:
        while (job := jobs.get()) is not None:
            work, after = job
            if not work.finished.wait(max(0.0, after or 0.0)):
                work.helped = True
                work.work()
