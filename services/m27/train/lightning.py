"""PyTorch Lightning through m27's checkpointer (the `lightning` extra).

    from m27.train import ResumableSampler
    from m27.train.lightning import M27Checkpoint

    ckpt = M27Checkpoint(every_steps=200)              # also on SIGUSR1 and on SIGTERM
    trainer = Trainer(callbacks=[ckpt], max_epochs=10)
    trainer.fit(model, loader, ckpt_path=ckpt.resume_path())   # None on a fresh start

The callback is a `m27.train.Checkpointer` over the LightningModule and its optimizer: a
checkpoint costs the loop a snapshot, it is encoded and written in the background as
differential chunks to the checkpoint-store (or ./checkpoints outside m27), and SIGTERM
(preemption, drain) checkpoints the current step and exits once that is durable. Each
checkpoint holds Lightning's own checkpoint (the dict `trainer.save_checkpoint` writes:
loop progress, callbacks, schedulers, precision plugin, hyper-parameters) with the model
and first optimizer stored as tensors, plus the RNG states and the data position.

Resuming goes through Lightning's own restore (`ckpt_path="m27:<checkpoint id>"`, read
by the callback's `M27CheckpointIO`, which it installs as the strategy's checkpoint IO),
then the callback puts the RNG states back and, with a `ResumableSampler` in the
training DataLoader, has the interrupted epoch continue at the next batch: the run goes
on bitwise as if never stopped (CPU; tests/test_lightning_resume.py). With another
sampler the interrupted epoch starts over, as Lightning warns. Other saves through the
trainer (`ModelCheckpoint`, `trainer.save_checkpoint(path)`) go to the store too, named
by their path; a path that is a file (an earlier run's `.ckpt`) is read with torch.load.

Limits: one process (no DDP/FSDP strategy yet: `m27.train.Checkpointer` itself handles
ranks); a checkpoint is taken only where the optimizer has just stepped (not within
gradient accumulation); a dataset that draws random numbers in DataLoader workers
(num_workers > 0) resumes exactly only if it seeds them from the index.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Final

import torch

from m27.common.checkpoint_format import CorruptChunk, Manifest
from m27.common.checkpoint_storage import CheckpointSink
from m27.train import _rng, _state
from m27.train._checkpointer import Checkpointer
from m27.train._cursor import Cursor, ResumableSampler
from m27.train._errors import CheckpointError, RestoreError
from m27.train._log import log
from m27.train._restore import read_checkpoint, train_checkpoints
from m27.train._stores import open_store, task_identity

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
except ImportError:  # the standalone distribution
    try:
        import pytorch_lightning as pl
        from pytorch_lightning.plugins.io import CheckpointIO, TorchCheckpointIO
    except ImportError as exc:
        raise ImportError("m27.train.lightning needs PyTorch Lightning: pip install "
                          "'m27[lightning]'") from exc

PREFIX: Final = "m27:"
EXTRA: Final = "lightning"  # the extras entry holding Lightning's checkpoint
#: Keys of Lightning's checkpoint whose values may be any object the program chose
#: (`save_hyperparameters`): what cannot be stored without pickle is kept as its repr.
FREE_FORM: Final = ("hyper_parameters", "datamodule_hyper_parameters")
NOT_RESUMABLE: Final = "You're resuming from a checkpoint that ended before the epoch ended"

__all__ = ["M27Checkpoint", "M27CheckpointIO"]


class M27Checkpoint(pl.Callback):
    """Checkpoints a Lightning run through m27 and resumes it exactly (module docstring).

    `every_steps`/`every_seconds`: when (optimizer steps, or wall time; inside m27 the
    step's `checkpoint:` interval applies when neither is given and no signal can be
    installed); the other keyword arguments are `m27.train.Checkpointer`'s (`store`,
    `task_id`, `keep_full_every`, `delta_base`, `compress`, `durable_within`, `signal`,
    `stop_signal`, ...)."""

    def __init__(self, *, every_steps: int | None = None, every_seconds: float | None = None,
                 store: CheckpointSink | str | os.PathLike[str] | None = None,
                 task_id: str | None = None, **options: Any) -> None:
        super().__init__()
        self.task_id, attempt = task_identity(task_id, os.environ)
        self.store = open_store(store, os.environ, task_id=self.task_id, attempt=attempt)
        self.options = {"every_steps": every_steps, "every_seconds": every_seconds,
                        "task_id": self.task_id, **options}
        self.io = M27CheckpointIO(self)
        self.checkpointer: Checkpointer | None = None
        self._trainer: Any = None
        self._given: dict[str, Any] | None = None  # a checkpoint the trainer built itself
        self._loaded: tuple[str, dict[str, Any]] | None = None  # (id, Lightning's dict)
        self._resumed: dict[str, Any] | None = None  # the "m27" part of the restored dict

    # ------------------------------------------------------------------ before fit

    def resume_path(self) -> str | None:
        """`ckpt_path` for `trainer.fit`: this task's latest checkpoint that reads back
        intact (a damaged one is reported and the one before it tried), or None."""
        tried = 0
        for manifest in self._candidates():
            tried += 1
            try:
                loaded = lightning_checkpoint(self.store, manifest)
            except CorruptChunk as exc:
                log.warning("checkpoint_corrupt", task_id=self.task_id,
                            checkpoint=manifest.checkpoint_id, error=str(exc),
                            action="trying the previous checkpoint")
                continue
            self._loaded = (manifest.checkpoint_id, loaded)
            return f"{PREFIX}{manifest.checkpoint_id}"
        if tried:
            raise RestoreError(f"every checkpoint of {self.task_id} is damaged ({tried} tried)")
        return None

    def _candidates(self) -> Iterator[Manifest]:
        return train_checkpoints(self.store, self.task_id)

    def load(self, checkpoint_id: str) -> dict[str, Any]:
        """Lightning's checkpoint dict of `checkpoint_id` (the IO's load_checkpoint)."""
        if self._loaded is not None and self._loaded[0] == checkpoint_id:
            loaded, self._loaded = self._loaded[1], None
            return loaded
        for manifest in self.store.list(self.task_id):
            if manifest.checkpoint_id == checkpoint_id:
                return lightning_checkpoint(self.store, manifest)
        raise RestoreError(f"no checkpoint {checkpoint_id!r} of task {self.task_id} in the "
                           "store")

    # ------------------------------------------------------------------ Lightning's hooks

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.world_size > 1:
            raise CheckpointError("m27.train.lightning runs in one process for now "
                                  f"(this trainer has {trainer.world_size}); "
                                  "m27.train.Checkpointer handles ranks in a plain loop")
        current = trainer.strategy.checkpoint_io
        if isinstance(current, M27CheckpointIO):
            current.owner = self
        else:
            trainer.strategy.checkpoint_io = self.io
        self._trainer = trainer

    def on_load_checkpoint(self, trainer: Any, pl_module: Any,
                           checkpoint: dict[str, Any]) -> None:
        self._resumed = checkpoint.get("m27")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = trainer.optimizers
        if not optimizers:
            raise CheckpointError("M27Checkpoint needs an optimizer (configure_optimizers)")
        # optimizer.step(closure) runs forward and backward inside the step: the snapshot
        # is waited for just before the update (on_before_optimizer_step), not at its start.
        self.checkpointer = Checkpointer(model=pl_module, optimizer=optimizers[0],
                                         extras={EXTRA: _LightningState(self)},
                                         store=self.store,
                                         **{**self.options, "wait_in_step": False})
        resumed, self._resumed = self._resumed, None
        if resumed is None:
            return
        cursor = Cursor.from_state(resumed["cursor"])
        manifest = next((m for m in self.store.list(self.task_id)
                         if m.checkpoint_id == resumed["checkpoint_id"]), None)
        if manifest is not None:
            self.checkpointer.continue_from(manifest, cursor)
        _rng.restore(resumed["rng"])
        self._continue_data(trainer, cursor)

    def _continue_data(self, trainer: Any, cursor: Cursor) -> None:
        """Have the interrupted epoch continue at `cursor`'s batch, with the RNG states as
        they were: the DataLoader iterator Lightning made before this hook drew its seed
        from the generators, which the uninterrupted run did at the start of the epoch, so
        a checkpoint from the end of an epoch makes (and drops) one iterator to draw it
        again."""
        total = trainer.num_training_batches
        loaders = list(_loaders(trainer.train_dataloader))
        if isinstance(total, int) and cursor.batch >= total:
            for loader in loaders:
                iter(loader)
            return
        samplers = [s for s in map(_sampler, loaders) if s is not None]
        if cursor.batch == 0:
            return
        if not samplers or len(samplers) != len(loaders):
            log.warning("lightning_epoch_restarts", task_id=self.task_id, epoch=cursor.epoch,
                        batch=cursor.batch, reason="the training DataLoader has no "
                        "m27.train.ResumableSampler: the interrupted epoch starts over")
            return
        for sampler in samplers:
            sampler.skip_once(cursor.epoch, cursor.batch)
        warnings.filterwarnings("ignore", message=NOT_RESUMABLE)  # (it is, through the sampler)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.checkpointer is None or _accumulating(trainer):
            return
        self.checkpointer.after_step(self._cursor(trainer, batch_idx + 1))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait_snapshot()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, SystemExit):  # (a stop signal served: closed already)
            return
        try:
            self._close()  # the last checkpoint taken, durable
        except CheckpointError as exc:
            log.warning("checkpoint_failed", task_id=self.task_id, error=str(exc),
                        while_handling=type(exception).__name__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        checkpointer, self.checkpointer = self.checkpointer, None
        if checkpointer is not None:
            checkpointer.close()

    # ------------------------------------------------------------------ saving

    def save_given(self, checkpoint: dict[str, Any], path: str) -> None:
        """A checkpoint the trainer built (`trainer.save_checkpoint`, ModelCheckpoint):
        taken by the checkpointer now, named by its path."""
        if self.checkpointer is None or self._trainer is None:
            raise CheckpointError(f"cannot save {path}: the trainer is not fitting (m27 "
                                  "stores Lightning checkpoints while trainer.fit runs)")
        self._given = checkpoint
        try:
            batch = self._trainer.fit_loop.epoch_loop.batch_progress.current.completed
            self.checkpointer.save(self._cursor(self._trainer, batch), f"lightning {path}")
        finally:
            self._given = None

    def lightning_state(self) -> dict[str, Any]:
        """Lightning's checkpoint now, without the model and first optimizer state (the
        checkpointer stores those itself)."""
        checkpoint = self._given
        if checkpoint is None:
            checkpoint = self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        if rest.get("optimizer_states"):
            rest["optimizer_states"] = [None, *rest["optimizer_states"][1:]]
        plain: dict[str, Any] = storable(rest)
        return plain

    @staticmethod
    def _cursor(trainer: Any, batch: int) -> Cursor:
        return Cursor(epoch=trainer.current_epoch, batch=batch, step=trainer.global_step)


class _LightningState:
    """The `extras` entry that reads Lightning's checkpoint when one is taken (restored
    by Lightning itself, through M27CheckpointIO)."""

    def __init__(self, owner: M27Checkpoint) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return self.owner.lightning_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RestoreError("a Lightning checkpoint is resumed through trainer.fit(..., "
                           "ckpt_path=M27Checkpoint.resume_path())")


class M27CheckpointIO(CheckpointIO):
    """The strategy's checkpoint IO while an M27Checkpoint is in the callbacks (it installs
    one; passing one in `plugins=` works too). `m27:<id>` paths are read from the store,
    other paths with torch.load; saves go to the store."""

    def __init__(self, owner: M27Checkpoint | None = None) -> None:
        self.owner = owner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        if self.owner is None:
            raise CheckpointError("M27CheckpointIO saves through an M27Checkpoint: add "
                                  "m27.train.lightning.M27Checkpoint() to the callbacks")
        self.owner.save_given(checkpoint, str(path))

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        text = str(path)
        if not text.startswith(PREFIX):
            return TorchCheckpointIO().load_checkpoint(  # type: ignore[no-any-return]
                path, weights_only=weights_only)
        if self.owner is None:
            raise RestoreError(f"cannot read {text}: add m27.train.lightning.M27Checkpoint() "
                               "to the callbacks")
        return self.owner.load(text.removeprefix(PREFIX))

    def remove_checkpoint(self, path: Any) -> None:
        """Nothing: the checkpoint-store keeps checkpoints by its own retention."""

    def teardown(self) -> None:
        if self.owner is not None:
            self.owner._close()


# ---------------------------------------------------------------------- pure helpers

def lightning_checkpoint(store: CheckpointSink, manifest: Manifest) -> dict[str, Any]:
    """Lightning's checkpoint dict from an M27Checkpoint checkpoint, with "m27": its id,
    RNG states and cursor (for the callback)."""
    skeleton, tensors = read_checkpoint(store, manifest)
    saved = skeleton.get("extras", {}).get(EXTRA)
    if not isinstance(saved, dict) or "stateful" not in saved:
        raise RestoreError(f"checkpoint {manifest.checkpoint_id} was not written by "
                           "m27.train.lightning.M27Checkpoint")
    checkpoint: dict[str, Any] = _state.decode(saved["stateful"], tensors)
    checkpoint["state_dict"] = _state.decode(skeleton["model"], tensors)
    states = checkpoint.get("optimizer_states") or [None]
    states[0] = _state.decode(skeleton["optimizer"], tensors)
    checkpoint["optimizer_states"] = states
    checkpoint["m27"] = {"checkpoint_id": manifest.checkpoint_id,
                         "rng": _state.decode(skeleton["rng"], tensors),
                         "cursor": skeleton["cursor"]}
    return checkpoint


def storable(value: Any, path: str = "", free: bool = False) -> Any:
    """`value` with mappings made plain dicts; under FREE_FORM keys, what m27 cannot store
    (no pickle: docs/training.md) becomes its repr. Anything else stays as it is (an
    unstorable value elsewhere fails the checkpoint naming its path)."""
    if isinstance(value, Mapping):
        return {k: storable(v, f"{path}/{k}", free or (not path and k in FREE_FORM))
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [storable(v, f"{path}/{i}", free) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if free and not isinstance(value, None | bool | int | float | str | bytes | torch.Tensor):
        return repr(value)
    return value


def _loaders(value: Any) -> Iterator[Any]:
    if isinstance(value, torch.utils.data.DataLoader):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _loaders(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _loaders(item)


def _sampler(loader: Any) -> ResumableSampler | None:
    for found in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(found, ResumableSampler):
            return found
    return None


def _accumulating(trainer: Any) -> bool:
    """Within gradient accumulation (no optimizer step at this batch)."""
    should = getattr(trainer.fit_loop, "_should_accumulate", None)
    return bool(should()) if callable(should) else False
