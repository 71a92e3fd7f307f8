"""Exact resume of a gang: two processes (gloo on 127.0.0.1), one of them SIGKILLed at a
random step, the other killed after it (as the node-agent kills a gang), both restarted:
every rank ends with parameters, optimizer state, scheduler, extras, RNG states, sampler
and cursor bitwise identical to a two-process run never interrupted (CPU).

Two layouts: DDP (replicated model and optimizer: rank 0 saves them once) and FSDP2
(`fully_shard`: each rank saves its own shard of the parameters and optimizer state).
Each rank trains on its own data shard with its own ResumableSampler, a random
augmentation from torch's, numpy's and Python's generators and dropout, all seeded per
rank; checkpoints every 2 steps. The program runs as `python tests/test_train_ranks.py
MODE OUT RANK WORLD STEPS RENDEZVOUS`; rank 0 prints its progress.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from m27.common.checkpoint_storage import LocalStore
from tests.test_train_resume import assert_bitwise_equal

torch = pytest.importorskip("torch")

STEPS = 20  # 6 batches per epoch: three epoch boundaries
WORLD = 2
WORKER = Path(__file__).resolve()


def rendezvous(rank: int, world: int, port_file: Path) -> Any:
    """A TCPStore on a free port: rank 0 binds port 0 and writes the port it got."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        port_file.with_suffix(".tmp").write_text(str(store.port))
        port_file.with_suffix(".tmp").replace(port_file)
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never wrote its port")
        time.sleep(0.02)
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(port_file.read_text()), world, is_master=False)


def local(value: Any) -> Any:
    """A state dict with every DTensor replaced by its local shard (for torch.save)."""
    if hasattr(value, "to_local"):
        return value.to_local().clone()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(local(v) for v in value)
    return value


def train(mode: str, out: Path, rank: int, world: int, steps: int, port_file: Path) -> None:
    """The training program of one rank."""
    import numpy as np
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from m27.train import Checkpointer, Cursor, ResumableSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous(rank, world, port_file), rank=rank,
                            world_size=world)
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 8192),  # 2 MiB: entries of their own
                                torch.nn.ReLU(), torch.nn.Linear(8192, 4))
    random.seed(100 + rank)  # every rank draws its own random numbers
    np.random.seed(100 + rank)
    torch.manual_seed(1000 + rank)

    class Augmented(Dataset[tuple[Any, Any]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(1 + rank)  # this rank's data shard
            self.x = torch.randn(48, 16, generator=generator)
            self.y = torch.randint(0, 4, (48,), generator=generator)

        def __len__(self) -> int:
            return 48

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            x = self.x[i] + 0.1 * torch.randn(16)
            x = x * float(1.0 + 0.05 * np.random.rand()) + 0.01 * random.random()
            return x, self.y[i]

    sampler = ResumableSampler(48, batch_size=8, seed=7 + rank)
    loader = DataLoader(Augmented(), batch_size=8, sampler=sampler, num_workers=0)
    if mode == "ddp":
        net: Any = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[4], model[6]):
            fully_shard(layer)
        net = fully_shard(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    extras: dict[str, Any] = {"losses": []}
    ckpt = Checkpointer(model=net, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                        extras=extras, every_steps=2, store=out / "store", signal=False,
                        sharded=mode == "fsdp", rank_timeout=60)
    cursor = ckpt.resume() or Cursor()
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"resumed {cursor.step}", flush=True)
    durable = cursor.step
    slow_after = int(os.environ.get("M27_TEST_SLOW_AFTER") or 0)
    while cursor.step < steps:
        sampler.start(cursor)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            extras["losses"].append(round(float(loss.detach()), 6))
            cursor.advance()
            ckpt.after_step(cursor)
            say(f"step {cursor.step}", flush=True)
            if ckpt.latest is not None and ckpt.latest.step != durable:
                durable = ckpt.latest.step or 0
                say(f"durable {durable}", flush=True)
            # checkpoints persist across steps; slower from the step the test signals at
            time.sleep(0.2 if slow_after and cursor.step >= slow_after else 0.02)
            if cursor.step >= steps:
                break
        if cursor.batch >= len(loader.batch_sampler):  # type: ignore[arg-type]
            cursor.next_epoch()
    ckpt.close()
    torch.save({"model": local(net.state_dict()), "optimizer": local(optimizer.state_dict()),
                "scheduler": scheduler.state_dict(), "extras": dict(ckpt.extras),
                "sampler": sampler.state_dict(), "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(legacy=False)["state"]["key"],
                "python_rng": random.getstate(), "cursor": cursor.state_dict()},
               out / f"final{rank}.pt")
    dist.destroy_process_group()


def run(mode: str, out: Path, kill_at: int | None = None, victim: int = 0,
        how: signal.Signals = signal.SIGKILL) -> tuple[list[int], int]:
    """Run both ranks; send `victim` `how` once rank 0 reports step `kill_at` or later and
    a checkpoint is durable (steps are slower from `kill_at` on, so it lands before the
    end). SIGKILL: the other rank fails on its own or hangs, and is killed after 5 s.
    Returns the exit codes and the step the run resumed from."""
    runs = len(list(out.glob("rendezvous-*")))
    port_file = out / f"rendezvous-{runs}"
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent),
           "M27_TEST_SLOW_AFTER": str(kill_at or 0)}
    procs = [subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(out), str(rank), str(WORLD), str(STEPS),
         str(port_file)], env=env, text=True,
        stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
        stderr=(out / f"stderr-{runs}-{rank}").open("w"))
        for rank in range(WORLD)]
    try:
        resumed = _watch(procs, kill_at, victim, how)
        if how == signal.SIGKILL and kill_at is not None:
            _kill_the_gang(procs, victim)
        return [proc.wait(timeout=120) for proc in procs], resumed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _watch(procs: list[subprocess.Popen[str]], kill_at: int | None, victim: int,
           how: signal.Signals) -> int:
    assert procs[0].stdout is not None
    resumed, durable = -1, False
    for line in procs[0].stdout:
        if line.startswith("resumed "):
            resumed = int(line.split()[1])
            durable = resumed > 0
        durable = durable or line.startswith("durable ")
        if kill_at is not None and line.startswith("step ") and \
                int(line.split()[1]) >= kill_at and durable:
            procs[victim].send_signal(how)
            kill_at = None
            if how == signal.SIGKILL:
                break
    return resumed


