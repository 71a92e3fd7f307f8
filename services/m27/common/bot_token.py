"""The Telegram bot's token, read once the same way by the bot (`m27.telegram.settings`)
and by the report service, which sends notices through the same bot."""

from __future__ import annotations

from pathlib import Path

from m27.common.config import TelegramSection
from m27.common.secret_files import read_secret


def read_token(section: TelegramSection) -> tuple[str, str]:
    """(`[telegram] token` — $M27_TELEGRAM_TOKEN — else the content of `token_file`, and
    where it came from); ("", "") when neither is set. ConfigError when the file cannot be
    read or others can read it."""
    value = section.token.strip()
    if value:
        return value, "[telegram] token"
    if section.token_file.strip():
        path = Path(section.token_file.strip()).expanduser()
        found = read_secret(path, "Telegram bot token file").decode("utf-8", "replace")
        return found, f"the Telegram bot token file {path}"
    return "", ""
