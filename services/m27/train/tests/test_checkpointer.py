"""The Checkpointer against a LocalStore: what it saves, what it restores, when it saves,
and what happens when the store fails."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from m27.common.checkpoint_api import StorageFull
from m27.common.checkpoint_format import Manifest, Payload, chain_depth, chunk_ids
from m27.common.checkpoint_storage import LocalStore
from m27.train import (
    Checkpointer,
    CheckpointError,
    Cursor,
    RestoreError,
    ResumableSampler,
    _snapshot,
)
from m27.train.precision import GradScaler


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 600), torch.nn.BatchNorm1d(600),
                               torch.nn.ReLU(), torch.nn.Linear(600, 600),
                               torch.nn.Linear(600, 4))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(16, 32)).pow(2).mean().backward()
    optimizer.step()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and \
            a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"M27_CONFIG": str(tmp_path / "no-config")}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


class Run:
    """A model, an optimizer and a checkpointer on the same store."""

    def __init__(self, store: Any, env: Mapping[str, str], seed: int = 0,
                 **options: Any) -> None:
        self.model = make_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ckpt = Checkpointer(model=self.model, optimizer=self.optimizer, store=store,
                                 signal=options.pop("signal", False), environ=env, **options)

    def steps(self, n: int, cursor: Cursor) -> None:
        for _ in range(n):
            train_step(self.model, self.optimizer)
            cursor.advance()
            self.ckpt.after_step(cursor)
            self.ckpt.flush()


@pytest.fixture
def runs(store: LocalStore, env: dict[str, str]) -> Iterator[list[Run]]:
    made: list[Run] = []
    yield made
    for run in made:
        run.ckpt.close()


def new_run(runs: list[Run], store: Any, env: Mapping[str, str], **options: Any) -> Run:
    run = Run(store, env, **options)
    runs.append(run)
    return run


def test_everything_comes_back_bitwise_in_a_fresh_model(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    first = new_run(runs, store, env, every_steps=3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(first.optimizer, 50)
    scaler = GradScaler("cpu", init_scale=256.0, growth_interval=2, max_scale=4096.0)
    sampler = ResumableSampler(100, batch_size=4, seed=9)
    extras = {"best": 0.25, "history": [1, 2, 3]}
    ckpt = Checkpointer(model=first.model, optimizer=first.optimizer, scheduler=scheduler,
                        scaler=scaler, sampler=sampler, extras=extras, store=store,
                        signal=False, environ=env)
    cursor = Cursor()
    for _ in range(4):
        first.optimizer.zero_grad()
        scaler.scale(first.model(torch.randn(8, 32)).pow(2).mean()).backward()
        scaler.step(first.optimizer)
        scaler.update()
        scheduler.step()
        cursor.advance()
    random.seed(5)
    np.random.seed(6)
    ckpt.save(cursor, wait=True)
    expected = {"model": first.model.state_dict(), "opt": first.optimizer.state_dict(),
                "sched": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "python": random.random(), "numpy": np.random.rand(), "torch": torch.rand(3)}
    ckpt.close()

    second = Run(store, env, seed=1)
    second.ckpt.close()
    scheduler2 = torch.optim.lr_scheduler.CosineAnnealingLR(second.optimizer, 50)
    scaler2 = GradScaler("cpu")
    sampler2 = ResumableSampler(100, batch_size=4)
    extras2: dict[str, Any] = {}
    ckpt2 = Checkpointer(model=second.model, optimizer=second.optimizer, scheduler=scheduler2,
                         scaler=scaler2, sampler=sampler2, extras=extras2, store=store,
                         signal=False, environ=env)
    assert ckpt2.resume() == cursor
    got = {"model": second.model.state_dict(), "opt": second.optimizer.state_dict(),
           "sched": scheduler2.state_dict(), "scaler": scaler2.state_dict(),
           "python": random.random(), "numpy": np.random.rand(), "torch": torch.rand(3)}
    ckpt2.close()
    assert same(got, expected)
    assert extras2 == extras
    assert sampler2.seed == 9
    assert scaler2.max_scale == 4096.0


def test_without_a_checkpoint_resume_is_a_fresh_start(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    assert new_run(runs, store, env).ckpt.resume() is None


def test_the_snapshot_is_the_state_at_after_step_not_after_the_next_step(
        store: LocalStore, env: dict[str, str], runs: list[Run],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy runs in the background; BatchNorm statistics changed by the next forward
    and parameters changed by the next optimizer step are not in the checkpoint."""
    copy = _snapshot.Copier.copy

    def slow_copy(self: _snapshot.Copier, snapshot: _snapshot.Snapshot) -> None:
        time.sleep(0.3)
        copy(self, snapshot)

    monkeypatch.setattr(_snapshot.Copier, "copy", slow_copy)
    run = new_run(runs, store, env)
    cursor = Cursor()
    train_step(run.model, run.optimizer)
    cursor.advance()
    expected = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.ckpt.save(cursor)
    started = time.perf_counter()
    train_step(run.model, run.optimizer)  # forward changes BN stats; step waits for the copy
    assert time.perf_counter() - started > 0.2
    run.ckpt.flush()
    report = run.ckpt.reports[-1]
    assert report.blocked_s > 0.1
    assert report.stall_s == report.capture_s + report.blocked_s

    fresh = new_run(runs, store, env, seed=3)
    fresh.ckpt.resume()
    assert same(dict(fresh.model.state_dict()), expected)


