"""`m27 bus credentials` and `m27 bus setup`: the authenticated bus of a deployment.

`m27 up` does both by itself for the embedded system; a compose or Kubernetes deployment
runs them once (docs/security.md): `credentials` writes one nkey seed per principal (for
Secrets) and the nats-server `authorization` block that admits exactly them; `setup`
creates or updates the streams and buckets with the admin credential, which no service
holds.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Final

import msgspec

from m27.cli._common import Subparsers, add, config
from m27.common.bus import NatsBus, access_for
from m27.common.credentials import authorization, ensure_seeds
from m27.common.errors import M27Error
from m27.common.principals import deployment, principal

AUTH_FILE: Final = "nats-authorization.conf"


def add_commands(sub: Subparsers) -> None:
    bus = add(sub, "bus", "the NATS bus of a deployment: generate its credentials, create "
              "its streams (`m27 up` does both for the embedded system)", _usage)
    verbs = bus.add_subparsers(dest="verb", metavar="VERB", required=True)
    credentials = verbs.add_parser(
        "credentials", help="write an nkey seed per principal (mode 0600) and the "
        f"nats-server authorization block ({AUTH_FILE}) into DIR",
        description="Write one nkey seed file per principal into DIR (admin, status, each "
        "service, node-<id> for each --nodes entry), keeping seeds already there unless "
        f"--rotate, and {AUTH_FILE}: include it in nats-server.conf. Seeds are secrets "
        "(put each in its service's Secret); the authorization file holds public keys only.")
    credentials.add_argument("dir", metavar="DIR", type=Path)
    credentials.add_argument("--nodes", default="", metavar="ID,ID,...",
                             help="node ids of the node-agents (each gets its own seed)")
    credentials.add_argument("--rotate", action="store_true",
                             help="replace every seed (restart the services with the new "
                             "ones after reloading nats-server)")
    credentials.set_defaults(handler=cmd_credentials)
    setup = verbs.add_parser(
        "setup", help="create or update the streams and KV buckets (admin credential)",
        description="Create or update every stream and KV bucket on the NATS at --nats "
        "([nats] url), connecting with the admin seed given by --credentials ([nats] "
        "credentials); services wait for them at start.")
    setup.add_argument("--nats", metavar="URL", help="NATS URL (default: [nats] url)")
    setup.add_argument("--credentials", metavar="FILE", help="the admin nkey seed file")
    setup.set_defaults(handler=cmd_setup)


def _usage(args: argparse.Namespace) -> int:  # argparse requires a verb first
    raise M27Error("`m27 bus credentials DIR` or `m27 bus setup`")


def cmd_credentials(args: argparse.Namespace) -> int:
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    try:
        principals = deployment(nodes)
    except ValueError as exc:
        raise M27Error(f"--nodes: {exc}") from exc
    keys = ensure_seeds(args.dir, principals, rotate=args.rotate)
    (args.dir / AUTH_FILE).write_text(authorization(keys))
    print(f"{len(keys)} credentials in {args.dir} ({'new' if args.rotate else 'kept or new'});"
          f" include {args.dir / AUTH_FILE} in nats-server.conf")
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    settings = config(args).nats
    url = args.nats or settings.url
    seed = args.credentials or settings.credentials
    if not seed:
        raise M27Error("`m27 bus setup` needs the admin seed: --credentials FILE")
    access = msgspec.structs.replace(access_for(settings, principal("admin")),
                                     seed_file=seed)

    async def create() -> None:
        bus = await NatsBus.open(url, name="m27-bus-setup", access=access, create=True,
                                 replicas=settings.replicas)
        await bus.close()

    asyncio.run(create())
    print(f"streams and buckets ready on {url} ({settings.replicas} replica(s))")
    return 0
