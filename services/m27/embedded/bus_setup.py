"""The embedded bus's servers, users and topology: who may connect with which seed, the
nats-server (or cluster) configured for them, and the streams and buckets created on it.
Used by the supervisor when it starts the bus, and by `m27 up` / `m27 runs` around it."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec

from m27.common.bus import Access, NatsBus, access_for
from m27.common.config import NatsSection
from m27.common.credentials import SEED_SUFFIX, authorization, ensure_seeds, seed_path
from m27.common.errors import M27Error
from m27.common.principals import NODE_ID, Principal, deployment
from m27.embedded.nats_cluster import NatsCluster, run_blocking, wait_for_jetstream
from m27.embedded.nats_server import NatsServer, ServerTls

CLUSTER_DIR: Final = "nats-cluster"
CLUSTER_REPLICAS: Final = 3
SIZE_FILE: Final = "nats-servers"  # how many the last `up` ran


def credentials_dir(home: Path) -> Path:
    """Where `up` keeps the embedded bus's nkey seeds (0700, each file 0600)."""
    return home / "credentials" / "nats"


def access(home: Path, who: Principal, config: NatsSection) -> Access:
    """How `who` connects to the embedded bus under `home`."""
    return msgspec.structs.replace(
        access_for(config, who), seed_file=str(seed_path(credentials_dir(home), who)))


def embedded_server(home: Path, config: NatsSection, nodes: int) -> NatsServer:
    """The embedded nats-server: users for every principal (seeds made if missing), TLS
    when `[nats] server_cert` and `server_key` are set (mutual with `tls_cert` too)."""
    auth, tls = _server_security(home, config, nodes)
    return NatsServer(home / "nats", server_name="m27-embedded", authorization=auth, tls=tls)


def embedded_cluster(home: Path, config: NatsSection, nodes: int, size: int) -> NatsCluster:
    """The embedded NATS as a JetStream cluster of `size` servers on loopback, with the
    same users and TLS as the single server."""
    auth, tls = _server_security(home, config, nodes)
    return NatsCluster(home / CLUSTER_DIR, size, prefix="m27-embedded-", authorization=auth,
                       tls=tls)


def _server_security(home: Path, config: NatsSection, nodes: int
                     ) -> tuple[str, ServerTls | None]:
    keys = ensure_seeds(credentials_dir(home), principals(home, nodes))
    tls = None
    if config.server_cert or config.server_key:
        if not (config.server_cert and config.server_key):
            raise M27Error("[nats] server_cert and server_key go together")
        tls = ServerTls(cert=config.server_cert, key=config.server_key,
                        ca=config.tls_ca if config.tls_cert else "")
    return authorization(keys), tls


def principals(home: Path, nodes: int) -> list[Principal]:
    """Who the embedded bus admits: every service, its own nodes `node-1`…`node-<nodes>`,
    and every other node whose seed is in its credentials directory (a host that joins
    with `m27 agent`; `m27 bus credentials $M27_HOME/credentials/nats --nodes ID` puts
    it there)."""
    own = {f"node-{i}" for i in range(1, nodes + 1)}
    return deployment(sorted(own | set(joined_nodes(home))))


def joined_nodes(home: Path) -> list[str]:
    """Node ids whose seeds (`node-<id>.nk`) are in the embedded bus's credentials."""
    found = []
    for path in sorted(credentials_dir(home).glob(f"node-*{SEED_SUFFIX}")):
        node_id = path.name[len("node-"):-len(SEED_SUFFIX)]
        if NODE_ID.fullmatch(node_id):
            found.append(node_id)
    return found


def create_topology(url: str, admin: Access, replicas: int = 1) -> None:
    """Every stream and bucket, with `replicas` (a cluster: once it has a meta leader)."""
    async def create() -> None:
        if replicas > 1:  # a cluster answers once its members have elected a meta leader
            await wait_for_jetstream(url, access=admin)
        bus = await NatsBus.open(url, name="m27-up", access=admin, create=True,
                                 replicas=replicas)
        await bus.close()

    run_blocking(create)
