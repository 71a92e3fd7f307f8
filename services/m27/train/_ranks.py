"""Ranks (DDP, FSDP): the pure half of checkpointing a gang of processes.

Every rank saves its own RNG states, data cursor, sampler and extras under `rank{r}/`;
the model, optimizer, scheduler and scaler are saved once, unprefixed, by rank 0 when
they are replicated (DDP), or by every rank under its prefix when they are sharded
(FSDP, ZeRO). One manifest holds every rank's entries and is committed once, by rank 0.

Ranks agree on every decision the loop takes (save or not, stop or not) with one small
all-reduce of `Vote`s; they do not vote at every step but at steps all ranks know
alike: when a step trigger is due, while a due save waits, and about every
`AGREE_EVERY_S` seconds of training (the gap in steps is computed from the agreed step
time, so every rank computes the same next step). Nothing here talks to torch.distributed
(`_gang.py` does); decisions come back as data.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from m27.common.checkpoint_format import Entry, Manifest
from m27.train._policy import Decision

AGREE_EVERY_S: Final = 0.5  # about the longest a request or stop signal waits for a vote
MAX_GAP: Final = 1000  # steps between agreements at most
SHARED_PARTS: Final = ("model", "optimizer", "scheduler", "scaler")
_RANK_PREFIX: Final = re.compile(r"rank(\d+)/")


# ------------------------------------------------------------------ entry names


def prefix(rank: int) -> str:
    return f"rank{rank}/"


def entry_name(path: str, rank: int, sharded: bool) -> str:
    """The entry name of a state path ("model/0.weight", "rng/torch") on `rank`: model,
    optimizer, scheduler and scaler are unprefixed when replicated; the rest is per rank."""
    if not sharded and path.split("/", 1)[0] in SHARED_PARTS:
        return path
    return f"{prefix(rank)}{path}"


def rank_of(name: str) -> int | None:
    """The rank an entry belongs to; None for the replicated state."""
    found = _RANK_PREFIX.match(name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Read:
    """One skeleton a rank reads: whose "meta"/"packed" (`prefix`) and which entries."""

    prefix: str
    wanted: Callable[[str], bool]


def reads(rank: int, sharded: bool) -> tuple[Read, Read]:
    """(where the model/optimizer/scheduler/scaler come from, where this rank's own state
    comes from): only the entries this rank needs."""
    own = prefix(rank)
    mine = Read(own, lambda name: name.startswith(own))
    if sharded:
        return mine, mine
    if rank == 0:
        both = Read(own, lambda name: name.startswith(own) or rank_of(name) is None)
        return both, both
    return Read(prefix(0), lambda name: rank_of(name) is None), mine


# ------------------------------------------------------------------ the manifest


def layout(world: int, sharded: bool) -> dict[str, str]:
    """What a gang's manifest records of how it was written."""
    return {"ranks": str(world), "state": "sharded" if sharded else "replicated"}


def layout_problem(manifest: Manifest, world: int, sharded: bool) -> str:
    """Why `manifest` cannot be restored by `world` ranks ("" when it can): a checkpoint is
    restored by as many ranks as wrote it, never partly."""
    saved = manifest.metadata.get("ranks", "1")
    saved_world = int(saved) if saved.isdigit() else 0
    where = f"checkpoint {manifest.checkpoint_id} (step {manifest.step})"
    if saved_world != world:
        return (f"{where} was written by {saved_world} rank{'s' * (saved_world != 1)}; this "
                f"run has {world}: restoring it would restore only part of the state "
                f"(resume with {saved_world} rank{'s' * (saved_world != 1)}; changing the "
                f"number of ranks is not supported)")
    state = manifest.metadata.get("state", "replicated")
    wanted = "sharded" if sharded else "replicated"
    if world > 1 and state != wanted:
        return (f"{where} holds {state} model/optimizer state; this Checkpointer has "
                f"sharded={sharded}")
    return ""


def merge(parts: Sequence[Manifest], sharded: bool) -> Manifest:
    """One manifest of every rank's part (rank order): the gang's checkpoint. Raises
    ValueError when the parts do not belong together."""
    first = parts[0]
    steps = {(p.step, p.epoch) for p in parts}
    if len(steps) != 1:
        raise ValueError(f"the ranks saved different steps: {sorted(p.step or 0 for p in parts)}")
    entries: list[Entry] = [e for p in parts for e in p.entries]
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"entries saved by more than one rank: {twice[:5]}")
    return msgspec.structs.replace(
        first, entries=tuple(entries), full=all(p.full for p in parts),
        chain=max(p.chain for p in parts),
        metadata={**first.metadata, **layout(len(parts), sharded)},
        size_bytes=sum(p.size_bytes for p in parts), new_bytes=sum(p.new_bytes for p in parts))


