"""Taking a snapshot: what `after_step` captures at once, what a background thread copies
into preallocated host buffers while the next forward/backward runs, and the barrier
the next optimizer step waits on.

Small state (RNG states, cursor, scheduler, scaler, model buffers such as BatchNorm
statistics — the next forward changes those) is copied synchronously. Parameters and
optimizer state only change in `optimizer.step()`, so they are copied by the copier
thread; an optimizer step pre-hook blocks until that copy is complete (on CUDA it makes
the step's stream wait for the copy's event instead, so the CPU does not block at all).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from m27.train._policy import Kind

Signature = tuple[int, int, str, tuple[int, ...], str]


def bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def signature(tensor: torch.Tensor) -> Signature:
    """What identifies a tensor's bytes: storage address, autograd version counter (bumped
    by every in-place change, optimizer steps and `load_state_dict` included), dtype,
    shape, device. Equal signatures: the bytes are unchanged."""
    return (tensor.data_ptr(), tensor._version, str(tensor.dtype), tuple(tensor.shape),
            str(tensor.device))


@dataclass
class TensorRef:
    """One tensor of a snapshot and where its bytes are (or will be)."""

    index: int
    name: str  # the entry name of a tensor stored on its own; a path for packed ones
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    packed: bool  # stored together with the other small tensors in the "packed" entry
    source: torch.Tensor | None = None  # live tensor the copier copies (None: copied now)
    signature: Signature | None = None
    data: torch.Tensor | None = None  # uint8 host bytes, valid once the copy is done
    base: torch.Tensor | None = None  # uint8 host bytes of the last committed checkpoint
    reuse: bool = False  # unchanged since the last committed checkpoint
    slot: int = 0


@dataclass
class Snapshot:
    """A checkpoint on its way: captured by `after_step`, copied, then persisted."""

    reason: str
    step: int
    epoch: int
    cursor: dict[str, int]
    created_at: float
    started: float  # perf_counter() when after_step began
    kind: Kind
    skeleton: dict[str, Any] = field(default_factory=dict)
    refs: list[TensorRef] = field(default_factory=list)
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_start: dict[int, Any] = field(default_factory=dict)  # device → event (compute)
    cuda_done: dict[int, Any] = field(default_factory=dict)  # device → event (copies)
    sync_events: list[Any] = field(default_factory=list)  # small copies (compute stream)
    capture_s: float = 0.0  # time in after_step
    blocked_s: float = 0.0  # time the next optimizer step waited for the copy
    error: BaseException | None = None
    report: Any = None  # the checkpointer's SaveReport
    capture: Any = None  # what walks parameters and optimizer state on the copier thread
    urgent: bool = False  # requested (signal, monitor): encoded at normal priority at once
    helped: bool = False  # the normal-priority helper took part in encoding it


class HostBuffers:
    """Per tensor, one or two host byte buffers (pinned when the tensors are on a GPU).

    With two slots, one holds the bytes of the last *full* checkpoint, the base of the
    XOR deltas of the checkpoints after it (no re-read from the store); a changed tensor
    is copied into the other. With one slot there is no in-memory base. Touched only by
    the thread that owns the snapshot in flight (at most one at a time)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._lock = threading.Lock()  # the copier allocates, the persister prepares
        self._buffers: dict[str, list[torch.Tensor | None]] = {}
        self._committed: dict[str, tuple[int, Signature]] = {}  # the last checkpoint's
        self._full: dict[str, int] = {}  # the slot holding the last full checkpoint's bytes

    def plan(self, ref: TensorRef, *, skip_unchanged: bool) -> None:
        """Decide whether `ref` is copied, into which slot, and its delta base."""
        assert ref.signature is not None
        held = self._committed.get(ref.name)
        if held is not None and skip_unchanged and held[1] == ref.signature:
            ref.reuse, ref.slot = True, held[0]
            ref.data = self.get(ref.name, held[0])
            return
        ref.reuse = False
        full = self._full.get(ref.name)
        ref.slot = 1 - full if full is not None and self.slots == 2 else 0
        if full is not None and self.slots == 2:
            ref.base = self.get(ref.name, full)

    def ensure(self, name: str, slot: int, nbytes: int, *, pin: bool) -> torch.Tensor:
        with self._lock:
            buffers = self._buffers.setdefault(name, [None] * self.slots)
            buffer = buffers[slot]
            if buffer is None or buffer.numel() != nbytes:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
                buffers[slot] = buffer
            return buffer

    def prepare(self, name: str, nbytes: int, *, pin: bool, slots: tuple[int, ...]) -> None:
        """Allocate and touch buffers ahead of time (off the training loop), so the copy
        into them does not pay for page faults. Never replaces a buffer in use."""
        for slot in slots:
            if self._has(name, slot, nbytes):
                continue
            fresh = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            fresh.numpy().fill(0)
            with self._lock:
                if not self._has(name, slot, nbytes):
                    self._buffers.setdefault(name, [None] * self.slots)[slot] = fresh

    def _has(self, name: str, slot: int, nbytes: int) -> bool:
        buffers = self._buffers.get(name)
        buffer = buffers[slot] if buffers is not None else None
        return buffer is not None and buffer.numel() == nbytes

    def get(self, name: str, slot: int) -> torch.Tensor:
        buffer = self._buffers[name][slot]
        assert buffer is not None
        return buffer

    def committed(self, refs: list[TensorRef], *, full: bool) -> None:
        """The snapshot of `refs` is durable: its slots now hold the checkpoint's bytes
        (and, for a full checkpoint, the base of the deltas to come)."""
        for ref in refs:
            if ref.signature is not None:
                self._committed[ref.name] = (ref.slot, ref.signature)
                if full:
                    self._full[ref.name] = ref.slot

    def forget(self) -> None:
        """After a failed checkpoint nothing in the buffers is known to be committed."""
        self._committed.clear()
        self._full.clear()

    def prune(self, names: set[str]) -> None:
        for name in [n for n in self._buffers if n not in names]:
            del self._buffers[name]
            self._committed.pop(name, None)
            self._full.pop(name, None)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for slots in self._buffers.values() for b in slots
                   if b is not None)


