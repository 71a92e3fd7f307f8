"""`python -m m27.embedded.supervisor`: the one process `m27 up` leaves running. It starts
nats-server (or a NATS cluster) and every service as its own children and keeps them
running: a process that exits is started again after a backoff, one that keeps exiting is
given up on (m27.embedded.restarts decides), and every exit, restart and readiness is
logged (`$M27_HOME/logs/supervisor.log`) and written to `$M27_HOME/embedded.json`, which
`m27 status` shows.

With `m27 up` (system.py): the `Plan` arrives as JSON on stdin; one `Report` line goes
to the file descriptor `--report-fd` names once everything is ready and the state is
written, or once starting failed (whatever it had started stopped again). Then:

- SIGTERM or SIGINT (`m27 down`): services stopped first, NATS last; every process is
  marked `stopped`. Those exits are no crashes.
- SIGUSR1 (`m27 up` while something is down): every process waiting for its restart or
  given up on is started now, with its history forgotten.

A nats-server comes back on its own config: the same client port (a single server was
started on a free one, then pinned to it), name and store, so the services, whose
connections retry for ever, reconnect by themselves. A service comes back on the same
gRPC address (and the report on the same dashboard), so `m27 status` and clients keep
finding it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Final

import msgspec

from m27.common import logrotate
from m27.common.config import NatsSection, SupervisorSection
from m27.common.credentials import seed_path
from m27.common.errors import M27Error
from m27.common.logging import configure, get_logger
from m27.common.principals import Principal, principal
from m27.embedded.bus_setup import (
    CLUSTER_REPLICAS,
    SIZE_FILE,
    access,
    create_topology,
    credentials_dir,
    embedded_cluster,
    embedded_server,
)
from m27.embedded.nats_server import NatsServer, spawn
from m27.embedded.nats_server import wait_ready as wait_server_ready
from m27.embedded.processes import ServiceProcess, check_ready, start_process, wait_ready
from m27.embedded.restarts import History, RestartPolicy, decide, describe_exit
from m27.embedded.state import EmbeddedState, NatsProcess, Supervision, write_state

log = get_logger()

START_TIMEOUT_S: Final = 60.0  # every service ready (`m27 up`), or one started again
SERVICES_STOP_S: Final = 20.0  # SIGTERM → this long → SIGKILL
NATS_STOP_S: Final = 10.0
TICK_S: Final = 0.2  # how often a service started again is looked at until it is ready
IDLE_S: Final = 5.0  # nothing to do: wake up this often anyway (a signal wakes it at once)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """What `m27 up` asks the supervisor to run."""

    home: str
    nodes: int
    gpus: str  # each node-agent's --gpus
    simulated: bool
    log_level: str = "info"
    nats: NatsSection = NatsSection()
    policy: SupervisorSection = SupervisorSection()
    telegram: bool = False
    nats_cluster: int = 1


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """The supervisor's one answer to `m27 up`: everything ready, or why not."""

    ok: bool
    error: str = ""


class Aborted(M27Error):
    """SIGTERM while starting: stop what was started and say so."""


class Child:
    """One supervised process: its Popen (whoever holds it gets its exit status), what
    `m27 status` shows of it, and its restart history."""

    def __init__(self, name: str, process: subprocess.Popen[bytes]) -> None:
        self.name = name
        self.process = process
        self.info = Supervision()
        self.history = History()
        self.started_at = time.time()

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        """Start it again; M27Error or OSError when that fails at once."""
        raise NotImplementedError

    def ready(self) -> bool:
        return True


class NatsChild(Child):
    """A nats-server, started again on its own config and waited for until it accepts
    clients (at most nats_server.START_TIMEOUT_S)."""

    def __init__(self, member: NatsProcess, process: subprocess.Popen[bytes]) -> None:
        super().__init__(member.name, process)
        self.member = member

    def start(self) -> None:
        config, log_path = Path(self.member.config_path), Path(self.member.log_path)
        ports = config.parent / "ports"  # as NatsServer lays its files out
        for stale in ports.glob("*.ports"):
            stale.unlink(missing_ok=True)
        self.process = spawn(config, log_path, detached=True)
        self.member.pid = self.process.pid
        wait_server_ready(self.process, ports, log_path)


