"""The threads that encode and upload a checkpoint's chunks.

Two kinds of workers share one list of chunks:
- *idle* workers (SCHED_IDLE by default: they run only on cores nothing else wants) take
  whatever CPU training leaves — all of it on a GPU job, whose host cores mostly wait;
- *paced* workers run at normal priority but sleep after each chunk so that together
  they use at most `persist_cpu_share` of the machine's cores. On a CPU-bound job,
  where idle workers may never run, they make sure a checkpoint becomes durable within a
  bounded time at a bounded cost to training.
A checkpoint that is urgent (the agent's signal, a stop, the monitor's request) or still
not durable after `durable_within` seconds is finished unpaced. Chunks are independent,
so any thread may take any of them.
"""

from __future__ import annotations

import math
import queue
import threading
import time
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
        self.unpaced = threading.Event()  # urgent or late: paced workers stop sleeping
        self.paced_items = 0  # items done by paced workers
        if not items:
            self.finished.set()

    def work(self, duty: float | None = None) -> None:
        """Take items until none is left; with `duty` (0 < duty < 1), sleep after each item
        so that this thread is busy at most that share of the time (until `unpaced`)."""
        while True:
            with self._lock:
                if self._next >= len(self._items) or self._error is not None:
                    return
                index = self._next
                self._next += 1
            started = time.perf_counter()
            try:
                self._results[index] = self._action(self._items[index])
            except BaseException as exc:
                self._error = exc
            with self._lock:
                self._left -= 1
                if duty is not None:
                    self.paced_items += 1
                if self._left == 0 or self._error is not None:
                    self.finished.set()
            if duty is not None and not self.unpaced.is_set():
                self.unpaced.wait(pause_after(time.perf_counter() - started, duty))

    def wait(self) -> list[R]:
        self.finished.wait()
        if self._error is not None:
            raise self._error
        return [r for r in self._results if r is not None]


def pause_after(busy_s: float, duty: float) -> float:
    """How long a paced thread rests after `busy_s` of work to be busy `duty` of the time."""
    return busy_s * (1.0 / duty - 1.0) if 0.0 < duty < 1.0 else 0.0


def paced_workers(share: float, cores: int) -> tuple[int, float]:
    """(threads, duty of each) that together use `share` of `cores` (0: none)."""
    if share <= 0:
        return 0, 0.0
    wanted = min(share, 1.0) * cores
    threads = max(1, math.ceil(wanted))
    return threads, wanted / threads


Job = tuple[WorkList[object, object], float | None] | None


class Crew:
    def __init__(self, idle_workers: int, cpu_share: float, cores: int,
                 lower_priority: Callable[[], None]) -> None:
        self._lower = lower_priority
        self._idle = [self._start(self._idle_loop, f"m27-ckpt-encode-{i}")
                      for i in range(idle_workers)]
        count, self.duty = paced_workers(cpu_share, cores)
        # Started from the thread that makes the crew (the training loop's): they keep
        # that thread's normal priority.
        self._paced = [self._start(self._paced_loop, f"m27-ckpt-paced-{i}")
                       for i in range(count)]

    def _start(self, loop: Callable[[queue.Queue[Job]], None], name: str
               ) -> tuple[threading.Thread, queue.Queue[Job]]:
        jobs: queue.Queue[Job] = queue.Queue()
        thread = threading.Thread(target=loop, args=(jobs,), name=name, daemon=True)
        thread.start()
        return thread, jobs

    def run(self, work: WorkList[T, R], unpace_after: float | None) -> list[R]:
        """Work on `work` with every worker and this thread; paced workers stop pacing
        after `unpace_after` seconds (0: at once; None: never)."""
        if unpace_after is not None and unpace_after <= 0:
            work.unpaced.set()
        for _, jobs in (*self._idle, *self._paced):
            jobs.put((work, unpace_after))  # type: ignore[arg-type]
        if unpace_after is not None and unpace_after > 0:
            timer = threading.Timer(unpace_after, work.unpaced.set)
            timer.daemon = True
            timer.start()
        else:
            timer = None
        try:
            work.work()
            return work.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        for thread, jobs in (*self._idle, *self._paced):
            jobs.put(None)
            thread.join()

    def _idle_loop(self, jobs: queue.Queue[Job]) -> None:
        self._lower()
        while (job := jobs.get()) is not None:
            job[0].work()

    def _paced_loop(self, jobs: queue.Queue[Job]) -> None:
        while (job := jobs.get()) is not None:
            job[0].work(self.duty if self.duty < 1.0 else None)
