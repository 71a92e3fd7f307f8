"""The API's credentials in practice: key files, tokens on calls, TLS, and the interceptor
that turns a call's bearer token into its caller (`caller()`).

Transport: with `[api] tls_cert` and `tls_key` a server speaks TLS only (and asks for a
client certificate when `tls_client_ca` is set); without them it uses gRPC's local
credentials, which accept connections from this machine's loopback only, and a bind to any
other address is refused. Either way every call but a health check carries
`authorization: Bearer <token>` (`m27.common.tokens`), checked here before the servicer
runs; what a caller may do is `m27.common.api_access`.

Keys live in `$M27_HOME/credentials/api/` (0700; files 0600) unless `[api]` names others:
`control.key` for the control-plane services, `node.key` for node-agents. `m27 up` writes
them and `cli.token`, an admin token for the user who started the system.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import getpass
import ipaddress
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from m27.common import api_access, tokens
from m27.common.config import ApiSection, ClientSection, load_config
from m27.common.errors import ConfigError, M27Error, PermissionDenied, Unauthenticated
from m27.common.secret_files import read_secret, write_secret
from m27.common.tokens import ApiRole, Identity, KeyId

API_DIR: Final = Path("credentials") / "api"
CONTROL_KEY: Final = "control.key"
NODE_KEY: Final = "node.key"
CLI_TOKEN: Final = "cli.token"  # noqa: S105 - a file name
TOKEN_ENV: Final = "M27_TOKEN"  # noqa: S105 - a variable name
#: Tokens a service signs for its own calls to another live this long (one per call).
SERVICE_TOKEN_TTL_S: Final = 300.0
#: How long a refused client stream may take to send its first message (see `_Check`).
FIRST_MESSAGE_WAIT_S: Final = 1.0
NODE_SERVICES: Final = frozenset({"node-agent"})
KEYS_HINT: Final = "`m27 up` makes the embedded system's; `m27 api keys DIR` a deployment's"

Context = grpc.aio.ServicerContext[Any, Any]
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Any]]

_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("m27_api_caller")


def caller() -> Identity:
    """Who made the call being served (set by `Authenticator` before the servicer runs)."""
    try:
        return _CALLER.get()
    except LookupError:
        raise Unauthenticated("this call carries no verified identity") from None


# ---------------------------------------------------------------- key and token files


def api_dir(home: Path) -> Path:
    return home / API_DIR


def ensure_keys(directory: Path, *, rotate: bool = False) -> bytes:
    """`control.key` and its `node.key` in `directory`, kept if there unless `rotate`
    (which invalidates every token signed before); returns the control-plane key."""
    path = directory / CONTROL_KEY
    if path.exists() and not rotate:
        control = _key(read_secret(path, "API key", KEYS_HINT), path)
    else:
        control = tokens.new_key()
        write_secret(path, control.hex().encode() + b"\n")
    write_secret(directory / NODE_KEY, tokens.node_key(control).hex().encode() + b"\n")
    return control


def login_name() -> str:
    """This process's login name as an m27 user name (characters tokens do not allow: -)."""
    name = re.sub(r"[^A-Za-z0-9_.@-]", "-", getpass.getuser()).lstrip(".@-")[:100]
    return name or "user"


def ensure_cli_token(home: Path, user: str) -> Path:
    """The embedded system's keys and an admin token for `user` (who started it) in
    `cli.token`, kept while it is still valid; returns the token's path."""
    directory = api_dir(home)
    control = ensure_keys(directory)
    path = directory / CLI_TOKEN
    keys = Keys.of_control(control)
    if path.exists():
        try:
            held = keys.identify(read_secret(path, "API token").decode("utf-8", "replace"),
                                 time.time())
            if held.user == user and held.is_admin:
                return path
        except (tokens.TokenError, ConfigError):
            pass
    write_secret(path, keys.mint(user=user, role="admin", ttl_s=0.0).encode() + b"\n")
    return path


def _key(text: bytes, path: Path) -> bytes:
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"the API key {path} is not hex") from None
    if len(key) != tokens.KEY_BYTES:
        raise ConfigError(f"the API key {path} is {len(key)} bytes, not {tokens.KEY_BYTES}")
    return key


@dataclass(frozen=True)
class Keys:
    """The keys one process holds: a control-plane service both, a node-agent the node
    key only."""

    control: bytes | None
    node: bytes

    @classmethod
    def of_control(cls, control: bytes) -> Keys:
        """What a control-plane service holds: the key and the node key derived from it."""
        return cls(control=control, node=tokens.node_key(control))

    def identify(self, token: str, now: float) -> Identity:
        return tokens.verify(token, control_key=self.control, node_key_=self.node, now=now)

    def mint(self, *, user: str, role: ApiRole, ttl_s: float = SERVICE_TOKEN_TTL_S,
             task_id: str = "", attempt: int = 0) -> str:
        """A token signed with the control key when this process holds it and the role
        needs it, else with the node key."""
        kid: KeyId = "n" if role in tokens.NODE_KEY_ROLES or self.control is None else "c"
        key = self.node if kid == "n" else self.control
        assert key is not None
        return tokens.mint(key, kid, user=user, role=role, now=time.time(), ttl_s=ttl_s,
                           task_id=task_id, attempt=attempt)