class ServiceChild(Child):
    """A service, started again with its arguments on the address it had; ready once it
    writes its ready file."""

    def __init__(self, proc: ServiceProcess, args: list[str],
                 process: subprocess.Popen[bytes]) -> None:
        super().__init__(proc.name, process)
        self.proc = proc  # the record in the state: kept current
        self.args = args

    def start(self) -> None:
        args = list(self.args)
        if self.proc.grpc_address:  # the address it had: `m27 status` and clients keep it
            args += ["--grpc", self.proc.grpc_address]
        env = dict(os.environ)
        if self.proc.http_address:  # the report's dashboard: on the address it had
            env["M27_REPORT_DASHBOARD"] = self.proc.http_address
        new, self.process = start_process(self.proc.name, self.proc.module, args,
                                          log_dir=Path(self.proc.log_path).parent,
                                          detached=True, env=env)
        self.proc.pid, self.proc.ready_file = new.pid, new.ready_file

    def ready(self) -> bool:
        return check_ready(self.proc)


class Wakeup:
    """Signals as events for the loop: SIGCHLD (a child exited) wakes it, SIGTERM and
    SIGINT stop it, SIGUSR1 asks for every waiting or given-up process now. While
    `starting`, SIGTERM and SIGINT abort the start instead (Aborted)."""

    def __init__(self) -> None:
        self.stop = False
        self.retry = False
        self.starting = True
        self._read, write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.stop = True
            if self.starting:  # once: a second signal must not cut the clean-up short
                self.starting = False
                raise Aborted(f"stopped by {signal.Signals(signum).name} while starting")
        elif signum == signal.SIGUSR1:
            self.retry = True

    def wait(self, timeout: float) -> None:
        """Until a signal comes or `timeout` passes."""
        if self.stop or self.retry:
            return
        select.select([self._read], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 512):
                pass


