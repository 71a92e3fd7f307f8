"""`Checkpointer`: one object that saves and restores everything an exact resume needs.

    ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                        sampler=sampler, extras={"best": best}, every_steps=500)
    cursor = ckpt.resume() or Cursor()
    while cursor.epoch < epochs:
        sampler.start(cursor)
        for x, y in loader:
            ... forward, backward, opt.step(), sched.step() ...
            cursor.advance()
            ckpt.after_step(cursor)          # fast; saves when due
        cursor.next_epoch()
    ckpt.close()                             # waits until the last checkpoint is durable

Inside m27 the store, task id, attempt and checkpoint signal come from the M27_* variables
the node-agent sets; on a laptop it writes to ./checkpoints (or the `store` given).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal as signals
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final, NoReturn

import torch

from m27.common.checkpoint_format import CorruptChunk, Manifest
from m27.common.checkpoint_storage import CheckpointSink
from m27.common.config import load_config
from m27.train import _rng, _state
from m27.train._capture import Capture, Sources, StateLayout
from m27.train._cursor import Cursor
from m27.train._errors import CheckpointError, RestoreError
from m27.train._gang import Gang, Restored, local_tensor, read_parts, sharded_again
from m27.train._log import log
from m27.train._persist import Compress, DeltaBase, Persister, Priority, usable_cores
from m27.train._policy import Decision, Policy, decide, next_kind
from m27.train._ranks import Vote, layout_problem, must_agree, settle, step_due
from m27.train._restore import read_checkpoint, train_checkpoints
from m27.train._snapshot import Copier, HostBuffers, Snapshot, wait_copied
from m27.train._stores import STORE_OUTAGE_S, may_pass, open_store, task_identity

PACK_BELOW: Final = 1024 * 1024
BufferPlan = list[tuple[str, torch.Tensor, tuple[int, ...]]]  # (entry name, tensor, slots)


@dataclass
class SaveReport:
    """One checkpoint, filled in as it progresses (times in seconds)."""

    step: int
    reason: str
    full: bool
    capture_s: float = 0.0  # in after_step
    blocked_s: float = 0.0  # the next optimizer step waiting for the copy
    durable_s: float | None = None  # from after_step until the manifest was committed
    size_bytes: int = 0  # decoded size of the checkpoint
    new_bytes: int = 0  # bytes it added to the store
    checkpoint_id: str = ""
    error: str = ""
    helped: bool = False  # encoding needed the normal-priority helper (urgent or late)

    @property
    def stall_s(self) -> float:
        """What the training loop lost to this checkpoint."""
        return self.capture_s + self.blocked_s


@dataclass
class Counters:
    started: int = 0
    committed: int = 0
    failed: int = 0
    deferred: int = 0  # after_step calls at which a due save waited for the one in flight
    requests: int = 0  # request() calls and signals received
    corrupt: int = 0  # damaged checkpoints skipped by resume()


class Checkpointer:
    """Saves model, optimizer, scheduler, scaler, RNG states, data cursor, sampler and
    `extras` with a stall of a snapshot, and restores them (see the module docstring).
    Under torch.distributed with several ranks every rank makes one and they work as a
    gang (`sharded`, `rank_timeout`: docs/training.md, "Ranks (DDP, FSDP)")."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, scaler: Any = None, sampler: Any = None,
                 extras: dict[str, Any] | None = None, every_steps: int | None = None,
                 every_seconds: float | None = None,
                 store: CheckpointSink | str | os.PathLike[str] | None = None,
                 task_id: str | None = None, keep_full_every: int = 10,
                 delta_base: DeltaBase = "off", compress: Compress = "auto",
                 skip_unchanged: bool = True, persist_priority: Priority = "idle",
                 persist_threads: int | None = None, persist_cpu_share: float = 0.25,
                 durable_within: float | None = 30.0,
                 signal: str | int | bool = True,
                 stop_signal: str | int | bool = True,
                 environ: Mapping[str, str] | None = None, sharded: bool = False,
                 rank_timeout: float = 1800.0, wait_in_step: bool = True) -> None:
        _check_settings(delta_base=delta_base, compress=compress,
                        persist_cpu_share=persist_cpu_share, persist_threads=persist_threads)
        env = os.environ if environ is None else environ
        config = load_config(environ=env).config
        self.sources = Sources(model, optimizer, scheduler, scaler, sampler, extras)
        self.extras = extras if extras is not None else {}
        self.task_id, self.attempt = task_identity(task_id, env)
        self.store = open_store(store, env, task_id=self.task_id, attempt=self.attempt)
        self.skip_unchanged = skip_unchanged
        self.counters = Counters()
        self.reports: deque[SaveReport] = deque(maxlen=10_000)
        self._lock = threading.Lock()
        self._requests: list[str] = []
        self._signalled: str | None = None
        self._stopping: int | None = None  # the stop signal received, until it is served
        self._closed = False
        self._inflight: Snapshot | None = None
        self._barrier: Snapshot | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._force_full = False
        self._last_step, self._last_time = 0, time.monotonic()
        self._cursor: Cursor | None = None  # the latest after_step's or save's
        self._layout = StateLayout(model)
        self.buffers = HostBuffers(slots=2 if delta_base == "memory" else 1)
        self._persister = Persister(
            self.store, self.buffers, self._persisted, task_id=self.task_id,
            attempt=self.attempt, compression_level=config.checkpoint.compression_level,
            diff_threshold=config.checkpoint.diff_threshold, delta_base=delta_base,
            nice=persist_priority, threads=persist_threads or default_persist_threads(),
            cpu_share=persist_cpu_share, compress=compress, durable_within=durable_within)
        self._copier = Copier(self.buffers, self._persister.submit,
                              side_streams=config.performance.gpu_streams > 1)
        # Ranks (docs/training.md, "Ranks"): made in the same order on every rank.
        self.sharded = sharded
        self._gang = Gang.of_torch(sharded=sharded, timeout=rank_timeout)
        if self._gang is not None:
            self._persister.prefix = self._gang.prefix
            self._persister.commit = self._gang.committer(self.store)
        self._vote_at, self._pending = 0, False  # when the ranks vote next (alike on all)
        self._voted = (0, time.monotonic())  # (step, time) of the last vote here
        # False: the caller calls wait_snapshot() right before parameters change (a
        # framework whose optimizer.step(closure) runs forward and backward inside it).
        self._wait_in_step = wait_in_step
        self._versions_before: list[tuple[torch.Tensor, int]] | None = None
        self._versions_known = False
        self._written_unseen: frozenset[int] = frozenset()
        self._watch_versions(optimizer)
        self._hook = optimizer.register_step_pre_hook(self._before_step)
        self._prepared = False
        self._prepare_hook: Any = optimizer.register_step_post_hook(self._after_first_step)
        interval = env.get("M27_CHECKPOINT_INTERVAL")
        self._signal: int | None = None
        self._old_handler: Any = None
        if signal is not False and not self._install_signal(signal, env) and interval and \
                every_seconds is None:
            every_seconds = float(interval)  # no handler: the agent's interval, by time
        self.policy = Policy(every_steps, every_seconds, keep_full_every)
        self._stop_signal: int | None = None
        self._old_stop_handler: Any = None
        if stop_signal is not False:
            self._install_stop_signal("SIGTERM" if stop_signal is True else stop_signal)

    # ------------------------------------------------------------------ the loop

    def after_step(self, cursor: Cursor) -> bool:
        """Call at the end of every iteration (after optimizer.step(), scheduler.step(),
        scaler.update() and cursor.advance()). Starts a checkpoint when one is due;
        returns whether it did."""
        started = time.perf_counter()
        self._cursor = cursor
        if self._stopping is not None and self._gang is None:
            self._stop_now(cursor)
        with self._lock:
            requests = tuple(self._requests) + ((self._signalled,) if self._signalled else ())
        urgent = bool(requests)
        if self._gang is not None:
            decision, urgent = self._agree(self._gang, cursor, requests)
        else:
            decision = decide(self.policy, step=cursor.step, now=time.monotonic(),
                              last_step=self._last_step, last_time=self._last_time,
                              requests=requests, busy=self._inflight is not None)
        if not decision.save:
            if decision.reason:
                self.counters.deferred += 1
            return False
        with self._lock:
            self._requests.clear()
            self._signalled = None
        self._start(cursor, decision.reason, started, urgent=urgent)
        return True

    def _agree(self, gang: Gang, cursor: Cursor, requests: tuple[str, ...]
               ) -> tuple[Decision, bool]:
        """What every rank does at this step, and whether it is urgent: they vote when a
        step trigger is due, while a due save waits, and about every
        `_ranks.AGREE_EVERY_S` (`_ranks.settle`)."""
        step, now = cursor.step, time.monotonic()
        if not must_agree(step, next_step=self._vote_at, pending=self._pending,
                          step_due=step_due(self.policy.every_steps, step, self._last_step)):
            return Decision(False, ""), False
        reason = decide(self.policy, step=step, now=now, last_step=self._last_step,
                        last_time=self._last_time, requests=requests, busy=False).reason
        voted_step, voted_time = self._voted
        step_us = int((now - voted_time) * 1e6 / (step - voted_step)) if step > voted_step \
            else 0
        due = 2 if requests else int(bool(reason))
        agreed = settle(gang.vote(Vote(due=due, busy=self._inflight is not None,
                                       stop=self._stopping or 0, step=step, low_step=step,
                                       step_us=step_us)), reason=reason, step=step)
        if agreed.error:
            raise CheckpointError(agreed.error)
        self._vote_at, self._pending, self._voted = agreed.next_step, agreed.pending, (step, now)
        if agreed.stop:
            self._stop_now(cursor, agreed.stop)
        return agreed.decision, agreed.urgent

    def save(self, cursor: Cursor, reason: str = "save()", *, wait: bool = False) -> None:
        """Checkpoint now (after the one in flight, if any); `wait`: until durable (and
        encoded at normal priority, as a requested checkpoint is). With ranks, every rank
        calls it at the same step."""
        started = time.perf_counter()
        self._cursor = cursor
        self._idle.wait()
        self._start(cursor, reason, started, urgent=wait)
        if wait:
            self.flush()

    def request(self, reason: str) -> None:
        """Ask for a checkpoint at the next after_step (the training monitor on a loss spike
        or NaN; thread-safe)."""
        with self._lock:
            self._requests.append(reason)
            self.counters.requests += 1

    def flush(self, timeout: float | None = None) -> Manifest | None:
        """Wait until the last checkpoint is durable; raise CheckpointError if it failed.
        Returns the latest committed checkpoint."""
        if not self._idle.wait(timeout):
            raise CheckpointError(f"the checkpoint in flight was not durable after {timeout}s")
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"checkpoint failed: {error}") from error
        return self._persister.previous

    def wait_snapshot(self) -> None:
        """Block until the snapshot in flight is copied: call before changing parameters
        or optimizer state other than through optimizer.step() (and, with
        `wait_in_step=False`, right before every optimizer update)."""
        self._before_step(None, (), {})

    def close(self) -> None:
        """Wait until the last checkpoint is durable and release the checkpointer (its
        threads, hooks and signal handlers). A stop signal that arrived after the last
        after_step ends the process here, once that checkpoint is durable."""
        if self._closed:
            return
        try:
            self._final_flush()
        finally:
            self._release()
        if self._stopping is not None:
            raise SystemExit(128 + self._stopping)

    def _final_flush(self) -> None:
        """flush(); a last checkpoint that failed in a way waiting may cure (the store away,
        its disk full) is taken again, at the last cursor, until it is durable or
        STORE_OUTAGE_S have passed: no later checkpoint will make good for it."""
        began, pause = time.monotonic(), 1.0
        while True:
            try:
                self.flush()
                return
            except CheckpointError as exc:
                if (self._gang is not None or self._cursor is None or not may_pass(exc)
                        or time.monotonic() - began + pause > STORE_OUTAGE_S):
                    raise
                log.warning("checkpoint_retried_at_close", task_id=self.task_id,
                            step=self._cursor.step, error=str(exc), retry_in_s=pause)
            time.sleep(pause)
            pause = min(pause * 2, 10.0)
            self.save(self._cursor, "close(): the last checkpoint failed")

    def _release(self) -> None:
        self._closed = True
        self._hook.remove()
        self._prepare_hook.remove()
        self._copier.close()
        self._persister.close()
        for number, ours, handler in (
                (self._signal, self._on_signal, self._old_handler),
                (self._stop_signal, self._on_stop_signal, self._old_stop_handler)):
            # (a handler installed after ours, e.g. by a later checkpointer, stays)
            if number is not None and signals.getsignal(number) == ours:
                with contextlib.suppress(ValueError, TypeError):
                    signals.signal(number, handler)
        self._signal = self._stop_signal = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def latest(self) -> Manifest | None:
        """The last checkpoint committed (or restored) by this checkpointer."""
        return self._persister.previous

    @property
    def host_buffer_bytes(self) -> int:
        return self.buffers.nbytes

    # ------------------------------------------------------------------ saving

    def _start(self, cursor: Cursor, reason: str, started: float, *, urgent: bool) -> None:
        previous = self._persister.previous
        kind = next_kind(previous.chain if previous else None, self.policy.keep_full_every,
                         force_full=self._force_full)
        snapshot = Snapshot(reason=reason, step=cursor.step, epoch=cursor.epoch,
                            cursor=cursor.state_dict(), created_at=time.time(),
                            started=started, kind=kind, urgent=urgent)
        gang = self._gang
        capture = Capture(snapshot, self.buffers, self._layout, pack_below=PACK_BELOW,
                          skip_unchanged=self.skip_unchanged,
                          names=gang.name if gang else None,
                          shared=gang.saves_shared if gang else True,
                          model_now=gang is not None and gang.sharded,
                          versions_tell=gang is None or not gang.sharded,
                          written_unseen=self._written_unseen)
        try:
            capture.capture_now(self.sources, cursor.state_dict())
        except TypeError as exc:
            raise CheckpointError(str(exc)) from None
        snapshot.capture = capture
        report = SaveReport(step=cursor.step, reason=reason, full=kind.full)
        snapshot.report = report
        self.reports.append(report)
        self.counters.started += 1
        self._inflight = self._barrier = snapshot
        self._idle.clear()
        self._last_step, self._last_time = cursor.step, time.monotonic()
        self._copier.submit(snapshot)
        report.capture_s = snapshot.capture_s = time.perf_counter() - started

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        snapshot = self._barrier
        if snapshot is not None and (self._wait_in_step or optimizer is None):
            self._barrier = None
            snapshot.blocked_s = wait_copied(snapshot)
            snapshot.report.blocked_s = snapshot.blocked_s
        if not self._versions_known and optimizer is not None:
            self._versions_before = [(p, p._version) for p in _parameters(optimizer)
                                     if p.grad is not None]

    def _after_first_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer state exists now: have the host buffers allocated in the
        background, long before the first checkpoint needs them. The first step that
        updated parameters also tells whether the optimizer's writes bump their version
        counters (`_watch_versions`)."""
        before, self._versions_before = self._versions_before, None
        if before and not self._versions_known:
            self._versions_known = True
            if any(p._version == version for p, version in before):
                self._written_unseen_by(optimizer, "a parameter it updated kept its version")
        if not self._prepared:  # (a hook cannot remove itself while hooks run)
            self._prepared = True
            self._prepare_later()

    def _watch_versions(self, optimizer: torch.optim.Optimizer) -> None:
        """Unchanged tensors are not copied again; "unchanged" is read from the version
        counter autograd bumps at every in-place change. A fused optimizer kernel and an
        update through `p.data` write without bumping it: such an optimizer is known
        from its settings (`fused=True`) or from its first step, and its parameters and
        state are then copied into every checkpoint."""
        if any(group.get("fused") for group in optimizer.param_groups):
            self._written_unseen_by(optimizer, "fused=True")

    def _written_unseen_by(self, optimizer: torch.optim.Optimizer, why: str) -> None:
        self._versions_known = True
        self._written_unseen = frozenset(local_tensor(p).data_ptr()
                                         for p in _parameters(optimizer))
        log.info("optimizer_writes_unseen", task_id=self.task_id, optimizer=type(
            optimizer).__name__, why=why, effect="its parameters and state are copied "
                 "into every checkpoint, changed or not")

    def _prepare_later(self) -> None:
        if self._gang is None:
            self._persister.later(self._prepare_buffers)
        elif self._gang.saves_shared:  # (a DDP rank other than 0 copies no parameters)
            # Walked on this thread: an FSDP model's state_dict() reshards its parameters.
            plan = self._buffer_plan()
            self._persister.later(lambda: self._prepare_buffers(plan))

    def _buffer_plan(self) -> BufferPlan:
        """(entry name, tensor, slots) of every buffer a snapshot will copy into: both
        slots for tensors that change, one for frozen parameters."""
        both: tuple[int, ...] = (0, 1) if self.buffers.slots == 2 else (0,)
        name = self._gang.name if self._gang else str
        plan: BufferPlan = [
            (name(f"model/{key}"), local_tensor(tensor), both if tensor.requires_grad else (0,))
            for key, tensor in self.sources.model.state_dict(keep_vars=True).items()
            if f"model/{key}" in self._layout.params]
        for index, state in self.sources.optimizer.state_dict()["state"].items():
            plan.extend((name(f"optimizer/state/{index}/{key}"), local_tensor(value), both)
                        for key, value in state.items() if isinstance(value, torch.Tensor))
        return plan

    def _prepare_buffers(self, plan: BufferPlan | None = None) -> None:
        """On the persister thread: allocate and touch every buffer a snapshot will copy
        into (the plan made now, unless given)."""
        for name, tensor, slots in plan if plan is not None else self._buffer_plan():
            self.buffers.prepare(name, tensor.numel() * tensor.element_size(),
                                 pin=tensor.is_cuda, slots=slots)

    def _persisted(self, snapshot: Snapshot, manifest: Manifest | None,
                   error: BaseException | None) -> None:
        """On the persister thread, when a checkpoint is committed or has failed."""
        if self._gang is not None:
            if error is not None and not self._gang.joined:
                self._gang.fail(self.store, error)  # the other ranks' parts fail with it
            self._gang.joined = False
        report: SaveReport = snapshot.report
        report.durable_s = time.perf_counter() - snapshot.started
        if error is not None or manifest is None:
            self.counters.failed += 1
            self._error, self._force_full = error, True
            report.error = str(error)
            self.buffers.forget()  # nothing in them is known to be committed now
            self._layout = StateLayout(self.sources.model)  # in case the model changed
            log.warning("checkpoint_failed", task_id=self.task_id, step=snapshot.step,
                        error=str(error))
        else:
            self.counters.committed += 1
            self._error, self._force_full = None, False  # an earlier failure is made good
            self.buffers.committed(snapshot.refs, full=manifest.full)
            self.buffers.prune({r.name for r in snapshot.refs if r.signature is not None})
            self._persister.previous = manifest
            report.size_bytes, report.new_bytes = manifest.size_bytes, manifest.new_bytes
            report.checkpoint_id = manifest.checkpoint_id
            report.helped = snapshot.helped
        snapshot.refs.clear()
        self._inflight = None
        self._idle.set()

    # ------------------------------------------------------------------ restoring

    def resume(self) -> Cursor | None:
        """Restore everything from the latest checkpoint of this task; its cursor (the next
        batch), or None when there is none (a fresh start)."""
        if self._inflight is not None:
            raise RestoreError("resume() must come before the first checkpoint")
        found = self._read_latest_good()
        if found is None:
            return None
        manifest, shared, own = found
        try:
            cursor: Cursor | None = self._apply(shared, own)
            failure: Exception | None = None
        except (KeyError, ValueError, RuntimeError, RestoreError) as exc:
            cursor, failure = None, exc
        if self._gang is not None and self._gang.worst(int(cursor is None)) and failure is None:
            failure = RestoreError("it did not fit another rank's program")
        if cursor is None or failure is not None:
            raise RestoreError(f"checkpoint {manifest.checkpoint_id} ({manifest.name}) does "
                               f"not fit this program: {failure}") from failure
        self.continue_from(manifest, cursor)
        log.info("checkpoint_restored", task_id=self.task_id, checkpoint=manifest.checkpoint_id,
                 step=cursor.step, epoch=cursor.epoch)
        return cursor

    def continue_from(self, manifest: Manifest, cursor: Cursor) -> None:
        """Carry on after `manifest`, whose state the program restored by other means (a
        framework's own restore, m27.train.lightning): the next checkpoint follows it
        (its step trigger counts from `cursor`) and is full, the host buffers holding no
        base for deltas yet."""
        if self._inflight is not None:
            raise RestoreError("continue_from() must come before the first checkpoint")
        self._persister.previous = manifest
        self._force_full = True
        self._last_step, self._last_time = cursor.step, time.monotonic()
        self._cursor = cursor
        self._prepared = True
        self._prepare_later()
        self._vote_at, self._pending = cursor.step, False
        self._voted = (cursor.step, time.monotonic())

    def _read_latest_good(self) -> tuple[Manifest, Restored, Restored] | None:
        """The newest checkpoint of this task written by m27.train that reads back intact:
        a damaged one (a chunk that no longer matches its hash) is reported and the one
        before it is tried; the node-agent's uploads of a program's own files are skipped.
        With ranks, rank 0 chooses, every rank reads its part, and all of them go back to
        the previous checkpoint when any rank finds its part damaged."""
        gang = self._gang
        candidates = self._candidates() if gang is None or gang.rank == 0 else iter(())
        tried = 0
        while True:
            manifest = next(candidates, None)
            if gang is not None:
                manifest = gang.share(manifest)
            if manifest is None:
                if tried:
                    raise RestoreError(f"every checkpoint of {self.task_id} is damaged "
                                       f"({tried} tried)")
                return None
            tried += 1
            problem = layout_problem(manifest, gang.world if gang else 1, self.sharded)
            if problem:
                raise RestoreError(problem)
            error: Exception | None = None
            try:
                shared, own = self._read_parts(manifest)
            except Exception as exc:  # (ranks: reported to the others before it is raised)
                error = exc
            status = 2 if error is not None and not isinstance(error, CorruptChunk) else \
                int(error is not None)
            worst = gang.worst(status) if gang is not None else status
            if worst == 2:
                raise error if error is not None else RestoreError(
                    f"checkpoint {manifest.checkpoint_id}: another rank could not read it")
            if worst == 1:
                log.warning("checkpoint_corrupt", task_id=self.task_id,
                            checkpoint=manifest.checkpoint_id, step=manifest.step,
                            error=str(error or "damaged on another rank"),
                            action="trying the previous checkpoint")
                self.counters.corrupt += 1
                continue
            return manifest, shared, own

    def _candidates(self) -> Iterator[Manifest]:
        """This task's checkpoints written by m27.train, the latest first."""
        return train_checkpoints(self.store, self.task_id)

    def _read_parts(self, manifest: Manifest) -> tuple[Restored, Restored]:
        """(where the model/optimizer/scheduler/scaler come from, this rank's own state)."""
        if self._gang is None:
            whole = read_checkpoint(self.store, manifest)
            return whole, whole
        return read_parts(self.store, manifest, self._gang)

    def _apply(self, shared: Restored, own: Restored) -> Cursor:
        sources = self.sources
        rebuilt = sharded_again(shared, sources.model, sources.optimizer) if self._gang \
            else shared
        own = rebuilt if own is shared else own
        skeleton, tensors = rebuilt
        sources.model.load_state_dict(_state.decode(skeleton["model"], tensors))
        sources.optimizer.load_state_dict(_state.decode(skeleton["optimizer"], tensors))
        if sources.scheduler is not None and skeleton["scheduler"] is not None:
            sources.scheduler.load_state_dict(_state.decode(skeleton["scheduler"], tensors))
        if sources.scaler is not None and skeleton["scaler"] is not None:
            _restore_scaler(sources.scaler, skeleton["scaler"], tensors)
        skeleton, tensors = own
        if sources.sampler is not None and skeleton["sampler"] is not None:
            sources.sampler.load_state_dict(_state.decode(skeleton["sampler"], tensors))
        self._restore_extras(skeleton["extras"], tensors)
        rng = _state.decode(skeleton["rng"], tensors)
        _rng.restore(rng)
        cursor = Cursor.from_state(skeleton["cursor"])
        if cursor.batch > 0 and hasattr(sources.sampler, "call_before_next_iteration"):
            # DataLoader's iterator draws its base seed from torch's global generator before
            # the first index; in the uninterrupted run that draw happened at the start of
            # the epoch, so the states are put back once more when iteration begins.
            sources.sampler.call_before_next_iteration(lambda: _rng.restore(rng))
        return cursor

    def _restore_extras(self, saved: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        for name, item in saved.items():
            target = self.extras.get(name)
            if "stateful" in item:
                if target is None or not hasattr(target, "load_state_dict"):
                    raise KeyError(f"extras[{name!r}] is in the checkpoint but not given")
                target.load_state_dict(_state.decode(item["stateful"], tensors))
            else:
                self.extras[name] = _state.decode(item["value"], tensors)

    # ------------------------------------------------------------------ signals

    def _install_signal(self, signal: str | int | bool, env: Mapping[str, str]) -> bool:
        chosen = env.get("M27_CHECKPOINT_SIGNAL", "SIGUSR1") if signal is True else signal
        if chosen == "none":  # the step's `checkpoint_signal: none`
            return False
        try:
            number = _signal_number(chosen)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        if threading.current_thread() is not threading.main_thread():
            log.warning("checkpoint_signal_not_installed", reason="not the main thread")
            return False
        self._old_handler = signals.signal(number, self._on_signal)
        self._signal = number
        # Python puts back the default action (death) while it shuts down; a request that
        # comes then must not turn a finished step into one killed by a signal.
        atexit.register(signals.signal, number, signals.SIG_IGN)
        return True

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        # Only a flag: the checkpoint is taken at the next after_step, on the loop's thread.
        self._signalled = f"signal {signals.Signals(number).name}"
        self.counters.requests += 1

    def _install_stop_signal(self, signal: str | int) -> None:
        """Checkpoint-then-stop: the node-agent stops a step (preemption, drain, the node
        shutting down, a cancel) with SIGTERM and a grace period before SIGKILL."""
        try:
            number = _signal_number(signal)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        if threading.current_thread() is not threading.main_thread():
            return
        self._old_stop_handler = signals.signal(number, self._on_stop_signal)
        self._stop_signal = number

    def _on_stop_signal(self, number: int, frame: FrameType | None) -> None:
        if self._stopping is not None:  # asked twice: stop at once, as without us
            signals.signal(number, signals.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self._stopping = number
        self.counters.requests += 1

    def _stop_now(self, cursor: Cursor, number: int | None = None) -> NoReturn:
        """Serve a stop signal (`number`: the one another rank received): a checkpoint of
        this step, durable, then exit 128+N."""
        number = number or self._stopping
        assert number is not None
        name = signals.Signals(number).name
        log.info("checkpoint_then_stop", task_id=self.task_id, step=cursor.step, signal=name)
        try:
            self._idle.wait()  # (ranks: then every rank has the same latest checkpoint)
            if self._persister.previous is None or self._persister.previous.step != cursor.step:
                self.save(cursor, f"signal {name} (stopping)", wait=True)
            else:
                self.flush()
        finally:
            self._release()
        raise SystemExit(128 + number)


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _check_settings(*, delta_base: str, compress: str, persist_cpu_share: float,
                    persist_threads: int | None) -> None:
    """A clear error for a setting out of range, before any thread starts."""
    if delta_base not in ("memory", "store", "off"):
        raise CheckpointError(f"delta_base must be 'memory', 'store' or 'off', not {delta_base!r}")
    if compress not in ("auto", "always", "never"):
        raise CheckpointError(f"compress must be 'auto', 'always' or 'never', not {compress!r}")
    if not 0.0 <= persist_cpu_share <= 1.0:
        raise CheckpointError("persist_cpu_share is a share of the machine's cores, from 0 "
                              f"to 1, not {persist_cpu_share!r}")
    if persist_threads is not None and not 1 <= persist_threads <= 64:
        raise CheckpointError(f"persist_threads must be 1 to 64, not {persist_threads!r}")


def default_persist_threads() -> int:
    """Idle-priority encoders: one per core, at most four. They take only CPU nothing else
    wants (a GPU job leaves the host's cores mostly idle), so more cost training nothing."""
    return max(1, min(4, usable_cores()))


def _signal_number(value: str | int | bool) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    name = str(value).strip().upper()
    if name.isdigit():
        return int(name)
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signals.Signals[name])
    except KeyError:
        raise ValueError(f"not a signal: {value!r} (M27_CHECKPOINT_SIGNAL)") from None


def scaler_state(saved: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The GradScaler state_dict a checkpoint's "scaler" holds (empty: a disabled one)."""
    if saved.get("tensors_as_numbers"):
        state: dict[str, Any] = _state.decode(saved["state"], tensors)
        state["scale"] = float(state["scale"].reshape(-1)[0])
        state["_growth_tracker"] = int(state["_growth_tracker"].reshape(-1)[0])
        return state
    decoded: dict[str, Any] = _state.decode(saved, tensors)
    return decoded


def _restore_scaler(scaler: Any, saved: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    state = scaler_state(saved, tensors)
    if not state:
        return  # saved from a disabled scaler: nothing to restore
    if "max_scale" in state and hasattr(scaler, "max_scale"):
        scaler.max_scale = state["max_scale"]
    if getattr(scaler, "_enabled", True):
        scaler.load_state_dict(state)

