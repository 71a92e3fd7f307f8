"""The embedded bus as an attacker on the same machine meets it (issue 14, point 1): each
test is one attack from the issue, made against a real `m27 up` system with two nodes, and
shows it does no harm. docs/security.md is the threat model these check."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from m27.client import Client
from m27.common import events, subjects
from m27.common.bus import Access, NatsBus, connect
from m27.common.errors import BusError, ConfigError
from m27.common.principals import Principal, principal
from m27.embedded import NatsServer, system
from m27.report.service import history_path
from m27.report.store import History
from tests.support import finished_run, nats_settings

pytestmark = pytest.mark.integration

LONG = "pipeline:\n  - name: long\n    type: gpu_light\n    command: sleep 300\n"


@pytest.fixture(scope="module")
def home(attacked_home: Path) -> Path:
    return attacked_home


def url(home: Path) -> str:
    state = system.read_state(home)
    assert state is not None
    return state.nats_url


class Attacker:
    """A raw NATS client holding one principal's seed, collecting the server's refusals."""

    def __init__(self) -> None:
        self.refusals: list[str] = []
        self.nc: NatsClient | None = None

    async def connect(self, home: Path, who: Principal) -> NatsClient:
        access = system.access(home, who, nats_settings())

        async def on_error(exc: Exception) -> None:
            self.refusals.append(str(exc).lower())

        self.nc = await nats.connect(url(home), nkeys_seed=access.seed_file,
                                     inbox_prefix=access.inbox_prefix,
                                     tls=access.tls_context(), error_cb=on_error,
                                     allow_reconnect=False)
        return self.nc

    async def refused(self, subject: str) -> None:
        """The server told us it dropped a publish to `subject` (its error arrives before
        the PONG that ends a flush; nats-py hands it to error_cb in a task of its own)."""
        assert self.nc is not None
        await self.nc.flush()
        wanted = f'publish to "{subject.lower()}"'
        deadline = time.monotonic() + 10
        while not any(wanted in text for text in self.refusals):
            assert time.monotonic() < deadline, (subject, self.refusals)
            await asyncio.sleep(0.05)


@pytest.fixture
async def attacker() -> AsyncIterator[Attacker]:
    one = Attacker()
    yield one
    if one.nc is not None:
        await one.nc.close()


async def admin(home: Path) -> NatsClient:
    return await connect(url(home), name="test-admin",
                         access=system.access(home, principal("admin"), nats_settings()))


async def test_anonymous_clients_and_unknown_keys_are_refused(home: Path,
                                                              tmp_path: Path) -> None:
    settings = nats_settings()  # with TLS on: a valid client certificate, and still no user
    tls = {"tls_ca": settings.tls_ca, "tls_cert": settings.tls_cert,
           "tls_key": settings.tls_key}
    with pytest.raises(BusError, match=r"refused .* \(anonymous\)"):
        await connect(url(home), name="anonymous", timeout=5, access=Access(**tls))
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(b"SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU\n")
    stranger.chmod(0o600)
    with pytest.raises(BusError, match="refused"):
        await connect(url(home), name="stranger", timeout=5,
                      access=Access(seed_file=str(stranger), **tls))


def test_seed_files_are_the_owners_alone(home: Path, tmp_path: Path) -> None:
    directory = system.credentials_dir(home)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    seeds = sorted(directory.glob("*.nk"))
    assert {p.stem for p in seeds} >= {"admin", "orchestrator", "scheduler", "node-node-1",
                                       "node-node-2", "checkpoint-store", "report", "status"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in seeds)
    config = (home / "nats" / "nats.conf").read_text()
    assert "authorization" in config
    assert not [p for p in seeds if p.read_text().strip() in config]  # public keys only
    shared = tmp_path / "shared.nk"
    shutil.copy(directory / "admin.nk", shared)
    shared.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by others"):
        asyncio.run(connect("nats://127.0.0.1:1", name="x", access=Access(
            seed_file=str(shared))))


async def test_a_node_cannot_start_work_write_fences_or_speak_for_another_node(
        home: Path, attacker: Attacker) -> None:
    nc = await attacker.connect(home, principal("node-agent", "node-2"))
    js = nc.jetstream(timeout=1)
    start = events.StartTask(at=time.time(), task_id="r-20261203-000000-abcdef/evil",
                             run_id="r-20261203-000000-abcdef", step="evil", attempt=1,
                             step_type="cpu", command="touch /tmp/m27-pwned", workdir="/tmp")
    fence = {"task_id": start.task_id, "attempt": 1, "node_id": "node-1", "at": 0.0}
    forged = [
        (subjects.node_commands("node-1"), events.encode(start)),  # another node's commands
        (subjects.node_commands("node-2"), events.encode(start)),  # even its own
        (f"$KV.{subjects.FENCES_BUCKET}.r-20261203-000000-abcdef.evil",
         json.dumps(fence).encode()),
        (f"$KV.{subjects.RUNS_BUCKET}.r-20261203-000000-abcdef", b"{}"),
        (f"$KV.{subjects.NODES_BUCKET}.node-1", b"{}"),
        (subjects.task_events("r-20261203-000000-abcdef", "evil", "node-node-1"), b"{}"),
        (subjects.run_state("r-20261203-000000-abcdef"), b"{}"),
    ]
    for subject, data in forged:
        with pytest.raises(nats.errors.TimeoutError):  # not stored, so never acknowledged
            await js.publish(subject, data)
        await attacker.refused(subject)
    await nc.publish(subjects.heartbeat("node-1"), b"{}")
    await attacker.refused(subjects.heartbeat("node-1"))
    assert not Path("/tmp/m27-pwned").exists()
    checker = await admin(home)
    try:
        kv = await checker.jetstream().key_value(subjects.FENCES_BUCKET)
        with pytest.raises(Exception, match="not found"):
            await kv.get("r-20261203-000000-abcdef.evil")
    finally:
        await checker.close()


async def test_no_service_may_delete_or_change_the_streams(home: Path) -> None:
    services = [principal(role) for role in ("orchestrator", "scheduler",
                                             "checkpoint-store", "report", "status")]
    for who in [*services, principal("node-agent", "node-1")]:
        one = Attacker()
        nc = await one.connect(home, who)
        js = nc.jetstream(timeout=0.5)  # refused at once: no ack comes
        try:
            for attempt in (js.delete_stream(subjects.EVENTS_STREAM),
                            js.purge_stream(subjects.COMMANDS_STREAM),
                            js.delete_consumer(subjects.COMMANDS_STREAM, "node-node-1"),
                            js.delete_key_value(subjects.RUNS_BUCKET)):
                with pytest.raises(nats.errors.TimeoutError):
                    await attempt
            assert sum("permissions violation" in text for text in one.refusals) >= 4, who
        finally:
            await nc.close()
    checker = await admin(home)
    try:
        info = await checker.jetstream().stream_info(subjects.EVENTS_STREAM)
        assert info.config.name == subjects.EVENTS_STREAM
    finally:
        await checker.close()


async def dead_letters(nc: NatsClient) -> list[dict[str, str]]:
    js = nc.jetstream(timeout=5)
    info = await js.stream_info(subjects.DEAD_STREAM)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        msg = await js.get_msg(subjects.DEAD_STREAM, seq)
        found.append(dict(msg.headers or {}))
    return found


async def test_a_forged_exit_is_dead_lettered_and_the_run_keeps_running(
        home: Path, attacker: Attacker) -> None:
    state = system.read_state(home)
    assert state is not None
    async with Client(state.api) as client:
        run_id = await client.submit(LONG, workdir=str(home))
        running = None

        async def step_running() -> bool:
            nonlocal running
            running = (await client.get_run(run_id)).step("long")
            return running is not None and running.state == "running"

        deadline = time.monotonic() + 60
        while not await step_running():
            assert time.monotonic() < deadline, running
            await asyncio.sleep(0.2)
        assert running is not None
        assert running.node_id
        victim = running.node_id
        thief = "node-2" if victim == "node-1" else "node-1"
        nc = await attacker.connect(home, principal("node-agent", thief))
        js = nc.jetstream(timeout=5)
        checker = await admin(home)
        before = len(await dead_letters(checker))
        for claimed in (thief, victim):  # as itself, and pretending to be the victim
            exit_0 = events.TaskExited(at=time.time(), task_id=f"{run_id}/long",
                                       run_id=run_id, step="long", attempt=running.attempt,
                                       node_id=claimed, exit_code=0)
            await js.publish(subjects.task_events(run_id, "long", f"node-{thief}"),
                             events.encode(exit_0))
        # the orchestrator and the scheduler each refuse both
        try:
            deadline = time.monotonic() + 30
            while len(letters := await dead_letters(checker)) < before + 4:
                assert time.monotonic() < deadline, letters
                await asyncio.sleep(0.2)
        finally:
            await checker.close()
        reasons = [h.get("M27-Error", "") for h in letters[before:]]
        assert all(r.startswith("refused: task_exited") for r in reasons), reasons
        assert any(f"from node {thief!r}, but that attempt runs on {victim!r}" in r
                   for r in reasons), reasons
        assert any(f"sent by 'node-{thief}'" in r for r in reasons), reasons
        after = (await client.get_run(run_id)).step("long")
        assert after is not None
        assert (after.state, after.attempt, after.node_id) == ("running", running.attempt,
                                                                victim)
        await client.cancel(run_id)


async def test_a_nodes_own_user_may_publish_its_steps_metrics(home: Path) -> None:
    """Metrics go out under the node's own permissions (`m27.metrics.*.*.node-<id>`)."""
    state = system.read_state(home)
    assert state is not None
    text = ("pipeline:\n  - name: m\n    command: |\n"
            "      echo '{\"step\": 7, \"loss\": 0.5}' >> \"$M27_METRICS_FILE\"\n")
    async with Client(state.api) as client:
        run_id = await client.submit(text, workdir=str(home))
        run = await finished_run(client, run_id)
    assert run.state == "succeeded", run
    checker = await admin(home)
    try:
        js = checker.jetstream(timeout=5)
        info = await js.stream_info(subjects.METRICS_STREAM)
        found = [events.decode_metrics((await js.get_msg(subjects.METRICS_STREAM, seq)).data
                                       or b"")
                 for seq in range(info.state.first_seq, info.state.last_seq + 1)]
    finally:
        await checker.close()
    mine = [b for b in found if b.run_id == run_id]
    assert [(p.step, p.values) for b in mine for p in b.points] == [(7, {"loss": 0.5})]
    history = History(history_path(home))  # and the report, as its own user, stored them
    try:
        deadline = time.monotonic() + 30
        while not history.metric_series(run_id, "m", "loss"):
            assert time.monotonic() < deadline, "the report stored no metrics"
            await asyncio.sleep(0.1)
    finally:
        history.close()