class Supervisor:
    """The loop: notice exits and readiness, start again what is due, write the state."""

    def __init__(self, home: Path, state: EmbeddedState, nats: list[NatsChild],
                 services: list[ServiceChild], policy: RestartPolicy) -> None:
        self.home = home
        self.state = state
        self.nats = nats
        self.services = services
        self.children: list[Child] = [*nats, *services]
        self.policy = policy

    def run(self, wake: Wakeup) -> None:
        """Until SIGTERM; then stop everything."""
        while not wake.stop:
            if wake.retry:
                wake.retry = False
                self.retry_now(time.time())
            wake.wait(self.tick(time.time()))
        self.shutdown()

    def tick(self, now: float) -> float:
        """One look at every child; how long until the next thing to do."""
        changed = [self._step(child, now) for child in self.children]
        if any(changed):
            self.write()
        due = [child.info.restart_at - time.time() for child in self.children
               if child.info.state == "restarting"]
        if any(child.info.state == "starting" for child in self.children):
            due.append(TICK_S)
        return max(0.0, min(due, default=IDLE_S))

    def _step(self, child: Child, now: float) -> bool:
        """Whether anything changed for `child`."""
        state = child.info.state
        if state in ("running", "starting"):
            code = child.process.poll()
            if code is not None:
                self._exited(child, code, now)
                return True
            if state == "starting" and child.ready():
                child.info.state = "running"
                log.info("supervisor.ready", process=child.name, pid=child.pid)
                return True
            if state == "starting" and now - child.started_at > START_TIMEOUT_S:
                log.warning("supervisor.not_ready", process=child.name, pid=child.pid,
                            after_s=START_TIMEOUT_S)
                child.process.kill()  # hung: its exit is seen next, one more exit
            return False
        if state == "restarting" and now >= child.info.restart_at:
            self._restart(child, now)
            return True
        return False

    def _exited(self, child: Child, code: int, now: float) -> None:
        child.history, decision = decide(self.policy, child.history,
                                         started_at=child.started_at, now=now)
        info = child.info
        info.last_exit, info.last_exit_at = describe_exit(code), now
        info.reason = decision.reason
        fields = {"process": child.name, "pid": child.pid, "exit": info.last_exit,
                  "up_s": round(now - child.started_at, 3), "restarts": info.restarts}
        if decision.restart:
            info.state, info.restart_at = "restarting", decision.at
            log.warning("supervisor.process_exited", restart_in_s=decision.delay, **fields)
        else:
            info.state, info.restart_at = "gave-up", 0.0
            log.error("supervisor.gave_up", reason=decision.reason, **fields)

    def _restart(self, child: Child, now: float) -> None:
        child.info.restarts += 1
        child.started_at = now
        # a nats-server is waited for in start(); a service is seen ready later
        child.info.state = "running" if isinstance(child, NatsChild) else "starting"
        try:
            child.start()
        except (M27Error, OSError) as exc:  # its exit (or the last one) is seen next
            log.warning("supervisor.restart_failed", process=child.name, error=str(exc))
            if child.process.poll() is None:  # hung while starting
                child.process.kill()
                child.process.wait()
            return
        log.info("supervisor.restarted", process=child.name, pid=child.pid,
                 restarts=child.info.restarts)

    def retry_now(self, now: float) -> None:
        """Every process waiting for its restart or given up on: start it now, its
        history forgotten (SIGUSR1, from `m27 up`)."""
        for child in self.children:
            if child.info.state in ("restarting", "gave-up"):
                child.history = History()
                child.info.state, child.info.restart_at = "restarting", now
                child.info.reason = "started again by `m27 up`"
                log.info("supervisor.retry", process=child.name)

    def shutdown(self) -> None:
        """Services first, then NATS; each marked stopped."""
        log.info("supervisor.stopping")
        stop_children(self.services, SERVICES_STOP_S)
        stop_children(self.nats, NATS_STOP_S)
        for child in self.children:
            child.info.state, child.info.restart_at = "stopped", 0.0
        self.write()
        log.info("supervisor.stopped")

    def write(self) -> None:
        self.state.nats_pid = self.nats[0].pid
        if self.state.nats_servers:
            self.state.nats_servers = [child.member for child in self.nats]
        self.state.supervision = {child.name: child.info for child in self.children}
        write_state(self.home, self.state)


def stop_children(children: Sequence[Child], timeout: float) -> None:
    """SIGTERM all at once (each may wait for the others while it stops), wait for them
    together, SIGKILL what outlives `timeout`."""
    running = [child for child in children if child.process.poll() is None]
    for child in reversed(running):
        with contextlib.suppress(ProcessLookupError):
            child.process.terminate()
    deadline = time.monotonic() + timeout
    for child in reversed(running):
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def start(plan: Plan) -> tuple[EmbeddedState, list[NatsChild], list[ServiceChild]]:
    """NATS, its topology, then every service, ready; M27Error (all stopped) if not."""
    home = Path(plan.home)
    nats = start_nats(home, plan)
    (home / SIZE_FILE).write_text(f"{plan.nats_cluster}\n")  # which store `stored_nats` reads
    try:
        services = start_services(home, plan, [child.member.url for child in nats])
    except M27Error:
        stop_children(nats, NATS_STOP_S)
        raise
    api = next(child.proc.grpc_address for child in services
               if child.name == "orchestrator")
    state = EmbeddedState(
        home=str(home), nats_url=",".join(child.member.url for child in nats),
        nats_pid=nats[0].pid, api=api, processes=[child.proc for child in services],
        started_at=time.time(), gpus=plan.gpus, simulated_gpus=plan.simulated,
        nats_servers=[child.member for child in nats] if plan.nats_cluster > 1 else [],
        supervisor_pid=os.getpid())
    return state, nats, services