def test_a_mostly_frozen_model_stores_almost_nothing_again(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    run = new_run(runs, store, env, every_steps=1)
    for parameter in list(run.model.parameters())[:-2]:
        parameter.requires_grad_(False)
    run.steps(3, Cursor())
    first, *later = list(run.ckpt.reports)
    assert first.new_bytes > 1_000_000
    assert all(r.new_bytes < 150_000 for r in later), [r.new_bytes for r in later]


class DataSGD(torch.optim.Optimizer):
    """An optimizer as many are written: updates through `p.data`, which autograd's version
    counter does not see."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["momentum"] = state.get("momentum", torch.zeros_like(p)) * 0.9 + \
                        p.grad
                    p.data.add_(state["momentum"], alpha=-group["lr"])


@pytest.mark.parametrize("optimizer", ["fused AdamW", "writes through .data"])
def test_optimizers_whose_writes_bump_no_version_are_checkpointed_as_they_are(
        optimizer: str, store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    """A fused kernel (the Hugging Face Trainer's default optimizer) and `p.data` updates
    leave version counters alone: each checkpoint must still hold that step's weights and
    optimizer state, not those of the last copy."""
    model = make_model()
    for parameter in list(model.parameters())[:6]:
        parameter.requires_grad_(False)  # frozen: still skipped when unchanged
    trained = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = torch.optim.AdamW(trained, lr=1e-2, fused=True) \
        if optimizer == "fused AdamW" else DataSGD(trained)
    ckpt = Checkpointer(model=model, optimizer=opt, store=store, signal=False, environ=env,
                        every_steps=1)
    cursor, expected = Cursor(), {}
    for _ in range(4):
        train_step(model, opt)
        cursor.advance()
        expected[cursor.step] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                                 "opt": opt.state_dict()["state"]}
        expected[cursor.step]["opt"] = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                            for k, v in state.items()}
                                        for i, state in expected[cursor.step]["opt"].items()}
        ckpt.after_step(cursor)
        ckpt.flush()
    ckpt.close()
    later = [r.new_bytes for r in list(ckpt.reports)[1:]]
    assert all(b < 150_000 for b in later), later  # the frozen 600x600 layer: not again
    for manifest in store.list("local"):
        fresh = make_model(seed=5)
        fresh_opt: torch.optim.Optimizer = torch.optim.AdamW(
            list(fresh.parameters())[6:], lr=1e-2, fused=True) \
            if optimizer == "fused AdamW" else DataSGD(list(fresh.parameters())[6:])
        reader = Checkpointer(model=fresh, optimizer=fresh_opt, store=store, signal=False,
                              environ=env)
        reader.store = _AtStep(store, manifest)
        assert reader.resume() is not None
        reader.close()
        assert manifest.step is not None
        assert same(dict(fresh.state_dict()), expected[manifest.step]["model"]), manifest.step
        assert same(fresh_opt.state_dict()["state"], expected[manifest.step]["opt"])


class _AtStep:
    """A store whose latest checkpoint is `manifest` (to restore each one in turn)."""

    def __init__(self, store: LocalStore, manifest: Manifest) -> None:
        self.store, self.manifest = store, manifest

    def latest(self, task_id: str) -> Manifest:
        return self.manifest

    def list(self, task_id: str) -> list[Manifest]:
        return [self.manifest]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_dense_training_is_stored_as_deltas_with_a_full_checkpoint_every_n(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    run = new_run(runs, store, env, every_steps=1, keep_full_every=3, delta_base="memory",
                  compress="always")
    run.steps(7, Cursor())
    manifests = store.list("local")
    assert [m.full for m in manifests] == [True, False, False, True, False, False, True]
    assert [m.chain for m in manifests] == [0, 1, 2, 0, 1, 2, 0]
    codecs = {c.codec for m in manifests for e in m.entries for c in e.chunks}
    assert "xor-zstd" in codecs
    for manifest in manifests:  # deltas are against the last full checkpoint
        depth = max(chain_depth(c) for e in manifest.entries for c in e.chunks)
        assert depth <= min(manifest.chain, 1)
    assert sum(m.new_bytes for m in manifests[1:3]) < 2 * manifests[0].new_bytes


@pytest.mark.parametrize("delta_base", ["store", "off"])
def test_deltas_against_the_store_or_none_restore_the_same(
        store: LocalStore, env: dict[str, str], runs: list[Run], delta_base: str) -> None:
    run = new_run(runs, store, env, every_steps=1, delta_base=delta_base, compress="always")
    run.steps(3, Cursor())
    codecs = {c.codec for m in store.list("local") for e in m.entries for c in e.chunks}
    assert ("xor-zstd" in codecs) == (delta_base == "store")
    assert run.ckpt.host_buffer_bytes < 1.2 * sum(
        t.numel() * t.element_size() for t in run.model.parameters()) * 3
    fresh = new_run(runs, store, env, seed=4)
    fresh.ckpt.resume()
    assert same(dict(fresh.model.state_dict()), dict(run.model.state_dict()))


class FailingStore(LocalStore):
    fail = True

    def commit(self, manifest: Manifest) -> Manifest:
        if self.fail:
            raise OSError("disk full")
        return super().commit(manifest)


def test_a_failed_checkpoint_is_reported_and_the_next_one_is_full(
        tmp_path: Path, env: dict[str, str], runs: list[Run]) -> None:
    store = FailingStore(tmp_path / "failing")
    run = new_run(runs, store, env, every_steps=1)
    cursor = Cursor()
    train_step(run.model, run.optimizer)
    cursor.advance()
    run.ckpt.after_step(cursor)
    with pytest.raises(CheckpointError, match="disk full"):
        run.ckpt.flush()
    assert run.ckpt.counters.failed == 1
    store.fail = False
    run.steps(2, cursor)
    assert [m.full for m in store.list("local")] == [True, False]
    assert run.ckpt.counters.committed == 2


def test_a_failure_made_good_by_a_later_checkpoint_does_not_fail_close(
        tmp_path: Path, env: dict[str, str], runs: list[Run]) -> None:
    """Found by the chaos suite: the disk full at one checkpoint, the last one durable after
    it was emptied, and close() still raised the old error (the step failed)."""
    store = FailingStore(tmp_path / "failing")
    run = new_run(runs, store, env, every_steps=1)
    cursor = Cursor()
    train_step(run.model, run.optimizer)
    cursor.advance()
    run.ckpt.after_step(cursor)  # fails on the persister thread; nobody flushes it
    deadline = time.monotonic() + 30
    # (failed, and no longer in flight: the failure is counted a moment before the
    # checkpointer is idle, and a busy checkpointer defers the next due checkpoint)
    while run.ckpt.counters.failed == 0 or run.ckpt._inflight is not None:
        assert time.monotonic() < deadline, "the checkpoint neither failed nor committed"
        time.sleep(0.01)
    store.fail = False
    train_step(run.model, run.optimizer)
    cursor.advance()
    assert run.ckpt.after_step(cursor), "the next due checkpoint was not started"
    run.ckpt.close()  # the last checkpoint is durable: nothing to raise
    assert [m.step for m in store.list("local")] == [2]


class FullForAWhile(LocalStore):
    """The checkpoint-store's answer while its disk is full, for the first `full` commits."""

    full = 2

    def commit(self, manifest: Manifest) -> Manifest:
        if self.full > 0:
            self.full -= 1
            raise StorageFull("checkpoint-store: the checkpoint disk is full")
        return super().commit(manifest)


def test_a_last_checkpoint_that_met_a_full_disk_is_taken_again_at_close(
        tmp_path: Path, env: dict[str, str], runs: list[Run]) -> None:
    """Found by the chaos suite (seed 1030): the disk full as training ended failed the
    step, although it had room again seconds later. close() takes the last checkpoint
    again while waiting may cure it; an error it cannot cure is raised at once."""
    store = FullForAWhile(tmp_path / "full")
    run = new_run(runs, store, env, every_steps=1)
    cursor = Cursor()
    for _ in range(2):
        train_step(run.model, run.optimizer)
        cursor.advance()
        run.ckpt.after_step(cursor)
    began = time.monotonic()
    run.ckpt.close()  # the step-1 and step-2 checkpoints failed; a third try at close
    assert 1.0 <= time.monotonic() - began < 30
    assert [m.step for m in store.list("local")] == [2]
    failing = FailingStore(tmp_path / "failing")  # OSError("disk full"), no errno: a bug
    other = new_run(runs, failing, env, every_steps=1)
    train_step(other.model, other.optimizer)
    other.ckpt.after_step(Cursor(step=1))
    with pytest.raises(CheckpointError, match="disk full"):
        other.ckpt.close()


class SlowStore(LocalStore):
    def put_chunks(self, chunks: Mapping[str, Payload]) -> None:
        time.sleep(0.2)
        super().put_chunks(chunks)


def test_a_save_due_while_one_persists_waits_and_requests_are_not_lost(
        tmp_path: Path, env: dict[str, str], runs: list[Run]) -> None:
    run = new_run(runs, SlowStore(tmp_path / "slow"), env, every_steps=1)
    cursor = Cursor()
    started = []
    for _ in range(3):
        train_step(run.model, run.optimizer)
        cursor.advance()
        started.append(run.ckpt.after_step(cursor))
    assert started == [True, False, False]
    assert run.ckpt.counters.deferred == 2
    run.ckpt.request("loss spike")
    run.ckpt.flush()
    train_step(run.model, run.optimizer)
    cursor.advance()
    assert run.ckpt.after_step(cursor)
    assert run.ckpt.reports[-1].reason == "loss spike"
    run.ckpt.flush()


def test_the_agents_signal_asks_for_a_checkpoint(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    before = signal.getsignal(signal.SIGUSR2)
    run = new_run(runs, store, {**env, "M27_CHECKPOINT_SIGNAL": "SIGUSR2"}, signal=True)
    cursor = Cursor()
    train_step(run.model, run.optimizer)
    cursor.advance()
    assert not run.ckpt.after_step(cursor)
    os.kill(os.getpid(), signal.SIGUSR2)
    assert run.ckpt.after_step(cursor)
    run.ckpt.close()
    assert run.ckpt.reports[-1].reason == "signal SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) == before
    runs.remove(run)


def test_inside_m27_the_agents_directory_task_and_attempt_are_used(
        tmp_path: Path, env: dict[str, str]) -> None:
    agent = {**env, "M27_CHECKPOINT_DIR": str(tmp_path / "task"), "M27_TASK_ID": "r1.train",
             "M27_ATTEMPT": "2"}
    run = Run(None, agent, every_steps=1)
    run.steps(1, Cursor())
    run.ckpt.close()
    (manifest,) = LocalStore(tmp_path / "task" / "m27-train").list("r1.train")
    assert (manifest.attempt, manifest.step, manifest.name) == (2, 1, "step-1")
    assert manifest.metadata["reason"] == "every 1 steps"


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    first = new_run(runs, store, env, every_steps=1)
    first.steps(3, Cursor())
    *_, before, latest = store.list("local")
    only_latest = sorted(chunk_ids(latest) - chunk_ids(before))
    assert only_latest
    path = store.chunks.path(only_latest[0])
    path.chmod(0o644)
    path.write_bytes(b"flipped by a failing disk")
    # the node-agent's upload of a program's own files is newer still, and is skipped too
    files = store.commit(Manifest(task_id="local", metadata={"kind": "files"}))
    assert store.latest("local") == files

    second = new_run(runs, store, env)
    assert second.ckpt.resume() == Cursor(step=2, batch=2)
    assert second.ckpt.counters.corrupt == 1
    assert second.ckpt.latest is not None
    assert second.ckpt.latest.checkpoint_id == before.checkpoint_id


def test_the_fallback_is_logged_through_the_programs_logging_never_printed(
        store: LocalStore, env: dict[str, str], runs: list[Run],
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    first = new_run(runs, store, env, every_steps=1)
    first.steps(3, Cursor())
    *_, before, latest = store.list("local")
    path = store.chunks.path(sorted(chunk_ids(latest) - chunk_ids(before))[0])
    path.chmod(0o644)
    path.write_bytes(b"flipped")
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="m27.train"):
        new_run(runs, store, env).ckpt.resume()
    events = [r.m27["event"] for r in caplog.records if r.name == "m27.train"]  # type: ignore[attr-defined]
    assert events == ["checkpoint_corrupt", "checkpoint_restored"]
    assert caplog.records[0].getMessage().startswith("checkpoint_corrupt task_id=local ")
    assert capsys.readouterr().out == ""


def test_when_every_checkpoint_is_damaged_resume_says_so(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    new_run(runs, store, env, every_steps=1).steps(1, Cursor())
    for chunk_id in chunk_ids(store.list("local")[0]):
        store.chunks.path(chunk_id).chmod(0o644)
        store.chunks.path(chunk_id).write_bytes(b"x")
    with pytest.raises(RestoreError, match="every checkpoint of local is damaged"):
        new_run(runs, store, env).ckpt.resume()


def test_a_checkpoint_of_another_model_is_refused_clearly(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    new_run(runs, store, env, every_steps=1).steps(1, Cursor())
    other = torch.nn.Linear(3, 3)
    ckpt = Checkpointer(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                        store=store, signal=False, environ=env)
    with pytest.raises(RestoreError, match="does not fit"):
        ckpt.resume()
    ckpt.close()


def test_extras_that_cannot_be_stored_are_refused_at_save(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    run = new_run(runs, store, env)
    ckpt = Checkpointer(model=run.model, optimizer=run.optimizer, store=store, signal=False,
                        environ=env, extras={"callback": print})
    with pytest.raises(CheckpointError, match="extras/callback"):
        ckpt.save(Cursor())
    ckpt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_and_empty_tensors_round_trip(
        store: LocalStore, env: dict[str, str], dtype: torch.dtype) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(700, 700), torch.nn.Linear(700, 0)).to(dtype)
    model.register_buffer("flag", torch.tensor(True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(model=model, optimizer=optimizer, store=store, signal=False,
                        environ=env)
    optimizer.zero_grad()
    model[0](torch.randn(2, 700, dtype=dtype)).float().sum().backward()
    optimizer.step()
    ckpt.save(Cursor(step=1), wait=True)
    ckpt.close()
    clone = torch.nn.Sequential(torch.nn.Linear(700, 700), torch.nn.Linear(700, 0)).to(dtype)
    clone.register_buffer("flag", torch.tensor(False))
    optimizer2 = torch.optim.SGD(clone.parameters(), lr=0.1, momentum=0.9)
    ckpt2 = Checkpointer(model=clone, optimizer=optimizer2, store=store, signal=False,
                         environ=env)
    ckpt2.resume()
    ckpt2.close()
    assert same(dict(clone.state_dict()), dict(model.state_dict()))
    assert same(optimizer2.state_dict(), optimizer.state_dict())


def ids(manifests: Sequence[Manifest]) -> list[str]:
    return [m.checkpoint_id for m in manifests]


def test_after_resume_a_full_checkpoint_starts_a_new_chain(
        store: LocalStore, env: dict[str, str], runs: list[Run]) -> None:
    """Deltas are against the last full checkpoint, whose bytes a resumed process does not
    hold: its first checkpoint is full (unchanged chunks are still not stored again)."""
    first = new_run(runs, store, env, every_steps=1, keep_full_every=4)
    first.steps(2, Cursor())
    second = new_run(runs, store, env, every_steps=1, keep_full_every=4, seed=8)
    cursor = second.ckpt.resume()
    assert cursor is not None
    assert cursor.step == 2
    second.steps(3, cursor)
    manifests = store.list("local")
    assert [m.chain for m in manifests] == [0, 1, 0, 1, 2]
    assert len(set(ids(manifests))) == 5
