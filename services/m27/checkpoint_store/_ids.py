"""Task, run, checkpoint and chunk ids, and how a checkpoint maps to its KV key (pure).

Every id that reaches the disk or the KV passes through here first. The patterns admit
only `[A-Za-z0-9_-]` (and the fixed `c-` and 64-hex forms), so no user input can ever form
`..`, `/`, an absolute path or a KV wildcard.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import msgspec

from m27.common.checkpoint_api import InvalidCheckpointRequest
from m27.common.checkpoint_format import is_chunk_id
from m27.common.ids import split_task_id

# Patterns are ASCII-only and used with fullmatch: `$` alone also matches before a final
# newline, and `\d` matches every Unicode digit.
#: `c-<unix ms, 13 digits>-<6 hex>`: sorts by commit time, unique per store.
CHECKPOINT_ID_RE: Final = re.compile(r"c-([0-9]{13})-[0-9a-f]{6}")
TOKEN_RE: Final = re.compile(r"[0-9a-f]{6}")
#: Checked on top of `split_task_id`, whose patterns accept a trailing newline.
RUN_ID_RE: Final = re.compile(r"r-[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
TASK_ID_RE: Final = re.compile(rf"{RUN_ID_RE.pattern}/[A-Za-z0-9][A-Za-z0-9_-]{{0,99}}")
_SHOWN_CHARS: Final = 80


class CheckpointRef(msgspec.Struct, frozen=True):
    """A validated (run_id, step, checkpoint_id): safe as a path and as a KV key."""

    run_id: str
    step: str
    checkpoint_id: str

    @property
    def task_id(self) -> str:
        return f"{self.run_id}/{self.step}"

    @property
    def key(self) -> str:
        """The KV key of the record: `<run_id>.<step>.<checkpoint_id>`."""
        return f"{task_prefix(self.run_id, self.step)}{self.checkpoint_id}"



def shown(value: str) -> str:
    """`value` quoted for an error message, cut short so a huge input stays a short line."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}… ({len(value)} chars)"


def new_checkpoint_id(ms: int, token: str) -> str:
    """The id of a checkpoint committed at unix time `ms` (milliseconds)."""
    if not 0 <= ms < 10**13 or not TOKEN_RE.fullmatch(token):
        raise ValueError(f"cannot form a checkpoint id from ms={ms}, token={token!r}")
    return f"c-{ms:013d}-{token}"


def next_id_ms(now_ms: int, last_ms: int) -> int:
    """Strictly increasing milliseconds, so ids of one store sort in commit order."""
    return max(now_ms, last_ms + 1)


def is_valid_checkpoint_id(value: str) -> bool:
    return bool(CHECKPOINT_ID_RE.fullmatch(value))


def checkpoint_id_ms(checkpoint_id: str) -> int:
    """The commit time (unix ms) an id carries; ValueError for a malformed id."""
    match = CHECKPOINT_ID_RE.fullmatch(checkpoint_id)
    if not match:
        raise ValueError(f"not a checkpoint id: {shown(checkpoint_id)}")
    return int(match.group(1))


def parse_task_id(task_id: str) -> tuple[str, str]:
    """(run_id, step) of a task id; InvalidCheckpointRequest with the expected form."""
    try:
        if not TASK_ID_RE.fullmatch(task_id):
            raise ValueError(task_id)
        return split_task_id(task_id)
    except ValueError:
        raise InvalidCheckpointRequest(
            f"task_id must be <run_id>/<step> (e.g. r-20240101-120000-abc123/train), "
            f"got {shown(task_id)}") from None


def parse_run_id(run_id: str) -> str:
    if not RUN_ID_RE.fullmatch(run_id):
        raise InvalidCheckpointRequest(
            f"run_id must look like r-20240101-120000-abc123, got {shown(run_id)}")
    return run_id


def parse_chunk_ids(ids: Sequence[str], limit: int) -> list[str]:
    """The ids, each a 64-hex sha256; at most `limit` of them in one request."""
    if len(ids) > limit:
        raise InvalidCheckpointRequest(
            f"at most {limit} chunk ids per request, got {len(ids)}")
    for chunk_id in ids:
        if not is_chunk_id(chunk_id):
            raise InvalidCheckpointRequest(
                f"a chunk id is 64 lower-case hex digits (sha256), got {shown(chunk_id)}")
    return list(ids)


def parse_ref(task_id: str, checkpoint_id: str) -> CheckpointRef:
    """A validated reference to one checkpoint; the id must be given and well formed."""
    run_id, step = parse_task_id(task_id)
    if not checkpoint_id:
        raise InvalidCheckpointRequest("checkpoint_id is required")
    if not is_valid_checkpoint_id(checkpoint_id):
        raise InvalidCheckpointRequest(
            f"checkpoint_id must look like c-<13 digits>-<6 hex>, got {shown(checkpoint_id)}")
    return CheckpointRef(run_id, step, checkpoint_id)


def task_prefix(run_id: str, step: str) -> str:
    """The KV key prefix shared by every checkpoint of one task."""
    return f"{run_id}.{step}."


def run_pattern(run_id: str) -> str:
    """The KV key pattern of every checkpoint of every step of one run."""
    return f"{run_id}.*.*"


def ref_from_key(key: str) -> CheckpointRef | None:
    """The reference a KV key names, or None for a key this store never writes."""
    run_id, _, rest = key.partition(".")
    step, _, checkpoint_id = rest.partition(".")
    try:
        return parse_ref(f"{run_id}/{step}", checkpoint_id)
    except InvalidCheckpointRequest:
        return None
