"""`[telegram]` read into the bot's settings: a token from the config, a file or the
environment; each mistake one clear sentence naming the key, never showing the token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from m27.common.config import TelegramSection, load_config
from m27.common.errors import ConfigError
from m27.telegram.settings import configured, load

TOKEN = "123456:AAbb-cc_DDeeffGGhhIIjjKKllMMnnOOpp"  # noqa: S105 - made up


def secret_file(path: Path, content: str, mode: int = 0o600) -> str:
    path.write_text(content + "\n")
    path.chmod(mode)
    return str(path)


def test_a_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    loaded = load_config(tmp_path / "none", environ={
        "M27_TELEGRAM_TOKEN": TOKEN, "M27_TELEGRAM_ALLOWED_USERS": "42:alice",
        "M27_TELEGRAM_API_URL": "http://127.0.0.1:9/"}).config.telegram
    assert configured(loaded)
    bot = load(loaded)
    assert (bot.token, bot.api_url, bot.allow.user_of(42)) == (
        TOKEN, "http://127.0.0.1:9", "alice")
    assert bot.webhook is None
    from_file = TelegramSection(token_file=secret_file(tmp_path / "t", TOKEN))
    assert load(from_file).token == TOKEN
    assert not configured(TelegramSection())


@pytest.mark.parametrize(("section", "said"), [
    (TelegramSection(), "no Telegram bot token: set BotFather's token"),
    (TelegramSection(token="not-a-token"),  # noqa: S106 - a made-up one
     "[telegram] token does not hold a bot token"),
    (TelegramSection(token=TOKEN, allowed_users="alice"), "[telegram] allowed_users: "),
    (TelegramSection(token=TOKEN, api_url="ftp://x"),
     "[telegram] api_url must be an http(s) URL"),
    (TelegramSection(token=TOKEN, webhook_url="http://bot.lab.example/tg"),
     "[telegram] webhook_url must be an https URL"),
    (TelegramSection(token=TOKEN, webhook_url="https://bot.lab.example/tg"),
     "[telegram] webhook_url needs webhook_secret_file"),
])
def test_mistakes_are_one_sentence_naming_the_key(section: TelegramSection, said: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(said)) as caught:
        load(section)
    assert TOKEN not in str(caught.value)


def test_token_and_secret_files_must_be_private_and_well_formed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="can be read by others"):
        load(TelegramSection(token_file=secret_file(tmp_path / "t", TOKEN, 0o644)))
    with pytest.raises(ConfigError, match="cannot read the Telegram bot token file"):
        load(TelegramSection(token_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="does not hold a bot token") as caught:
        load(TelegramSection(token_file=secret_file(tmp_path / "u", "oops " + TOKEN)))
    assert TOKEN not in str(caught.value)
    hook = TelegramSection(token=TOKEN, webhook_url="https://bot.lab.example/m27/tg",
                           webhook_secret_file=secret_file(tmp_path / "s", "s3cr-et_"),
                           webhook_bind="127.0.0.1:8443")
    webhook = load(hook).webhook
    assert webhook is not None
    assert (webhook.host, webhook.port, webhook.path, webhook.secret) == (
        "127.0.0.1", 8443, "/m27/tg", "s3cr-et_")
    bad = TelegramSection(token=TOKEN, webhook_url="https://x/y",
                          webhook_secret_file=secret_file(tmp_path / "b", "no spaces!"))
    with pytest.raises(ConfigError, match="must be 1-256 characters"):
        load(bad)
