"""Secret values against a real `m27 up` system with two nodes (issue 14, point 4): a
step gets its secrets, and nothing m27 stores, sends in a stored message, shows or logs
holds one; no principal but the orchestrator can read them, and a node gets only those of
an attempt assigned to it. Each attack is written as the attack; docs/security.md is the
threat model."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from m27.client import Client, ClientError
from m27.common import subjects
from m27.common.bus import connect
from m27.common.events import SecretsReply, SecretsRequest
from m27.common.model import RunRecord, SecretSet
from m27.common.principals import Principal, principal
from m27.embedded import system
from m27.v1 import pipeline_pb2 as pb
from tests.support import finished_run, nats_settings

pytestmark = pytest.mark.integration

#: Random, so no fixed text of m27's can contain it by chance.
SECRET = "Zq" + secrets.token_hex(12)

LEAK = """\
vars:
  token: {secret: true}
pipeline:
  - name: leak
    command: |
      echo "stdout: $API_TOKEN and $DB_PASS"
      echo "stderr: $API_TOKEN" >&2
      printf '%s' "$API_TOKEN" > got.txt
      printf '%s' "$DB_PASS" > got-db.txt
    output: got.txt
    env:
      PLAIN: visible
    secrets:
      API_TOKEN: "{{token}}"
      DB_PASS: "pw-{{token}}"
"""

HOLD = """\
vars:
  token: {secret: true}
pipeline:
  - name: hold
    command: sleep 300
    env: {API_TOKEN: {value: "{{token}}", secret: true}}
"""

FAIL = """\
pipeline:
  - name: fails
    command: exit 3
    secrets: {API_TOKEN: "{{token}}"}
"""


@pytest.fixture(scope="module")
def home(attacked_home: Path) -> Path:
    return attacked_home


def api(home: Path) -> str:
    state = system.read_state(home)
    assert state is not None
    return state.api


def url(home: Path) -> str:
    state = system.read_state(home)
    assert state is not None
    return state.nats_url


async def as_principal(home: Path, who: Principal,
                       refusals: list[str] | None = None) -> NatsClient:
    access = system.access(home, who, nats_settings())

    async def on_error(exc: Exception) -> None:
        if refusals is not None:
            refusals.append(str(exc).lower())

    return await nats.connect(url(home), nkeys_seed=access.seed_file,
                              inbox_prefix=access.inbox_prefix, tls=access.tls_context(),
                              error_cb=on_error, allow_reconnect=False)


@pytest.fixture
async def admin(home: Path) -> AsyncIterator[NatsClient]:
    nc = await connect(url(home), name="test-admin",
                       access=system.access(home, principal("admin"), nats_settings()))
    yield nc
    await nc.close()


async def stored_messages(nc: NatsClient) -> AsyncIterator[tuple[str, bytes]]:
    """Every message of every stream but the secrets bucket's: (stream, headers + data)."""
    js = nc.jetstream(timeout=5)
    for stream in [s.name for s in subjects.STREAMS] + [f"KV_{b.name}"
                                                          for b in subjects.BUCKETS]:
        if stream == f"KV_{subjects.SECRETS_BUCKET}":
            continue
        info = await js.stream_info(stream)
        if info.state.messages == 0:
            continue
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            yield stream, json.dumps(msg.headers or {}).encode() + (msg.data or b"")


async def secret_keys(admin: NatsClient, run_id: str) -> list[str]:
    """Where the run's secret sets are: in its stored record only, never in the API."""
    kv = await admin.jetstream().key_value(subjects.RUNS_BUCKET)
    stored = msgspec.json.decode((await kv.get(run_id)).value or b"{}")
    return list(stored["run"]["secret_keys"])


async def running(client: Client, run_id: str, step: str) -> RunRecord:
    deadline = time.monotonic() + 60
    while True:
        run = await client.get_run(run_id)
        found = run.step(step)
        if found is not None and found.state == "running":
            return run
        assert time.monotonic() < deadline, run
        await asyncio.sleep(0.1)


