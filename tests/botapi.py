"""A Telegram Bot API stand-in for tests: a real HTTP server on 127.0.0.1 (aiohttp, its own
event loop in a background thread, so sync and async tests, and bots in other processes,
can all use it).

It speaks what python-telegram-bot and plain httpx callers use — `/bot{token}/{method}`
with query, form, multipart or JSON parameters, and `/file/bot{token}/{file_path}` — and
remembers what was sent, so a test can push a user's message and read the bot's answer:

    with BotApi() as api:
        api.push_message(user_id=42, chat_id=42, text="/start")
        api.wait_for(lambda: api.sent(42))
        assert "help" in api.sent(42)[0].text

Methods: getMe, getUpdates (long polling: offset, timeout, limit, allowed_updates),
sendMessage, sendPhoto, sendDocument (uploads kept as bytes), getFile, setMyCommands,
deleteWebhook, setWebhook (then updates are POSTed to the webhook with Telegram's
`X-Telegram-Bot-Api-Secret-Token` header, and getUpdates answers 409 as Telegram does),
answerCallbackQuery, editMessageText, editMessageReplyMarkup. A wrong token gets
Telegram's 401; `fail_next` makes the next calls of a method fail (429 with retry_after).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Any, Final

import aiohttp
from aiohttp import web

BOT_ID: Final = 7000001
BOT_USERNAME: Final = "m27_test_bot"
#: Parameters whose form value is JSON (python-telegram-bot JSON-dumps every non-str value).
_JSON_PARAMS: Final = frozenset({
    "chat_id", "offset", "limit", "timeout", "allowed_updates", "reply_markup", "commands",
    "entities", "caption_entities", "message_id", "show_alert", "drop_pending_updates",
    "max_connections", "disable_notification", "protect_content", "link_preview_options",
    "reply_parameters", "cache_time", "scope"})
_UPDATE_KINDS: Final = ("message", "edited_message", "callback_query")
_MAX_WAIT_S: Final = 50.0


def new_token() -> str:
    """A token shaped like BotFather's: `<bot id>:<35 characters>`."""
    return f"{BOT_ID}:{secrets.token_urlsafe(26)[:35]}"


@dataclass(frozen=True)
class Sent:
    """One thing the bot sent to a chat (or changed there)."""

    kind: str  # message, photo, document, edit
    chat_id: int
    message_id: int
    text: str  # the text, or a photo's/document's caption
    data: bytes | None = None  # an upload's bytes
    filename: str = ""
    reply_markup: dict[str, Any] | None = None
    parse_mode: str = ""


@dataclass(frozen=True)
class Call:
    """One request the API answered, whatever it answered."""

    method: str
    params: dict[str, Any]
    status: int
    at: float


@dataclass
class _Failure:
    left: int
    status: int
    retry_after: int


