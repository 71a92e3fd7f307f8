"""A live system to hurt: tests.support.Cluster with node-agents of their own (own
M27_HOME, each behind a TcpProxy to NATS), and each kind of fault done and undone on it.

Nothing here supervises the system as `m27 up` does: the harness starts again what it
killed after the fault's duration, as a supervisor or Kubernetes would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Final

from m27.client.scheduler import SchedulerClient
from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import ServiceProcess, wait_ready
from tests.chaos.schedule import KINDS, Kind
from tests.support import Cluster, TcpProxy

MODULES: Final = {"orchestrator": "m27.orchestrator", "scheduler": "m27.scheduler",
                  "checkpoint-store": "m27.checkpoint_store", "report": "m27.report"}
#: The checkpoint-store's directory is a tmpfs of this size when one can be mounted.
STORE_FS_BYTES: Final = 256 * 1024 * 1024


def mount_tmpfs(path: Path, size: int) -> bool:
    """Mount a size-limited tmpfs at `path` (needs root); False where it cannot."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(path)], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10, check=False)


def guard_pids(node: str) -> list[int]:
    """The node guard processes of `node` (`_guard.py … --node-id node`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"_guard.py") for a in argv) and node.encode() in argv:
            found.append(int(entry))
    return found


def reap(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


class Live:
    """A running system and the means to hurt and heal it (blocking calls: the harness
    runs them in threads, so its timeline keeps going)."""

    def __init__(self, root: Path, *, nodes: int, env: dict[str, str]) -> None:
        self.cluster = Cluster(root / "system", nodes=0, env=env)
        self.nodes = tuple(f"node-{i}" for i in range(1, nodes + 1))
        self.proxies: dict[str, TcpProxy] = {}
        self.store_dir = self.cluster.home / "checkpoints"
        self.mounted = False
        self.frozen: set[str] = set()
        self.drained: set[str] = set()
        self.ballast = self.store_dir / "chaos-ballast"

    def kinds(self) -> tuple[Kind, ...]:
        """The fault kinds this machine can do: all but disk_full without a tmpfs."""
        return tuple(k for k in KINDS if k != "disk_full" or self.mounted)

    def start(self) -> None:
        self.mounted = mount_tmpfs(self.store_dir, STORE_FS_BYTES)
        self.cluster.start()
        self.cluster.nats.pin_port()  # started again, it comes back on the same URL
        port = int(self.cluster.nats_url.rsplit(":", 1)[1])
        for node in self.nodes:
            self.proxies[node] = TcpProxy("127.0.0.1", port)
            (self.cluster.root / f"home-{node}").mkdir(exist_ok=True)
        wait_ready([self.launch_agent(node) for node in self.nodes])

    def launch_agent(self, node: str) -> ServiceProcess:
        """An agent with a home of its own (no shared disk: checkpoints move through the
        checkpoint-store), reaching NATS through its proxy."""
        return self.cluster.launch(
            node, "m27.node_agent",
            ["--node-id", node, "--instance", node, "--gpus", "sim:1", "--cpu-slots", "8",
             "--heartbeat-interval", "1s", "--nats", self.proxies[node].url],
            env={"M27_HOME": str(self.cluster.root / f"home-{node}")})

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
        pids = guard_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def kill_nats(self) -> None:
        nats = self.cluster.nats
        assert nats.process is not None
        nats.process.kill()
        nats.process.wait(10)

    def start_nats(self) -> None:
        self.cluster.nats.start()

    def freeze(self, name: str) -> None:
        os.kill(self.proc(name).pid, signal.SIGSTOP)
        self.frozen.add(name)

    def thaw(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc(name).pid, signal.SIGCONT)
        self.frozen.discard(name)

    def cut(self, node: str) -> None:
        self.proxies[node].cut()

    def reconnect(self, node: str) -> None:
        self.proxies[node].heal()

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
        """Undo whatever is still done: thaw, reconnect, empty the disk, uncordon, start
        NATS and every dead process again."""
        for name in list(self.frozen):
            self.thaw(name)
        for node in self.nodes:
            self.reconnect(node)
        self.empty_disk()
        nats = self.cluster.nats
        if nats.process is None or nats.process.poll() is not None:
            self.start_nats()
        for name in self.dead():
            self.restart(name)
        for node in list(self.drained):
            await self.maintenance(node, "uncordon")

    def stop(self) -> None:
        for name in list(self.frozen):
            self.thaw(name)
        try:
            self.cluster.stop()
        finally:
            for proxy in self.proxies.values():
                proxy.close()
            if self.mounted:
                unmount(self.store_dir)
                self.mounted = False
