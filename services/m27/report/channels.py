"""Where notices go: a webhook (JSON POST), e-mail (SMTP), a Telegram chat (Bot API).

Each channel's `send` returns once the place took the notice. It raises `NotTaken` for a
failure that trying later may cure and after which the place certainly does not have the
notice (it answered 5xx, 429 or an SMTP 4xx, or no connection was made); `Unavailable`
for one whose outcome is unknown (a timeout or a connection lost after the request went
out, the client closed under it: the notice may have arrived); `Refused` for one trying
again will not cure (4xx, a chat that blocked the bot, an address the server rejects).
Deduplication and retries are the notifier's (`m27.report.notify`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from email.message import EmailMessage
from email.utils import formatdate
from pathlib import Path
from typing import Final, Protocol

import aiosmtplib
import httpx
import msgspec

from m27 import __version__
from m27.common.bot_token import read_token
from m27.common.config import Config, NotifySection
from m27.common.errors import ConfigError, M27Error, Unavailable
from m27.common.logging import get_logger
from m27.common.notifications import ChannelKind, Notice, notice_buttons
from m27.common.secret_files import read_secret
from m27.report.notices import subject_line

log = get_logger()

# httpx logs every request's URL at INFO, and a Bot API URL holds the bot's token.
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpcore").setLevel(logging.WARNING)

#: Telegram: about one message per second to one chat; longer waits than this asked by a
#: 429 are left to the consumer's redelivery.
CHAT_GAP_S: Final = 1.0
MAX_RETRY_AFTER_S: Final = 120.0
CAPTION_MAX: Final = 1024
TEXT_MAX: Final = 4096


class Refused(M27Error):
    """The place will not take this notice, however often it is sent."""


class NotTaken(Unavailable):
    """Not now, and the place certainly did not take the notice: sending again cannot
    repeat it."""


#: httpx failures raised before a request reached the place.
_NOT_SENT_HTTP = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                  httpx.UnsupportedProtocol)


def _unavailable(exc: Exception, why: str) -> Unavailable:
    """`why` as NotTaken when `exc` came before the request left, else as Unavailable."""
    return NotTaken(why) if isinstance(exc, _NOT_SENT_HTTP) else Unavailable(why)


class Channel(Protocol):
    kind: ChannelKind

    async def send(self, notice: Notice, target: str, image: bytes | None) -> None: ...

    async def close(self) -> None: ...


def make_channels(config: Config) -> dict[ChannelKind, Channel]:
    """The channels the config allows: webhooks always (a rule may name its URL), e-mail
    with `[notify] smtp_host`, Telegram with a bot token."""
    found: dict[ChannelKind, Channel] = {"webhook": Webhook(config.notify.webhook_timeout)}
    if config.notify.smtp_host:
        found["email"] = Email(config.notify)
    token, _ = read_token(config.telegram)
    if token:
        found["telegram"] = Telegram(token, config.telegram.api_url)
    return found


# ---------------------------------------------------------------- webhook


def webhook_body(notice: Notice) -> dict[str, object]:
    """The JSON a webhook gets: the notice's fields, its kind as `type`."""
    body: dict[str, object] = msgspec.to_builtins(notice)
    body["type"] = body.pop("kind")
    return body


class Webhook:
    kind: ChannelKind = "webhook"

    def __init__(self, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        self._client = client or httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)

    async def send(self, notice: Notice, target: str, image: bytes | None) -> None:
        headers = {"Idempotency-Key": notice.id, "User-Agent": f"m27/{__version__}"}
        try:
            answer = await self._client.post(target, json=webhook_body(notice),
                                             headers=headers)
        except httpx.HTTPError as exc:
            raise _unavailable(exc, f"webhook {_origin(target)}: {type(exc).__name__}: "
                                    f"{exc}") from exc
        if answer.is_success:
            return
        why = f"webhook {_origin(target)} answered {answer.status_code}"
        if answer.status_code in (408, 425, 429) or answer.status_code >= 500:
            raise NotTaken(why)
        raise Refused(why)

    async def close(self) -> None:
        await self._client.aclose()


def _origin(url: str) -> str:
    """Scheme and host only: a webhook's path and query often hold its secret."""
    try:
        parsed = httpx.URL(url)
    except Exception:
        return "(unparsable URL)"
    return f"{parsed.scheme}://{parsed.host}" + (f":{parsed.port}" if parsed.port else "")


# ---------------------------------------------------------------- e-mail


