"""NATS JetStream plumbing shared by the service shells: connect, topology, publish, consume.

`Bus` is what a service's core needs of the bus (publish, KV); `NatsBus` is the one real
implementation and `m27.common.memory_bus.MemoryBus` the one in-memory fake for unit tests.

Connections override nats-py's defaults (120 s pings, giving up on reconnect): a dead server
is noticed within ~15 s and reconnects never stop. Handlers are acked only after they return,
that is after their effect is stored; a message that cannot be decoded, or that fails
again and again for a reason that is not transient, is kept in the dead-letter stream
(`M27_DEAD`, `m27.dead.<consumer>`), not redelivered forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final, Protocol, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    Header,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from m27.common import events, principals, subjects
from m27.common.config import NatsSection
from m27.common.credentials import read_seed
from m27.common.errors import BusError, ConfigError, M27Error, Unavailable
from m27.common.logging import get_logger
from m27.common.model import Fence
from m27.common.principals import Principal

log = get_logger()

T = TypeVar("T")

STREAM_NAME_IN_USE: Final = 10058
#: JetStream's "wrong last sequence" (a compare-and-set lost) and "per-message TTL is
#: disabled" (a bucket whose stream was made without `allow_msg_ttl`) error codes.
WRONG_LAST_SEQUENCE: Final = (10071, 10164)
TTL_DISABLED: Final = 10166
#: How long a deleted key's marker stays (a reader or watcher sees "deleted"); then the
#: server removes it and the key is gone from the bucket's stream. Without it, every key
#: ever deleted — each finished task, each retired checkpoint — stayed for good.
DELETE_MARKER_TTL_S: Final = 3600.0
KV_OPERATION: Final = "KV-Operation"
PING_INTERVAL_S: Final = 5
MAX_OUTSTANDING_PINGS: Final = 3
RECONNECT_WAIT_S: Final = 0.5
JS_TIMEOUT_S: Final = 10.0
ACK_WAIT_S: Final = 5.0
#: A message whose handler fails this often for a reason that is not transient (bad data,
#: a bug) goes to the dead-letter stream instead of coming back forever.
MAX_FAILED_DELIVERIES: Final = 5
MAX_RETRY_DELAY_S: Final = 30.0
MAX_DEAD_REASON: Final = 1000


class PoisonMessage(M27Error):
    """A message that can never be handled (undecodable); it is terminated, not retried."""


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """How a client proves who it is to NATS (docs/security.md): its nkey seed file and
    its own reply-subject prefix (its principal's inbox), and the TLS files."""

    seed_file: str = ""  # empty: anonymous
    inbox_prefix: str = "_INBOX"
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def tls_context(self) -> ssl.SSLContext | None:
        """A verifying TLS context when a CA is given; ConfigError naming a bad file."""
        if not self.tls_ca:
            if self.tls_cert or self.tls_key:
                raise ConfigError("[nats] tls_cert and tls_key need [nats] tls_ca as well")
            return None
        try:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert or self.tls_key:
                context.load_cert_chain(self.tls_cert, self.tls_key or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"NATS TLS files ({self.tls_ca}, {self.tls_cert or '-'}, "
                              f"{self.tls_key or '-'}): {exc}") from exc
        return context


def access_for(config: NatsSection, who: Principal) -> Access:
    """How `who` connects, from the `[nats]` section."""
    return Access(seed_file=config.credentials, inbox_prefix=who.inbox,
                  tls_ca=config.tls_ca, tls_cert=config.tls_cert, tls_key=config.tls_key)


def server_urls(url: str) -> str | list[str]:
    """`[nats] url` as nats-py takes it: one URL as it is, or the servers of a cluster
    written `nats://a:4222,nats://b:4222` as a list, tried in that order."""
    if "," not in url:
        return url
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise ConfigError(f"[nats] url {url!r} names no server")
    return urls[0] if len(urls) == 1 else urls


async def connect(url: str, *, name: str, timeout: float = 10.0,
                  access: Access | None = None) -> NatsClient:
    """Connect, retrying until `timeout`; BusError with the URL when NATS cannot be reached,
    ConfigError when the credentials or TLS files cannot be used. `url` may list several
    servers of one cluster, comma-separated: the first that answers is used (so clients
    given the servers in different orders spread over them), and when it goes away the
    connection moves to another (nats-py also learns the cluster's other members)."""
    access = access or Access()
    servers = server_urls(url)
    secure: dict[str, object] = {"inbox_prefix": access.inbox_prefix}
    if isinstance(servers, list):
        secure["dont_randomize"] = True
    if access.seed_file:
        read_seed(Path(access.seed_file))  # a clear error now, not an opaque one per retry
        secure["nkeys_seed"] = access.seed_file
    tls = access.tls_context()
    if tls is not None:
        secure["tls"] = tls
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error: BaseException | None = None
    holder: list[NatsClient] = []

    async def on_disconnected() -> None:
        if holder and (holder[0].is_draining or holder[0].is_closed):
            return  # our own close, not an outage
        log.warning("nats.disconnected", url=url)

    refusal: asyncio.Future[str] = loop.create_future()

    async def on_error(exc: Exception) -> None:
        # nats-py retries a refused first connection forever and only tells error_cb
        if _refused(exc) and not holder and not refusal.done():
            refusal.set_result(str(exc) or type(exc).__name__)
        await _on_error(exc)

    while loop.time() < deadline:
        # nats-py keeps retrying a first connection forever when reconnects never give up,
        # so the deadline is enforced here.
        attempt = asyncio.ensure_future(nats.connect(
            servers,
            name=name,
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,  # type: ignore[arg-type,unused-ignore]
            ping_interval=PING_INTERVAL_S,
            max_outstanding_pings=MAX_OUTSTANDING_PINGS,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=_on_reconnected,
            **secure,  # type: ignore[arg-type,unused-ignore]
        ))
        waiting: set[asyncio.Future[object]] = {attempt, refusal}  # type: ignore[arg-type]
        try:
            await asyncio.wait(waiting, timeout=max(0.5, deadline - loop.time()),
                               return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _abandon(attempt)  # told to stop while waiting: leave nothing running
            raise
        if not attempt.done():
            await _abandon(attempt)
            if refusal.done():
                raise BusError(f"NATS at {url} refused {name}'s credentials "
                               f"({_credentials(access)}): {refusal.result()}")
            last_error = TimeoutError()
            continue
        try:
            nc = attempt.result()
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            last_error = exc
            if _refused(exc):
                raise BusError(f"NATS at {url} refused {name}'s credentials "
                               f"({_credentials(access)}): {exc}") from exc
            await asyncio.sleep(0.25)
            continue
        holder.append(nc)
        return nc
    reason = str(last_error) or type(last_error).__name__
    raise BusError(f"cannot reach NATS at {url} within {timeout:.0f}s ({reason}); is "
                   "nats-server running there? (`m27 up` starts one)")


async def _abandon(attempt: asyncio.Future[NatsClient]) -> None:
    """Stop a connection attempt for good. nats-py's retry loop can swallow a single
    cancellation (one arriving as a refused connect completes is lost in `wait_for`), and
    a task left retrying would hang the service's shutdown, so cancel until it is done.
    Our own cancellation during this is held back until the attempt is gone."""
    cancelled = False
    while not attempt.done():
        attempt.cancel()
        try:
            await asyncio.wait({attempt}, timeout=0.1)
        except asyncio.CancelledError:
            cancelled = True
    if not attempt.cancelled() and attempt.exception() is None:
        with contextlib.suppress(Exception):  # it connected just as we gave up on it
            await attempt.result().close()
    if cancelled:
        raise asyncio.CancelledError


def _refused(exc: BaseException) -> bool:
    """The server said who we are is not allowed in: retrying will not change that."""
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


def _credentials(access: Access) -> str:
    return f"nkey seed {access.seed_file}" if access.seed_file else "anonymous"


async def _on_error(exc: Exception) -> None:
    log.warning("nats.error", error=str(exc) or type(exc).__name__)


async def _on_reconnected() -> None:
    log.info("nats.reconnected")


def stream_config(spec: subjects.StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue"
        else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=spec.max_age_s,
        duplicate_window=spec.duplicate_window_s,
        num_replicas=replicas,
    )


async def ensure_topology(js: JetStreamContext, replicas: int = 1) -> None:
    """Create (or bring up to date) every stream and KV bucket; safe to run concurrently."""
    for stream in subjects.STREAMS:
        config = stream_config(stream, replicas)
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != STREAM_NAME_IN_USE:
                raise
            await js.update_stream(config)
    for bucket in subjects.BUCKETS:
        kv_config = KeyValueConfig(
            bucket=bucket.name,
            description=bucket.description,
            history=bucket.history,
            max_value_size=bucket.max_value_size,
            storage=StorageType.FILE,
            replicas=replicas,
            ttl=bucket.ttl_s,
        )
        try:
            await js.create_key_value(kv_config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != STREAM_NAME_IN_USE:
                raise


def topology_names() -> tuple[str, ...]:
    """Every stream the bus needs, the buckets' included (`KV_<bucket>`)."""
    return (*(stream.name for stream in subjects.STREAMS),
            *(f"KV_{bucket.name}" for bucket in subjects.BUCKETS))


async def wait_for_topology(js: JetStreamContext, timeout: float,
                            names: tuple[str, ...] | None = None) -> None:
    """Wait until every stream and bucket (or those of `names`) exists; BusError naming
    the missing ones."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        missing = []
        for name in topology_names() if names is None else names:
            try:
                await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                missing.append(name)
        if not missing:
            return
        if loop.time() >= deadline:
            raise BusError(f"NATS has no {', '.join(missing)}: they are created with the "
                           "admin credential (`m27 up` does it; on a deployment run "
                           "`m27 bus setup`)")
        await asyncio.sleep(0.5)


class Bus(Protocol):
    """What a service's core uses of the bus: stored and core publishes, and KV buckets.
    Shells that consume streams or subscribe need the connection itself (`NatsBus`)."""

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None: ...

    async def publish_core(self, subject: str, message: events.Message) -> None: ...

    async def kv_get(self, bucket: str, key: str, type_: type[T]) -> tuple[T, int] | None: ...

    async def kv_keys(self, bucket: str, pattern: str = ">") -> list[str]: ...

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int: ...

    async def kv_update(self, bucket: str, key: str, type_: type[T],
                        change: Callable[[T | None], T | None], attempts: int = 20,
                        ttl_s: float | None = None) -> T | None: ...

    async def kv_delete(self, bucket: str, key: str) -> None: ...

    async def kv_purge(self, bucket: str, key: str) -> None: ...

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes: ...


async def _create(kv: KeyValue, key: str, data: bytes, ttl: float | None) -> int:
    return await kv.create(key, data, msg_ttl=ttl)


class NatsBus:
    """One service's connection: JetStream publishing, KV buckets and core pub/sub."""

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=JS_TIMEOUT_S)
        self._buckets: dict[str, KeyValue] = {}
        self._no_ttl: set[str] = set()  # buckets whose stream refuses per-message TTLs

    @classmethod
    async def open(cls, url: str, *, name: str, timeout: float = 10.0,
                   replicas: int = 1, access: Access | None = None,
                   create: bool = False, topology: tuple[str, ...] | None = None) -> NatsBus:
        """Connect and make sure the streams and buckets exist: anonymous (a bus without
        users) or with `create` (the admin credential), create or update them; with a
        service's credentials, which may not change them, wait until they (or those of
        `topology`, the ones it may look at) exist."""
        bus = cls(await connect(url, name=name, timeout=timeout, access=access))
        try:
            if access is not None and access.seed_file and not create:
                await wait_for_topology(bus.js, timeout, topology)
            else:
                await ensure_topology(bus.js, replicas)
        except (TimeoutError, nats.errors.Error, BusError) as exc:
            await bus.close()
            if isinstance(exc, BusError):
                raise
            raise BusError(f"NATS at {url} has no usable JetStream: {exc}") from exc
        return bus

    async def publish(self, subject: str, message: events.Message, *,
                      msg_id: str | None = None) -> None:
        """Store a message in its stream; `msg_id` makes a re-publish a no-op (2 min window)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await self.js.publish(subject, events.encode(message), headers=headers)

    async def publish_core(self, subject: str, message: events.Message) -> None:
        """Fire-and-forget on core NATS (heartbeats): not stored anywhere."""
        await self.nc.publish(subject, events.encode(message))

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._buckets:
            self._buckets[bucket] = await self.js.key_value(bucket)
        return self._buckets[bucket]

    async def kv_get(self, bucket: str, key: str, type_: type[T]) -> tuple[T, int] | None:
        """The decoded value at `key` and its revision, or None when there is none."""
        kv = await self.kv(bucket)
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return msgspec.json.decode(entry.value, type=type_), entry.revision

    async def kv_keys(self, bucket: str, pattern: str = ">") -> list[str]:
        """Keys of `bucket` matching `pattern` (NATS wildcards, e.g. `r-1.train.*`), sorted.

        Listed by the server from the bucket stream's subjects, not with nats-py's
        `keys()`: that uses a watcher, which can report "no keys" before its first message
        arrives. A deleted key may still appear (its tombstone): `kv_get` gives None for it.
        """
        prefix = f"$KV.{bucket}."
        keys: list[str] = []
        while True:
            request = {"subjects_filter": prefix + pattern, "offset": len(keys)}
            reply = await self.nc.request(f"$JS.API.STREAM.INFO.KV_{bucket}",
                                          json.dumps(request).encode(), timeout=JS_TIMEOUT_S)
            data = json.loads(reply.data)
            if "error" in data:
                if data["error"].get("code") == 503:  # a cluster without a leader for it
                    raise nats.js.errors.ServiceUnavailableError(**data["error"])
                raise BusError(f"cannot list keys of {bucket}: {data['error']}")
            found = (data.get("state") or {}).get("subjects") or {}
            keys.extend(subject[len(prefix):] for subject in found)
            if not found or len(keys) >= int(data.get("total", 0)):
                return sorted(keys)

    async def kv_put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        kv = await self.kv(bucket)
        return await kv.put(key, msgspec.json.encode(value))

    async def kv_update(self, bucket: str, key: str, type_: type[T],
                        change: Callable[[T | None], T | None], attempts: int = 20,
                        ttl_s: float | None = None) -> T | None:
        """Compare-and-set: `change` gets the current value (None if there is none) and
        returns the new one (None: leave it). Retried on a concurrent write; returns what
        is stored afterwards. `ttl_s`: the value written expires after that long (the
        server removes it; a later write without one stays)."""
        kv = await self.kv(bucket)
        for _ in range(attempts):
            got = await self.kv_get(bucket, key, type_)
            current, revision = (got[0], got[1]) if got else (None, None)
            new = change(current)
            if new is None:
                return current
            data = msgspec.json.encode(new)
            try:
                if revision is None:  # nats-py's create also writes over a delete marker
                    await self._without_ttl_if_disabled(bucket, ttl_s, functools.partial(
                        _create, kv, key, data))
                else:
                    await self._kv_publish(bucket, key, data, {
                        Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(revision)},
                        ttl_s)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            return new
        raise BusError(f"{bucket}/{key}: too many concurrent updates")

    async def kv_delete(self, bucket: str, key: str, *, last: int | None = None) -> None:
        """Delete `key`: a purge marker (the value goes at once) that the server removes
        DELETE_MARKER_TTL_S later. With `last`, only while the key is still at that
        revision (nats.js.errors.KeyWrongLastSequenceError otherwise)."""
        headers = {KV_OPERATION: "PURGE", Header.ROLLUP: "sub"}
        if last:
            headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)
        await self._kv_publish(bucket, key, b"", headers, DELETE_MARKER_TTL_S)

    async def kv_purge(self, bucket: str, key: str) -> None:
        """Remove the value at `key` from the bucket's stream (`kv_delete`: every bucket
        keeps one revision, so a delete is a purge)."""
        await self.kv_delete(bucket, key)

    async def _kv_publish(self, bucket: str, key: str, data: bytes, headers: dict[str, str],
                          ttl_s: float | None) -> int:
        """Store one KV message (a value or a marker) with `headers`; its revision."""
        async def publish(ttl: float | None) -> int:
            try:
                ack = await self.js.publish(f"$KV.{bucket}.{key}", data,  # nats-py adds
                                            headers=dict(headers), msg_ttl=ttl)  # to them
            except nats.js.errors.APIError as exc:
                if exc.err_code in WRONG_LAST_SEQUENCE:
                    raise nats.js.errors.KeyWrongLastSequenceError(
                        description=exc.description) from exc
                raise
            return ack.seq

        return await self._without_ttl_if_disabled(bucket, ttl_s, publish)

    async def _without_ttl_if_disabled(self, bucket: str, ttl_s: float | None,
                                       write: Callable[[float | None], Awaitable[T]]) -> T:
        """`write(ttl_s)`; on a bucket made without per-message TTLs (by an older m27 or
        by hand), `write(None)`: the entry stays until deleted, as it always did."""
        if bucket in self._no_ttl:
            return await write(None)
        try:
            return await write(ttl_s)
        except nats.js.errors.APIError as exc:
            if ttl_s is None or getattr(exc, "err_code", None) != TTL_DISABLED:
                raise
            self._no_ttl.add(bucket)
            log.warning("nats.kv_ttl_disabled", bucket=bucket,
                        effect="deleted keys and ended tasks' fences are kept for good",
                        fix="a bucket made with allow_msg_ttl (NATS 2.11 or later)")
            return await write(None)

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        """A core NATS request (not stored); the answer's payload. nats' TimeoutError or
        NoRespondersError when nobody answers."""
        reply = await self.nc.request(subject, data, timeout=timeout)
        return reply.data

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()
        with contextlib.suppress(Exception):
            await self.nc.close()


Handler = Callable[[Msg], Awaitable[None]]


async def consume(
    js: JetStreamContext,
    *,
    stream: str,
    durable: str,
    filter_subject: str,
    handle: Handler,
    stop: asyncio.Event,
    batch: int = 8,
    ack_wait_s: float = ACK_WAIT_S,
    deliver_new: bool = False,
    retry_s: float = 1.0,
) -> None:
    """Pull messages from a durable consumer until `stop` is set.

    Each message is acked after `handle` returns; PoisonMessage sends it to the dead-letter
    stream (`subjects.dead_letter`); any other exception is logged and the message
    redelivered after a delay that doubles — forever if the failure is transient, else
    until MAX_FAILED_DELIVERIES, then it is dead-lettered too. The ack wait is short
    (messages a crashed consumer had fetched come back within seconds); a handler that runs
    longer keeps its message with in-progress acks.
    """
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        deliver_policy=DeliverPolicy.NEW if deliver_new else DeliverPolicy.ALL,
        filter_subject=filter_subject,
        max_ack_pending=1000,
    )
    sub = await until_settled(
        lambda: js.pull_subscribe(filter_subject, durable=durable, stream=stream,
                                  config=config),
        what=f"the consumer {durable}", stop=stop)
    me = asyncio.current_task()
    try:
        while not stop.is_set():
            try:
                messages = await sub.fetch(batch, timeout=0.5)
            except TimeoutError:  # nats.errors.TimeoutError, or asyncio's from inside fetch
                if me is not None and me.cancelling():
                    # asyncio.wait_for (3.11) turned our cancellation into its timeout
                    raise asyncio.CancelledError from None
                continue
            except (nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError):
                await asyncio.sleep(0.5)
                continue
            except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
                # A clustered JetStream electing the consumer's leader (a server died):
                # nobody answers the pull for a few seconds; ask again.
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                await _handle_one(msg, handle, durable, js, retry_s)
    finally:
        # Only the client-side inbox goes; the durable consumer keeps its position. Without
        # this, draining the connection waits out its whole timeout at every shutdown.
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _keep(msg: Msg) -> None:
    """Tell JetStream the message is still being worked on, so it is not redelivered."""
    while True:
        await asyncio.sleep(ACK_WAIT_S / 2)
        with contextlib.suppress(Exception):
            await msg.in_progress()


def transient(error: BaseException) -> bool:
    """A failure that trying again later may cure (NATS or a service away, a timeout), as
    opposed to one the same message will meet every time (bad data, a bug)."""
    return isinstance(error, (Unavailable, TimeoutError, ConnectionError, nats.errors.Error))


#: The bus away, or a clustered JetStream without a leader for the stream or consumer
#: (starting, or a member died): nobody answers for a few seconds, and asking again later
#: is answered. Not a refusal (a wrong config, a permission): asking again gets it again.
UNSETTLED: Final = (TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError,
                    nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError)


async def until_settled(op: Callable[[], Awaitable[T]], *, what: str, stop: asyncio.Event,
                        first_s: float = 0.5, max_s: float = 5.0) -> T:
    """`op()`, asked again after 0.5, 1 … 5 s while it meets an `UNSETTLED` bus; any other
    error, or one met after `stop`, is raised. For what a service cannot do without (its
    registration, its consumers) and that a fresh or healing cluster may not answer at
    once: without it the service died of a timeout at start (chaos seed 2028)."""
    delay = first_s
    while True:
        try:
            return await op()
        except UNSETTLED as exc:
            if stop.is_set():
                raise
            log.warning("bus.not_settled", what=what, error=repr(exc), retry_in_s=delay)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            # asyncio.wait_for (3.11) turned our cancellation into its timeout
            raise asyncio.CancelledError
        delay = min(max_s, delay * 2)


def retry_delay(deliveries: int, first_s: float = 1.0) -> float:
    """Seconds before a failed message comes back: 1, 2, 4 … at most MAX_RETRY_DELAY_S."""
    return float(min(MAX_RETRY_DELAY_S, first_s * 2 ** max(0, deliveries - 1)))


async def _handle_one(msg: Msg, handle: Handler, durable: str, js: JetStreamContext,
                      retry_s: float) -> None:
    keeper = asyncio.create_task(_keep(msg))
    try:
        await handle(msg)
    except PoisonMessage as exc:
        log.error("bus.message_rejected", consumer=durable, subject=msg.subject, error=str(exc))
        await _bury(msg, durable, str(exc), js)
        return
    except Exception as exc:
        deliveries = _deliveries(msg)
        if not transient(exc) and deliveries >= MAX_FAILED_DELIVERIES:
            log.exception("bus.message_dead_lettered", consumer=durable, subject=msg.subject,
                          error=str(exc), deliveries=deliveries)
            await _bury(msg, durable, f"{type(exc).__name__}: {exc}", js)
            return
        log.exception("bus.handler_failed", consumer=durable, subject=msg.subject,
                      error=str(exc), deliveries=deliveries)
        with contextlib.suppress(Exception):
            await msg.nak(delay=retry_delay(deliveries, retry_s))
        return
    finally:
        keeper.cancel()
    await msg.ack()


def _deliveries(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_delivered or 1)
    except Exception:  # not a JetStream message (a test's, a core one)
        return 1


async def _bury(msg: Msg, durable: str, why: str, js: JetStreamContext) -> None:
    """Keep the message in the dead-letter stream with why, then end its redelivery. If
    even that cannot be stored, it is left to come back (nothing is lost silently)."""
    headers = {"M27-Original-Subject": msg.subject, "M27-Consumer": durable,
               "M27-Error": why[:MAX_DEAD_REASON].replace("\r", " ").replace("\n", " ")}
    try:
        await js.publish(subjects.dead_letter(durable), msg.data, headers=headers,
                         timeout=JS_TIMEOUT_S)
    except Exception as exc:
        log.error("bus.dead_letter_failed", consumer=durable, error=str(exc))
        with contextlib.suppress(Exception):
            await msg.nak(delay=MAX_RETRY_DELAY_S)
        return
    await msg.term()


def decode_or_poison(data: bytes, decode: Callable[[bytes], T]) -> T:
    """Decode a payload; an undecodable one becomes PoisonMessage with the reason."""
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PoisonMessage(f"undecodable message: {exc}") from exc


async def fence_of(bus: Bus, task_id: str) -> Fence | None:
    """The task's current assignment (None before its first placement, and from a day
    after it ended: the scheduler's `expire_fence`)."""
    got = await bus.kv_get(subjects.FENCES_BUCKET, subjects.task_key(task_id), Fence)
    return got[0] if got else None


async def task_event_or_poison(bus: Bus, subject: str, data: bytes) -> events.Event:
    """Decode a task event and check who sent it (`principals.sender_problem`, with the
    task's fence when a node reports on it); PoisonMessage when it cannot be what it
    claims, so a forged report is dead-lettered instead of applied."""
    event = decode_or_poison(data, events.decode_event)
    fence = None
    node_id = getattr(event, "node_id", None)
    task_id = getattr(event, "task_id", None)
    if subject.rsplit(".", 1)[-1].startswith("node-") and node_id and task_id:
        fence = await fence_of(bus, task_id)
    problem = principals.sender_problem(subject, event, fence)
    if problem:
        raise PoisonMessage(f"refused: {problem}")
    return event
