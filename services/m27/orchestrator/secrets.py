"""A run's secret environment values, kept apart from the run (bucket m27_secrets).

The pipeline parser hands them over as `PipelineSpec.secret_sets`; the run record keeps
only their names (`StepRecord.secret_env`) and where each set is stored
(`RunRecord.secret_keys`, one random key per set). No message that is stored carries a
value: the commands to the scheduler and the nodes carry the key. Only the orchestrator
may read or write the bucket. A node-agent that starts a step asks for its values
(`subjects.SECRETS_REQUEST`, core request/reply); the orchestrator answers only the node
the scheduler's fence assigns that very attempt to, and only on that node's own reply
subject, which no other principal can read (`subjects.inbox_node`).

A set is removed when its run succeeds, and expires after `subjects.SECRETS_TTL_S`
whatever happens (a failed or cancelled run can be retried until then).
"""

from __future__ import annotations

import secrets as random
from collections.abc import Sequence

import msgspec
from nats.aio.msg import Msg

from m27.common import subjects
from m27.common.bus import Bus
from m27.common.errors import NotFoundError
from m27.common.events import SecretsReply, SecretsRequest
from m27.common.ids import split_task_id
from m27.common.logging import get_logger
from m27.common.model import Fence, RunRecord, SecretSet
from m27.orchestrator.store import RunStore

log = get_logger()


def refusal(node_id: str | None, request: SecretsRequest, fence: Fence | None,
            run: RunRecord | None) -> str:
    """Why `node_id` may not have the values `request` asks for, or '' when it may (pure)."""
    if node_id is None:
        return "the request's reply subject is not a node's inbox"
    if fence is None or (fence.attempt, fence.node_id) != (request.attempt, node_id):
        return (f"attempt {request.attempt} of {request.task_id} is not assigned to node "
                f"{node_id}")
    step = None if run is None else run.step(split_task_id(request.task_id)[1])
    if run is None or step is None:
        return f"no run has the step {request.task_id}"
    if step.secret_set < 0 or step.secret_set >= len(run.secret_keys) \
            or run.secret_keys[step.secret_set] != request.key:
        return f"{request.task_id} has no secret values under that key"
    return ""


class Secrets:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def store(self, run_id: str, sets: Sequence[dict[str, str]]) -> tuple[str, ...]:
        """Store each set under a fresh random key; the keys, in order."""
        keys: list[str] = []
        try:
            for index, env in enumerate(sets):
                key = subjects.secret_key(run_id, index, random.token_hex(16))
                await self.bus.kv_put(subjects.SECRETS_BUCKET, key,
                                      SecretSet(run_id=run_id, env=env))
                keys.append(key)
        except BaseException:
            await self.forget(keys)
            raise
        return tuple(keys)

    async def forget(self, keys: Sequence[str]) -> None:
        """Remove the sets from the bucket's stream (a failure is logged: they expire)."""
        for key in keys:
            try:
                await self.bus.kv_purge(subjects.SECRETS_BUCKET, key)
            except Exception as exc:  # a leftover expires with the TTL
                log.warning("secrets.forget_failed", error=str(exc)[:200])

    async def forget_left(self, keys: Sequence[str]) -> None:
        """`forget` those of `keys` that still hold a value (at start: the sets of runs that
        succeeded just before a crash), without writing anything for the others."""
        left = [key for key in keys
                if await self.bus.kv_get(subjects.SECRETS_BUCKET, key, SecretSet) is not None]
        await self.forget(left)

    async def missing(self, run: RunRecord) -> bool:
        """Whether a set the run's steps need is gone (expired or removed)."""
        for key in run.secret_keys:
            if await self.bus.kv_get(subjects.SECRETS_BUCKET, key, SecretSet) is None:
                return True
        return False

    async def answer(self, store: RunStore, reply_to: str, data: bytes) -> SecretsReply:
        """What to answer a SECRETS_REQUEST that came with reply subject `reply_to`."""
        try:
            request = msgspec.json.decode(data, type=SecretsRequest)
            run_id, _ = split_task_id(request.task_id)
        except (msgspec.DecodeError, ValueError) as exc:
            return SecretsReply(error=f"not a secrets request: {str(exc)[:200]}")
        node_id = subjects.inbox_node(reply_to)
        fence = await self.bus.kv_get(subjects.FENCES_BUCKET,
                                      subjects.task_key(request.task_id), Fence)
        try:
            run: RunRecord | None = (await store.get(run_id))[0].run
        except NotFoundError:
            run = None
        why = refusal(node_id, request, fence[0] if fence else None, run)
        if why:
            log.warning("secrets.refused", task_id=request.task_id, node_id=node_id,
                        reason=why)
            return SecretsReply(error=why)
        found = await self.bus.kv_get(subjects.SECRETS_BUCKET, request.key, SecretSet)
        if found is None or found[0].run_id != run_id:
            return SecretsReply(error="the run's secret values are gone (removed when it "
                                "succeeded, or expired): submit it again")
        return SecretsReply(env=found[0].env)

    async def on_request(self, store: RunStore, msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            reply = await self.answer(store, msg.reply, msg.data)
        except Exception as exc:  # the asker retries; the values never go in a log
            log.warning("secrets.answer_failed", error=type(exc).__name__)
            reply = SecretsReply(error=f"the orchestrator could not answer: "
                                 f"{type(exc).__name__}", transient=True)
        await msg.respond(msgspec.json.encode(reply))
