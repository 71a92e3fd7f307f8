"""Hugging Face `transformers.Trainer` through m27's checkpointer (the `huggingface` extra).

    from m27.train.huggingface import M27Callback

    ckpt = M27Callback(every_steps=200)               # also on SIGUSR1 and on SIGTERM
    trainer = Trainer(model=model, args=TrainingArguments(..., save_strategy="no"),
                      train_dataset=data, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume_dir())   # None on a fresh start

The callback is a `m27.train.Checkpointer` over the model, optimizer, LR scheduler and
GradScaler the Trainer made: a checkpoint costs the loop a snapshot, it is encoded and
written in the background as differential chunks to the checkpoint-store (or
./checkpoints outside m27), and SIGTERM (preemption, drain) checkpoints the current step
and exits once that is durable. Each checkpoint holds the Trainer's state (global step,
epoch, log history) and the RNG states with them.

Resuming goes through the Trainer's own resume: `resume_dir()` writes the latest
checkpoint that reads back intact as a Trainer checkpoint directory (model.safetensors,
optimizer.pt, scheduler.pt, scaler.pt, rng_state.pth, trainer_state.json) in a temporary
directory, removed once training is under way; the Trainer loads it, skips the batches
already trained and puts the RNG states back, and the run goes on bitwise as if never
stopped (CPU; tests/test_huggingface_resume.py).

Limits, the Trainer's own: it puts the RNG states back after fetching the first batch of
the resumed epoch, so random augmentation drawn from the global generators in the
main process (dataset or collator) differs for that one batch (the model's dropout does
not); one process (no DDP/DeepSpeed/FSDP yet); checkpoints at optimizer steps only. The
Trainer's own checkpoints (`save_strategy`) are not needed beside these.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import torch

from m27.common.checkpoint_format import CorruptChunk, Manifest
from m27.common.checkpoint_storage import CheckpointSink
from m27.train import _state
from m27.train._checkpointer import Checkpointer, scaler_state
from m27.train._cursor import Cursor
from m27.train._errors import CheckpointError, RestoreError
from m27.train._log import log
from m27.train._restore import read_checkpoint, train_checkpoints
from m27.train._stores import open_store, task_identity

try:
    from safetensors.torch import save_file
    from transformers import TrainerCallback, TrainerState
except ImportError as exc:
    raise ImportError("m27.train.huggingface needs transformers: pip install "
                      "'m27[huggingface]'") from exc

EXTRA: Final = "trainer_state"
# The Trainer's checkpoint file names (transformers.trainer, transformers.utils).
WEIGHTS: Final = "model.safetensors"
OPTIMIZER: Final = "optimizer.pt"
SCHEDULER: Final = "scheduler.pt"
SCALER: Final = "scaler.pt"
RNG: Final = "rng_state.pth"
TRAINER_STATE: Final = "trainer_state.json"

__all__ = ["M27Callback", "write_trainer_checkpoint"]


class M27Callback(TrainerCallback):
    """Checkpoints a `transformers.Trainer` run through m27 and resumes it exactly (module
    docstring). `every_steps`/`every_seconds`: when (optimizer steps, or wall time; inside
    m27 the step's `checkpoint:` interval applies when neither is given and no signal can
    be installed); `scratch`: where resume_dir() writes (default: the system's temporary
    directory); the other keyword arguments are `m27.train.Checkpointer`'s."""

    def __init__(self, *, every_steps: int | None = None, every_seconds: float | None = None,
                 store: CheckpointSink | str | os.PathLike[str] | None = None,
                 task_id: str | None = None, scratch: str | os.PathLike[str] | None = None,
                 **options: Any) -> None:
        self.task_id, attempt = task_identity(task_id, os.environ)
        self.store = open_store(store, os.environ, task_id=self.task_id, attempt=attempt)
        self.options = {"every_steps": every_steps, "every_seconds": every_seconds,
                        "task_id": self.task_id, **options}
        self.scratch = scratch
        self.checkpointer: Checkpointer | None = None
        self.state: Any = None  # the Trainer's TrainerState, read when a checkpoint is taken
        self._resumed: tuple[Manifest, Path] | None = None

    # ------------------------------------------------------------------ before train

    def resume_dir(self) -> str | None:
        """`resume_from_checkpoint` for `trainer.train`: this task's latest checkpoint that
        reads back intact, written as a Trainer checkpoint directory; None when there is
        none (a damaged one is reported and the one before it tried)."""
        tried = 0
        for manifest in self._candidates():
            tried += 1
            target = Path(tempfile.mkdtemp(prefix="m27-resume-", dir=self.scratch))
            try:
                write_trainer_checkpoint(self.store, manifest, target)
            except CorruptChunk as exc:
                shutil.rmtree(target, ignore_errors=True)
                log.warning("checkpoint_corrupt", task_id=self.task_id,
                            checkpoint=manifest.checkpoint_id, error=str(exc),
                            action="trying the previous checkpoint")
                continue
            except BaseException:
                shutil.rmtree(target, ignore_errors=True)
                raise
            atexit.register(shutil.rmtree, target, ignore_errors=True)
            self._resumed = (manifest, target)
            log.info("checkpoint_restored", task_id=self.task_id,
                     checkpoint=manifest.checkpoint_id, step=manifest.step, directory=str(target))
            return str(target)
        if tried:
            raise RestoreError(f"every checkpoint of {self.task_id} is damaged ({tried} tried)")
        return None

    def _candidates(self) -> Iterator[Manifest]:
        return train_checkpoints(self.store, self.task_id)

    # ------------------------------------------------------------------ the Trainer's hooks

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "world_size", 1) > 1:
            raise CheckpointError("m27.train.huggingface runs in one process for now (this "
                                  f"Trainer has {args.world_size}); m27.train.Checkpointer "
                                  "handles ranks in a plain loop")
        optimizer, schedule = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        model = kwargs.get("model")
        if optimizer is None or model is None:
            raise CheckpointError("M27Callback needs the Trainer's model and optimizer")
        if getattr(args, "save_strategy", "no") not in ("no", "SaveStrategy.NO"):
            log.info("trainer_checkpoints_too", save_strategy=str(args.save_strategy),
                     note="m27 checkpoints already; save_strategy='no' saves the disk")
        self.state = state
        self.checkpointer = Checkpointer(
            model=model, optimizer=getattr(optimizer, "optimizer", optimizer),
            scheduler=getattr(schedule, "scheduler", schedule),
            scaler=getattr(optimizer, "scaler", None),
            extras={EXTRA: _TrainerStateSource(self)}, store=self.store, **self.options)
        if self._resumed is not None:
            manifest, _ = self._resumed
            self.checkpointer.continue_from(manifest, self._cursor(state))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.state = state
            self.checkpointer.after_step(self._cursor(state))
        self._forget_resume_dir()  # read by now: the RNG states come before the first step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpointer, self.checkpointer = self.checkpointer, None
        self._forget_resume_dir()
        if checkpointer is not None:
            checkpointer.close()

    def _forget_resume_dir(self) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            shutil.rmtree(resumed[1], ignore_errors=True)

    @staticmethod
    def _cursor(state: Any) -> Cursor:
        epoch = float(state.epoch or 0.0)
        return Cursor(epoch=int(epoch), batch=0, step=int(state.global_step))


