"""Where the data stands: the cursor of the next batch, and a sampler whose order depends
only on (seed, epoch), so a resumed run draws exactly the batches it would have drawn."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.utils.data import Sampler

_MASK: Final = 2**64 - 1


@dataclass
class Cursor:
    """The position of the next batch: `epoch`, `batch` (its index within the epoch) and
    `step` (the global batch index: batches trained on so far, over all epochs)."""

    epoch: int = 0
    batch: int = 0
    step: int = 0

    def advance(self, batches: int = 1) -> None:
        """One (or more) batches trained on: call after the optimizer step."""
        self.batch += batches
        self.step += batches

    def next_epoch(self) -> None:
        self.epoch += 1
        self.batch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch, self.step = state["epoch"], state["batch"], state["step"]

    @classmethod
    def from_state(cls, state: dict[str, int]) -> Cursor:
        cursor = cls()
        cursor.load_state_dict(state)
        return cursor


def epoch_seed(seed: int, epoch: int) -> int:
    """A well-mixed 63-bit seed for one epoch (splitmix64 of seed and epoch)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def epoch_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The sample order of an epoch: a permutation from its own generator (never torch's
    global one), so it is the same in every process that asks."""
    if not shuffle:
        return torch.arange(size)
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(size, generator=generator)


class ResumableSampler(Sampler[int]):
    """Sample indices for a DataLoader, in an order derived from (seed, epoch), starting at
    any batch of the epoch.

        sampler = ResumableSampler(len(dataset), batch_size=64, seed=0)
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        ...
        sampler.start(cursor)        # at the top of each epoch: skips batches done

    `batch_size` must be the loader's, so that batch `b` starts at sample `b * batch_size`.
    """

    def __init__(self, size: int, *, batch_size: int = 1, shuffle: bool = True,
                 seed: int = 0) -> None:
        if size < 0 or batch_size < 1:
            raise ValueError("size must be ≥ 0 and batch_size ≥ 1")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.start_batch = 0, 0
        self._skip: tuple[int, int] | None = None  # (epoch, batches): skip_once
        self._before_next_iteration: Callable[[], None] | None = None

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def start(self, cursor: Any) -> None:
        """Iterate the cursor's epoch from its batch on (a `Cursor`)."""
        self.set_epoch(cursor.epoch, cursor.batch)

    def skip_once(self, epoch: int, batches: int) -> None:
        """The next iteration of `epoch` starts `batches` batches further on, while len()
        stays the whole epoch's (a framework that counts the batches itself, such as
        Lightning resuming mid-epoch, sets the epoch with set_epoch and expects it)."""
        self._skip = (epoch, batches)

    def call_before_next_iteration(self, action: Callable[[], None]) -> None:
        """Run `action` when the next iteration begins (the checkpointer uses it to put the
        RNG states back after DataLoader's iterator drew its base seed from them)."""
        self._before_next_iteration = action

    def __iter__(self) -> Iterator[int]:
        action, self._before_next_iteration = self._before_next_iteration, None
        if action is not None:
            action()
        start = self.start_batch
        if self._skip is not None and self._skip[0] == self.epoch:
            start += self._skip[1]
            self._skip = None
        order = epoch_order(self.size, self.seed, self.epoch, self.shuffle)
        yield from order[start * self.batch_size:].tolist()

    def __len__(self) -> int:
        return max(0, self.size - self.start_batch * self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "epoch": self.epoch, "start_batch": self.start_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["size"], state["batch_size"]) != (self.size, self.batch_size):
            raise ValueError(
                f"the checkpoint's sampler had {state['size']} samples in batches of "
                f"{state['batch_size']}; this one has {self.size} in batches of "
                f"{self.batch_size}: the data cursor would not point at the same batch")
        self.shuffle, self.seed = state["shuffle"], state["seed"]
        self.epoch, self.start_batch = state["epoch"], state["start_batch"]
