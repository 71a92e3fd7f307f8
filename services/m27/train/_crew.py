"""The threads that encode and upload a checkpoint's chunks.

Two kinds of workers share one list of chunks:
- *idle* workers (SCHED_IDLE by default: they run only on cores nothing else wants) take
  whatever CPU training leaves — all of it on a GPU job, whose host cores mostly wait;
- *paced* workers run at normal priority, but take a chunk only while the CPU time that
  all workers together spent on the checkpoint stays within `persist_cpu_share` of the
  machine's cores over the time since it began (CPU time: waiting for the disk is not
  counted). Where idle workers keep up — a GPU job — the paced ones stand back and
  training is never delayed; on a CPU-bound job, where idle workers may never run, they
  make up the share, so a checkpoint becomes durable in bounded time at a bounded cost.
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
RECHECK_S = 1.0  # a resting paced worker looks at the budget again at least this often


class WorkList(Generic[T, R]):
    """Items any number of threads take one at a time; results keep the items' order."""

    def __init__(self, items: list[T], action: Callable[[T], R]) -> None:
        self._items, self._action = items, action
        self._next, self._left = 0, len(items)
        self._results: list[R | None] = [None] * len(items)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.finished = threading.Event()
        self.unpaced = threading.Event()  # urgent or late: paced workers stop resting
        self.began = time.monotonic()
        self.cpu_s = 0.0  # CPU time all threads spent on items so far
        self.paced_items = 0  # items done by paced workers
        if not items:
            self.finished.set()

    def work(self, share_cores: float | None = None) -> None:
        """Take items until none is left. A paced worker (`share_cores`: the cores the
        paced workers may use together) takes one only while `cpu_s` is within
        `share_cores` × the time since the list began, and rests otherwise (until
        `unpaced`)."""
        while True:
            with self._lock:
                if self._next >= len(self._items) or self._error is not None:
                    return
            if share_cores is not None and not self.unpaced.is_set():
                rest = rest_before_next(share_cores, time.monotonic() - self.began,
                                        self.cpu_s)
                if rest > 0:
                    self.unpaced.wait(min(rest, RECHECK_S))
                    continue
            with self._lock:
                if self._next >= len(self._items) or self._error is not None:
                    return
                index = self._next
                self._next += 1
            started = time.thread_time()
            try:
                self._results[index] = self._action(self._items[index])
            except BaseException as exc:
                self._error = exc
            with self._lock:
                self.cpu_s += time.thread_time() - started
                self._left -= 1
                if share_cores is not None:
                    self.paced_items += 1
                if self._left == 0 or self._error is not None:
                    self.finished.set()

    def wait(self) -> list[R]:
        self.finished.wait()
        if self._error is not None:
            raise self._error
        return [r for r in self._results if r is not None]


def rest_before_next(share_cores: float, elapsed_s: float, cpu_s: float) -> float:
    """How long a paced worker rests before its next item so that the CPU time all workers
    spent (`cpu_s`) stays within `share_cores` × `elapsed_s`: 0 while there is budget
    left, else the time the budget takes to catch up if nobody spends more."""
    if share_cores <= 0:
        return math.inf
    return max(0.0, (cpu_s - share_cores * elapsed_s) / share_cores)


def paced_workers(share: float, cores: int) -> tuple[int, float]:
    """(threads, cores they may use together) for `share` of `cores` (0: none)."""
    if share <= 0:
        return 0, 0.0
    wanted = min(share, 1.0) * cores
    return max(1, math.ceil(wanted - 1e-9)), wanted  # (1.0000000000000002 cores: one)


Job = tuple[WorkList[object, object], float | None] | None


class Crew:
    def __init__(self, idle_workers: int, cpu_share: float, cores: int,
                 lower_priority: Callable[[], None]) -> None:
        self._lower = lower_priority
        self._idle = [self._start(self._idle_loop, f"m27-ckpt-encode-{i}")
                      for i in range(idle_workers)]
        count, self.share_cores = paced_workers(cpu_share, cores)
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
        """Work on `work` with every worker; paced workers stop pacing after
        `unpace_after` seconds (0: at once; None: never), and then this thread helps."""
        work.began = time.monotonic()
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
            if self._idle or self._paced:
                # The calling thread runs at normal priority: it takes chunks only once
                # pacing is off (urgent or late), else it would bypass the share.
                while not work.finished.wait(0.05):
                    if work.unpaced.is_set():
                        work.work()
            else:
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
            job[0].work(self.share_cores)