class _TrainerStateSource:
    """The `extras` entry that reads the TrainerState when a checkpoint is taken."""

    def __init__(self, owner: M27Callback) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(dataclasses.asdict(self.owner.state), sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RestoreError("a Trainer checkpoint is resumed through trainer.train("
                           "resume_from_checkpoint=M27Callback.resume_dir())")


def write_trainer_checkpoint(store: CheckpointSink, manifest: Manifest, target: Path) -> None:
    """Write checkpoint `manifest` of an M27Callback as the Trainer's checkpoint directory
    `target` (what `trainer.train(resume_from_checkpoint=...)` reads)."""
    skeleton, tensors = read_checkpoint(store, manifest)
    saved = skeleton.get("extras", {}).get(EXTRA)
    if not isinstance(saved, dict) or "stateful" not in saved:
        raise RestoreError(f"checkpoint {manifest.checkpoint_id} was not written by "
                           "m27.train.huggingface.M27Callback")
    state = TrainerState(**json.loads(_state.decode(saved["stateful"], tensors)["json"]))
    state.save_to_json(str(target / TRAINER_STATE))
    model = _state.decode(skeleton["model"], tensors)
    save_file({k: v.contiguous() for k, v in model.items()}, str(target / WEIGHTS),
              metadata={"format": "pt"})
    torch.save(_state.decode(skeleton["optimizer"], tensors), target / OPTIMIZER)
    if skeleton.get("scheduler") is not None:
        torch.save(_state.decode(skeleton["scheduler"], tensors), target / SCHEDULER)
    if skeleton.get("scaler") is not None and (scaler := scaler_state(skeleton["scaler"],
                                                                       tensors)):
        torch.save(scaler, target / SCALER)
    rng = _state.decode(skeleton["rng"], tensors)
    trainer_rng = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    if rng.get("cuda"):
        trainer_rng["cuda"] = rng["cuda"][0]  # one process: the Trainer's one device
    torch.save(trainer_rng, target / RNG)
