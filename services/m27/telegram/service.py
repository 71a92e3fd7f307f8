"""The Telegram bot's shell: settings, NATS, the m27 APIs, and python-telegram-bot.

    [telegram] → settings (token, allow list, webhook) → token redacted from every log
    → NATS as `telegram` → ready (health, services bucket) → Telegram: getMe,
    setMyCommands, then long polling (deleteWebhook, getUpdates) or a webhook (setWebhook
    with its secret, our own endpoint) → updates → `bot.Handlers` → until SIGTERM

A token Telegram refuses stops the service with one clear line, before it says it is
ready when Telegram answers in time; a Telegram that cannot be reached is retried (the
bot is ready meanwhile: the rest of m27 does not depend on it).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final, TypeAlias

from telegram import BotCommand
from telegram.error import InvalidToken, TelegramError
from telegram.ext import Application, CallbackQueryHandler, MessageHandler, filters

from m27.common.errors import ConfigError
from m27.common.logging import get_logger
from m27.common.service import ServiceRuntime
from m27.telegram import commands, redact, settings
from m27.telegram.bot import Actions, Handlers, with_retries
from m27.telegram.calls import M27Api
from m27.telegram.settings import BotSettings
from m27.telegram.webhook import WebhookServer

#: What the bot asks Telegram for (nothing else reaches it).
ALLOWED_UPDATES: Final = ("message", "callback_query")
POLL_TIMEOUT_S: Final = 25
#: How long start-up waits for Telegram's first answer before it is ready anyway.
FIRST_CONTACT_S: Final = 10.0
RETRY_MAX_S: Final = 60.0

App: TypeAlias = "Application[Any, Any, Any, Any, Any, Any]"

log = get_logger()


class TokenRefused(ConfigError):
    """Telegram does not know the token (revoked, mistyped)."""


async def serve(rt: ServiceRuntime) -> None:
    """Run the bot until `rt.stop` is set."""
    bot_settings = settings.load(rt.config.telegram)
    redact.install(bot_settings.token)
    if not bot_settings.allow:
        log.warning("telegram.nobody_allowed",
                    hint="[telegram] allowed_users is empty: the bot refuses everyone")
    nats = await rt.connect()
    api = M27Api(nats, rt.api_keys, rt.config.api, api=rt.args.api)
    handlers = Handlers(bot_settings.allow, Actions(api, nats, menu=commands.MENU))
    link = TelegramLink(build_application(bot_settings, handlers), bot_settings)
    contact = asyncio.create_task(link.connect(rt.stop))
    done, _ = await asyncio.wait({contact}, timeout=FIRST_CONTACT_S)
    if done:
        contact.result()  # a refused token ends the service here, before it is ready
    await rt.ready()
    rt.spawn(link.run(contact, rt.stop), "telegram")
    log.info("telegram.serving", mode="webhook" if bot_settings.webhook else "polling",
             allowed=len(bot_settings.allow), api_url=bot_settings.api_url)
    try:
        await rt.stop.wait()
    finally:
        await link.close()


def build_application(bot_settings: BotSettings, handlers: Handlers) -> App:
    """python-telegram-bot's Application against `[telegram] api_url`, with our handlers."""
    builder = (Application.builder().token(bot_settings.token)
               .base_url(f"{bot_settings.api_url}/bot")
               .base_file_url(f"{bot_settings.api_url}/file/bot")
               .get_updates_read_timeout(POLL_TIMEOUT_S + 10))
    if bot_settings.webhook is not None:
        builder = builder.updater(None)
    app = builder.build()
    app.add_handler(MessageHandler(
        filters.UpdateType.MESSAGE & (filters.TEXT | filters.Document.ALL | filters.CAPTION),
        handlers.on_message))
    app.add_handler(CallbackQueryHandler(handlers.on_button))
    app.add_error_handler(handlers.on_error)
    return app


class TelegramLink:
    """The Application's life: reach Telegram, take updates, stop."""

    def __init__(self, app: App, bot_settings: BotSettings) -> None:
        self.app = app
        self.settings = bot_settings
        self.webhook: WebhookServer | None = None

    async def connect(self, stop: asyncio.Event) -> bool:
        """getMe until Telegram answers (False: stopped first); TokenRefused when it does
        not know the token."""
        delay = 1.0
        while not stop.is_set():
            try:
                await self.app.initialize()
                log.info("telegram.connected", bot=self.app.bot.username)
                return True
            except InvalidToken as exc:
                raise TokenRefused(f"the Bot API at {self.settings.api_url} refused the "
                                   "bot token (revoked or mistyped?); check [telegram] "
                                   "token / token_file / $M27_TELEGRAM_TOKEN") from exc
            except TelegramError as exc:
                log.warning("telegram.unreachable", error=str(exc), retry_in_s=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, RETRY_MAX_S)
        return False

    async def run(self, contact: asyncio.Task[bool], stop: asyncio.Event) -> None:
        """Once connected: commands set, updates flowing, until `stop`."""
        if not await contact:
            return
        await self.app.start()
        await with_retries(lambda: self.app.bot.set_my_commands(
            [BotCommand(name, what[:256]) for name, what in commands.MENU]))
        hook = self.settings.webhook
        if hook is None:
            assert self.app.updater is not None
            await self.app.updater.start_polling(
                timeout=POLL_TIMEOUT_S, allowed_updates=list(ALLOWED_UPDATES),
                error_callback=_polling_failed)
            log.info("telegram.polling")
            return
        self.webhook = WebhookServer(hook, self.app.bot, self.app.update_queue)
        address = await self.webhook.start()
        await with_retries(lambda: self.app.bot.set_webhook(
            hook.url, secret_token=hook.secret, allowed_updates=list(ALLOWED_UPDATES)))
        log.info("telegram.webhook", listening=address, path=hook.path)

    async def close(self) -> None:
        if self.app.updater is not None and self.app.updater.running:
            await self.app.updater.stop()
        if self.webhook is not None:
            await self.webhook.stop()
        if self.app.running:
            await self.app.stop()
        with contextlib.suppress(TelegramError, RuntimeError):
            await self.app.shutdown()


def _polling_failed(error: TelegramError) -> None:
    log.warning("telegram.polling_failed", error=str(error))

