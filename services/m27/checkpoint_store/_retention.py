"""Which checkpoints to keep, and which chunks garbage collection may remove (pure).

Retention works on manifests only: after each Commit a task keeps its last `keep_last`
checkpoints, every `keep_every`-th one (by `seq`, its place in commit order) and every
protected one (the last before a training anomaly, `choose_protected`). Deleting a
manifest never breaks a kept delta checkpoint: a delta's refs name the chunks of its base
(`checkpoint_format.chunk_ids` includes them), and chunks are what garbage collection
decides about — a chunk is removed only when no manifest at all references it and it is
older than the grace period (chunks of a checkpoint being uploaded are not referenced yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import msgspec

from m27.common.checkpoint_api import CheckpointSummary
from m27.common.checkpoint_format import Manifest, chunk_ids

DEFAULT_GRACE_S: Final = 3600.0


class RetentionPolicy(msgspec.Struct, frozen=True, kw_only=True):
    keep_last: int = 3  # 0: keep every checkpoint
    keep_every: int = 0  # 0: none kept for being an Mth


class RetentionDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What retention does to one task's checkpoints, each with its reason."""

    keep: tuple[str, ...]
    delete: tuple[str, ...]
    reasons: dict[str, str]  # checkpoint_id → why it is kept or deleted


def choose_retained(checkpoints: Sequence[CheckpointSummary],
                    policy: RetentionPolicy) -> RetentionDecision:
    """Keep and delete lists for one task's checkpoints (any order; decided by commit
    order, which the ids sort by)."""
    ordered = sorted(checkpoints, key=lambda c: c.checkpoint_id)
    keep: list[str] = []
    delete: list[str] = []
    reasons: dict[str, str] = {}
    newest = len(ordered) - policy.keep_last
    for index, summary in enumerate(ordered):
        checkpoint_id = summary.checkpoint_id
        if summary.protected:
            reasons[checkpoint_id] = f"protected: {summary.protected}"
        elif policy.keep_last == 0:
            reasons[checkpoint_id] = "keep_last = 0: every checkpoint is kept"
        elif index >= newest:
            reasons[checkpoint_id] = f"one of the last {policy.keep_last}"
        elif policy.keep_every > 0 and summary.seq > 0 and summary.seq % policy.keep_every == 0:
            reasons[checkpoint_id] = f"every {policy.keep_every}th is kept (seq {summary.seq})"
        else:
            reasons[checkpoint_id] = f"older than the last {policy.keep_last}"
            delete.append(checkpoint_id)
            continue
        keep.append(checkpoint_id)
    return RetentionDecision(keep=tuple(keep), delete=tuple(delete), reasons=reasons)


def choose_protected(checkpoints: Sequence[CheckpointSummary], before_step: int | None,
                     before: float) -> CheckpointSummary | None:
    """The checkpoint a training anomaly protects: the task's newest one taken after a
    training step before `before_step`; for checkpoints that name no step (or no
    `before_step`), the newest committed before `before` (a time). None: there is none."""
    def earlier(summary: CheckpointSummary) -> bool:
        if before_step is not None and summary.step is not None:
            return summary.step < before_step
        return summary.created_at < before

    found = [c for c in checkpoints if earlier(c)]
    return max(found, key=lambda c: c.checkpoint_id, default=None)


class ChunkFile(msgspec.Struct, frozen=True):
    """A chunk on disk as garbage collection sees it: id, modification time, size."""

    id: str
    mtime: float
    size: int = 0


class SweepDecision(msgspec.Struct, frozen=True, kw_only=True):
    delete: tuple[str, ...]  # unreferenced and older than the grace period
    sizes: dict[str, int]  # chunk id → bytes, of those in `delete`
    referenced: int
    young: int  # unreferenced but within the grace period: maybe an upload in progress
    cutoff: float  # chunks modified before this (unix time) could go


def removal_time(ended_at: float | None, keep_finished_s: float) -> float | None:
    """When a run's checkpoints go: `keep_finished_s` after the run ended; None while it
    has not (queued, running, unknown to the store) or with `keep_finished_s` 0 (never)."""
    if ended_at is None or keep_finished_s <= 0:
        return None
    return ended_at + keep_finished_s


def mark(manifests: Iterable[Manifest], found: set[str] | None = None) -> set[str]:
    """Every chunk any committed manifest needs, delta bases included; added to `found`
    when given (marking a batch at a time)."""
    found = set() if found is None else found
    for manifest in manifests:
        found |= chunk_ids(manifest)
    return found


def sweep(chunks: Iterable[ChunkFile], referenced: set[str], *, marked_at: float,
          grace_s: float = DEFAULT_GRACE_S) -> SweepDecision:
    """The chunks to remove. `marked_at` is when marking began: a chunk touched after
    `marked_at - grace_s` may belong to a commit the mark did not see, so it stays."""
    cutoff = marked_at - grace_s
    sizes: dict[str, int] = {}
    in_use = young = 0
    for chunk in chunks:
        if chunk.id in referenced:
            in_use += 1
        elif chunk.mtime >= cutoff:
            young += 1
        else:
            sizes[chunk.id] = chunk.size
    return SweepDecision(delete=tuple(sorted(sizes)), sizes=sizes, referenced=in_use,
                         young=young, cutoff=cutoff)
