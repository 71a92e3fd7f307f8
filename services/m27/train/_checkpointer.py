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
from collections.abc import Mapping
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
from m27.train._log import log
from m27.train._persist import DeltaBase, Persister, Priority
from m27.train._policy import Policy, decide, next_kind
from m27.train._restore import is_train_checkpoint, read_checkpoint
from m27.train._snapshot import Copier, HostBuffers, Snapshot, wait_copied
from m27.train._stores import open_store, task_identity

PACK_BELOW: Final = 1024 * 1024


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
    `extras` with a stall of a snapshot, and restores them (see the module docstring)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any = None, scaler: Any = None, sampler: Any = None,
                 extras: dict[str, Any] | None = None, every_steps: int | None = None,
                 every_seconds: float | None = None,
                 store: CheckpointSink | str | os.PathLike[str] | None = None,
                 task_id: str | None = None, keep_full_every: int = 10,
                 delta_base: DeltaBase = "memory", skip_unchanged: bool = True,
                 persist_priority: Priority = "idle", persist_threads: int | None = None,
                 durable_within: float | None = 30.0,
                 signal: str | int | bool = True,
                 stop_signal: str | int | bool = True,
                 environ: Mapping[str, str] | None = None) -> None:
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
        self._layout = StateLayout(model)
        self.buffers = HostBuffers(slots=2 if delta_base == "memory" else 1)
        self._persister = Persister(
            self.store, self.buffers, self._persisted, task_id=self.task_id,
            attempt=self.attempt, compression_level=config.checkpoint.compression_level,
            diff_threshold=config.checkpoint.diff_threshold, delta_base=delta_base,
            nice=persist_priority, threads=persist_threads or default_persist_threads(),
            durable_within=durable_within)
        self._copier = Copier(self.buffers, self._persister.submit,
                              side_streams=config.performance.gpu_streams > 1)
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
        if self._stopping is not None:
            self._stop_now(cursor)
        with self._lock:
            requests = tuple(self._requests) + ((self._signalled,) if self._signalled else ())
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
        self._start(cursor, decision.reason, started, urgent=bool(requests))
        return True

    def save(self, cursor: Cursor, reason: str = "save()", *, wait: bool = False) -> None:
        """Checkpoint now (after the one in flight, if any); `wait`: until durable (and
        encoded at normal priority, as a requested checkpoint is)."""
        started = time.perf_counter()
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
        or optimizer state other than through optimizer.step()."""
        self._before_step(None, (), {})

    def close(self) -> None:
        """Wait until the last checkpoint is durable and release the checkpointer (its
        threads, hooks and signal handlers). A stop signal that arrived after the last
        after_step ends the process here, once that checkpoint is durable."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._release()
        if self._stopping is not None:
            raise SystemExit(128 + self._stopping)

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
        capture = Capture(snapshot, self.buffers, self._layout, pack_below=PACK_BELOW,
                          skip_unchanged=self.skip_unchanged)
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
        snapshot, self._barrier = self._barrier, None
        if snapshot is not None:
            snapshot.blocked_s = wait_copied(snapshot)
            snapshot.report.blocked_s = snapshot.blocked_s

    def _after_first_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer state exists now: have the host buffers allocated in the
        background, long before the first checkpoint needs them."""
        if not self._prepared:  # (a hook cannot remove itself while hooks run)
            self._prepared = True
            self._persister.later(self._prepare_buffers)

    def _prepare_buffers(self) -> None:
        """On the persister thread: allocate and touch every buffer a snapshot will copy
        into (both slots for tensors that change, one for frozen parameters)."""
        both = (0, 1) if self.buffers.slots == 2 else (0,)
        for key, tensor in self.sources.model.state_dict(keep_vars=True).items():
            if f"model/{key}" in self._layout.params:
                self.buffers.prepare(f"model/{key}", tensor.numel() * tensor.element_size(),
                                     pin=tensor.is_cuda,
                                     slots=both if tensor.requires_grad else (0,))
        for index, state in self.sources.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.buffers.prepare(f"optimizer/state/{index}/{key}",
                                         value.numel() * value.element_size(),
                                         pin=value.is_cuda, slots=both)

    def _persisted(self, snapshot: Snapshot, manifest: Manifest | None,
                   error: BaseException | None) -> None:
        """On the persister thread, when a checkpoint is committed or has failed."""
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
            self._force_full = False
            self.buffers.committed(snapshot.refs)
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
        manifest, skeleton, tensors = found
        try:
            cursor = self._apply(skeleton, tensors)
        except (KeyError, ValueError, RuntimeError) as exc:
            raise RestoreError(f"checkpoint {manifest.checkpoint_id} ({manifest.name}) does "
                               f"not fit this program: {exc}") from exc
        self._persister.previous = manifest
        self._last_step, self._last_time = cursor.step, time.monotonic()
        self._prepared = True
        self._persister.later(self._prepare_buffers)
        log.info("checkpoint_restored", task_id=self.task_id, checkpoint=manifest.checkpoint_id,
                 step=cursor.step, epoch=cursor.epoch)
        return cursor

    def _read_latest_good(self) -> tuple[Manifest, dict[str, Any], list[torch.Tensor]] | None:
        """The newest checkpoint of this task written by m27.train that reads back intact:
        a damaged one (a chunk that no longer matches its hash) is reported and the one
        before it is tried; the node-agent's uploads of a program's own files are skipped."""
        latest = self.store.latest(self.task_id)
        if latest is None:
            return None
        candidates = [latest] if is_train_checkpoint(latest) else []
        tried: set[str] = set()
        while True:
            if not candidates:
                candidates = [m for m in reversed(self.store.list(self.task_id))
                              if is_train_checkpoint(m) and m.checkpoint_id not in tried]
                if not candidates:
                    if tried:
                        raise RestoreError(f"every checkpoint of {self.task_id} is damaged "
                                           f"({len(tried)} tried)")
                    return None
            manifest = candidates.pop(0)
            tried.add(manifest.checkpoint_id)
            try:
                skeleton, tensors = read_checkpoint(self.store, manifest)
            except CorruptChunk as exc:
                log.warning("checkpoint_corrupt", task_id=self.task_id,
                            checkpoint=manifest.checkpoint_id, step=manifest.step,
                            error=str(exc), action="trying the previous checkpoint")
                self.counters.corrupt += 1
                continue
            return manifest, skeleton, tensors

    def _apply(self, skeleton: dict[str, Any], tensors: list[torch.Tensor]) -> Cursor:
        sources = self.sources
        sources.model.load_state_dict(_state.decode(skeleton["model"], tensors))
        sources.optimizer.load_state_dict(_state.decode(skeleton["optimizer"], tensors))
        if sources.scheduler is not None and skeleton["scheduler"] is not None:
            sources.scheduler.load_state_dict(_state.decode(skeleton["scheduler"], tensors))
        if sources.scaler is not None and skeleton["scaler"] is not None:
            _restore_scaler(sources.scaler, skeleton["scaler"], tensors)
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

    def _stop_now(self, cursor: Cursor) -> NoReturn:
        """Serve a stop signal: a checkpoint of this step, durable, then exit 128+N."""
        number = self._stopping
        assert number is not None
        name = signals.Signals(number).name
        log.info("checkpoint_then_stop", task_id=self.task_id, step=cursor.step, signal=name)
        try:
            if self._persister.previous is None or self._persister.previous.step != cursor.step:
                self.save(cursor, f"signal {name} (stopping)", wait=True)
            else:
                self.flush()
        finally:
            self._release()
        raise SystemExit(128 + number)


def default_persist_threads() -> int:
    """One encoder per four cores, at most four: a GPU job leaves the host CPUs mostly idle,
    a CPU job (like this library's tests) needs its cores for training."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


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


def _restore_scaler(scaler: Any, saved: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    if saved.get("tensors_as_numbers"):
        state = _state.decode(saved["state"], tensors)
        state["scale"] = float(state["scale"].reshape(-1)[0])
        state["_growth_tracker"] = int(state["_growth_tracker"].reshape(-1)[0])
    else:
        state = _state.decode(saved, tensors)
    if not state:
        return  # saved from a disabled scaler: nothing to restore
    if "max_scale" in state and hasattr(scaler, "max_scale"):
        scaler.max_scale = state["max_scale"]
    if getattr(scaler, "_enabled", True):
        scaler.load_state_dict(state)