class Part(msgspec.Struct, frozen=True, tag=True):
    """A rank's part of a checkpoint, as the persister threads exchange it."""

    manifest: bytes  # msgspec JSON of the rank's Manifest


class Failed(msgspec.Struct, frozen=True, tag=True):
    """A rank's part (or the commit) failed: the whole checkpoint fails."""

    error: str


Outcome = Part | Failed


def settle_commit(outcomes: Sequence[Outcome], sharded: bool) -> Manifest | Failed:
    """Rank 0's view of the exchanged parts: the merged manifest to commit, or why not."""
    failed = [(rank, o.error) for rank, o in enumerate(outcomes) if isinstance(o, Failed)]
    if failed:
        return Failed("; ".join(f"rank {rank}: {error}" for rank, error in failed))
    parts = [msgspec.json.decode(o.manifest, type=Manifest) for o in outcomes
             if isinstance(o, Part)]
    try:
        return merge(parts, sharded)
    except ValueError as exc:
        return Failed(str(exc))


# ------------------------------------------------------------------ agreement


@dataclass(frozen=True)
class Vote:
    """What one rank brings to an agreement; the gang's vote is every field's maximum
    (`low_step` is negated on the wire, so its maximum is the lowest step)."""

    due: int = 0  # a save is due here: 1 a step or time trigger, 2 requested (urgent)
    busy: bool = False  # its last checkpoint is not committed yet
    stop: int = 0  # the stop signal it received (0: none)
    step: int = 0
    low_step: int = 0
    step_us: int = 0  # its mean step time since the last agreement

    def encode(self) -> list[int]:
        return [int(self.due), int(self.busy), self.stop, self.step, -self.low_step,
                self.step_us]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Vote:
        due, busy, stop, step, low, step_us = (int(v) for v in values)
        return cls(due, bool(busy), stop, step, -low, step_us)


def combine(votes: Sequence[Vote]) -> Vote:
    """The gang's vote (what an all-reduce MAX of the encoded votes computes)."""
    return Vote.decode([max(column) for column in zip(*(v.encode() for v in votes),
                                                      strict=True)])


def must_agree(step: int, *, next_step: int, pending: bool, step_due: bool) -> bool:
    """Whether this after_step votes: every rank computes the same answer."""
    return step >= next_step or pending or step_due


@dataclass(frozen=True)
class Agreed:
    decision: Decision
    stop: int  # the stop signal the gang serves now (0: none)
    urgent: bool  # requested on some rank: encoded at normal priority on every rank
    next_step: int  # the next step at which the ranks vote
    pending: bool  # a save is due and waits for the one in flight
    error: str = ""  # the ranks are not at the same step


def settle(gang: Vote, *, reason: str, step: int, every_s: float = AGREE_EVERY_S,
           max_gap: int = MAX_GAP) -> Agreed:
    """What every rank does after a vote (`reason`: why a save is due here, "" if not)."""
    gap = max(1, min(max_gap, int(every_s * 1e6 / gang.step_us))) if gang.step_us > 0 else 1
    urgent = gang.due > 1
    if gang.step != gang.low_step:
        return Agreed(Decision(False, ""), 0, False, step + 1, False,
                      f"the ranks are at different steps ({gang.low_step} to {gang.step}): "
                      "every rank must call after_step once per step")
    if not gang.due:
        return Agreed(Decision(False, ""), gang.stop, False, step + gap, False)
    why = reason or "due on another rank"
    if gang.busy:
        return Agreed(Decision(False, f"deferred ({why}): the previous checkpoint is in "
                                      "flight"), gang.stop, urgent, step + 1, True)
    return Agreed(Decision(True, why), gang.stop, urgent, step + gap, False)


# ------------------------------------------------------------------ sharded tensors


def encode_placements(placements: Sequence[Any], path: str) -> list[list[Any]]:
    """A DTensor's placements as JSON: Shard(dim) and Replicate() are supported."""
    from torch.distributed.tensor import Replicate, Shard

    out: list[list[Any]] = []
    for placement in placements:
        if type(placement) is Shard:
            out.append(["shard", placement.dim])
        elif type(placement) is Replicate:
            out.append(["replicate"])
        else:
            raise TypeError(f"cannot checkpoint {path}: a DTensor placed as {placement} "
                            "(Shard and Replicate placements are supported)")
    return out


def decode_placements(saved: Sequence[Sequence[Any]]) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(int(p[1])) if p[0] == "shard" else Replicate() for p in saved]


def step_due(every_steps: int | None, step: int, last_step: int) -> bool:
    """Whether the step trigger is due: the same on every rank (steps and the step of the
    last checkpoint are), so it needs no vote to be known, only to be served in step."""
    return bool(every_steps) and step - last_step >= (every_steps or 0)
