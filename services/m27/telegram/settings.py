"""The bot's settings from `[telegram]`: its token, who may use it, polling or a webhook.

Every problem is one ConfigError naming the key, so `m27 up` (and the service's log) say
exactly what to fix; the token itself is never part of a message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import msgspec

from m27.common.bot_token import read_token
from m27.common.config import TelegramSection
from m27.common.errors import ConfigError
from m27.common.secret_files import read_secret
from m27.telegram.allow import AllowList, parse_allowed

WHERE_IT_GOES: Final = (
    "BotFather's token: [telegram] token_file (a file only you can read), or "
    "$M27_TELEGRAM_TOKEN; docs/telegram.md")
_TOKEN: Final = re.compile(r"[0-9]{1,20}:[A-Za-z0-9_-]{1,200}")
#: What Telegram accepts as a webhook's secret_token.
_WEBHOOK_SECRET: Final = re.compile(r"[A-Za-z0-9_-]{1,256}")


class Webhook(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # the public HTTPS URL Telegram posts to
    host: str  # where the bot listens (behind the proxy that ends TLS)
    port: int
    path: str  # the path it serves (the URL's)
    secret: str


class BotSettings(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    api_url: str
    allow: AllowList
    webhook: Webhook | None = None


def configured(section: TelegramSection) -> bool:
    """Does the config ask for a bot at all (a token, or a file with one)?"""
    return bool(section.token.strip() or section.token_file.strip())


def load(section: TelegramSection) -> BotSettings:
    """The bot's settings; ConfigError naming the key that is missing or wrong."""
    try:
        allow = parse_allowed(section.allowed_users)
    except ValueError as exc:
        raise ConfigError(f"[telegram] allowed_users: {exc}") from exc
    api_url = section.api_url.strip().rstrip("/")
    if urlsplit(api_url).scheme not in ("http", "https") or not urlsplit(api_url).netloc:
        raise ConfigError(f"[telegram] api_url must be an http(s) URL, got {api_url[:100]!r}")
    return BotSettings(token=token(section), api_url=api_url, allow=allow,
                       webhook=webhook(section) if section.webhook_url.strip() else None)


def token(section: TelegramSection) -> str:
    """`[telegram] token` ($M27_TELEGRAM_TOKEN), else the content of `token_file`."""
    value, where = read_token(section)
    if not value:
        raise ConfigError(f"no Telegram bot token: set {WHERE_IT_GOES}")
    if not _TOKEN.fullmatch(value):
        raise ConfigError(f"{where} does not hold a bot token (it looks like "
                          "123456789:AA…, as BotFather gives it)")
    return value


def webhook(section: TelegramSection) -> Webhook:
    url = section.webhook_url.strip()
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.netloc:
        raise ConfigError(f"[telegram] webhook_url must be an https URL (Telegram posts "
                          f"only to HTTPS), got {url[:100]!r}")
    if not section.webhook_secret_file.strip():
        raise ConfigError("[telegram] webhook_url needs webhook_secret_file: a file with "
                          "the secret Telegram sends with each update (A-Z, a-z, 0-9, _, -)")
    path = Path(section.webhook_secret_file.strip()).expanduser()
    secret = read_secret(path, "webhook secret file").decode("utf-8", "replace")
    if not _WEBHOOK_SECRET.fullmatch(secret):
        raise ConfigError(f"the webhook secret in {path} must be 1-256 characters of "
                          "A-Z, a-z, 0-9, _ and - (as Telegram requires)")
    host, _, port = section.webhook_bind.strip().rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"[telegram] webhook_bind must be HOST:PORT, got "
                          f"{section.webhook_bind[:100]!r}")
    return Webhook(url=url, host=host.strip("[]"), port=int(port), path=parts.path or "/",
                   secret=secret)