def _kill_the_gang(procs: list[subprocess.Popen[str]], victim: int) -> None:
    """What the node-agent does when a gang's rank dies: the rest goes too."""
    procs[victim].wait(timeout=30)
    with contextlib.suppress(subprocess.TimeoutExpired):
        procs[1 - victim].wait(timeout=5)
    procs[1 - victim].kill()


def finals(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"final{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[[str], list[dict[str, Any]]]:
    """The final state of each rank of a gang never interrupted, per mode."""
    cached: dict[str, list[dict[str, Any]]] = {}

    def get(mode: str) -> list[dict[str, Any]]:
        if mode not in cached:
            out = tmp_path_factory.mktemp(f"uninterrupted-{mode}")
            assert run(mode, out) == ([0] * WORLD, 0)
            cached[mode] = finals(out)
            assert not _ranks_alike(cached[mode])
        return cached[mode]
    return get


def assert_same_finals(out: Path, expected: list[dict[str, Any]]) -> None:
    for rank, resumed in enumerate(finals(out)):
        assert resumed["cursor"] == expected[rank]["cursor"]
        assert_bitwise_equal(resumed, expected[rank])


@pytest.mark.slow
def test_a_ddp_gang_with_a_rank_killed_at_a_random_step_resumes_bitwise_identically(
        tmp_path: Path, uninterrupted: Callable[[str], list[dict[str, Any]]]) -> None:
    """DDP: rank 1 SIGKILLed at a random step (rank 0 then fails or is killed); the
    restarted gang resumes from the last checkpoint every rank completed and ends exactly
    as a gang never interrupted."""
    kill_at = random.Random(1).randrange(3, STEPS - 3)
    codes, started = run("ddp", tmp_path, kill_at, victim=1)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0, "rank 0 cannot finish alone"
    assert started == 0
    codes, resumed_from = run("ddp", tmp_path)
    assert codes == [0] * WORLD
    assert 0 < resumed_from < STEPS
    assert_same_finals(tmp_path, uninterrupted("ddp"))


@pytest.mark.slow
def test_an_fsdp_gang_stopped_on_one_rank_then_killed_resumes_bitwise_identically(
        tmp_path: Path, uninterrupted: Callable[[str], list[dict[str, Any]]]) -> None:
    """FSDP2, each rank saving its own shard. SIGTERM reaches rank 1 only: the ranks agree
    to stop at one step, checkpoint it and exit 143 together; the next run resumes at
    exactly that step, then rank 0 (the one that commits) is SIGKILLed at a random step;
    the third run ends exactly as a gang never interrupted."""
    stop_at, kill_at = random.Random(2).randrange(3, 8), random.Random(3).randrange(11, 16)
    codes, _ = run("fsdp", tmp_path, stop_at, victim=1, how=signal.SIGTERM)
    assert codes == [128 + signal.SIGTERM] * WORLD
    last = LocalStore(tmp_path / "store").latest("local")
    assert last is not None
    assert last.step is not None
    assert last.metadata["reason"] == "signal SIGTERM (stopping)"
    assert last.metadata["ranks"] == str(WORLD)
    codes, resumed_from = run("fsdp", tmp_path, kill_at, victim=0)
    assert resumed_from == last.step > stop_at
    assert codes[0] == -signal.SIGKILL
    assert codes[1] != 0, "rank 1 cannot finish alone"
    codes, resumed_from = run("fsdp", tmp_path)
    assert codes == [0] * WORLD
    assert last.step <= resumed_from < STEPS
    assert_same_finals(tmp_path, uninterrupted("fsdp"))


def faults(out: Path, rank: int, world: int, port_file: Path) -> None:
    """A gang program meeting faults; writes what each rank saw to `faults{rank}.json`:
    rank 1's store fails while its part uploads; later a chunk only rank 1 reads is
    damaged before both ranks resume."""
    import json

    import torch.distributed as dist

    from m27.train import Checkpointer, CheckpointError, Cursor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=rendezvous(rank, world, port_file), rank=rank,
                            world_size=world)

    class Flaky(LocalStore):
        failing = False

        def put_chunks(self, chunks: Any) -> None:
            if self.failing:
                raise OSError("disk full (the test's)")
            super().put_chunks(chunks)

    def program() -> tuple[Any, Any, Checkpointer, Flaky]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        store = Flaky(out / "store")
        return model, optimizer, Checkpointer(
            model=model, optimizer=optimizer, store=store, signal=False, stop_signal=False,
            rank_timeout=30), store

    model, optimizer, ckpt, store = program()
    torch.manual_seed(rank)  # each rank's own RNG state: its own "packed" entry
    seen: dict[str, Any] = {}
    cursor = Cursor()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        cursor.advance()
        store.failing = rank == 1 and cursor.step == 1
        try:
            ckpt.save(cursor, wait=True)
            seen[f"step {cursor.step}"] = "committed"
        except CheckpointError as exc:
            seen[f"step {cursor.step}"] = str(exc)
        seen[f"manifests after {cursor.step}"] = len(store.list("local"))
    assert ckpt.latest is not None
    seen["latest"] = ckpt.latest.checkpoint_id
    ckpt.close()
    dist.barrier()
    if rank == 0:
        *_, before, latest = store.list("local")
        entry = latest.entry("rank1/packed")
        assert entry is not None
        path = store.chunks.path(entry.chunks[0].id)
        path.chmod(0o644)
        path.write_bytes(b"flipped by a failing disk")
        seen["before"] = before.checkpoint_id
    dist.barrier()
    _, _, ckpt, _ = program()
    resumed = ckpt.resume()
    assert resumed is not None
    assert ckpt.latest is not None
    seen.update(resumed=resumed.step, corrupt=ckpt.counters.corrupt,
                restored=ckpt.latest.checkpoint_id)
    ckpt.close()
    (out / f"faults{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_ranks_failure_fails_the_gangs_checkpoint_and_damage_sends_all_ranks_back(
        tmp_path: Path) -> None:
    """One rank's failed upload fails the checkpoint on every rank (none is committed, no
    rank waits); a chunk damaged in the part only rank 1 reads sends both ranks back to
    the checkpoint before, together."""
    import json

    port_file = tmp_path / "rendezvous"
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent.parent)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "faults", str(tmp_path),
                               str(rank), str(WORLD), "0", str(port_file)], env=env)
             for rank in range(WORLD)]
    assert [proc.wait(timeout=120) for proc in procs] == [0] * WORLD
    seen = [json.loads((tmp_path / f"faults{rank}.json").read_text()) for rank in range(WORLD)]
    assert "rank 1: disk full (the test's)" in seen[0]["step 1"]
    for rank in range(WORLD):
        assert "disk full (the test's)" in seen[rank]["step 1"]
        assert seen[rank]["manifests after 1"] == 0
        assert seen[rank]["step 2"] == seen[rank]["step 3"] == "committed"
        assert seen[rank]["manifests after 3"] == 2
        assert seen[rank]["latest"] == seen[0]["latest"]  # one manifest for the gang
        assert (seen[rank]["resumed"], seen[rank]["corrupt"]) == (2, 1)
        assert seen[rank]["restored"] == seen[0]["before"]


def _ranks_alike(finals: list[dict[str, Any]]) -> bool:
    """Whether the ranks' own state is alike (then the test would not notice a rank
    restored from another's entries)."""
    a, b = finals
    return bool(a["torch_rng"].equal(b["torch_rng"]) or a["extras"] == b["extras"])


if __name__ == "__main__":
    if sys.argv[1] == "faults":
        faults(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[6]))
    else:
        train(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
              int(sys.argv[5]), Path(sys.argv[6]))
