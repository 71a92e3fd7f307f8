"""The Telegram bot's command line (`python -m m27.telegram --help`)."""

from __future__ import annotations

import argparse
from typing import Final

from m27.common import subjects
from m27.common.config import Overrides
from m27.common.service import service_parser

NAME: Final = "telegram"


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser(NAME, "A Telegram bot for m27: submit and follow runs from a "
                            "chat, subscribe the chat to notifications ([telegram], "
                            "docs/telegram.md).")
    parser.add_argument("--api", metavar="HOST:PORT", default="",
                        help="the orchestrator's gRPC address (default: the one registered "
                        f"in the {subjects.SERVICES_BUCKET} bucket)")
    parser.add_argument("--bot-api-url", metavar="URL",
                        help="the Bot API server ([telegram] api_url; default "
                        "https://api.telegram.org)")
    return parser


def overrides(args: argparse.Namespace) -> Overrides:
    """The config keys this service's flags set (None: not given, the config decides)."""
    return {(NAME, "api_url"): args.bot_api_url}
