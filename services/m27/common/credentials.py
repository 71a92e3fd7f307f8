"""NATS credentials: one nkey per principal (`m27.common.principals`), kept in files only
their owner can read, and the nats-server `authorization` block that admits exactly them.

An nkey seed is an Ed25519 private key in NATS's text encoding (`SU…`); the server holds
only the public keys (`U…`), so its config is no secret. A client proves it holds the
seed by signing the server's nonce (nats-py does that with `nkeys_seed`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import nkeys

from m27.common.errors import ConfigError
from m27.common.principals import Principal, permissions
from m27.common.secret_files import read_secret, write_secret

SEED_SUFFIX: Final = ".nk"
SEED_BYTES: Final = 32


def seed_path(directory: Path, who: Principal) -> Path:
    return directory / f"{who.name}{SEED_SUFFIX}"


def new_seed() -> bytes:
    """A fresh user seed from the OS's random source."""
    return bytes(nkeys.encode_seed(os.urandom(SEED_BYTES), nkeys.PREFIX_BYTE_USER))


def public_key(seed: bytes) -> str:
    """The user's public key (`U…`); ConfigError when `seed` is not a user seed."""
    try:
        pair = nkeys.from_seed(bytearray(seed.strip()))
        key = str(pair.public_key.decode())
        pair.wipe()
    except (nkeys.NkeysError, ValueError, TypeError) as exc:
        raise ConfigError(f"not an nkey user seed: {exc}") from exc
    if not key.startswith("U"):
        raise ConfigError("not an nkey user seed (its public key does not start with U)")
    return key


def read_seed(path: Path) -> bytes:
    """A seed file's content; ConfigError when it is missing, unreadable or readable by
    others than its owner (the server would take whoever copied it for that principal)."""
    data = read_secret(path, "NATS credentials")
    public_key(data)
    return data


def ensure_seeds(directory: Path, principals: Iterable[Principal], *,
                 rotate: bool = False) -> dict[Principal, str]:
    """A seed file (mode 0600, in a 0700 directory) for each principal, kept if it is
    there unless `rotate`; returns each principal's public key."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    keys: dict[Principal, str] = {}
    for who in principals:
        path = seed_path(directory, who)
        if path.exists() and not rotate:
            keys[who] = public_key(read_seed(path))
            continue
        seed = new_seed()
        write_secret(path, seed + b"\n")
        keys[who] = public_key(seed)
    return keys


def authorization(keys: dict[Principal, str]) -> str:
    """The nats-server `authorization` block: one nkey user per principal with its
    permissions. With users listed the server refuses anonymous connections."""
    users = []
    for who, key in sorted(keys.items(), key=lambda item: item[0].name):
        allowed = permissions(who)
        rules: dict[str, object] = {"publish": {"allow": list(allowed.publish)},
                                    "subscribe": {"allow": list(allowed.subscribe)}}
        if allowed.allow_responses:
            rules["allow_responses"] = True
        users.append({"nkey": key, "permissions": rules})
    # JSON is valid nats-server config syntax.
    return "authorization: " + json.dumps({"users": users}, indent=2) + "\n"