async def test_a_step_gets_its_secrets_and_nothing_m27_keeps_or_shows_holds_them(
        home: Path, tmp_path: Path, admin: NatsClient) -> None:
    work = tmp_path / "work"
    work.mkdir()
    async with Client(api(home)) as client:
        run_id = await client.submit(LEAK, workdir=str(work), secrets={"token": SECRET})
        run = await finished_run(client, run_id)
        assert run.state == "succeeded", run
        # the step had them
        assert (work / "got.txt").read_text() == SECRET
        assert (work / "got-db.txt").read_text() == f"pw-{SECRET}"
        # GetRun: the names, never the values
        step = run.step("leak")
        assert step is not None
        assert step.env == {"PLAIN": "visible"}
        assert step.secret_env == ("API_TOKEN", "DB_PASS")
        assert run.vars == {}
        raw = await client._stub.GetRun(pb.GetRunRequest(run_id=run_id))  # the wire form
        assert dict(raw.steps[0].env) == {"PLAIN": "visible", "API_TOKEN": "***",
                                          "DB_PASS": "***"}
        assert SECRET.encode() not in raw.SerializeToString()
        # logs: masked in the tails, in StreamLogs and in the files themselves
        assert "stdout: *** and ***" in step.stdout_tail
        assert "stderr: ***" in step.stderr_tail
        chunks = [c.data async for c in client.stream_logs(run_id, "leak")]
        assert b"stdout: *** and ***" in b"".join(chunks)
        for path in (step.stdout_path, step.stderr_path):
            assert SECRET.encode() not in Path(path).read_bytes()
        deadline = time.monotonic() + 60
        while not (await client.get_run(run_id)).report_path:
            assert time.monotonic() < deadline, "no report"
            await asyncio.sleep(0.2)
    # no stored message: runs, commands, events, dead letters, every other bucket
    leaks = [stream async for stream, data in stored_messages(admin) if SECRET.encode() in data]
    assert leaks == []
    # no file of the system: service logs, step logs, reports, ledgers, caches
    files = [p for p in home.rglob("*") if p.is_file() and "nats" not in p.relative_to(
        home).parts[:1]]
    assert files
    assert [p for p in files if SECRET.encode() in p.read_bytes()] == []
    # and once the run succeeded, not even the secrets bucket
    keys = await secret_keys(admin, run_id)
    assert len(keys) == 1
    secrets_kv = await admin.jetstream().key_value(subjects.SECRETS_BUCKET)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await secrets_kv.get(keys[0])


async def test_no_principal_but_the_orchestrator_reads_the_secrets_bucket(
        home: Path, admin: NatsClient) -> None:
    async with Client(api(home)) as client:
        run_id = await client.submit(HOLD, workdir=str(home), secrets={"token": SECRET})
        await running(client, run_id, "hold")
        try:
            # every role is checked against the table in test_principals; here the bus
            # itself refuses a node and two services
            for who in [principal("node-agent", "node-1"), principal("scheduler"),
                        principal("report")]:
                refusals: list[str] = []
                nc = await as_principal(home, who, refusals)
                try:
                    attacks = [  # the last match of a wildcard filter, by sequence, listing
                        (f"$JS.API.DIRECT.GET.KV_{subjects.SECRETS_BUCKET}.$KV."
                         f"{subjects.SECRETS_BUCKET}.>", b""),
                        (f"$JS.API.DIRECT.GET.KV_{subjects.SECRETS_BUCKET}", b'{"seq": 1}'),
                        (f"$JS.API.STREAM.MSG.GET.KV_{subjects.SECRETS_BUCKET}",
                         b'{"seq": 1}'),
                        (f"$JS.API.STREAM.INFO.KV_{subjects.SECRETS_BUCKET}",
                         b'{"subjects_filter": ">"}'),
                    ]
                    for subject, payload in attacks:
                        with pytest.raises(nats.errors.TimeoutError):
                            await nc.request(subject, payload, timeout=0.5)
                    await nc.subscribe(f"$KV.{subjects.SECRETS_BUCKET}.>")  # overhear puts
                    await nc.flush()
                    deadline = time.monotonic() + 10
                    while sum("permissions violation" in r for r in refusals) < 5:
                        assert time.monotonic() < deadline, (who, refusals)
                        await asyncio.sleep(0.05)
                finally:
                    await nc.close()
        finally:
            await client.cancel(run_id)


