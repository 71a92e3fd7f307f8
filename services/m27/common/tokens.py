"""API bearer tokens: who a gRPC caller is, signed so that no caller can claim another.

A token is `m27t1.<key>.<claims>.<mac>`: `key` names the key that signed it (`c`, the
control plane's; `n`, the node key), `claims` is base64url JSON (`Claims`), `mac` is
HMAC-SHA256 over everything before it. Pure functions: the key files, the interceptor and
the channels are `m27.common.api_auth`.

Two keys, so that a machine running only a node-agent cannot make itself an admin:

- the control-plane key signs tokens of users, admins and the services themselves;
- the node key (derived from the control-plane key, `node_key`) is all a node-agent holds:
  it signs only `node` tokens (the agent's own calls) and `step` tokens (one task attempt's
  calls to the checkpoint-store). A token signed with it that claims any other role is
  refused, so a stolen node key reads logs and writes checkpoints, and nothing else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from typing import Final, Literal

import msgspec

from m27.common.errors import Unauthenticated

ApiRole = Literal["user", "admin", "service", "node", "step"]
API_ROLES: Final[tuple[ApiRole, ...]] = ("user", "admin", "service", "node", "step")
KeyId = Literal["c", "n"]
#: What a token signed with the node key may say it is.
NODE_KEY_ROLES: Final[frozenset[str]] = frozenset({"node", "step"})
PREFIX: Final = "m27t1"
KEY_BYTES: Final = 32
MAX_TOKEN_CHARS: Final = 4096
USER_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,99}")
_NODE_KEY_LABEL: Final = b"m27 node key v1"


class TokenError(Unauthenticated):
    """A token that does not prove anything: malformed, signed with another key, expired."""


class Claims(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a token says (short names: it travels with every call)."""

    sub: str  # the m27 user (or the service, the node)
    role: ApiRole
    jti: str  # this token's id (for logs and revocation lists)
    iat: float  # issued at, epoch seconds
    exp: float = 0.0  # expires at; 0: never
    task: str = ""  # step tokens: the task and attempt they may act for
    attempt: int = 0


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """A verified caller."""

    user: str
    role: ApiRole
    token_id: str
    task_id: str = ""
    attempt: int = 0

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def reads_everything(self) -> bool:
        """Admins and the services (report reads any run it renders)."""
        return self.role in ("admin", "service")


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def node_key(control_key: bytes) -> bytes:
    """The node key that belongs to a control-plane key (rotating one rotates both)."""
    return hmac.new(control_key, _NODE_KEY_LABEL, hashlib.sha256).digest()


def mint(key: bytes, kid: KeyId, *, user: str, role: ApiRole, now: float,
         ttl_s: float = 0.0, task_id: str = "", attempt: int = 0,
         token_id: str = "") -> str:
    """A token for `user` in `role`, signed with `key` (`kid` says which key it is);
    ValueError when that key may not sign that role or the user name is not valid."""
    if role not in API_ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(API_ROLES)})")
    if kid == "n" and role not in NODE_KEY_ROLES:
        raise ValueError(f"the node key signs only {sorted(NODE_KEY_ROLES)} tokens, not {role}")
    if not USER_NAME.fullmatch(user):
        raise ValueError(f"not a user name: {user[:100]!r} (letters, digits, _ . @ -)")
    if (role == "step") != bool(task_id):
        raise ValueError("a step token names its task, and only a step token does")
    claims = Claims(sub=user, role=role, jti=token_id or os.urandom(9).hex(), iat=now,
                    exp=now + ttl_s if ttl_s > 0 else 0.0, task=task_id, attempt=attempt)
    body = f"{PREFIX}.{kid}.{_b64(msgspec.json.encode(claims))}"
    return f"{body}.{_b64(_mac(key, body))}"


def verify(token: str, *, control_key: bytes | None, node_key_: bytes | None,
           now: float) -> Identity:
    """Who `token` proves its bearer is; TokenError (a sentence for the caller) when it
    proves nothing. A key that is None is not held here: its tokens are refused."""
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenError("the token is too long to be an m27 token")
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != PREFIX:
        raise TokenError("not an m27 API token (they start with m27t1.)")
    _prefix, kid, claims_text, mac_text = parts
    key = {"c": control_key, "n": node_key_}.get(kid)
    if key is None:
        raise TokenError("the token is signed with a key this server does not accept")
    try:
        mac = _unb64(mac_text)
        claims = msgspec.json.decode(_unb64(claims_text), type=Claims)
    except (ValueError, binascii.Error, msgspec.DecodeError, msgspec.ValidationError):
        raise TokenError("the token is damaged") from None
    if _b64(mac) != mac_text:  # one spelling per signature: no altered copies that verify
        raise TokenError("the token is damaged")
    if not hmac.compare_digest(mac, _mac(key, f"{PREFIX}.{kid}.{claims_text}")):
        raise TokenError("the token's signature does not match (another system's token, "
                         "or signed before the keys were rotated)")
    if kid == "n" and claims.role not in NODE_KEY_ROLES:
        raise TokenError(f"a node's token cannot claim the role {claims.role}")
    if claims.exp and now >= claims.exp:
        raise TokenError("the token has expired; ask an admin for a new one")
    if not USER_NAME.fullmatch(claims.sub):
        raise TokenError("the token names no valid user")
    return Identity(user=claims.sub, role=claims.role, token_id=claims.jti,
                    task_id=claims.task, attempt=claims.attempt)


def _mac(key: bytes, body: str) -> bytes:
    return hmac.new(key, body.encode(), hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not re.fullmatch(r"[A-Za-z0-9_-]*", text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
