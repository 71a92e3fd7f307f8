"""The bot's handlers: an update in → `commands.decide` → the m27 calls it needs → replies.

    message / button → Incoming → decide (pure) → Refuse | Say | Act
    Act → `Actions` (calls the APIs as the chat's m27 user) → [Message | Photo | Upload]
    → sent, a 429's retry_after honoured

Whatever goes wrong while carrying out a command ends as one line in the chat (an API that
cannot be reached, a refusal, a bug in the bot: logged with its traceback, named in the
chat only by its log event), never a traceback there and never a dead bot.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar

from telegram import Bot as TelegramBot
from telegram import (
    CallbackQuery,
    InlineKeyboardButton,
    InlineKeyboardMarkup,
    MessageEntity,
    Update,
)
from telegram.error import BadRequest, Forbidden, NetworkError, RetryAfter, TelegramError
from telegram.ext import ContextTypes
from telegram.warnings import PTBDeprecationWarning

from m27.client import PipelineRejected
from m27.common import subjects
from m27.common.bus import Bus
from m27.common.curves import Curve
from m27.common.errors import M27Error
from m27.common.logging import bound_contextvars, get_logger
from m27.common.model import TERMINAL_RUN_STATES
from m27.common.notifications import Subscription
from m27.pipeline.plan import render_text
from m27.plots.phone import curve_png, format_metrics, key_metrics
from m27.telegram import commands, text
from m27.telegram.allow import AllowList
from m27.telegram.calls import M27Api, is_down
from m27.telegram.commands import (
    Act,
    Command,
    Decision,
    Document,
    Help,
    Incoming,
    Nodes,
    OnRun,
    Queue,
    Refuse,
    Runs,
    Submit,
    Subscribe,
    Unsubscribe,
)
from m27.telegram.text import Message, Out, Photo, Upload

T = TypeVar("T")
SEND_TRIES: Final = 4
MAX_RETRY_WAIT_S: Final = 30.0
#: The largest HTML report sent as a document (Telegram takes up to 50 MB from bots).
MAX_REPORT_BYTES: Final = 20 * 1024 * 1024
BUG: Final = ("Something went wrong inside the bot (error {id}); the lab's admin finds it "
              "in the bot's log.")

log = get_logger()
_DRAWING = threading.Lock()  # matplotlib's settings are global while a figure is drawn


def retry_seconds(error: RetryAfter) -> float:
    """How long Telegram asks us to wait (an int or a timedelta, by PTB's settings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PTBDeprecationWarning)
        value: Any = error.retry_after
    return value.total_seconds() if isinstance(value, dt.timedelta) else float(value)


class Handlers:
    """What the Application calls for each update."""

    def __init__(self, allow: AllowList, actions: Actions) -> None:
        self.allow = allow
        self.actions = actions

    async def on_message(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message, user, chat = update.effective_message, update.effective_user, \
            update.effective_chat
        if message is None or user is None or chat is None:
            return
        document = message.document
        incoming = Incoming(
            user_id=user.id, chat_id=chat.id, text=message.text or message.caption or "",
            document=Document(file_id=document.file_id, file_name=document.file_name or "",
                              file_size=document.file_size) if document else None)
        await self.handle(incoming, context.bot)

    async def on_button(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        query = update.callback_query
        if query is None or query.message is None:
            return
        await _answer(query)
        incoming = Incoming(user_id=query.from_user.id, chat_id=query.message.chat.id,
                            text=query.data or "", button=True)
        await self.handle(incoming, context.bot)

    async def on_error(self, update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        """Errors outside `handle` (it catches its own): logged, the bot goes on."""
        log.error("telegram.update_failed", error=repr(context.error))

    async def handle(self, incoming: Incoming, bot: TelegramBot) -> None:
        decision = commands.decide(incoming, self.allow, bot.username or "")
        log.info("telegram.update", telegram_user=incoming.user_id, chat=incoming.chat_id,
                 decision=_kind(decision))
        outs: list[Out]
        if isinstance(decision, Refuse):
            log.warning("telegram.refused", telegram_user=incoming.user_id)
            outs = [text.compose(decision.text)]
        elif isinstance(decision, Act):
            with bound_contextvars(user=decision.user):
                outs = await self.act(decision, incoming.chat_id, bot)
        else:
            outs = [text.compose(decision.text)]
        for out in outs:
            await send(bot, incoming.chat_id, out)

    async def act(self, decision: Act, chat_id: int, bot: TelegramBot) -> list[Out]:
        try:
            return await self.actions.run(decision.user, decision.command, chat_id, bot)
        except M27Error as exc:
            log.warning("telegram.command_refused", command=_kind(decision.command),
                        error=str(exc))
            return [text.compose(text.failed_text(str(exc), is_down(exc)))]
        except Exception:
            error_id = uuid.uuid4().hex[:8]
            log.exception("telegram.command_failed", command=_kind(decision.command),
                          error_id=error_id)
            return [text.compose(BUG.format(id=error_id))]


class Actions:
    """Carries out a command as an m27 user: API calls in, messages out."""

    def __init__(self, api: M27Api, nats: Bus, *, menu: tuple[tuple[str, str], ...] = (),
                 clock: Callable[[], float] = time.time) -> None:
        self.api = api
        self.nats = nats
        self.menu = menu
        self.clock = clock

    async def run(self, user: str, command: Command, chat_id: int,
                  bot: TelegramBot) -> list[Out]:
        if isinstance(command, Help):
            return [text.compose(text.help_text(user, command.start, self.menu))]
        if isinstance(command, Submit):
            return [await self.submit(user, command, bot)]
        if isinstance(command, Runs):
            async with self.api.orchestrator(user) as client:
                runs, _ = await client.list_runs(command.limit, user=user)
            return [text.compose(text.runs_text(runs, user, self.clock()))]
        if isinstance(command, OnRun):
            return await self.on_run(user, command)
        if isinstance(command, Nodes):
            async with self.api.orchestrator(user) as client:
                return [text.nodes_text(await client.list_nodes())]
        if isinstance(command, Queue):
            async with self.api.scheduler(user) as scheduler:
                return [text.queue_text(await scheduler.queue(), self.clock())]
        if isinstance(command, Subscribe):
            return [await self.subscribe(user, command, chat_id)]
        assert isinstance(command, Unsubscribe)
        return [await self.unsubscribe(chat_id)]

    async def submit(self, user: str, command: Submit, bot: TelegramBot) -> Message:
        pipeline = command.pipeline
        if command.document is not None:
            try:
                pipeline = commands.decode_pipeline(
                    await _download(bot, command.document.file_id), command.source_name)
            except ValueError as exc:
                return text.compose(f"Not submitted: {exc}.")
            except TelegramError as exc:
                return text.compose(f"Not submitted: Telegram did not give me the file "
                                    f"({exc}).")
        try:
            async with self.api.orchestrator(user) as client:
                plan = await client.plan(pipeline, vars=command.variables,
                                         source_name=command.source_name,
                                         no_cache=command.no_cache)
                run_id = await client.submit(pipeline, vars=command.variables,
                                             source_name=command.source_name,
                                             no_cache=command.no_cache)
        except PipelineRejected as exc:
            return text.rejected_text(str(exc))
        log.info("telegram.submitted", run_id=run_id, source=command.source_name)
        return text.with_buttons(text.submitted_text(run_id, render_text(plan)),
                                 text.run_buttons(run_id, ended=False))

    async def on_run(self, user: str, command: OnRun) -> list[Out]:
        run_id = command.run_id
        async with self.api.orchestrator(user) as client:
            if command.action == "cancel":
                state = await client.cancel(run_id, f"cancelled from Telegram by {user}")
                return [text.compose(text.cancel_text(run_id, state))]
            if command.action == "retry":
                state, steps = await client.retry(run_id)
                return [text.compose(text.retry_text(run_id, state, steps))]
            run = await client.get_run(run_id)
        if command.action == "status":
            ended = run.state in TERMINAL_RUN_STATES
            return [text.with_buttons(text.status_text(run, self.clock()),
                                      text.run_buttons(run_id, ended))]
        outs: list[Out] = []
        try:
            async with self.api.report(user) as report:
                curves = await report.metrics(run_id)
        except M27Error as exc:
            outs.append(text.compose(f"No curves: {text.failed_text(str(exc), False)}"))
            curves = []
        png = await asyncio.to_thread(_draw, curves, f"{run.name} ({run_id})")
        caption = text.report_caption(run, format_metrics(key_metrics(curves)))
        outs.append(Photo(png=png, caption=caption) if png else
                    text.compose(caption + "\n(no metrics were logged)"))
        html = await asyncio.to_thread(_read_report, run.report_path)
        outs.append(Upload(data=html, filename=f"{run_id}.html", caption=f"{run_id} report")
                    if html is not None else text.compose(text.no_report_text(
                        run, run.report_path)))
        return outs

    async def subscribe(self, user: str, command: Subscribe, chat_id: int) -> Message:
        subscription = Subscription(channel="telegram", target=str(chat_id), user=user,
                                    kinds=command.kinds, runs=command.runs,
                                    created_at=self.clock())
        await self.nats.kv_put(subjects.SUBSCRIPTIONS_BUCKET,
                               subjects.subscription_key("telegram", str(chat_id)),
                               subscription)
        log.info("telegram.subscribed", chat=chat_id, kinds=list(command.kinds),
                 runs=list(command.runs))
        return text.compose(text.subscribed_text(subscription))

    async def unsubscribe(self, chat_id: int) -> Message:
        key = subjects.subscription_key("telegram", str(chat_id))
        had = await self.nats.kv_get(subjects.SUBSCRIPTIONS_BUCKET, key, Subscription)
        if had is not None:
            await self.nats.kv_delete(subjects.SUBSCRIPTIONS_BUCKET, key)
        log.info("telegram.unsubscribed", chat=chat_id, had=had is not None)
        return text.compose(text.unsubscribed_text(had is not None))


def _draw(curves: list[Curve], title: str) -> bytes | None:
    with _DRAWING:
        return curve_png(curves, title=title)


def _read_report(path: str) -> bytes | None:
    """The run's HTML report, when this host can read it and it is small enough."""
    if not path.endswith(".html"):
        return None
    try:
        file = Path(path)
        if file.stat().st_size > MAX_REPORT_BYTES:
            return None
        return file.read_bytes()
    except OSError:
        return None


async def _download(bot: TelegramBot, file_id: str) -> bytes:
    file = await bot.get_file(file_id)
    if file.file_size is not None and file.file_size > commands.MAX_DOCUMENT_BYTES:
        raise ValueError(f"larger than {commands.MAX_DOCUMENT_BYTES // 1024} KiB")
    return bytes(await file.download_as_bytearray())


async def _answer(query: CallbackQuery) -> None:
    try:
        await query.answer()
    except TelegramError as exc:  # the button still works; the spinner stops by itself
        log.warning("telegram.answer_failed", error=str(exc))


async def send(bot: TelegramBot, chat_id: int, out: Out) -> None:
    """Send one reply; a 429 is waited out (its retry_after) and the reply sent again."""
    if isinstance(out, Photo):
        await with_retries(lambda: bot.send_photo(
            chat_id, out.png, caption=text.cut(out.caption, text.CAPTION_LIMIT)))
    elif isinstance(out, Upload):
        await with_retries(lambda: bot.send_document(
            chat_id, out.data, filename=out.filename,
            caption=text.cut(out.caption, text.CAPTION_LIMIT)))
    else:
        entities = [MessageEntity(MessageEntity.PRE, out.pre[0], out.pre[1])] \
            if out.pre and out.pre[1] else None
        markup = InlineKeyboardMarkup([[InlineKeyboardButton(label, callback_data=data)
                                        for label, data in out.buttons]]) \
            if out.buttons else None
        await with_retries(lambda: bot.send_message(chat_id, out.text, entities=entities,
                                                    reply_markup=markup))


async def with_retries(call: Callable[[], Awaitable[T]]) -> T | None:
    """`call()`, again after a 429's retry_after or a network failure (a few times);
    None when it cannot be sent (logged)."""
    for attempt in range(1, SEND_TRIES + 1):
        try:
            return await call()
        except RetryAfter as exc:
            wait = min(retry_seconds(exc), MAX_RETRY_WAIT_S)
            log.warning("telegram.rate_limited", retry_after=wait, attempt=attempt)
        except (BadRequest, Forbidden) as exc:  # not ours to fix by trying again
            log.warning("telegram.send_refused", error=str(exc))
            return None
        except NetworkError as exc:
            wait = float(attempt)
            log.warning("telegram.send_failed", error=str(exc), attempt=attempt)
        except TelegramError as exc:
            log.warning("telegram.send_refused", error=str(exc))
            return None
        if attempt < SEND_TRIES:
            await asyncio.sleep(wait)
    log.error("telegram.send_gave_up", tries=SEND_TRIES)
    return None


def _kind(value: Decision | Command) -> str:
    return type(value).__name__.lower()
