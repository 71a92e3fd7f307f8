"""Two checkpoint-store copies on one directory and one manifest index, as a rolling
update or `replicas: 2` runs them: what one copy's per-task lock cannot order, the index
must (the real processes: `tests/test_checkpoint_store_copies.py`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from m27.checkpoint_store._index import MemoryManifestIndex
from m27.checkpoint_store._manifests import stored_sizes
from m27.checkpoint_store._retention import RetentionPolicy
from m27.checkpoint_store._store import CheckpointStore
from m27.checkpoint_store.tests.test_checkpoint_store_core import (
    TASK,
    Clock,
    make_store,
    restore,
    upload,
)
from m27.common.checkpoint_format import Manifest

Hook = Callable[[], Awaitable[object]]


class Shared(MemoryManifestIndex):
    """One index as two copies see it; a hook runs (once) on the next `list` or `put`, to
    let the other copy act at exactly that point."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__()
        self.values = values
        self.after_list: Hook | None = None
        self.before_put: Hook | None = None

    async def list(self, pattern: str, *, strict: bool = False) -> list[Manifest]:
        found = await super().list(pattern, strict=strict)
        if self.after_list is not None:
            hook, self.after_list = self.after_list, None
            await hook()
        return found

    async def put(self, manifest: Manifest) -> None:
        if self.before_put is not None:
            hook, self.before_put = self.before_put, None
            await hook()
        await super().put(manifest)


def two_copies(root: Path, **options: object) -> tuple[CheckpointStore, CheckpointStore,
                                                       Shared, Shared]:
    values: dict[str, bytes] = {}
    index_a, index_b = Shared(values), Shared(values)
    return (make_store(root, index=index_a, **options),
            make_store(root, index=index_b, **options), index_a, index_b)


async def test_a_checkpoint_through_the_other_copy_sorts_after_the_one_it_follows(
        tmp_path: Path) -> None:
    """Copy A's clock is ahead (another host, or a burst of commits ran its ids ahead of
    the time): the next checkpoint, committed through B, still gets a later id, so it is
    the latest on both copies and retention (keep_last=1) keeps it, not the older one."""
    ahead, behind = Clock(1_704_110_400.250), Clock(1_704_110_400.0)
    values: dict[str, bytes] = {}
    keep_one = RetentionPolicy(keep_last=1)
    a = make_store(tmp_path / "root", index=Shared(values), clock=ahead, retention=keep_one)
    b = make_store(tmp_path / "root", index=Shared(values), clock=behind, retention=keep_one)
    first = await upload(a, {"w": b"first" * 100})
    second = await upload(b, {"w": b"second" * 100}, first)
    assert second.checkpoint_id > first.checkpoint_id
    assert second.seq == first.seq + 1
    for copy in (a, b):
        assert [s.checkpoint_id for s in await copy.list(TASK)] == [second.checkpoint_id]
        assert (await copy.get_manifest(TASK))[0] == second
    assert await restore(a, second) == {"w": b"second" * 100}


async def test_retention_on_one_copy_never_deletes_what_the_other_just_protected(
        tmp_path: Path) -> None:
    """B lists the task's checkpoints for a commit's retention; A protects the oldest
    before B deletes: the protection wins (within one copy the task lock orders them)."""
    a, b, _, index_b = two_copies(tmp_path / "root", retention=RetentionPolicy(keep_last=2))
    old = await upload(a, {"w": b"old" * 50}, step=100)
    await upload(a, {"w": b"mid" * 50}, step=200)
    protected: list[str] = []

    async def protect_on_a() -> None:
        protected.append(await a.protect(TASK, 0, 150, 0.0, "loss spike"))

    index_b.before_put = protect_on_a  # B's commit: listed, now sealing
    await upload(b, {"w": b"new" * 50}, step=300)
    assert protected == [old.checkpoint_id]
    assert [(s.step, s.protected) for s in await b.list(TASK)] == [
        (100, "loss spike"), (200, ""), (300, "")]


async def test_a_protect_never_brings_back_a_checkpoint_the_other_copy_retired(
        tmp_path: Path) -> None:
    """A lists for a Protect; meanwhile B commits, retires the chosen checkpoint and
    collects its chunks: A must not write the manifest back (it would name chunks that
    are gone), and says there is no checkpoint before the anomaly left."""
    a, b, index_a, _ = two_copies(tmp_path / "root", retention=RetentionPolicy(keep_last=2),
                                  gc_grace_s=0)
    old = await upload(a, {"w": b"old" * 50}, step=100)
    await upload(a, {"w": b"mid" * 50}, step=200)

    async def commit_and_collect_on_b() -> None:
        await upload(b, {"w": b"new" * 50}, step=300)
        await b.collect_garbage()

    index_a.after_list = commit_and_collect_on_b
    assert await a.protect(TASK, 0, 150, 0.0, "loss spike") == ""
    listed = await a.list(TASK)
    assert [(s.step, s.protected) for s in listed] == [(200, ""), (300, "")]
    for summary in listed:
        manifest, _ = await a.get_manifest(TASK, summary.checkpoint_id)
        assert not a.chunks.problems(stored_sizes(manifest))
    assert old.checkpoint_id not in {s.checkpoint_id for s in listed}
