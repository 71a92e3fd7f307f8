"""A live system to hurt: tests.support.Cluster with node-agents of their own (own
M27_HOME, each behind a TcpProxy to NATS, one per NATS server), and each kind of fault
done and undone on it.

Nothing here supervises the system as `m27 up` does: the harness starts again what it
killed after the fault's duration, as a supervisor or Kubernetes would.

The checkpoint-store's directory is a filesystem of its own where the machine allows
(root): ext4 on a loop device, which can be filled (disk_full) and slowed down
(slow_disk: a cgroup v1 blkio throttle on the device, so every write and fsync through
it waits, the kernel's own writeback included); else a tmpfs (full, not slow); else the
plain disk (neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Final

from nats.js.api import StreamInfo

from m27.client.scheduler import SchedulerClient
from m27.common.bus import NatsBus
from m27.embedded.nats_cluster import NatsCluster
from m27.embedded.nats_server import NatsServer, pid_alive
from m27.embedded.processes import ServiceProcess, wait_ready
from tests.chaos.schedule import KINDS, NATS, Kind
from tests.support import Cluster, TcpProxy

MODULES: Final = {"orchestrator": "m27.orchestrator", "scheduler": "m27.scheduler",
                  "checkpoint-store": "m27.checkpoint_store", "report": "m27.report"}
#: The size of the checkpoint-store's own filesystem.
STORE_FS_BYTES: Final = 256 * 1024 * 1024
#: cgroup v1's blkio controller: a throttle set in its root applies to every IO to a device.
BLKIO: Final = Path("/sys/fs/cgroup/blkio")
#: A slow disk: what the throttle lets through to the store's device (a tired NAS).
SLOW: Final = {"write_bps_device": 512 * 1024, "write_iops_device": 10,
               "read_bps_device": 1024 * 1024, "read_iops_device": 20}


def _run(*argv: str) -> str:
    """Run a system tool; its stdout. OSError or CalledProcessError when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def mount_tmpfs(path: Path, size: int) -> bool:
    """Mount a size-limited tmpfs at `path` (needs root); False where it cannot."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def mount_loop(path: Path, image: Path, size: int) -> str:
    """ext4 on a loop device over a sparse file `image` of `size` bytes, mounted at `path`
    (no blocks reserved for root: full means full); the loop device, or "" where the
    machine cannot (not root, no losetup or mkfs.ext4, no loop devices)."""
    path.mkdir(parents=True, exist_ok=True)
    device = ""
    try:
        with image.open("wb") as out:
            out.truncate(size)
        device = _run("losetup", "--find", "--show", str(image))
        _run("mkfs.ext4", "-q", "-m", "0", device)
        _run("mount", device, str(path))
    except (OSError, subprocess.SubprocessError):
        if device:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _run("losetup", "--detach", device)
        image.unlink(missing_ok=True)
        return ""
    return device


def unmount(path: Path, device: str = "") -> None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        _run("umount", "-l", str(path))
    if device:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _run("losetup", "--detach", device)


def can_throttle() -> bool:
    return os.access(BLKIO / "blkio.throttle.write_iops_device", os.W_OK)


def throttle(device: str, limits: dict[str, int] | None) -> None:
    """Limit every IO to `device` (block device path) to `limits`; None lifts them."""
    rdev = os.stat(device).st_rdev
    number = f"{os.major(rdev)}:{os.minor(rdev)}"
    for name, value in (limits or dict.fromkeys(SLOW, 0)).items():
        (BLKIO / f"blkio.throttle.{name}").write_text(f"{number} {value}")


def guard_pids(node: str, home: Path) -> list[int]:
    """The node guard processes of `node` (`_guard.py … --node-id node`) of the agent whose
    M27_HOME is `home` (not another system's node of the same name)."""
    found = []
    mine = f"M27_HOME={home}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if not (any(a.endswith(b"_guard.py") for a in argv) and node.encode() in argv):
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mine in environ:
            found.append(int(entry))
    return found


def _led(info: StreamInfo) -> bool:
    cluster = info.cluster
    if cluster is None:  # one server: it answered
        return True
    return bool(cluster.leader) and all(p.current and not p.offline
                                        for p in cluster.replicas or ())


def reap(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


class Live:
    """A running system and the means to hurt and heal it (blocking calls: the harness
    runs them in threads, so its timeline keeps going)."""

    def __init__(self, root: Path, *, nodes: int, env: dict[str, str],
                 nats_servers: int = 1) -> None:
        self.cluster = Cluster(root / "system", nodes=0, env=env, nats_servers=nats_servers)
        self.nodes = tuple(f"node-{i}" for i in range(1, nodes + 1))
        self.proxies: dict[str, list[TcpProxy]] = {}
        self.store_dir = self.cluster.home / "checkpoints"
        self.store_image = root / "checkpoints.ext4"
        self.store_device = ""  # the loop device under store_dir, when there is one
        self.mounted = False
        self.slowed = False
        self.frozen: set[str] = set()
        self.drained: set[str] = set()
        self.ballast = self.store_dir / "chaos-ballast"

    def kinds(self) -> tuple[Kind, ...]:
        """The fault kinds this machine can do: disk_full needs the store's directory on a
        filesystem of its own, slow_disk a loop device and the blkio throttle."""
        can = {"disk_full": self.mounted, "slow_disk": bool(self.store_device) and
               can_throttle()}
        return tuple(k for k in KINDS if can.get(k, True))

    @property
    def clustered(self) -> NatsCluster | None:
        nats = self.cluster.nats
        return nats if isinstance(nats, NatsCluster) else None

    def start(self) -> None:
        self.store_device = mount_loop(self.store_dir, self.store_image, STORE_FS_BYTES)
        self.mounted = bool(self.store_device) or mount_tmpfs(self.store_dir, STORE_FS_BYTES)
        self.cluster.start()
        clustered = self.clustered
        if isinstance(self.cluster.nats, NatsServer):
            self.cluster.nats.pin_port()  # started again, it comes back on the same URL
        urls = clustered.urls if clustered else [self.cluster.nats_url]
        for node in self.nodes:
            self.proxies[node] = [TcpProxy("127.0.0.1", int(url.rsplit(":", 1)[1]))
                                  for url in urls]
            (self.cluster.root / f"home-{node}").mkdir(exist_ok=True)
        wait_ready([self.launch_agent(node) for node in self.nodes])

    def agent_home(self, node: str) -> Path:
        return self.cluster.root / f"home-{node}"

    def launch_agent(self, node: str) -> ServiceProcess:
        """An agent with a home of its own (no shared disk: checkpoints move through the
        checkpoint-store), reaching NATS through its proxies (one per server)."""
        return self.cluster.launch(
            node, "m27.node_agent",
            ["--node-id", node, "--instance", node, "--gpus", "sim:1", "--cpu-slots", "8",
             "--heartbeat-interval", "1s",
             "--nats", ",".join(proxy.url for proxy in self.proxies[node])],
            env={"M27_HOME": str(self.agent_home(node))})

    def proc(self, name: str) -> ServiceProcess:
        return self.cluster.processes[name]

    def kill(self, name: str) -> None:
        pid = self.proc(name).pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        reap(pid)

    def restart(self, name: str) -> None:
        """Start a killed process again as a supervisor would: a service on the gRPC
        address it had (steps hold the checkpoint-store's), an agent on its node id and
        home."""
        old = self.proc(name)
        if name in self.nodes:
            proc = self.launch_agent(name)
        else:
            proc = self.cluster.launch(name, MODULES[name], ["--grpc", old.grpc_address])
        wait_ready([proc], timeout=90)

    def kill_guard(self, node: str) -> int:
        pids = guard_pids(node, self.agent_home(node))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def _member(self, target: str) -> int:
        """`nats-2` → 1 (a cluster member's index)."""
        return int(target.rsplit("-", 1)[1]) - 1

    def kill_nats(self, target: str = NATS) -> None:
        """SIGKILL the nats-server (`nats`) or one cluster member (`nats-<i>`)."""
        if (clustered := self.clustered) is not None:
            clustered.kill(self._member(target))
            return
        nats = self.cluster.nats
        assert isinstance(nats, NatsServer)
        assert nats.process is not None
        nats.process.kill()
        nats.process.wait(10)

    def start_nats(self, target: str = NATS) -> None:
        if (clustered := self.clustered) is not None:
            clustered.restart(self._member(target))
        else:
            self.cluster.nats.start()

    async def jetstream_ready(self, timeout_s: float = 120.0) -> None:
        """Until JetStream takes writes again: every stream answers with a leader and, on a
        cluster, every replica current. A member restarted is serving long before that —
        its streams elect leaders, it catches up, and a second restart meanwhile can leave
        a stream without a quorum (seed 22 in CI: 11 s without writes) — and that is the
        time a checkpoint cannot become durable (`checks.outage_windows`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # not up yet, or no quorum: look again
                bus = await NatsBus.open(self.cluster.nats_url, name="chaos-probe",
                                         timeout=2.0)
                try:
                    infos = await bus.js.streams_info()
                    if infos and all(_led(info) for info in infos):
                        return
                finally:
                    await bus.nc.close()
            await asyncio.sleep(0.2)

    def nats_dead(self) -> list[str]:
        if (clustered := self.clustered) is not None:
            return [f"{NATS}-{i + 1}" for i in range(len(clustered.servers))
                    if not clustered.alive(i)]
        nats = self.cluster.nats
        assert isinstance(nats, NatsServer)
        return [NATS] if nats.process is None or nats.process.poll() is not None else []

    def freeze(self, name: str) -> None:
        os.kill(self.proc(name).pid, signal.SIGSTOP)
        self.frozen.add(name)

    def thaw(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc(name).pid, signal.SIGCONT)
        self.frozen.discard(name)

    def cut(self, node: str) -> None:
        for proxy in self.proxies[node]:
            proxy.cut()

    def reconnect(self, node: str) -> None:
        for proxy in self.proxies[node]:
            proxy.heal()

    def fill_disk(self) -> None:
        """Fill the checkpoint-store's filesystem to the last byte."""
        chunk = b"\0" * (1 << 20)
        with self.ballast.open("ab") as out:
            for _ in range(STORE_FS_BYTES // len(chunk) + 2):
                try:
                    out.write(chunk)
                    out.flush()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break

    def empty_disk(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def slow_disk(self) -> None:
        """Throttle the store's device to SLOW: its writes, reads and fsyncs wait."""
        throttle(self.store_device, SLOW)
        self.slowed = True

    def fast_disk(self) -> None:
        if self.slowed:
            throttle(self.store_device, None)
            self.slowed = False

    async def maintenance(self, node: str, action: str) -> None:
        """Drain or uncordon `node` through the scheduler's API, asking again while the
        scheduler is down (killed or frozen by another fault)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                address = self.proc("scheduler").grpc_address
                async with SchedulerClient(address, access=self.cluster.access,
                                           ) as scheduler:
                    await scheduler.set_maintenance(node, action,  # type: ignore[arg-type]
                                                    reason="chaos")
            except Exception:
                if time.monotonic() > deadline:
                    raise
                import asyncio

                await asyncio.sleep(0.5)
            else:
                (self.drained.add if action == "drain" else self.drained.discard)(node)
                return

    def dead(self) -> list[str]:
        return [name for name, p in self.cluster.processes.items() if not pid_alive(p.pid)]

    async def heal_all(self) -> None:
        """Undo whatever is still done: thaw, reconnect, empty and speed up the disk,
        uncordon, start NATS (every member) and every dead process again."""
        for name in list(self.frozen):
            self.thaw(name)
        for node in self.nodes:
            self.reconnect(node)
        self.empty_disk()
        self.fast_disk()
        for server in self.nats_dead():
            self.start_nats(server)
        for name in self.dead():
            self.restart(name)
        for node in list(self.drained):
            await self.maintenance(node, "uncordon")

    def stop(self) -> None:
        for name in list(self.frozen):
            self.thaw(name)
        try:
            self.fast_disk()
            self.cluster.stop()
        finally:
            for proxies in self.proxies.values():
                for proxy in proxies:
                    proxy.close()
            if self.mounted:
                unmount(self.store_dir, self.store_device)
                self.store_image.unlink(missing_ok=True)
                self.mounted = False