def ephemeral_keys() -> Keys:
    """A fresh pair held in memory only (a server and its clients in one process)."""
    control = tokens.new_key()
    return Keys.of_control(control)


def load_keys(section: ApiSection, home: Path, service: str) -> Keys:
    """The keys `service` holds: a node-agent reads only the node key."""
    if service in NODE_SERVICES:
        path = Path(section.node_key_file) if section.node_key_file else (
            api_dir(home) / NODE_KEY)
        node = _key(read_secret(path, "node API key", KEYS_HINT), path)
        return Keys(control=None, node=node)
    path = Path(section.key_file) if section.key_file else api_dir(home) / CONTROL_KEY
    control = _key(read_secret(path, "API key", KEYS_HINT), path)
    return Keys.of_control(control)


# ---------------------------------------------------------------- the server side


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(address: str) -> str:
    return address.rsplit(":", 1)[0] if ":" in address else address


def server_credentials(bind: str, section: ApiSection) -> grpc.ServerCredentials:
    """TLS from `[api]` when set, else local (loopback-only) credentials; ConfigError for
    a bind beyond loopback without TLS, or certificate files that cannot be read."""
    if bool(section.tls_cert) != bool(section.tls_key):
        raise ConfigError("[api] tls_cert and tls_key go together")
    if not section.tls_cert:
        if not is_loopback(split_host(bind)):
            raise ConfigError(f"gRPC on {bind} would be reachable from other machines without "
                              "TLS: set [api] tls_cert and tls_key, or listen on 127.0.0.1")
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    pair = (_read(section.tls_key, "[api] tls_key"), _read(section.tls_cert, "[api] tls_cert"))
    client_ca = _read(section.tls_client_ca, "[api] tls_client_ca") if (
        section.tls_client_ca) else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from exc


class Authenticator(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Every call but a health check: a valid bearer token, a role the method allows
    (`api_access.METHOD_ROLES`); the caller is then `caller()` inside the servicer."""

    def __init__(self, keys: Keys, clock: Callable[[], float] = time.time,
                 table: Mapping[str, frozenset[ApiRole]] = api_access.METHOD_ROLES) -> None:
        self.keys = keys
        self.clock = clock
        self.table = table

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Any:
        handler: Any = await continuation(details)
        if handler is None or not api_access.needs_token(details.method):
            return handler
        check = _Check(self, details.method, details.invocation_metadata or ())
        for kind in ("unary_unary", "stream_unary"):
            if getattr(handler, kind) is not None:
                return handler._replace(**{kind: check.single(getattr(handler, kind))})
        for kind in ("unary_stream", "stream_stream"):
            if getattr(handler, kind) is not None:
                return handler._replace(**{kind: check.streaming(getattr(handler, kind))})
        return handler

    def identify(self, method: str, metadata: Any) -> Identity | M27Error:
        token = ""
        for key, value in metadata:
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() != "bearer":
                    return Unauthenticated("the authorization header must be `Bearer <token>`")
                token = token.strip()
        if not token:
            return Unauthenticated("this API needs a token: `m27 up` makes one for its user; "
                                   "others get one with `m27 api token create`")
        try:
            who = self.keys.identify(token, self.clock())
        except tokens.TokenError as exc:
            return Unauthenticated(str(exc))
        problem = api_access.call_problem(method, who, self.table)
        return PermissionDenied(problem) if problem else who


class _Check:
    def __init__(self, auth: Authenticator, method: str, metadata: Any) -> None:
        self.auth = auth
        self.method = method
        self.metadata = metadata

    async def _enter(self, context: Context, request: Any) -> contextvars.Token[Identity]:
        found = self.auth.identify(self.method, self.metadata)
        if isinstance(found, M27Error):
            if hasattr(request, "__aiter__"):
                # A client stream: take its first message before refusing. Ending the call
                # while the client still writes it makes gRPC core report a bare INTERNAL
                # ("Internal error from Core") to that client in about 1 call of 20.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(anext(aiter(request)), FIRST_MESSAGE_WAIT_S)
            await context.abort(grpc.StatusCode[found.status], str(found))
            raise AssertionError("context.abort raises")
        return _CALLER.set(found)

    def single(self, behavior: Callable[[Any, Context], Awaitable[Any]]
               ) -> Callable[[Any, Context], Awaitable[Any]]:
        async def checked(request: Any, context: Context) -> Any:
            mark = await self._enter(context, request)
            try:
                return await behavior(request, context)
            finally:
                _CALLER.reset(mark)

        return checked

    def streaming(self, behavior: Callable[[Any, Context], AsyncIterator[Any]]
                  ) -> Callable[[Any, Context], AsyncIterator[Any]]:
        async def checked(request: Any, context: Context) -> AsyncIterator[Any]:
            mark = await self._enter(context, request)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                _CALLER.reset(mark)

        return checked


# ---------------------------------------------------------------- the client side


@dataclass(frozen=True)
class ApiAccess:
    """How a client reaches an m27 API: its token (or a function that signs a fresh one
    for each call) and, for TLS, the servers' CA and an optional client certificate."""

    token: str | Callable[[], str]
    tls_ca: str = ""
    client_cert: str = ""
    client_key: str = ""

    @classmethod
    def of(cls, token: str | Callable[[], str], section: ApiSection) -> ApiAccess:
        return cls(token=token, tls_ca=section.tls_ca, client_cert=section.client_cert,
                   client_key=section.client_key)

    def credentials(self, address: str) -> grpc.ChannelCredentials:
        """Channel credentials carrying the token; ConfigError for an address beyond
        loopback without `[api] tls_ca`."""
        if self.tls_ca:
            transport = grpc.ssl_channel_credentials(
                root_certificates=_read(self.tls_ca, "[api] tls_ca"),
                private_key=_read(self.client_key, "[api] client_key")
                if self.client_key else None,
                certificate_chain=_read(self.client_cert, "[api] client_cert")
                if self.client_cert else None)
        elif is_loopback(split_host(address)):
            transport = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        else:
            raise ConfigError(f"the API at {address} is not on this machine: connecting to it "
                              "needs TLS ([api] tls_ca, the CA of its certificate)")
        token = self.token
        if isinstance(token, str):
            call = grpc.access_token_call_credentials(token)
        else:
            call = grpc.metadata_call_credentials(_Signer(token))
        return grpc.composite_channel_credentials(transport, call)

    def channel(self, address: str, options: Any = None) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, self.credentials(address), options=options)

    def sync_channel(self, address: str, options: Any = None) -> grpc.Channel:
        return grpc.secure_channel(address, self.credentials(address), options=options)


