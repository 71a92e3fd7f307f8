"""Exact resume of a PyTorch Lightning run through m27.train.lightning.M27Checkpoint: a
run SIGKILLed at a random step and resumed in a fresh process with
`trainer.fit(..., ckpt_path=ckpt.resume_path())` ends with parameters, optimizer state,
LR schedule, Lightning's loop counters and RNG states bitwise identical to a run never
interrupted (CPU); SIGTERM checkpoints the step it is at, then stops.

The program (`python tests/test_lightning_resume.py DIR STEPS`) mirrors
tests/test_train_resume.py: a shuffling ResumableSampler, an augmentation drawing from
torch's, numpy's and Python's global generators, dropout, BatchNorm, AdamW and a per-step
OneCycle schedule, a checkpoint every 2 optimizer steps, epochs of 12 batches, and
Lightning's own ModelCheckpoint saving at each epoch's end (through the same store).
"""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from m27.common.checkpoint_storage import LocalStore
from tests.test_train_resume import assert_bitwise_equal, run_program

torch = pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

STEPS = 40  # 12 batches per epoch: the run crosses three epoch boundaries
WORKER = Path(__file__).resolve()


def train(out: Path, steps: int) -> None:
    """The training program; prints `step N` after each optimizer step."""
    import time
    import warnings

    import numpy as np
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, Dataset

    from m27.train import ResumableSampler
    from m27.train.lightning import M27Checkpoint

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    slow_after = int(os.environ.get("M27_TEST_SLOW_AFTER") or 0)

    class Augmented(Dataset[tuple[Any, Any]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(1)
            self.x = torch.randn(96, 16, generator=generator)
            self.y = torch.randint(0, 4, (96,), generator=generator)

        def __len__(self) -> int:
            return 96

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            x = self.x[i] + 0.1 * torch.randn(16)
            if torch.rand(()) < 0.5:
                x = x.flip(0)
            x = x * float(1.0 + 0.05 * np.random.rand()) + 0.01 * random.random()
            return x, self.y[i]

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"hidden": 64, "note": object()})
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2,
                                                           total_steps=steps)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    class Report(pl.Callback):
        durable: int | None = 0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            print(f"step {trainer.global_step}", flush=True)
            latest = ckpt.checkpointer.latest if ckpt.checkpointer else None
            if latest is not None and latest.step != self.durable:
                self.durable = latest.step
                print(f"durable {latest.step}", flush=True)
            late = slow_after and trainer.global_step >= slow_after
            time.sleep(0.2 if late else 0.01)

    sampler = ResumableSampler(96, batch_size=8, seed=7)
    loader = DataLoader(Augmented(), batch_size=8, sampler=sampler, num_workers=0)
    ckpt = M27Checkpoint(every_steps=2, store=out / "store", signal=False)
    report = Report()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        callbacks=[ckpt, report, pl.callbacks.ModelCheckpoint(dirpath=out / "epochs")])
    model = Model()
    path = ckpt.resume_path()
    resumed = 0 if path is None else int(ckpt.load(path[4:])["global_step"])
    ckpt._loaded = None
    report.durable = resumed
    print(f"resumed {resumed}", flush=True)
    trainer.fit(model, loader, ckpt_path=path)
    optimizer = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "loops": {"global_step": trainer.global_step, "epoch": trainer.current_epoch},
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(legacy=False)["state"]["key"],
                "python_rng": random.getstate()}, out / "final.pt")


def run(out: Path, kill_at: int | None = None, how: signal.Signals = signal.SIGKILL
        ) -> tuple[bool, int]:
    return run_program(WORKER, out, STEPS, kill_at, how)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert run(out)[0]
    result: dict[str, Any] = torch.load(out / "final.pt", weights_only=False)
    return result


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_lightning_run_killed_at_a_random_step_resumes_bitwise_identically(
        seed: int, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(2, STEPS - 2), 2 if seed == 3 else 1))  # seed 3: twice
    starts = [run(tmp_path, kill_at)[1] for kill_at in kills]
    finished, resumed_from = run(tmp_path)
    assert finished
    assert 0 < resumed_from < STEPS, "the last run resumed from a checkpoint"
    assert starts[0] == 0
    assert starts == sorted(starts)
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert resumed["loops"] == uninterrupted["loops"] == {"global_step": STEPS, "epoch": 4}
    assert_bitwise_equal(resumed, uninterrupted)


@pytest.mark.parametrize("signal_at", [11, 13])
def test_sigterm_checkpoints_the_step_then_stops_and_nothing_is_redone(
        signal_at: int, tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    """At 11 the stop is served at step 12, the last batch of the first epoch: the resumed
    run starts at the next epoch (its DataLoader iterator drawn from the generators as in
    the uninterrupted run); at 13 within the second epoch."""
    assert not run(tmp_path, signal_at, signal.SIGTERM)[0]
    last = LocalStore(tmp_path / "store").latest("local")
    assert last is not None
    assert last.step is not None
    assert last.metadata["reason"] == "signal SIGTERM (stopping)"
    finished, resumed_from = run(tmp_path)
    assert finished
    assert resumed_from == last.step >= signal_at + 1
    resumed = torch.load(tmp_path / "final.pt", weights_only=False)
    assert_bitwise_equal(resumed, uninterrupted)


if __name__ == "__main__":
    train(Path(sys.argv[1]), int(sys.argv[2]))
