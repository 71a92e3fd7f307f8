"""Helpers for the integration tests: a whole m27 system on loopback."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from m27.embedded import NatsServer
from m27.embedded.processes import ServiceProcess, launch, stop, wait_ready


def service_log(proc: ServiceProcess) -> str:
    return Path(proc.log_path).read_text(errors="replace")


class Cluster:
    """A whole m27 on loopback: nats-server plus the five services as real processes."""

    def __init__(self, root: Path, nodes: int = 1, gpus: str = "sim:2") -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        config = root / "m2config"
        config.write_text("")
        self.env = {**os.environ, "M27_HOME": str(self.home), "M27_CONFIG": str(config)}
        self.nats = NatsServer(root / "nats")
        self.nodes = nodes
        self.gpus = gpus
        self.processes: dict[str, ServiceProcess] = {}

    @property
    def nats_url(self) -> str:
        assert self.nats.url is not None
        return self.nats.url

    @property
    def api(self) -> str:
        return self.processes["orchestrator"].grpc_address

    def start(self) -> None:
        self.nats.start()
        specs = [("orchestrator", "m27.orchestrator", []), ("scheduler", "m27.scheduler", []),
                 ("checkpoint-store", "m27.checkpoint_store", []), ("report", "m27.report", [])]
        specs += [(f"node-agent-{i}", "m27.node_agent",
                   ["--node-id", f"node-{i}", "--gpus", self.gpus,
                    "--heartbeat-interval", "1s"]) for i in range(1, self.nodes + 1)]
        for name, module, args in specs:
            self.launch(name, module, args)
        wait_ready(list(self.processes.values()))

    def launch(self, name: str, module: str, args: Sequence[str] = ()) -> ServiceProcess:
        proc = launch(name, module, ["--nats", self.nats_url, *args],
                      log_dir=self.root / "logs", env=self.env)
        self.processes[name] = proc
        return proc

    def logs(self) -> str:
        return "\n".join(f"===== {name}\n{service_log(p)[-3000:]}"
                         for name, p in self.processes.items())

    def stop(self) -> None:
        stop(list(self.processes.values()))
        self.nats.stop()