class _Signer(grpc.AuthMetadataPlugin):
    def __init__(self, sign: Callable[[], str]) -> None:
        self.sign = sign

    def __call__(self, context: grpc.AuthMetadataContext,
                 callback: grpc.AuthMetadataPluginCallback) -> None:
        try:
            callback((("authorization", f"Bearer {self.sign()}"),), None)
        except Exception as exc:
            callback((), exc)


def user_access(api: ApiSection, client: ClientSection, home: Path,
                environ: Mapping[str, str]) -> ApiAccess:
    """A person's (or a step's) access: `$M27_TOKEN`, else `[client] token_file`, else
    the `cli.token` `m27 up` wrote under `home`; ConfigError saying how to get one."""
    token = environ.get(TOKEN_ENV, "").strip()
    if not token:
        path = Path(client.token_file) if client.token_file else api_dir(home) / CLI_TOKEN
        if not client.token_file and not path.exists():
            raise ConfigError(f"no API token: {path} does not exist (`m27 up` writes it for "
                              "the user who starts the system; on a shared system ask an "
                              "admin for `m27 api token create --user YOU` and set [client] "
                              "token_file or $M27_TOKEN)")
        token = read_secret(path, "API token").decode("utf-8", "replace")
    return ApiAccess.of(token, api)


def service_access(keys: Keys, api: ApiSection, *, user: str, role: ApiRole) -> ApiAccess:
    """A service's access to another: a fresh short-lived token for each call."""
    return ApiAccess.of(lambda: keys.mint(user=user, role=role), api)


def step_env(keys: Keys, api: ApiSection, task_id: str, attempt: int) -> dict[str, str]:
    """What a step's environment carries to call the checkpoint-store: a `step` token for
    its own task attempt (no expiry: attempts run for days; it writes nothing else) and,
    when the APIs speak TLS, where the CA (and this node's client certificate) are."""
    env = {TOKEN_ENV: keys.mint(user=f"step-{attempt}", role="step", ttl_s=0.0,
                                task_id=task_id, attempt=attempt)}
    for key in ("tls_ca", "client_cert", "client_key"):
        if getattr(api, key):
            env[f"M27_API_{key.upper()}"] = str(Path(getattr(api, key)).absolute())
    return env


def default_access() -> ApiAccess:
    """The access of a client nobody gave one: from this process's config and environment."""
    loaded = load_config()
    return user_access(loaded.config.api, loaded.config.client, loaded.home, os.environ)
