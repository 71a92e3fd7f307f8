"""The clustered-NATS chaos harness the test (tests/test_nats_cluster.py) and the bench
(bench/nats_cluster_chaos.py) share: `m27 up --nats-cluster 3` in a temporary home, a
server killed (SIGKILL) and started again, what JetStream says about each stream's leader
and replicas, acked probe writes, and the steps' own start/end marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

import msgspec
from nats.js.api import StreamConfig

from m27.client import Client, ClientError
from m27.common import api_auth
from m27.common.api_auth import ApiAccess
from m27.common.bus import NatsBus, connect, topology_names
from m27.common.config import NatsSection, SupervisorSection
from m27.common.model import RunRecord
from m27.common.principals import principal
from m27.embedded import system
from m27.embedded.nats_server import pid_alive
from m27.embedded.system import EmbeddedState

#: A step that marks its start and end (task, attempt, node, time) in `marks.log`.
MARKED = ('echo "start $M27_TASK_ID $M27_ATTEMPT $M27_NODE_ID $(date +%s.%N)" >> marks.log; '
          'sleep {sleep}; echo "end $M27_TASK_ID $M27_ATTEMPT $M27_NODE_ID $(date +%s.%N)" '
          '>> marks.log')
PIPELINE: Final = f"""pipeline:
  - {{name: prep, command: '{MARKED.format(sleep=0.5)}'}}
  - {{name: train, type: gpu, depends_on: [prep], command: '{MARKED.format(sleep=1.5)}'}}
  - {{name: eval, depends_on: [train], command: '{MARKED.format(sleep=0.3)}'}}
"""
PROBE_STREAM: Final = "M27_TEST_PROBE"
#: A killed server stays down until `Clustered.revive` (`m27 up`) has it started: the
#: runs meanwhile go on over two servers, as the test and the bench mean them to.
BY_HAND = SupervisorSection(restart_backoff=600.0, restart_backoff_max=600.0)
#: Leases: renewed every second (a failed renewal is tried again a second later), so a
#: NATS election of a few seconds stays well inside the default 10 s self-fencing.
ENV: Final = {"M27_NODE_HEARTBEAT_INTERVAL": "1s"}


class Clustered:
    """`m27 up --nats-cluster 3` under `root/home` (users, R3 streams and buckets)."""

    def __init__(self, root: Path, state: EmbeddedState) -> None:
        self.root = root
        self.home = Path(state.home)
        self.state = state
        token = (api_auth.api_dir(self.home) / api_auth.CLI_TOKEN).read_text().strip()
        self.access = ApiAccess(token=token)

    def client(self) -> Client:
        return Client(self.state.api, access=self.access)

    async def admin(self) -> NatsBus:
        """The admin's connection (it may read every stream), over every server."""
        who = system.access(self.home, principal("admin"), NatsSection())
        return NatsBus(await connect(self.state.nats_url, name="m27-test-admin", access=who))

    def server_index(self, server_name: str) -> int:
        """`m27-embedded-2` → 1."""
        return int(server_name.rsplit("-", 1)[1]) - 1

    def kill(self, index: int) -> float:
        """SIGKILL NATS server `index` (0-based) as a crash would; when it happened."""
        pid = self.state.nats_servers[index].pid
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        while pid_alive(pid):
            time.sleep(0.01)
        return killed_at

    def revive(self) -> None:
        """`m27 up` again, as a user would: it has the supervisor start the dead server
        now, which rejoins (the state then has its new pid)."""
        self.state, started = system.up(self.home, nats_cluster=3)
        assert not started

    def logs(self) -> str:
        paths = [Path(p.log_path) for p in self.state.processes]
        paths += [Path(n.log_path) for n in self.state.nats_servers]
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in paths if p.exists())


