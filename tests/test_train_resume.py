"""Exact resume: a run SIGKILLed at a random step and resumed in a fresh process ends with
parameters, optimizer state, scheduler, extras and RNG states bitwise identical to a run
that was never interrupted (CPU).

The training program (run as a subprocess: `python tests/test_train_resume.py DIR STEPS`)
uses a DataLoader (num_workers=0) with a shuffling ResumableSampler, a random augmentation
drawing from torch's, numpy's and Python's global generators, dropout, BatchNorm (buffers
that the forward pass changes), AdamW and a per-step LR schedule, and checkpoints every
2 steps (a due checkpoint waits while the previous one persists, so kills land before,
during and after persists, and across epoch boundaries).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from m27.common.checkpoint_storage import LocalStore

torch = pytest.importorskip("torch")

STEPS = 40  # 12 batches per epoch: the run crosses three epoch boundaries
WORKER = Path(__file__).resolve()


def train(out: Path, steps: int) -> None:
    """The training program; prints `step N` after each step."""
    import numpy as np
    from torch.utils.data import DataLoader, Dataset

    from m27.train import Checkpointer, Cursor, ResumableSampler

    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    class Augmented(Dataset[tuple[Any, Any]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(1)
            self.x = torch.randn(96, 16, generator=generator)
            self.y = torch.randint(0, 4, (96,), generator=generator)

        def __len__(self) -> int:
            return 96

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            x = self.x[i] + 0.1 * torch.randn(16)  # torch's global generator
            if torch.rand(()) < 0.5:
                x = x.flip(0)
            x = x * float(1.0 + 0.05 * np.random.rand()) + 0.01 * random.random()
            return x, self.y[i]

    sampler = ResumableSampler(96, batch_size=8, seed=7)
    loader = DataLoader(Augmented(), batch_size=8, sampler=sampler, num_workers=0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=steps)
    extras: dict[str, Any] = {"loss_sum": 0.0, "losses": []}
    ckpt = Checkpointer(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                        extras=extras, every_steps=2, store=out / "store", signal=False)
    cursor = ckpt.resume() or Cursor()
    slow_after = int(os.environ.get("M27_TEST_SLOW_AFTER") or 0)
    print(f"resumed {cursor.step}", flush=True)
    durable: int | None = cursor.step
    while cursor.step < steps:
        sampler.start(cursor)
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            extras["loss_sum"] += float(loss.detach())
            extras["losses"].append(round(float(loss.detach()), 6))
            cursor.advance()
            ckpt.after_step(cursor)
            print(f"step {cursor.step}", flush=True)
            if ckpt.latest is not None and ckpt.latest.step != durable:
                durable = ckpt.latest.step
                print(f"durable {durable}", flush=True)
            import time
            # a realistic cadence: checkpoints persist across steps; slower from the step
            # the test signals at, so a loaded machine cannot finish the run first
            time.sleep(0.2 if slow_after and cursor.step >= slow_after else 0.01)
            if cursor.step >= steps:
                break
        if cursor.batch >= len(loader.batch_sampler):  # type: ignore[arg-type]
            cursor.next_epoch()
    ckpt.close()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "extras": dict(ckpt.extras),
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(legacy=False)["state"]["key"],
                "python_rng": random.getstate(), "cursor": cursor.state_dict()},
               out / "final.pt")


def run(out: Path, kill_at: int | None = None, how: signal.Signals = signal.SIGKILL
        ) -> tuple[bool, int]:
    return run_program(WORKER, out, STEPS, kill_at, how)


def run_program(worker: Path, out: Path, steps: int, kill_at: int | None = None,
                how: signal.Signals = signal.SIGKILL, timeout: float = 180.0
                ) -> tuple[bool, int]:
    """Run a training program (`python WORKER OUT STEPS`, printing `resumed N`, `step N`
    and `durable N`); send it `how` once it reports step `kill_at` or later and some
    checkpoint exists (on a loaded machine the first one may not be durable by then).
    (Whether it finished, the step it resumed from.)"""
    env = {**os.environ, "PYTHONPATH": str(worker.parent.parent),
           "M27_TEST_SLOW_AFTER": str(kill_at if how == signal.SIGTERM else 0)}
    proc = subprocess.Popen([sys.executable, str(worker), str(out), str(steps)],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    resumed, durable = -1, False
    for line in proc.stdout:
        if line.startswith("resumed "):
            resumed = int(line.split()[1])
            durable = resumed > 0
        durable = durable or line.startswith("durable ")
        if kill_at is not None and line.startswith("step ") and \
                int(line.split()[1]) >= kill_at and durable:
            proc.send_signal(how)
            if how == signal.SIGKILL:
                break
    proc.stdout.close()
    code = proc.wait(timeout=timeout)
    if kill_at is None or code == 0:
        assert code == 0, f"the training program failed ({code})"
        return True, resumed
    # SIGTERM: checkpoint-then-stop, so the program exits by itself with 128+15
    assert code == (-signal.SIGKILL if how == signal.SIGKILL else 128 + how)
    return False, resumed


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        pairs = value.items()
    elif isinstance(value, list | tuple):
        pairs = enumerate(value)  # type: ignore[assignment]
    else:
        return {prefix: value}
    return {k: v for key, item in pairs for k, v in flat(item, f"{prefix}/{key}").items()}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    left, right = flat(a), flat(b)
    assert left.keys() == right.keys()
    for key in left:
        x, y = left[key], right[key]
        if isinstance(x, torch.Tensor):
            assert (x.dtype, x.shape) == (y.dtype, y.shape), key
            assert x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), key
        elif hasattr(x, "tobytes"):
            assert x.tobytes() == y.tobytes(), key
        else:
            assert x == y, key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run(out)[0]
    result: dict[str, Any] = torch.load(out / "final.pt", weights_only=False)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_run_killed_at_a_random_step_resumes_bitwise_identically(
        seed: int, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(2, STEPS - 2), 2 if seed == 4 else 1))  # seed 4: twice
    starts = [run(tmp_path, kill_at)[1] for kill_at in kills]
    finished, resumed_from = run(tmp_path)
    assert finished
    assert 0 < resumed_from < STEPS, "the last run resumed from a checkpoint"
    assert starts[0] == 0
    assert starts == sorted(starts)
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert resumed["cursor"] == uninterrupted["cursor"]
    assert_bitwise_equal(resumed, uninterrupted)


def test_sigterm_checkpoints_then_stops_and_the_resume_loses_no_step(
        tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """The node-agent stops a step (preemption, drain, node shutdown) with SIGTERM and a
    grace period: the Checkpointer saves the step it is at, waits until that is durable,
    then exits, so the next attempt starts exactly where this one stopped."""
    assert not run(tmp_path, 13, signal.SIGTERM)[0]
    last = LocalStore(tmp_path / "store").latest("local")
    assert last is not None
    assert last.step is not None
    assert last.metadata["reason"] == "signal SIGTERM (stopping)"
    finished, resumed_from = run(tmp_path)
    assert finished
    assert resumed_from == last.step >= 14  # the step after the signal arrived
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert_bitwise_equal(resumed, uninterrupted)


if __name__ == "__main__":
    train(Path(sys.argv[1]), int(sys.argv[2]))
