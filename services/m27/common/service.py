"""The imperative shell every service shares: flags, config, logging, signals, readiness.

A service's `__main__` builds a parser with `service_parser`, adds its own flags, and calls
`run_service` with a coroutine that receives a started `ServiceRuntime`. Readiness means:
NATS connected, topology ensured, gRPC health SERVING, the service registered in the
services bucket and — when `--ready-file` is given — that file written (atomically).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

from m27 import __version__
from m27.common import logrotate, subjects
from m27.common.api_auth import ApiAccess, Keys, load_keys, service_access
from m27.common.bus import NatsBus, access_for, until_settled
from m27.common.config import Config, LoadedConfig, Overrides, effective, load_config
from m27.common.errors import M27Error
from m27.common.grpc_server import GrpcServer, Register, start_server
from m27.common.logging import configure, get_logger
from m27.common.model import ServiceInfo
from m27.common.principals import service_principal, streams_seen
from m27.common.tokens import ApiRole

log = get_logger()


def service_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m m27.{name}", description=description)
    parser.add_argument("--nats", metavar="URL", help="NATS server URL ([nats] url)")
    parser.add_argument("--nats-credentials", metavar="FILE",
                        help="this service's nkey seed file ([nats] credentials; "
                        "docs/security.md)")
    parser.add_argument("--grpc", metavar="HOST:PORT", default="127.0.0.1:0",
                        help="where this service's gRPC server listens (default: %(default)s, "
                        "a free port)")
    parser.add_argument("--config", metavar="FILE", type=Path,
                        help="config file (default: $M27_CONFIG or ~/.m2config)")
    parser.add_argument("--ready-file", metavar="FILE", type=Path,
                        help="write {pid, grpc_address} here once ready (used by `m27 up`)")
    parser.add_argument("--instance", default=os.environ.get("M27_INSTANCE", ""),
                        help="this copy's name, unique among the copies of the service "
                        "(default: $M27_INSTANCE, else the host name)")
    parser.add_argument("--log-level", default=os.environ.get("M27_LOG_LEVEL", "info"))
    parser.add_argument("--log-json", action="store_true", default=None,
                        help="JSON log lines even on a terminal")
    return parser


class ServiceRuntime:
    """What a running service holds: its config, bus connection, gRPC server, stop signal."""

    def __init__(self, name: str, args: argparse.Namespace, loaded: LoadedConfig) -> None:
        self.name = name
        self.args = args
        self.config: Config = loaded.config
        self.home: Path = loaded.home  # $M27_HOME, read once with the config
        self.instance: str = args.instance or socket.gethostname().split(".")[0] or "local"
        self.stop = asyncio.Event()
        self.bus: NatsBus | None = None
        self.grpc: GrpcServer | None = None
        self._keys: Keys | None = None
        self.started_at = time.time()
        self.failure: BaseException | None = None
        self.is_ready = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def nats(self) -> NatsBus:
        assert self.bus is not None, "connect() first"
        return self.bus

    async def connect(self, node_id: str = "") -> NatsBus:
        """Connect as this service's principal (a node-agent: as its node)."""
        who = service_principal(self.name, node_id)
        self.bus = await NatsBus.open(self.config.nats.url, name=f"m27-{self.name}",
                                      timeout=self.config.nats.connect_timeout,
                                      replicas=self.config.nats.replicas,
                                      access=access_for(self.config.nats, who),
                                      topology=streams_seen(who.role))
        log.info("nats.connected", url=self.config.nats.url)
        return self.bus

    @property
    def api_keys(self) -> Keys:
        """This service's API keys (a node-agent: the node key only), read once."""
        if self._keys is None:
            self._keys = load_keys(self.config.api, self.home, self.name)
        return self._keys

    def api_access(self, user: str = "") -> ApiAccess:
        """How this service calls another's API: as a `service` (control plane) or as a
        `node` (a node-agent), with a fresh short-lived token on each call."""
        role: ApiRole = "node" if self.api_keys.control is None else "service"
        return service_access(self.api_keys, self.config.api, user=user or self.name,
                              role=role)

    async def serve_grpc(self, registrations: Sequence[Register] = (),
                         service_names: Sequence[str] = ()) -> GrpcServer:
        self.grpc = await start_server(self.args.grpc, registrations, service_names,
                                       keys=self.api_keys, api=self.config.api)
        log.info("grpc.listening", address=self.grpc.address, services=list(service_names))
        return self.grpc

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a long-lived loop; if it dies, the whole service stops (and exits 1)."""
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._on_task_done)
        self._tasks.append(task)
        return task

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        log.error("service.loop_failed", loop=task.get_name(), error=repr(self.failure))
        self.stop.set()

    async def join(self, timeout: float = 10.0) -> None:
        """Wait for the spawned loops to finish after `stop`; cancel the ones that do not."""
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(self._tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def ready(self, metrics_address: str = "", http_address: str = "") -> None:
        """Mark the service ready everywhere that watches for it (with the address of its
        Prometheus /metrics, if it serves one, for scrapers and tests to find)."""
        if self.grpc is None:
            await self.serve_grpc()
        assert self.grpc is not None
        await self.grpc.serving()
        info = ServiceInfo(name=self.name, instance=self.instance,
                           grpc_address=self.grpc.address, pid=os.getpid(),
                           host=socket.gethostname(), started_at=self.started_at,
                           version=__version__, metrics_address=metrics_address,
                           http_address=http_address)
        await until_settled(
            lambda: self.nats.kv_put(subjects.SERVICES_BUCKET,
                                     subjects.service_key(self.name, self.instance), info),
            what="the service's registration", stop=self.stop)
        if self.args.ready_file:
            write_json_atomic(self.args.ready_file,
                              {"name": self.name, "pid": os.getpid(),
                               "grpc_address": self.grpc.address,
                               "http_address": http_address})
        self.is_ready = True
        log.info("service.ready", grpc_address=self.grpc.address)

    async def unready(self) -> None:
        """No longer ready (a scheduler copy that stopped acting): its health says
        NOT_SERVING (alive still: `grpc_server.LIVE_SERVICE`) and its registration is
        withdrawn, so neither a Service nor a client sends it work meanwhile."""
        if self.grpc is not None:
            await self.grpc.not_serving()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.kv_delete(subjects.SERVICES_BUCKET,
                                         subjects.service_key(self.name, self.instance))
        self.is_ready = False
        log.info("service.unready")

    async def close(self) -> None:
        self.stop.set()  # a service that failed while starting: its loops stop now, too
        await self.join()
        if self.bus is not None:
            with contextlib.suppress(Exception):
                await self.bus.kv_delete(subjects.SERVICES_BUCKET,
                                         subjects.service_key(self.name, self.instance))
        if self.grpc is not None:
            await self.grpc.stop()
        if self.bus is not None:
            await self.bus.close()


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class ServiceFlags(Protocol):
    """What a service's `flags` module offers (`m27/<service>/flags.py`)."""

    @property
    def NAME(self) -> str: ...

    def build_parser(self) -> argparse.ArgumentParser: ...

    def overrides(self, args: argparse.Namespace) -> Overrides: ...