@contextlib.contextmanager
def clustered(root: Path, *, nodes: int = 2, env: Mapping[str, str] = ENV,
              log_level: str = "info") -> Iterator[Clustered]:
    """`m27 up --nodes N --nats-cluster 3 --gpus sim:1` with its own home and an empty
    config, `m27 down` at the end; M27_HOME, M27_CONFIG and `env` meanwhile."""
    home, config = root / "home", root / "m2config"
    config.write_text("")
    names = ("M27_HOME", "M27_CONFIG", *env)
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update({"M27_HOME": str(home), "M27_CONFIG": str(config), **env})
    try:
        state, _ = system.up(home, nodes=nodes, gpus="sim:1", nats_cluster=3,
                             log_level=log_level, policy=BY_HAND)
        try:
            yield Clustered(root, state)
        finally:
            system.down(home)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def leader(bus: NatsBus, stream: str, timeout: float = 30.0) -> str:
    """The server that leads `stream` now (waits out an election)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            info = await bus.js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return info.cluster.leader
        assert time.monotonic() < deadline, f"{stream} has no leader"
        await asyncio.sleep(0.1)


def meta_leader(cluster: Clustered) -> str:
    """The server that leads the JetStream meta group now, from the servers' own logs
    (its latest "metadata leader" line; the admin's account cannot ask the system one)."""
    latest: tuple[str, str] = ("", "")
    for member in cluster.state.nats_servers:
        path = Path(member.log_path)
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if "Self is new JetStream cluster metadata leader" in line:
                name = f"m27-embedded-{member.name.rsplit('-', 1)[1]}"
            elif "JetStream cluster new metadata leader: " in line:
                name = line.rsplit(": ", 1)[1].split("/", 1)[0]
            else:
                continue
            stamp = " ".join(line.split()[1:3])  # [pid] date time [INF] ...
            latest = max(latest, (stamp, name))
    assert latest[1], "no metadata leader in the servers' logs"
    return latest[1]


async def replicas_current(bus: NatsBus, streams: tuple[str, ...] | None = None,
                           timeout: float = 60.0) -> dict[str, int]:
    """Wait until every replica of each stream (all of m27's by default) is current with
    its leader; each stream's message count then."""
    names = streams or topology_names()
    deadline = time.monotonic() + timeout
    counts: dict[str, int] = {}
    for name in names:
        while True:
            info = None
            with contextlib.suppress(Exception):
                info = await bus.js.stream_info(name)
            cluster = info.cluster if info is not None else None
            if info is not None and cluster is not None and cluster.leader and len(
                    cluster.replicas or []) == 2 and all(
                    r.current and not r.offline and not r.lag for r in cluster.replicas or []):
                counts[name] = int(info.state.messages)
                break
            assert time.monotonic() < deadline, f"replicas of {name} never caught up: {info}"
            await asyncio.sleep(0.2)
    return counts


async def finished(client: Client, run_id: str, timeout: float = 90.0) -> RunRecord:
    """The run once it has ended. While a stream has no leader the API can fail a read
    (the orchestrator's KV read times out): asked again until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            run = await client.get_run(run_id)
        except ClientError:
            run = None
        if run is not None and run.state in {"succeeded", "failed", "cancelled"}:
            return run
        assert time.monotonic() < deadline, f"run did not finish: {run}"
        await asyncio.sleep(0.1)


class Probe:
    """Writes to a probe stream (R3) as fast as acks come, recording each acked write's
    sequence and payload: afterwards every acked write must be stored, at its sequence."""

    def __init__(self, bus: NatsBus) -> None:
        self.bus = bus
        self.acked: dict[int, bytes] = {}
        self.failed = 0
        self.stalls: list[float] = []  # longest run of failed writes each time one ended
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        config = StreamConfig(name=PROBE_STREAM, subjects=["m27test.probe"],
                              num_replicas=3)
        await self.bus.js.add_stream(config)
        self._task = asyncio.create_task(self._write())

    async def _write(self) -> None:
        failing_since: float | None = None
        for n in itertools.count():
            if self._stop.is_set():
                return
            payload = f"probe-{n}".encode()
            try:
                ack = await self.bus.js.publish("m27test.probe", payload, timeout=2.0,
                                                headers={"Nats-Msg-Id": payload.decode()})
            except Exception:
                self.failed += 1
                failing_since = failing_since or time.monotonic()
                await asyncio.sleep(0.05)
                continue
            if failing_since is not None:
                self.stalls.append(time.monotonic() - failing_since)
                failing_since = None
            if not ack.duplicate:
                self.acked[ack.seq] = payload
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def lost(self) -> list[int]:
        """Sequences acked but not stored with their payload."""
        missing = []
        for seq, payload in sorted(self.acked.items()):
            try:
                msg = await self.bus.js.get_msg(PROBE_STREAM, seq)
            except Exception:
                missing.append(seq)
                continue
            if msg.data != payload:
                missing.append(seq)
        return missing


class Mark(msgspec.Struct, frozen=True):
    task: str
    attempt: int
    node: str
    start: float
    end: float | None


def marks(work: Path) -> list[Mark]:
    """Each attempt's start and end as the step wrote them (end None: never ended)."""
    starts: dict[tuple[str, int], tuple[str, float]] = {}
    ends: dict[tuple[str, int], float] = {}
    path = work / "marks.log"
    for line in path.read_text().splitlines() if path.exists() else []:
        kind, task, attempt, node, stamp = line.split()
        key = (task, int(attempt))
        if kind == "start":
            assert key not in starts, f"{task} attempt {attempt} started twice"
            starts[key] = (node, float(stamp))
        else:
            ends[key] = float(stamp)
    return [Mark(task=t, attempt=a, node=n, start=s, end=ends.get((t, a)))
            for (t, a), (n, s) in sorted(starts.items())]


def overlapping(found: list[Mark]) -> list[tuple[Mark, Mark]]:
    """Pairs of attempts of one task that ran at the same time."""
    pairs = []
    by_task = sorted(found, key=lambda m: (m.task, m.start))
    for _, group in itertools.groupby(by_task, key=lambda m: m.task):
        for first, second in itertools.pairwise(list(group)):
            if first.end is None or first.end > second.start:
                pairs.append((first, second))
    return pairs