class Email:
    kind: ChannelKind = "email"

    def __init__(self, section: NotifySection) -> None:
        if not section.smtp_host:
            raise ConfigError("[notify] smtp_host is needed to send e-mail")
        self._section = section
        self._password = (read_secret(Path(section.smtp_password_file).expanduser(),
                                      "SMTP password file").decode()
                          if section.smtp_password_file else None)
        self._sender = section.email_from or f"m27@{socket.gethostname()}"

    def message(self, notice: Notice, target: str, image: bytes | None) -> EmailMessage:
        mail = EmailMessage()
        mail["Subject"] = subject_line(notice)
        mail["From"] = self._sender
        mail["To"] = target
        mail["Date"] = formatdate(notice.at, usegmt=True)
        mail["Message-ID"] = f"<{notice.id}@m27>"  # the same notice: the same message
        mail.set_content(notice.text + "\n")
        if image is not None:
            mail.add_attachment(image, maintype="image", subtype="png",
                                filename=f"{notice.run_id or 'm27'}.png")
        return mail

    async def close(self) -> None:
        return None

    async def send(self, notice: Notice, target: str, image: bytes | None) -> None:
        s = self._section
        port = s.smtp_port or (465 if s.smtp_tls else 587 if s.smtp_starttls else 25)
        try:
            await aiosmtplib.send(
                self.message(notice, target, image), hostname=s.smtp_host, port=port,
                username=s.smtp_user or None, password=self._password,
                use_tls=s.smtp_tls, start_tls=s.smtp_starttls, timeout=30)
        except aiosmtplib.SMTPRecipientsRefused as exc:
            raise Refused(f"SMTP {s.smtp_host} refused {target}: {exc}") from exc
        except aiosmtplib.SMTPResponseException as exc:
            why = f"SMTP {s.smtp_host}:{port} answered {exc.code} {exc.message}"
            if 400 <= exc.code < 500:
                raise NotTaken(why) from exc
            raise Refused(why) from exc
        except aiosmtplib.SMTPConnectError as exc:
            raise NotTaken(f"SMTP {s.smtp_host}:{port}: {exc}") from exc
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            raise Unavailable(f"SMTP {s.smtp_host}:{port}: {exc}") from exc


# ---------------------------------------------------------------- Telegram


class Telegram:
    """sendMessage / sendPhoto through the Bot API at `api_url`, one chat at most one
    message per CHAT_GAP_S, a 429's `retry_after` waited out (up to MAX_RETRY_AFTER_S)."""

    kind: ChannelKind = "telegram"

    def __init__(self, token: str, api_url: str, client: httpx.AsyncClient | None = None
                 ) -> None:
        self._base = f"{api_url.rstrip('/')}/bot{token}"
        self._token = token
        self._client = client or httpx.AsyncClient(timeout=30)
        self._last: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def send(self, notice: Notice, target: str, image: bytes | None) -> None:
        lock = self._locks.setdefault(target, asyncio.Lock())
        buttons = notice_buttons(notice)
        markup = {"reply_markup": json.dumps({"inline_keyboard": [[
            {"text": label, "callback_data": data} for label, data in buttons]]})
        } if buttons else {}
        async with lock:
            if image is not None and len(notice.text) <= CAPTION_MAX:
                await self._call(target, "sendPhoto", {"chat_id": target,
                                                       "caption": notice.text, **markup},
                                 files={"photo": ("curve.png", image, "image/png")})
                return
            await self._call(target, "sendMessage",
                             {"chat_id": target, "text": notice.text[:TEXT_MAX], **markup})
            if image is not None:
                await self._call(target, "sendPhoto", {"chat_id": target},
                                 files={"photo": ("curve.png", image, "image/png")})

    async def _call(self, chat: str, method: str, data: dict[str, str],
                    files: dict[str, tuple[str, bytes, str]] | None = None) -> None:
        while True:
            gap = self._last.get(chat, 0.0) + CHAT_GAP_S - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)
            self._last[chat] = time.monotonic()
            try:
                answer = await self._client.post(f"{self._base}/{method}", data=data,
                                                 files=files)
            except httpx.HTTPError as exc:
                # `from None`: a chained httpx error could print the URL, the token in it
                raise _unavailable(exc, f"Telegram {method}: {type(exc).__name__}: "
                                        f"{self._clean(str(exc))}") from None
            try:
                body = answer.json()
            except ValueError:
                why = f"Telegram {method}: {answer.status_code}, not a Bot API answer"
                raise (NotTaken(why) if answer.status_code >= 500 or answer.status_code == 429
                       else Unavailable(why)) from None
            if answer.is_success and body.get("ok"):
                return
            code = int(body.get("error_code") or answer.status_code)
            why = f"Telegram {method} to chat {chat}: {code} {body.get('description', '')}"
            if code == 429:
                wait = float((body.get("parameters") or {}).get("retry_after") or 1)
                if wait > MAX_RETRY_AFTER_S:
                    raise NotTaken(why)
                log.warning("telegram.rate_limited", chat=chat, retry_after_s=wait)
                await asyncio.sleep(wait)
                continue
            if code >= 500:
                raise NotTaken(why)
            raise Refused(why)

    def _clean(self, text: str) -> str:
        return text.replace(self._token, "<token>") if self._token else text

    async def close(self) -> None:
        await self._client.aclose()
