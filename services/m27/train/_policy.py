"""When to checkpoint and what kind of checkpoint to write (pure: time comes in as `now`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    every_steps: int | None = None
    every_seconds: float | None = None
    keep_full_every: int = 10  # every Nth checkpoint stores no deltas


@dataclass(frozen=True)
class Decision:
    save: bool
    reason: str  # why it saves, or why a due save waits ("" when nothing is due)


def decide(policy: Policy, *, step: int, now: float, last_step: int, last_time: float,
           requests: tuple[str, ...], busy: bool) -> Decision:
    """Whether to checkpoint after `step` (steps and times of the last checkpoint given).

    Requests (the agent's signal, the training monitor, `request()`) come first; a save
    that is due while the previous checkpoint is still being persisted waits: the trigger
    stays due and is served by the first `after_step` once that one is durable."""
    reason = _due(policy, step, now, last_step, last_time, requests)
    if not reason:
        return Decision(False, "")
    if busy:
        return Decision(False, f"deferred ({reason}): the previous checkpoint is in flight")
    return Decision(True, reason)


def _due(policy: Policy, step: int, now: float, last_step: int, last_time: float,
         requests: tuple[str, ...]) -> str:
    if requests:
        return ", ".join(dict.fromkeys(requests))
    if policy.every_steps and step - last_step >= policy.every_steps:
        return f"every {policy.every_steps} steps"
    if policy.every_seconds and now - last_time >= policy.every_seconds:
        return f"every {policy.every_seconds:g} s"
    return ""


@dataclass(frozen=True)
class Kind:
    full: bool  # no entry is stored as a delta
    chain: int  # delta checkpoints since the last full one


def next_kind(previous_chain: int | None, keep_full_every: int, *, force_full: bool = False
              ) -> Kind:
    """A full checkpoint first, after a failure (`force_full`) and every `keep_full_every`
    checkpoints, so a restore never decodes a delta chain longer than that."""
    if previous_chain is None or force_full or previous_chain + 1 >= keep_full_every:
        return Kind(full=True, chain=0)
    return Kind(full=False, chain=previous_chain + 1)


def delta_pays(stored: int, plain: int | None, *, at_most: float = 0.9) -> bool:
    """Whether an entry stored with XOR deltas (`stored` bytes) saved enough against the
    same entry stored plain last time (`plain`) to keep paying for a second compression
    of every changed chunk. Adam's first moment, for one, changes too much per step."""
    return plain is None or stored <= at_most * plain


def compression_pays(saving: float, encode_bytes_per_s: float,
                     write_bytes_per_s: float | None) -> bool:
    """Whether compressing an entry makes it durable sooner than writing it raw.

    Per byte, raw costs 1/write; compressed costs 1/encode + (1 - saving)/write; so it
    pays when saving × encode > write. Dense float32 state saves under 10 % at zstd's
    ~700 MB/s: never worth it against a local disk writing 1–2 GB/s, worth it against a
    100 MB/s network store. Before any write was measured: when it saves a tenth."""
    if write_bytes_per_s is None:
        return saving >= 0.1
    return saving * encode_bytes_per_s > write_bytes_per_s
