"""Webhook mode: an HTTP endpoint (aiohttp) Telegram posts updates to.

Telegram sends the secret given to setWebhook in the `X-Telegram-Bot-Api-Secret-Token`
header of every post; a post without it, or with another, is refused (403) and never
reaches the bot. TLS is ended in front of it (a reverse proxy: Telegram posts only to
HTTPS), so it listens on `[telegram] webhook_bind`, loopback by default.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Final

from aiohttp import web
from telegram import Bot, Update

from m27.common.logging import get_logger
from m27.telegram.settings import Webhook

SECRET_HEADER: Final = "X-Telegram-Bot-Api-Secret-Token"  # noqa: S105 - a header's name
MAX_UPDATE_BYTES: Final = 1024 * 1024

log = get_logger()


def secret_matches(given: str | None, secret: str) -> bool:
    """Constant-time comparison of the header with the configured secret."""
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


class WebhookServer:
    """Puts each authentic update on `queue` (the Application's update queue)."""

    def __init__(self, hook: Webhook, bot: Bot, queue: asyncio.Queue[object]) -> None:
        self.hook = hook
        self.bot = bot
        self.queue = queue
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=MAX_UPDATE_BYTES)
        app.router.add_post(self.hook.path, self._post)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.hook.host, self.hook.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _post(self, request: web.Request) -> web.Response:
        if not secret_matches(request.headers.get(SECRET_HEADER), self.hook.secret):
            log.warning("telegram.webhook_refused", peer=request.remote or "",
                        reason="missing or wrong secret header")
            return web.Response(status=403)
        try:
            data: Any = json.loads(await request.read())
            update = Update.de_json(data, self.bot) if isinstance(data, dict) else None
        except Exception as exc:  # de_json fails as variously as an update can be malformed
            log.warning("telegram.webhook_bad_update", error=str(exc)[:200])
            return web.Response(status=400)
        if update is not None:
            await self.queue.put(update)
        return web.Response()