class Copier:
    """The thread that copies a snapshot's live tensors into host buffers.

    It runs at normal priority: the next optimizer step may be waiting for it. CPU copies
    use numpy (one thread, the GIL released) so they do not add to torch's intra-op pool;
    CUDA copies are non-blocking copies on a side stream per device into pinned buffers,
    ordered after the optimizer step by an event and followed by an event of their own."""

    def __init__(self, buffers: HostBuffers, then: Callable[[Snapshot], None],
                 side_streams: bool) -> None:
        self._buffers, self._then, self._side_streams = buffers, then, side_streams
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._streams: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._run, name="m27-ckpt-copy", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        self._queue.put(snapshot)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            try:
                self.copy(snapshot)
            except BaseException as exc:  # reported by the persister, never lost
                snapshot.error = exc
            finally:
                snapshot.copied.set()
            self._then(snapshot)

    def copy(self, snapshot: Snapshot) -> None:
        if snapshot.capture is not None:
            snapshot.capture.capture_rest()
            snapshot.capture = None
        on_gpu: dict[int, list[TensorRef]] = defaultdict(list)
        for ref in snapshot.refs:
            if ref.source is None or ref.reuse:
                continue
            ref.data = self._buffers.ensure(ref.name, ref.slot, ref.nbytes,
                                            pin=ref.source.is_cuda)
            if ref.source.is_cuda:
                on_gpu[ref.source.device.index or 0].append(ref)
            else:
                np.copyto(ref.data.numpy(), bytes_of(ref.source).numpy())
        for device, refs in on_gpu.items():
            snapshot.cuda_done[device] = self._copy_cuda(device, refs,
                                                         snapshot.cuda_start.get(device))

    def _copy_cuda(self, device: int, refs: list[TensorRef], start: Any) -> Any:
        with torch.cuda.device(device):
            if start is None:
                # No event from after_step for this device (the model moved to it after the
                # last snapshot): the default stream is shared by all threads, so an event
                # recorded on it now follows the optimizer step (and perhaps a little more).
                start = torch.cuda.default_stream(device).record_event()
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                stream.wait_event(start)
                for ref in refs:
                    assert ref.data is not None
                    assert ref.source is not None
                    ref.data.copy_(bytes_of(ref.source), non_blocking=True)
                return stream.record_event()

    def _stream(self, device: int) -> Any:
        if not self._side_streams:  # [performance] gpu_streams = 1: no extra stream
            return torch.cuda.current_stream(device)
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return self._streams[device]


def wait_copied(snapshot: Snapshot) -> float:
    """The barrier before an optimizer step: returns the seconds the CPU was blocked."""
    started = time.perf_counter()
    snapshot.copied.wait()
    blocked = time.perf_counter() - started
    for device, event in snapshot.cuda_done.items():
        torch.cuda.current_stream(device).wait_event(event)  # the GPU waits, not the CPU
    return blocked


def wait_readable(snapshot: Snapshot) -> None:
    """Before the persister reads host buffers: every copy has landed."""
    snapshot.copied.wait()
    for event in snapshot.cuda_done.values():
        event.synchronize()
    for event in snapshot.sync_events:
        event.synchronize()