def main(flags: ServiceFlags, serve: Callable[[ServiceRuntime], Awaitable[None]]) -> None:
    """What every service's `__main__` runs: its flags parsed, then `run_service`."""
    args = flags.build_parser().parse_args()
    run_service(flags.NAME, args, flags.overrides(args), serve)


def run_service(
    name: str,
    args: argparse.Namespace,
    overrides: Overrides,
    main: Callable[[ServiceRuntime], Awaitable[None]],
) -> None:
    """Load config, set up logging, run `main` until SIGTERM/SIGINT; exit 1 on a clear error."""
    try:
        loaded = load_config(args.config, overrides={
            ("nats", "url"): args.nats, ("nats", "credentials"): args.nats_credentials,
            **overrides})
        rotating = logrotate.from_environment(os.environ)
        os.environ.pop("M27_LOG_FILE", None)  # not for the processes it starts (steps)
    except M27Error as exc:
        print(f"m27.{name}: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    configure(name, args.log_level, json=args.log_json, stream=rotating)
    for warning in loaded.warnings:
        log.warning("config.warning", message=warning)
    log.info("service.starting", version=__version__, pid=os.getpid(),
             config_file=loaded.path, config=effective(loaded.config))
    runtime = ServiceRuntime(name, args, loaded)
    try:
        asyncio.run(_run(runtime, main))
    except M27Error as exc:
        log.error("service.failed", error=str(exc))
        raise SystemExit(1) from exc
    log.info("service.stopped")


async def _run(runtime: ServiceRuntime,
               main: Callable[[ServiceRuntime], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal() -> None:
        runtime.stop.set()
        if not runtime.is_ready and task is not None:
            task.cancel()  # still starting (e.g. waiting for NATS): give up at once

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await main(runtime)
    except asyncio.CancelledError:
        if not runtime.stop.is_set():
            raise
        log.info("service.stopped_while_starting")
    finally:
        await runtime.close()
    if runtime.failure is not None:
        raise M27Error(f"a service loop failed: {runtime.failure!r}")