async def ask(nc: NatsClient, request: SecretsRequest) -> SecretsReply:
    reply = await nc.request(subjects.SECRETS_REQUEST, msgspec.json.encode(request), timeout=5)
    return msgspec.json.decode(reply.data, type=SecretsReply)


async def test_a_node_gets_only_the_secrets_of_an_attempt_assigned_to_it(
        home: Path, admin: NatsClient) -> None:
    async with Client(api(home)) as client:
        run_id = await client.submit(HOLD, workdir=str(home), secrets={"token": SECRET})
        try:
            run = await running(client, run_id, "hold")
            step = run.step("hold")
            assert step is not None
            assert step.node_id
            owner, other = step.node_id, "node-2" if step.node_id == "node-1" else "node-1"
            assert run.secret_keys == ()  # the API does not even say where they are
            key = (await secret_keys(admin, run_id))[0]
            # even with the key (leaked, say), another node is refused ...
            request = SecretsRequest(task_id=f"{run_id}/hold", attempt=step.attempt, key=key)
            thief = await as_principal(home, principal("node-agent", other))
            try:
                refused = await ask(thief, request)
                assert refused.env == {}
                assert f"not assigned to node {other}" in refused.error
                # ... and so is a guessed key, or an attempt that is not the current one
                owner_nc = await as_principal(home, principal("node-agent", owner))
                try:
                    wrong = msgspec.structs.replace(request, key=f"{run_id}.0.{'0' * 32}")
                    assert "no secret values under that key" in (await ask(owner_nc,
                                                                           wrong)).error
                    stale = msgspec.structs.replace(request, attempt=step.attempt + 1)
                    assert "not assigned" in (await ask(owner_nc, stale)).error
                    assert (await ask(owner_nc, request)).env == {"API_TOKEN": SECRET}
                finally:
                    await owner_nc.close()
                # an answer to the owner's inbox cannot be overheard by the thief
                refusals: list[str] = []
                spy = await as_principal(home, principal("node-agent", other), refusals)
                try:
                    await spy.subscribe(f"_INBOX_node-{owner}.>")
                    await spy.flush()
                    deadline = time.monotonic() + 10
                    while not any("permissions violation" in r for r in refusals):
                        assert time.monotonic() < deadline, refusals
                        await asyncio.sleep(0.05)
                finally:
                    await spy.close()
            finally:
                await thief.close()
            value = await (await admin.jetstream().key_value(subjects.SECRETS_BUCKET)).get(key)
            assert msgspec.json.decode(value.value or b"", type=SecretSet).env == {
                "API_TOKEN": SECRET}  # still there while the run goes on
        finally:
            await client.cancel(run_id)


async def test_a_run_whose_secrets_are_gone_is_not_retried_blind(
        home: Path, admin: NatsClient) -> None:
    async with Client(api(home)) as client:
        run_id = await client.submit(FAIL, workdir=str(home), secrets={"token": SECRET})
        run = await finished_run(client, run_id)
        assert run.state == "failed"
        secrets_kv = await admin.jetstream().key_value(subjects.SECRETS_BUCKET)
        key = (await secret_keys(admin, run_id))[0]
        assert (await secrets_kv.get(key)).value  # kept for a retry
        await secrets_kv.purge(key)  # as when they expire
        with pytest.raises(ClientError, match="secret values are gone"):
            await client.retry(run_id)


async def test_a_secret_variable_cannot_reach_a_command_or_a_path(home: Path) -> None:
    async with Client(api(home)) as client:
        for field in ("command: echo {{token}}", "command: x\n    output: /tmp/{{token}}",
                      "command: x\n    workdir: /tmp/{{token}}"):
            text = f"vars:\n  token: {{secret: true}}\npipeline:\n  - name: a\n    {field}\n"
            with pytest.raises(ClientError, match="is a secret variable") as caught:
                await client.submit(text, secrets={"token": SECRET})
            assert SECRET not in str(caught.value)
