"""The orchestrator's side of secret values: who may have a step's (`refusal`, pure), how
they are stored and forgotten, and that GetRun shows names with `***` for values."""

from __future__ import annotations

import msgspec
import pytest

from m27.common import proto, subjects
from m27.common.events import SecretsRequest
from m27.common.memory_bus import MemoryBus
from m27.common.model import Fence, RunRecord, SecretSet, StepRecord
from m27.orchestrator.secrets import Secrets, refusal

RUN = "r-20261204-021500-abcdef"
KEY = f"{RUN}.0.{'a' * 32}"


def run(secret_set: int = 0, keys: tuple[str, ...] = (KEY,)) -> RunRecord:
    step = StepRecord(name="train", type="cpu", command="x", env={"A": "b"},
                      secret_env=("TOKEN",), secret_set=secret_set)
    return RunRecord(run_id=RUN, name="p", user="u", urgency="normal", state="running",
                     created_at=0.0, steps=(step,), secret_keys=keys)


REQUEST = SecretsRequest(task_id=f"{RUN}/train", attempt=2, key=KEY)
FENCE = Fence(task_id=f"{RUN}/train", attempt=2, node_id="gpu-1", at=0.0)


def test_the_node_the_attempt_is_fenced_to_gets_the_values() -> None:
    assert refusal("gpu-1", REQUEST, FENCE, run()) == ""


@pytest.mark.parametrize(("node", "request_", "fence", "record", "why"), [
    (None, REQUEST, FENCE, run(), "not a node's inbox"),
    ("gpu-2", REQUEST, FENCE, run(), "not assigned to node gpu-2"),
    ("gpu-1", SecretsRequest(task_id=REQUEST.task_id, attempt=1, key=KEY), FENCE, run(),
     "attempt 1 of"),
    ("gpu-1", REQUEST, None, run(), "not assigned"),
    ("gpu-1", REQUEST, FENCE, None, "no run has the step"),
    ("gpu-1", SecretsRequest(task_id=REQUEST.task_id, attempt=2, key=f"{RUN}.0.guess"),
     FENCE, run(), "no secret values under that key"),
    ("gpu-1", REQUEST, FENCE, run(secret_set=-1), "no secret values"),
    ("gpu-1", REQUEST, FENCE, run(secret_set=3), "no secret values"),
])
def test_anyone_else_is_refused(node: str | None, request_: SecretsRequest,
                                fence: Fence | None, record: RunRecord | None,
                                why: str) -> None:
    assert why in refusal(node, request_, fence, record)


async def test_sets_are_stored_under_fresh_keys_and_forgotten() -> None:
    bus = MemoryBus()
    secrets = Secrets(bus)
    keys = await secrets.store(RUN, [{"TOKEN": "one"}, {"TOKEN": "two"}])
    again = await secrets.store(RUN, [{"TOKEN": "one"}])
    assert len(keys) == 2
    assert keys[0].startswith(f"{RUN}.0.")
    assert again[0] != keys[0]  # a retried run id never names another run's set
    got = await bus.kv_get(subjects.SECRETS_BUCKET, keys[1], SecretSet)
    assert got is not None
    assert got[0] == SecretSet(run_id=RUN, env={"TOKEN": "two"})
    assert not await secrets.missing(run(keys=keys))
    await secrets.forget(keys[:1])
    assert await secrets.missing(run(keys=keys))
    await secrets.forget_left([*keys, *again])
    assert bus.kv == {}


class FullAfterOne(MemoryBus):
    """A bucket that takes one value, then fails (a full disk, a lost quorum)."""

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        if self.kv:
            raise OSError("disk full")
        return await super().kv_put(bucket, key, value)


async def test_a_failed_store_leaves_nothing_behind() -> None:
    bus = FullAfterOne()
    with pytest.raises(OSError, match="disk full"):
        await Secrets(bus).store(RUN, [{"A": "1"}, {"B": "2"}])
    assert bus.kv == {}


def test_get_run_shows_the_names_and_masks_the_values() -> None:
    message = proto.step_to_proto(run().steps[0])
    assert dict(message.env) == {"A": "b", "TOKEN": proto.MASKED}
    assert list(message.secret_env) == ["TOKEN"]
    back = proto.step_from_proto(message)
    assert (back.env, back.secret_env) == ({"A": "b"}, ("TOKEN",))
    assert proto.run_to_proto(run()).SerializeToString().count(KEY.encode()) == 0