@dataclass
class _State:
    updates: list[dict[str, Any]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # id → (path, bytes)
    failures: dict[str, _Failure] = field(default_factory=dict)
    commands: list[dict[str, Any]] = field(default_factory=list)
    webhook_url: str = ""
    webhook_secret: str = ""
    webhook_posts: list[tuple[int, str]] = field(default_factory=list)  # (status, secret)


class BotApi:
    """The stand-in. `url` is what the bot's `[telegram] api_url` should be."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token or new_token()
        self.port = 0
        self._state = _State()
        self._changed = threading.Condition()
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._arrived: asyncio.Event | None = None  # getUpdates: look again
        self._kick: asyncio.Event | None = None  # the webhook delivery: look again
        self._delivery: asyncio.Task[None] | None = None
        self._closing = False
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- life cycle

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> BotApi:
        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start())
            except BaseException as exc:
                errors.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="botapi", daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _start(self) -> None:
        self._arrived, self._kick = asyncio.Event(), asyncio.Event()
        app = web.Application(client_max_size=60 * 1024 * 1024)
        app.router.add_route("*", "/bot{token}/{method}", self._method)
        app.router.add_get("/file/bot{token}/{path:.+}", self._file)
        # a long poll whose caller went away ends, as at Telegram
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._delivery = self._loop.create_task(self._deliver_webhooks())

    def stop(self) -> None:
        if self._thread is None:
            self._loop.close()
            return

        async def shutdown() -> None:
            self._closing = True
            self._wake()  # long polls still waiting answer now
            if self._delivery is not None:
                self._delivery.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._delivery
            if self._runner is not None:
                await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()  # else its self-pipe sockets leak into a later test's warnings
        self._thread = None

    def __enter__(self) -> BotApi:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---------------------------------------------------------------- what tests call

    def push_message(self, user_id: int, chat_id: int, text: str = "",
                     document: tuple[str, bytes] | None = None, *,
                     file_size: int | None = None) -> int:
        """A user's message to the bot (a document with `text` as its caption); returns
        its update id. `file_size`: what Telegram says the document weighs (default: its
        length)."""
        message: dict[str, Any] = {
            "message_id": next(self._ids), "date": int(time.time()),
            "chat": _chat(chat_id, user_id), "from": _user(user_id)}
        if document is None:
            message["text"] = text
            message["entities"] = _command_entities(text)
        else:
            name, data = document
            file_id = self._keep_file(f"documents/{name}", data)
            message["document"] = {
                "file_id": file_id, "file_unique_id": f"u{file_id}", "file_name": name,
                "mime_type": "application/x-yaml",
                "file_size": len(data) if file_size is None else file_size}
            if text:
                message["caption"] = text
                message["caption_entities"] = _command_entities(text)
        return self._push({"message": message})

    def push_callback(self, user_id: int, chat_id: int, data: str,
                      message_id: int = 0) -> int:
        """A user's press of an inline button carrying `data`; returns its update id."""
        query = {"id": str(next(self._ids)), "from": _user(user_id), "chat_instance": "1",
                 "data": data,
                 "message": {"message_id": message_id or next(self._ids),
                             "date": int(time.time()), "chat": _chat(chat_id, user_id),
                             "from": _bot_user(), "text": "…"}}
        return self._push({"callback_query": query})

    def sent(self, chat_id: int | None = None) -> list[Sent]:
        """What the bot sent (to `chat_id`, or anywhere), in order."""
        with self._changed:
            return [s for s in self._state.sent if chat_id is None or s.chat_id == chat_id]

    def calls(self, method: str | None = None) -> list[Call]:
        """The requests answered (of `method`, case-insensitive), in order."""
        wanted = method.lower() if method else None
        with self._changed:
            return [c for c in self._state.calls if wanted is None or c.method == wanted]

    def pending(self) -> int:
        """Updates not yet confirmed by a getUpdates offset (nor delivered to a webhook)."""
        with self._changed:
            return len(self._state.updates)

    @property
    def commands(self) -> list[dict[str, Any]]:
        """What setMyCommands last set."""
        with self._changed:
            return list(self._state.commands)

    @property
    def webhook(self) -> tuple[str, str]:
        """(url, secret_token) that setWebhook set ("" when none)."""
        with self._changed:
            return self._state.webhook_url, self._state.webhook_secret

    @property
    def webhook_posts(self) -> list[tuple[int, str]]:
        """Each update POSTed to the webhook: (HTTP status it got, secret header sent)."""
        with self._changed:
            return list(self._state.webhook_posts)

    def fail_next(self, method: str, n: int = 1, status: int = 429,
                  retry_after: int = 1) -> None:
        """Answer the next `n` calls of `method` with `status` (429: Telegram's Too Many
        Requests with `retry_after`)."""
        with self._changed:
            self._state.failures[method.lower()] = _Failure(n, status, retry_after)

    def wait_for(self, predicate: Callable[[], object], timeout: float = 10.0,
                 what: str = "") -> None:
        """Block until `predicate()` is true (checked whenever the API's state changes);
        AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"not within {timeout:g}s: {what or predicate}; "
                                         f"sent so far: {self._state.sent}")
                self._changed.wait(min(left, 1.0))

    async def wait_for_async(self, predicate: Callable[[], object], timeout: float = 10.0,
                             what: str = "") -> None:
        """`wait_for` without blocking the caller's event loop."""
        await asyncio.to_thread(self.wait_for, predicate, timeout, what)

    # ---------------------------------------------------------------- state changes

    def _push(self, update: dict[str, Any]) -> int:
        with self._changed:
            update_id = next(self._ids)
            self._state.updates.append({"update_id": update_id, **update})
            self._changed.notify_all()
        self._loop.call_soon_threadsafe(self._wake)
        return update_id

    def _wake(self) -> None:
        assert self._arrived is not None
        assert self._kick is not None
        self._arrived.set()
        self._kick.set()

    def _keep_file(self, path: str, data: bytes) -> str:
        file_id = f"f{next(self._ids)}"
        with self._changed:
            self._state.files[file_id] = (f"{file_id}/{path.rsplit('/', 1)[-1]}", data)
        return file_id

    def _record(self, call: Call, sent: Sent | None = None) -> None:
        with self._changed:
            self._state.calls.append(call)
            if sent is not None:
                self._state.sent.append(sent)
            self._changed.notify_all()

    def _failure(self, method: str) -> _Failure | None:
        with self._changed:
            failure = self._state.failures.get(method)
            if failure is None or failure.left <= 0:
                return None
            failure.left -= 1
            return failure

    # ---------------------------------------------------------------- HTTP

    async def _method(self, request: web.Request) -> web.Response:
        method = request.match_info["method"].lower()
        params, uploads = await _params(request)
        if request.match_info["token"] != self.token:
            self._record(Call(method, params, 401, time.time()))
            return _error(401, "Unauthorized")
        failure = self._failure(method)
        if failure is not None:
            self._record(Call(method, params, failure.status, time.time()))
            if failure.status == 429:
                return _error(429, f"Too Many Requests: retry after {failure.retry_after}",
                              {"retry_after": failure.retry_after})
            return _error(failure.status, HTTPStatus(failure.status).phrase)
        handler = _HANDLERS.get(method)
        if handler is None:
            self._record(Call(method, params, 404, time.time()))
            return _error(404, "Not Found")
        try:
            status, result, sent = await handler(self, params, uploads)
        except (KeyError, ValueError, TypeError) as exc:
            self._record(Call(method, params, 400, time.time()))
            return _error(400, f"Bad Request: {exc}")
        self._record(Call(method, params, status, time.time()), sent)
        if status != 200:
            return _error(status, str(result))
        return web.json_response({"ok": True, "result": result})

    async def _file(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        path = request.match_info["path"]
        with self._changed:
            found = next((data for stored, data in self._state.files.values()
                          if stored == path), None)
        if found is None:
            return _error(404, "Not Found")
        return web.Response(body=found, content_type="application/octet-stream")

    async def _get_updates(self, params: dict[str, Any], _: Uploads) -> Answer:
        with self._changed:
            if self._state.webhook_url:
                return 409, ("Conflict: can't use getUpdates method while webhook is "
                             "active; use deleteWebhook to delete the webhook first"), None
        offset = int(params.get("offset") or 0)
        limit = int(params.get("limit") or 100)
        timeout = min(float(params.get("timeout") or 0), _MAX_WAIT_S)
        kinds = params.get("allowed_updates") or list(_UPDATE_KINDS)
        deadline = time.monotonic() + timeout
        assert self._arrived is not None
        while True:
            self._arrived.clear()
            found = self._confirm_and_take(offset, kinds, limit)
            left = deadline - time.monotonic()
            if found or left <= 0 or self._closing:
                return 200, found, None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    def _confirm_and_take(self, offset: int, kinds: list[str],
                          limit: int) -> list[dict[str, Any]]:
        with self._changed:
            if offset:
                self._state.updates = [u for u in self._state.updates
                                       if u["update_id"] >= offset]
            wanted = [u for u in self._state.updates if any(k in u for k in kinds)]
            self._changed.notify_all()
            return wanted[:limit]

    async def _send(self, kind: str, params: dict[str, Any], uploads: Uploads) -> Answer:
        chat_id = int(params["chat_id"])
        message_id = next(self._ids)
        message: dict[str, Any] = {"message_id": message_id, "date": int(time.time()),
                                   "chat": _chat(chat_id, chat_id), "from": _bot_user()}
        text = str(params.get("text" if kind == "message" else "caption") or "")
        data, filename = None, ""
        if kind == "message":
            if not text:
                raise ValueError("message text is empty")
            if len(text) > 4096:
                raise ValueError("message is too long")
            message["text"] = text
        else:
            data, filename = uploads.get(kind) or (None, "")
            if data is None and not params.get(kind):
                raise ValueError(f"there is no {kind} in the request")
            if len(text) > 1024:
                raise ValueError("message caption is too long")
            file_id = self._keep_file(f"{kind}s/{filename or kind}", data or b"")
            described = {"file_id": file_id, "file_unique_id": f"u{file_id}",
                         "file_size": len(data or b"")}
            message[kind] = [{**described, "width": 1, "height": 1}] if kind == "photo" \
                else {**described, "file_name": filename}
            if text:
                message["caption"] = text
        markup = params.get("reply_markup")
        if markup:
            message["reply_markup"] = markup
        return 200, message, Sent(
            kind=kind, chat_id=chat_id, message_id=message_id, text=text, data=data,
            filename=filename, reply_markup=markup if isinstance(markup, dict) else None,
            parse_mode=str(params.get("parse_mode") or ""))

    async def _send_message(self, params: dict[str, Any], uploads: Uploads) -> Answer:
        return await self._send("message", params, uploads)

    async def _send_photo(self, params: dict[str, Any], uploads: Uploads) -> Answer:
        return await self._send("photo", params, uploads)

    async def _send_document(self, params: dict[str, Any], uploads: Uploads) -> Answer:
        return await self._send("document", params, uploads)

    async def _edit(self, params: dict[str, Any], _: Uploads) -> Answer:
        chat_id = int(params.get("chat_id") or 0)
        markup = params.get("reply_markup")
        return 200, True, Sent(kind="edit", chat_id=chat_id,
                               message_id=int(params.get("message_id") or 0),
                               text=str(params.get("text") or ""),
                               reply_markup=markup if isinstance(markup, dict) else None)

    async def _get_me(self, params: dict[str, Any], _: Uploads) -> Answer:
        return 200, {**_bot_user(), "can_join_groups": True,
                     "can_read_all_group_messages": False,
                     "supports_inline_queries": False}, None

    async def _get_file(self, params: dict[str, Any], _: Uploads) -> Answer:
        file_id = str(params["file_id"])
        with self._changed:
            found = self._state.files.get(file_id)
        if found is None:
            return 400, "Bad Request: invalid file_id", None
        path, data = found
        return 200, {"file_id": file_id, "file_unique_id": f"u{file_id}",
                     "file_size": len(data), "file_path": path}, None

    async def _set_commands(self, params: dict[str, Any], _: Uploads) -> Answer:
        with self._changed:
            self._state.commands = list(params.get("commands") or [])
        return 200, True, None

    async def _set_webhook(self, params: dict[str, Any], _: Uploads) -> Answer:
        with self._changed:
            self._state.webhook_url = str(params["url"])
            self._state.webhook_secret = str(params.get("secret_token") or "")
        self._wake()
        return 200, True, None

    async def _delete_webhook(self, params: dict[str, Any], _: Uploads) -> Answer:
        with self._changed:
            self._state.webhook_url = self._state.webhook_secret = ""
            if params.get("drop_pending_updates"):
                self._state.updates.clear()
        return 200, True, None

    async def _answer(self, params: dict[str, Any], _: Uploads) -> Answer:
        return 200, True, None

    async def _deliver_webhooks(self) -> None:
        """While a webhook is set, POST each pending update to it, in order (an update
        the webhook does not answer 200 is tried again, as Telegram does)."""
        assert self._kick is not None
        async with aiohttp.ClientSession() as session:
            while True:
                self._kick.clear()
                with self._changed:
                    url, secret = self._state.webhook_url, self._state.webhook_secret
                    update = self._state.updates[0] if url and self._state.updates else None
                if update is None:
                    await self._kick.wait()
                    continue
                status = await _post(session, url, secret, update)
                with self._changed:
                    self._state.webhook_posts.append((status, secret))
                    if status == 200 and self._state.updates and self._state.updates[0] is \
                            update:
                        self._state.updates.pop(0)
                    self._changed.notify_all()
                if status != 200:
                    await asyncio.sleep(0.2)  # as Telegram, try the webhook again later
                self._kick.set()


Uploads = dict[str, tuple[bytes, str]]
Answer = tuple[int, Any, Sent | None]

_HANDLERS: Final[dict[str, Callable[[BotApi, dict[str, Any], Uploads],
                                    Any]]] = {
    "getme": BotApi._get_me, "getupdates": BotApi._get_updates,
    "sendmessage": BotApi._send_message, "sendphoto": BotApi._send_photo,
    "senddocument": BotApi._send_document, "getfile": BotApi._get_file,
    "setmycommands": BotApi._set_commands, "deletewebhook": BotApi._delete_webhook,
    "setwebhook": BotApi._set_webhook, "answercallbackquery": BotApi._answer,
    "editmessagetext": BotApi._edit, "editmessagereplymarkup": BotApi._edit,
}


async def _post(session: aiohttp.ClientSession, url: str, secret: str,
                update: dict[str, Any]) -> int:
    headers = {"X-Telegram-Bot-Api-Secret-Token": secret} if secret else {}
    try:
        async with session.post(url, json=update, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=10)) as reply:
            return reply.status
    except (aiohttp.ClientError, TimeoutError):
        return 0


async def _params(request: web.Request) -> tuple[dict[str, Any], Uploads]:
    """Query, JSON, form or multipart parameters (JSON-valued ones decoded), and uploads
    as (bytes, file name)."""
    raw: dict[str, Any] = dict(request.query)
    uploads: Uploads = {}
    if request.content_type == "application/json":
        body = await request.json()
        raw.update(body if isinstance(body, dict) else {})
        return _decoded(raw, only_strings=True), uploads
    if request.content_type == "multipart/form-data":
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, aiohttp.BodyPartReader) or not part.name:
                continue
            if part.filename is not None:
                uploads[part.name] = (bytes(await part.read()), part.filename)
            else:
                raw[part.name] = await part.text()
    elif request.body_exists:
        raw.update(dict(await request.post()))
    return _decoded(raw, only_strings=False), uploads


