"""`m27 agent`: this machine joins a lab's m27 as a node, without Kubernetes.

It checks what a node-agent needs besides a NATS URL — its node's nkey seed and the node
API key, both copied from the head node — and says in one line what is missing and where
it comes from; then it becomes `python -m m27.node_agent` with the mapped flags (exec), so
what runs is exactly the service, in the foreground (for systemd, a terminal, tmux).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Final

import msgspec

from m27.cli._common import Subparsers, config
from m27.common import api_auth
from m27.common.bus import server_urls
from m27.common.config import Config, node_id_default
from m27.common.credentials import read_seed
from m27.common.errors import M27Error
from m27.common.ids import is_valid_name
from m27.common.principals import principal

NODE_KEY_ENV: Final = "M27_API_NODE_KEY_FILE"  # [api] node_key_file, as the agent reads it

DESCRIPTION: Final = """\
Run a node-agent on this machine, in the foreground: it registers the machine and its
GPUs with the lab's m27, heartbeats, and runs the steps the scheduler places here. It is
`python -m m27.node_agent` with these flags (Ctrl-C or SIGTERM stops it; its running
steps get their grace period and move elsewhere).

What it needs from the head node (the machine that runs `m27 up`, or the deployment's
NATS and services):
  - the bus's URL: --nats, several servers of a NATS cluster comma-separated;
  - this node's NATS seed, node-<ID>.nk: made on the head by
    `m27 bus credentials DIR --nodes ID` (under `m27 up`: DIR is
    $M27_HOME/credentials/nats, and `m27 up` again lets it onto the running bus);
  - the node API key, node.key (to call the checkpoint-store and sign its steps' tokens):
    on the head in $M27_HOME/credentials/api/, or wherever `m27 api keys DIR` wrote it.
Copy both files here (mode 0600, readable only by the user that runs the agent)."""

EXAMPLE: Final = """\
example (gpu-02 joins a lab whose NATS and services run on gpu-01, docs/deploy.md):
  on gpu-01:  m27 bus credentials /etc/m27/nats --nodes gpu-01,gpu-02
              (then `nats-server --signal reload`: the bus admits node-gpu-02)
              scp /etc/m27/nats/node-gpu-02.nk /etc/m27/api/node.key gpu-02:/etc/m27/
  on gpu-02:  m27 agent --nats tls://gpu-01:4222 --creds /etc/m27/node-gpu-02.nk \\
                  --node-key /etc/m27/node.key --node-id gpu-02 --gpus auto
Beyond loopback, NATS and the gRPC APIs need TLS ([nats] tls_ca, [api] tls_ca …;
docs/security.md). `m27 up` serves loopback only: there a seed put into
$M27_HOME/credentials/nats, then `m27 up` again, lets an agent with an M27_HOME of its
own join from the same machine (to try it)."""


def add_commands(sub: Subparsers) -> None:
    agent = sub.add_parser(
        "agent", help="run a node-agent here in the foreground: this machine joins a lab's "
        "m27 as a node (no Kubernetes needed)", description=DESCRIPTION, epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    agent.set_defaults(handler=cmd_agent)
    agent.add_argument("--nats", metavar="URL",
                       help="the lab's NATS, e.g. tls://gpu-01:4222, or a cluster's servers "
                       "comma-separated (default: [nats] url)")
    agent.add_argument("--creds", metavar="FILE", type=Path,
                       help="this node's nkey seed, node-<ID>.nk from the head node "
                       "(default: [nats] credentials, else "
                       "$M27_HOME/credentials/nats/node-<ID>.nk)")
    agent.add_argument("--node-key", metavar="FILE", type=Path,
                       help="the node API key, node.key from the head node (default: [api] "
                       "node_key_file, else $M27_HOME/credentials/api/node.key)")
    agent.add_argument("--node-id", metavar="NAME",
                       help="this node's id (default: [node] id, else the host name)")
    agent.add_argument("--gpus", metavar="SPEC",
                       help="auto (NVML), none, sim:N or sim:NxMEM for simulated GPUs "
                       "(default: [node] gpus, auto)")
    agent.add_argument("--cpu-slots", metavar="N",
                       help="CPU steps run at once (default: [node] cpu_slots, the cores)")
    agent.add_argument("--heartbeat-interval", metavar="DURATION",
                       help="lease renewals, e.g. 5s (default: [node] heartbeat_interval)")
    agent.add_argument("--grpc", metavar="HOST:PORT",
                       help="where its log server (`m27 logs`) listens (default "
                       "127.0.0.1:0; beyond loopback it needs [api] tls_cert)")
    agent.add_argument("--log-level", metavar="LEVEL", help="debug, info (default), warning")
    agent.add_argument("--log-json", action="store_true", help="JSON log lines on a terminal")
    agent.add_argument("--ready-file", metavar="FILE", type=Path,
                       help="write {pid, grpc_address} here once registered (for scripts)")


def cmd_agent(args: argparse.Namespace) -> int:
    argv, env = agent_command(args, config(args), args.home)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)  # noqa: S606 - exactly the service, in our place


def agent_command(args: argparse.Namespace, cfg: Config, home: Path
                  ) -> tuple[list[str], dict[str, str]]:
    """The node-agent's command line and environment; M27Error in one line naming what is
    missing and what to copy from the head node."""
    node_id = args.node_id or cfg.node.id.strip() or node_id_default()
    if not is_valid_name(node_id):
        raise M27Error(f"--node-id {node_id[:100]!r}: use letters, digits, '_' and '-', "
                       "starting with a letter or digit, at most 100 characters")
    url = args.nats or cfg.nats.url
    server_urls(url)  # a list that names no server is refused here, with its text
    seed = _seed_file(args, cfg, home, node_id)
    node_key = _node_key_file(args, cfg, home)
    argv = [sys.executable, "-m", "m27.node_agent", "--nats", url,
            "--nats-credentials", str(seed), "--node-id", node_id, "--instance", node_id]
    for flag, value in (("--gpus", args.gpus), ("--cpu-slots", args.cpu_slots),
                        ("--heartbeat-interval", args.heartbeat_interval),
                        ("--grpc", args.grpc), ("--log-level", args.log_level),
                        ("--config", args.config), ("--ready-file", args.ready_file)):
        if value is not None:
            argv += [flag, str(value)]
    if args.log_json:
        argv.append("--log-json")
    return argv, {**os.environ, NODE_KEY_ENV: str(node_key)}


def _seed_file(args: argparse.Namespace, cfg: Config, home: Path, node_id: str) -> Path:
    name = f"{principal('node-agent', node_id).name}.nk"
    given = args.creds or (Path(cfg.nats.credentials) if cfg.nats.credentials else None)
    path = given or home / "credentials" / "nats" / name
    if not path.exists():
        raise M27Error(f"no NATS seed for node {node_id} at {path}: copy {name} from the head "
                       f"node (`m27 bus credentials DIR --nodes {node_id}` makes it there; "
                       "under `m27 up` DIR is $M27_HOME/credentials/nats, then run `m27 up` "
                       "again) and pass --creds FILE")
    try:
        read_seed(path)
    except M27Error as exc:
        raise M27Error(f"--creds {path}: {exc}") from exc
    return path


def _node_key_file(args: argparse.Namespace, cfg: Config, home: Path) -> Path:
    configured = Path(cfg.api.node_key_file) if cfg.api.node_key_file else None
    path = args.node_key or configured or api_auth.api_dir(home) / api_auth.NODE_KEY
    if not path.exists():
        raise M27Error(f"no node API key at {path}: copy {api_auth.NODE_KEY} from the head "
                       f"node ($M27_HOME/credentials/api/{api_auth.NODE_KEY} there, or the "
                       "DIR of its `m27 api keys DIR`) and pass --node-key FILE")
    section = msgspec.structs.replace(cfg.api, node_key_file=str(path))
    try:
        api_auth.load_keys(section, home, "node-agent")
    except M27Error as exc:
        raise M27Error(f"--node-key {path}: {exc}") from exc
    return path
