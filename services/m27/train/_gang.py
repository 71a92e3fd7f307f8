"""The ranks of a torch.distributed job, as a Checkpointer sees them: the shell around
`_ranks` (which decides) — votes, the collective commit, restoring in step.

Two gloo groups of every rank are made when the Checkpointer is: the training thread votes
on one, the persister thread commits on the other (a group's collectives must never run
from two threads at once). Both have `timeout`: a rank that dies closes its connections
and the others fail at once; one that hangs fails them after the timeout.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from m27.common.checkpoint_format import Manifest
from m27.common.checkpoint_storage import CheckpointSink
from m27.train import _ranks
from m27.train._errors import CheckpointError, RestoreError
from m27.train._ranks import Failed, Outcome, Part, Vote
from m27.train._restore import read_checkpoint

_OUTCOME: Any = msgspec.json.Decoder(Outcome)
Restored = tuple[dict[str, Any], list[torch.Tensor]]  # a skeleton and its tensors


class Gang:
    """This process's rank among `world`; `sharded`: whether the model/optimizer state
    differs per rank (FSDP, ZeRO) or is replicated (DDP)."""

    def __init__(self, rank: int, world: int, *, sharded: bool, timeout: float) -> None:
        self.rank, self.world, self.sharded = rank, world, sharded
        wait = timedelta(seconds=timeout)
        # Made in the same order on every rank (new_group is collective).
        self._votes = dist.new_group(backend="gloo", timeout=wait)
        self._commits = dist.new_group(backend="gloo", timeout=wait)
        self.joined = False  # this checkpoint's commit exchange has begun here

    @classmethod
    def of_torch(cls, *, sharded: bool, timeout: float) -> Gang | None:
        """The job's ranks, or None outside torch.distributed or with a world of one."""
        if not dist.is_available() or not dist.is_initialized():
            return None
        world = dist.get_world_size()
        if world < 2:
            return None
        return cls(dist.get_rank(), world, sharded=sharded, timeout=timeout)

    @property
    def prefix(self) -> str:
        return _ranks.prefix(self.rank)

    @property
    def saves_shared(self) -> bool:
        """Whether this rank saves the model, optimizer, scheduler and scaler."""
        return self.sharded or self.rank == 0

    def name(self, path: str) -> str:
        return _ranks.entry_name(path, self.rank, self.sharded)

    # ------------------------------------------------------------------ training thread

    def vote(self, vote: Vote) -> Vote:
        values = torch.tensor(vote.encode(), dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX,
                                                 group=self._votes), "vote")
        return Vote.decode(values.tolist())

    def worst(self, status: int) -> int:
        """The highest `status` of any rank (0: fine everywhere)."""
        value = torch.tensor([status], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(value, op=dist.ReduceOp.MAX,
                                                 group=self._votes), "vote")
        return int(value.item())

    def share(self, manifest: Manifest | None) -> Manifest | None:
        """Rank 0's `manifest` on every rank."""
        box: list[Any] = [msgspec.json.encode(manifest) if self.rank == 0 else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self._votes),
                         "share")
        return msgspec.json.decode(box[0], type=Manifest | None)

    def _collective(self, run: Callable[[], Any], what: str) -> None:
        try:
            run()
        except (RuntimeError, ValueError) as exc:  # DistBackendError is a RuntimeError
            raise CheckpointError(f"rank {self.rank}: the {what} with the other "
                                  f"{self.world - 1} rank(s) failed: {exc}") from exc

    # ------------------------------------------------------------------ persister thread

    def committer(self, store: CheckpointSink) -> Callable[[Manifest], Manifest]:
        """The Persister's `commit`: every rank's part to rank 0, one manifest committed
        there, the committed manifest (or why it failed) back to every rank."""
        return lambda manifest: self.exchange(store, Part(msgspec.json.encode(manifest)))

    def exchange(self, store: CheckpointSink, mine: Outcome) -> Manifest:
        self.joined = True
        try:
            gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(msgspec.json.encode(mine), gathered, dst=0,
                               group=self._commits)
            box: list[Any] = [None]
            if gathered is not None:
                box[0] = msgspec.json.encode(self._commit(store, [_OUTCOME.decode(g)
                                                                  for g in gathered]))
            dist.broadcast_object_list(box, src=0, group=self._commits)
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"rank {self.rank}: the commit with the other "
                                  f"{self.world - 1} rank(s) failed: {exc}") from exc
        result = _OUTCOME.decode(box[0])
        if isinstance(result, Failed):
            raise CheckpointError(f"the gang's checkpoint failed: {result.error}")
        return msgspec.json.decode(result.manifest, type=Manifest)

    def _commit(self, store: CheckpointSink, outcomes: list[Outcome]) -> Outcome:
        merged = _ranks.settle_commit(outcomes, self.sharded)
        if isinstance(merged, Failed):
            return merged
        try:
            return Part(msgspec.json.encode(store.commit(merged)))
        except Exception as exc:  # sent to every rank: nobody may think it committed
            return Failed(f"commit: {exc}")

    def fail(self, store: CheckpointSink, error: BaseException) -> None:
        """This rank's part failed before its commit: join the exchange, so the others
        learn it (instead of waiting for this rank until the timeout)."""
        with contextlib.suppress(CheckpointError):  # it fails everywhere, as it must
            self.exchange(store, Failed(str(error) or type(error).__name__))


