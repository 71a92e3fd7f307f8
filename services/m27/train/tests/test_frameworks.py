"""m27.train.lightning and m27.train.huggingface in process: how they are wired, and the
clear errors for what they cannot do (the exact-resume tests with SIGKILL are
tests/test_lightning_resume.py and tests/test_huggingface_resume.py)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from m27.common.checkpoint_storage import LocalStore
from m27.train import Checkpointer, CheckpointError, Cursor, RestoreError, _snapshot

pytest.importorskip("pytorch_lightning")
import pytorch_lightning as pl

from m27.train import lightning


class Tiny(pl.LightningModule):
    def __init__(self, note: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 4, "note": note})
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, index: int) -> Any:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> Any:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)),
                                       batch_size=4)


def trainer(tmp_path: Path, callbacks: list[Any], steps: int = 4, **options: Any) -> Any:
    warnings.filterwarnings("ignore")
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=callbacks, **options)


def test_the_io_given_as_a_plugin_is_used_with_the_callback_and_every_save_is_stored(
        tmp_path: Path) -> None:
    io = lightning.M27CheckpointIO()
    ckpt = lightning.M27Checkpoint(every_steps=2, store=tmp_path / "store", signal=False)
    model = Tiny(note=object())  # not storable without pickle: kept as its repr
    fit = trainer(tmp_path, [ckpt], plugins=[io], enable_checkpointing=True)
    fit.fit(model, loader())
    assert io.owner is ckpt
    manifests = LocalStore(tmp_path / "store").list("local")
    reasons = [m.metadata["reason"] for m in manifests]
    assert reasons[0] == "every 2 steps", reasons
    # ModelCheckpoint's save at the epoch's end, through the IO, named by its path
    assert reasons[-1] == f"lightning {tmp_path / 'checkpoints' / 'epoch=0-step=4.ckpt'}"
    path = ckpt.resume_path()
    assert path is not None
    assert path.startswith("m27:")
    restored = ckpt.io.load_checkpoint(path)
    assert restored["global_step"] == 4
    assert restored["hyper_parameters"]["note"].startswith("<object object at")
    assert torch.equal(restored["state_dict"]["net.weight"], model.net.weight.detach())


def test_each_checkpoint_is_its_steps_state_however_slow_the_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning runs forward and backward inside optimizer.step(closure): the callback
    waits for the snapshot copy just before the update, not at the step's start (where
    the wait would stall the whole forward and backward); a copy slower than a step must
    still see the parameters of the step it was taken at."""
    copy = _snapshot.Copier.copy

    def slow_copy(self: _snapshot.Copier, snapshot: _snapshot.Snapshot) -> None:
        time.sleep(0.3)
        copy(self, snapshot)

    monkeypatch.setattr(_snapshot.Copier, "copy", slow_copy)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            seen[trainer.global_step] = {k: v.clone() for k, v in module.state_dict().items()}
            time.sleep(0.1)  # the next update comes before the copy is done

    ckpt = lightning.M27Checkpoint(every_steps=2, store=tmp_path / "store", signal=False)
    trainer(tmp_path, [Record(), ckpt], steps=8, enable_checkpointing=False).fit(
        Tiny(), loader())
    store = LocalStore(tmp_path / "store")
    manifests = store.list("local")
    assert len(manifests) >= 2
    for manifest in manifests:
        assert manifest.step is not None
        state = lightning.lightning_checkpoint(store, manifest)["state_dict"]
        assert all(torch.equal(state[k], seen[manifest.step][k]) for k in state), manifest.step


def test_a_fresh_task_has_no_resume_path_and_unknown_ids_are_named(tmp_path: Path) -> None:
    ckpt = lightning.M27Checkpoint(store=tmp_path / "store", signal=False)
    assert ckpt.resume_path() is None
    with pytest.raises(RestoreError, match="no checkpoint 'c-nope' of task local"):
        ckpt.io.load_checkpoint("m27:c-nope")


def test_the_io_alone_says_what_it_needs(tmp_path: Path) -> None:
    io = lightning.M27CheckpointIO()
    with pytest.raises(CheckpointError, match=r"add m27\.train\.lightning\.M27Checkpoint"):
        io.save_checkpoint({}, tmp_path / "x.ckpt")
    with pytest.raises(RestoreError, match=r"add m27\.train\.lightning\.M27Checkpoint"):
        io.load_checkpoint("m27:c-1")
    io.remove_checkpoint(tmp_path / "x.ckpt")  # the store keeps by its own retention


def test_a_file_path_is_read_as_lightning_writes_it(tmp_path: Path) -> None:
    torch.save({"global_step": 7}, tmp_path / "old.ckpt")
    assert lightning.M27CheckpointIO().load_checkpoint(tmp_path / "old.ckpt") == \
        {"global_step": 7}


def test_a_checkpoint_of_a_plain_loop_is_not_taken_for_a_lightning_one(tmp_path: Path
                                                                       ) -> None:
    model = torch.nn.Linear(4, 2)
    plain = Checkpointer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         store=tmp_path / "store", signal=False)
    plain.save(Cursor(step=1), wait=True)
    plain.close()
    with pytest.raises(RestoreError, match=r"not written by m27\.train\.lightning"):
        lightning.M27Checkpoint(store=tmp_path / "store", signal=False).resume_path()


def test_hyper_parameters_are_made_storable_and_nothing_else_is_touched() -> None:
    thing = object()
    plain = lightning.storable({"hyper_parameters": {"a": [1, thing], "b": (2.0, "x")},
                                "loops": {"n": 1, "other": thing}})
    assert plain["hyper_parameters"] == {"a": [1, repr(thing)], "b": (2.0, "x")}
    assert plain["loops"]["other"] is thing  # elsewhere it fails at save, naming its path


def test_the_trainer_callback_starts_fresh_and_refuses_other_checkpoints(
        tmp_path: Path) -> None:
    huggingface = pytest.importorskip("m27.train.huggingface")
    ckpt = huggingface.M27Callback(store=tmp_path / "store", signal=False,
                                   scratch=tmp_path)
    assert ckpt.resume_dir() is None
    model = torch.nn.Linear(4, 2)
    plain = Checkpointer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         store=tmp_path / "store", signal=False)
    plain.save(Cursor(step=1), wait=True)
    plain.close()
    with pytest.raises(RestoreError, match=r"not written by m27\.train\.huggingface"):
        ckpt.resume_dir()
    assert not list(tmp_path.glob("m27-resume-*")), "a failed resume leaves no directory"