def start_nats(home: Path, plan: Plan) -> list[NatsChild]:
    """The embedded bus: its servers started, the topology created with 1 replica, or
    CLUSTER_REPLICAS on a cluster."""
    servers: list[NatsServer]
    if plan.nats_cluster == 1:
        server = embedded_server(home, plan.nats, plan.nodes)
        server.start(detached=True)
        server.pin_port()  # a restart comes back on the same URL
        servers, names, replicas = [server], ["nats-server"], 1
    else:
        cluster = embedded_cluster(home, plan.nats, plan.nodes, plan.nats_cluster)
        cluster.start(detached=True)
        servers, replicas = cluster.servers, CLUSTER_REPLICAS
        names = [f"nats-server-{i}" for i in range(1, len(servers) + 1)]
    children = []
    for name, server in zip(names, servers, strict=True):
        assert server.process is not None
        assert server.url is not None
        member = NatsProcess(name=name, pid=server.process.pid, url=server.url,
                             config_path=str(server.config_path),
                             log_path=str(server.log_path))
        children.append(NatsChild(member, server.process))
    try:
        create_topology(",".join(child.member.url for child in children),
                        access(home, principal("admin"), plan.nats), replicas)
    except M27Error:
        stop_children(children, 5)
        raise
    return children


def start_services(home: Path, plan: Plan, urls: list[str]) -> list[ServiceChild]:
    """Every service, each given the servers in another order; all ready."""
    common = ["--log-level", plan.log_level, "--log-json"]
    specs: list[tuple[str, str, Principal, list[str]]] = [
        ("orchestrator", "m27.orchestrator", principal("orchestrator"), []),
        ("scheduler", "m27.scheduler", principal("scheduler"), []),
        ("checkpoint-store", "m27.checkpoint_store", principal("checkpoint-store"), []),
        ("report", "m27.report", principal("report"), [])]
    if plan.telegram:
        specs.append(("telegram", "m27.telegram", principal("telegram"), []))
    specs += [(f"node-agent-{i}", "m27.node_agent", principal("node-agent", f"node-{i}"),
               ["--node-id", f"node-{i}", "--instance", f"node-{i}", "--gpus", plan.gpus])
              for i in range(1, plan.nodes + 1)]
    children = []
    for i, (name, module, who, extra) in enumerate(specs):
        args = ["--nats", rotated(urls, i), *common, "--nats-credentials",
                str(seed_path(credentials_dir(home), who)), *extra]
        proc, process = start_process(name, module, args, log_dir=home / "logs",
                                      detached=True)
        children.append(ServiceChild(proc, args, process))
    try:
        wait_ready([child.proc for child in children], timeout=START_TIMEOUT_S)
    except M27Error:
        stop_children(children, 5)
        raise
    return children


def rotated(urls: list[str], start: int) -> str:
    """The servers' URLs starting at the `start`-th (modulo their number), comma-separated:
    a client tries them in that order, so clients given different starts spread out."""
    shift = start % len(urls)
    return ",".join(urls[shift:] + urls[:shift])


def answer(fd: int, report: Report) -> None:
    """The one line for `m27 up` (which may have given up waiting: then nobody reads)."""
    with contextlib.suppress(BrokenPipeError), os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.encode(report) + b"\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m27.embedded.supervisor",
                                     description="Runs what `m27 up` starts (its Plan on "
                                     "stdin) and keeps it running.")
    parser.add_argument("--report-fd", type=int, required=True,
                        help="where to write the one Report line")
    args = parser.parse_args(argv)
    plan = msgspec.json.decode(sys.stdin.buffer.read(), type=Plan)
    rotating = logrotate.from_environment(os.environ)
    os.environ.pop("M27_LOG_FILE", None)  # not for the processes it starts
    configure("supervisor", plan.log_level, json=True, stream=rotating)
    wake = Wakeup()
    try:
        state, nats, services = start(plan)
        wake.starting = False
    except M27Error as exc:
        log.error("supervisor.start_failed", error=str(exc))
        answer(args.report_fd, Report(ok=False, error=str(exc)))
        return 1
    supervisor = Supervisor(Path(plan.home), state, nats, services, plan.policy)
    supervisor.write()
    answer(args.report_fd, Report(ok=True))
    log.info("supervisor.started", pid=os.getpid(), nats_url=state.nats_url, api=state.api,
             processes=[child.name for child in supervisor.children])
    wake.retry = False
    supervisor.run(wake)
    return 0


if __name__ == "__main__":
    sys.exit(main())