# ------------------------------------------------------------------ sharded tensors


def is_dtensor(tensor: torch.Tensor) -> bool:
    """A DTensor can only exist once its module is imported: no import here."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: Any, path: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """A DTensor's local shard and what rebuilds it (its global shape and stride, its
    placements, its mesh)."""
    mesh = tensor.device_mesh
    described = {"shape": list(tensor.shape), "stride": list(tensor.stride()),
                 "placements": _ranks.encode_placements(tensor.placements, path),
                 "mesh": mesh_key(mesh)}
    return local_tensor(tensor), described


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of `tensor` (a DTensor's local shard)."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        local: torch.Tensor = tensor.detach().to_local()  # type: ignore[attr-defined]
    return local


def mesh_key(mesh: Any) -> list[Any]:
    return [mesh.device_type, list(mesh.mesh.shape), mesh.mesh.flatten().tolist()]


def to_dtensors(saved: dict[str, Any] | None, tensors: list[torch.Tensor],
                live: Iterable[Any]) -> list[torch.Tensor]:
    """`tensors` with the local shards of DTensors made DTensors again, on the meshes of the
    live `tensors` (the model's and optimizer's parameters) that match the saved ones."""
    if not saved:
        return tensors
    from torch.distributed.tensor import DTensor

    meshes = {repr(mesh_key(t.device_mesh)): t.device_mesh for t in live if is_dtensor(t)}
    out = list(tensors)
    for index, described in saved.items():
        mesh = meshes.get(repr(described["mesh"]))
        if mesh is None:
            raise RestoreError(f"the checkpoint holds a tensor sharded over the device mesh "
                               f"{described['mesh']}, which no parameter of this program "
                               "uses")
        out[int(index)] = DTensor.from_local(
            tensors[int(index)], mesh, _ranks.decode_placements(described["placements"]),
            run_check=False, shape=torch.Size(described["shape"]),
            stride=tuple(described["stride"]))
    return out


# ------------------------------------------------------------------ restoring


def read_parts(store: CheckpointSink, manifest: Manifest, gang: Gang
               ) -> tuple[Restored, Restored]:
    """What `gang.rank` reads of a gang's checkpoint: (the skeleton and tensors the model,
    optimizer, scheduler and scaler come from, those its own state comes from)."""
    shared_part, own_part = _ranks.reads(gang.rank, gang.sharded)
    shared = read_checkpoint(store, manifest, prefix=shared_part.prefix,
                             wanted=shared_part.wanted)
    if own_part is shared_part:
        return shared, shared
    return shared, read_checkpoint(store, manifest, prefix=own_part.prefix,
                                   wanted=own_part.wanted)


def sharded_again(part: Restored, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> Restored:
    """`part` with its DTensor shards made DTensors again (FSDP), on the meshes of the
    model's and optimizer's parameters."""
    skeleton, tensors = part
    live = [*model.parameters(), *(p for group in optimizer.param_groups for p in group["params"])]
    return skeleton, to_dtensors(skeleton.get("dtensors"), tensors, live)