def _decoded(raw: Mapping[str, Any], *, only_strings: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in _JSON_PARAMS and isinstance(value, str):
            try:
                out[name] = json.loads(value)
            except ValueError:
                out[name] = value  # e.g. a chat id given as @channelname
        elif only_strings or isinstance(value, str):
            out[name] = value
    return out


def _error(status: int, description: str,
           parameters: dict[str, Any] | None = None) -> web.Response:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return web.json_response(body, status=status)


def _user(user_id: int) -> dict[str, Any]:
    return {"id": user_id, "is_bot": False, "first_name": f"user{user_id}",
            "language_code": "en"}


def _bot_user() -> dict[str, Any]:
    return {"id": BOT_ID, "is_bot": True, "first_name": "m27 test bot",
            "username": BOT_USERNAME}


def _chat(chat_id: int, user_id: int) -> dict[str, Any]:
    if chat_id == user_id:
        return {"id": chat_id, "type": "private", "first_name": f"user{user_id}"}
    return {"id": chat_id, "type": "group", "title": f"chat {chat_id}"}


def _command_entities(text: str) -> list[dict[str, Any]]:
    """Telegram marks a leading `/command[@bot]` as a bot_command entity (UTF-16 units)."""
    if not text.startswith("/"):
        return []
    word = text.split(maxsplit=1)[0] if text.split() else text
    return [{"type": "bot_command", "offset": 0,
             "length": len(word.encode("utf-16-le")) // 2}]


@contextlib.contextmanager
def running(token: str | None = None) -> Iterator[BotApi]:
    """A started stand-in, stopped on leaving."""
    api = BotApi(token).start()
    try:
        yield api
    finally:
        api.stop()