async def test_even_the_report_service_cannot_point_a_report_elsewhere(home: Path) -> None:
    """The report principal may announce reports, but only a run's own file."""
    state = system.read_state(home)
    assert state is not None
    async with Client(state.api) as client:
        run_id = await client.submit(LONG, workdir=str(home))
        one = Attacker()
        nc = await one.connect(home, principal("report"))
        checker = await admin(home)
        try:
            before = len(await dead_letters(checker))
            forged = events.ReportReady(at=time.time(), run_id=run_id, path="/etc/passwd")
            await nc.jetstream(timeout=5).publish(subjects.run_report(run_id),
                                                  events.encode(forged))
            deadline = time.monotonic() + 30
            while len(letters := await dead_letters(checker)) <= before:
                assert time.monotonic() < deadline, letters
                await asyncio.sleep(0.2)
            assert "not an absolute path to" in letters[-1].get("M27-Error", "")
            assert (await client.get_run(run_id)).report_path == ""
        finally:
            await checker.close()
            await nc.close()
            await client.cancel(run_id)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m27.cli", *args], capture_output=True,
                          text=True, timeout=60)


async def test_a_deployment_gets_its_users_and_streams_from_two_commands(
        tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    made = run_cli("bus", "credentials", str(creds), "--nodes", "gpu-01,gpu-02")
    assert made.returncode == 0, made.stderr
    auth = (creds / "nats-authorization.conf").read_text()
    server = NatsServer(tmp_path / "nats", authorization=auth)
    address = server.start()
    try:
        # a service waits for the streams, which only the admin may create
        orchestrator = Access(seed_file=str(creds / "orchestrator.nk"),
                              inbox_prefix=principal("orchestrator").inbox)
        with pytest.raises(BusError, match="has no M27_EVENTS"):
            await NatsBus.open(address, name="early", access=orchestrator, timeout=1)
        setup = run_cli("bus", "setup", "--nats", address, "--credentials",
                        str(creds / "admin.nk"))
        assert setup.returncode == 0, setup.stderr
        bus = await NatsBus.open(address, name="orchestrator", access=orchestrator,
                                 timeout=5)
        await bus.close()
        again = run_cli("bus", "credentials", str(creds), "--nodes", "gpu-01,gpu-02")
        assert (creds / "nats-authorization.conf").read_text() == auth  # seeds are kept
        rotated = run_cli("bus", "credentials", str(creds), "--rotate")
        assert again.returncode == rotated.returncode == 0
        assert (creds / "nats-authorization.conf").read_text() != auth
    finally:
        server.stop()
    bad = run_cli("bus", "credentials", str(tmp_path / "x"), "--nodes", "a.b")
    assert bad.returncode == 1
    assert bad.stderr.startswith("m27: --nodes: a node-agent needs a node id matching")
    assert "Traceback" not in bad.stderr
