"""The Bot API stand-in (`tests/botapi.py`) answers python-telegram-bot and plain httpx
callers as Telegram does: long polling with offsets, uploads kept, files downloadable, a
wrong token refused, 429s on demand, updates posted to a webhook with its secret."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import httpx
import pytest
import telegram
from aiohttp import web
from telegram.error import InvalidToken, RetryAfter

from tests.botapi import BotApi


def bot_of(api: BotApi, token: str | None = None) -> telegram.Bot:
    return telegram.Bot(token or api.token, base_url=f"{api.url}/bot",
                        base_file_url=f"{api.url}/file/bot")


async def test_long_polling_returns_pushed_updates_and_forgets_confirmed_ones(
        bot_api: BotApi) -> None:
    async with bot_of(bot_api) as bot:
        assert (await bot.get_me()).username == "m27_test_bot"
        started = time.monotonic()
        waiting = asyncio.create_task(bot.get_updates(timeout=5))
        await asyncio.sleep(0.2)  # the call is waiting on the server by now
        bot_api.push_message(user_id=42, chat_id=42, text="/start now")
        updates = await waiting
        assert time.monotonic() - started < 4
        assert [u.message.text for u in updates if u.message] == ["/start now"]
        entity = updates[0].message.entities[0] if updates[0].message else None
        assert entity is not None
        assert (entity.type, entity.length) == ("bot_command", 6)
        again = await bot.get_updates(offset=updates[-1].update_id + 1, timeout=0)
        assert again == ()
        assert bot_api.pending() == 0


async def test_allowed_updates_filters_what_polling_returns(bot_api: BotApi) -> None:
    bot_api.push_callback(user_id=1, chat_id=1, data="cancel:r-1")
    bot_api.push_message(user_id=1, chat_id=1, text="hello")
    async with bot_of(bot_api) as bot:
        only = await bot.get_updates(timeout=0, allowed_updates=["callback_query"])
        assert [u.callback_query.data for u in only if u.callback_query] == ["cancel:r-1"]


async def test_sent_messages_photos_and_documents_are_kept_in_order(bot_api: BotApi) -> None:
    markup = telegram.InlineKeyboardMarkup(
        [[telegram.InlineKeyboardButton("Cancel", callback_data="cancel:r-1")]])
    async with bot_of(bot_api) as bot:
        await bot.send_message(5, "first", reply_markup=markup)
        await bot.send_photo(5, b"\x89PNG fake", caption="curve")
        await bot.send_document(5, b"<html/>", filename="r-1.html", caption="report")
        await bot.send_message(6, "elsewhere")
    sent = bot_api.sent(5)
    assert [(s.kind, s.text) for s in sent] == [("message", "first"), ("photo", "curve"),
                                                 ("document", "report")]
    assert sent[0].reply_markup == {"inline_keyboard": [[{"text": "Cancel",
                                                          "callback_data": "cancel:r-1"}]]}
    assert sent[1].data == b"\x89PNG fake"
    assert (sent[2].data, sent[2].filename) == (b"<html/>", "r-1.html")


async def test_a_pushed_document_can_be_fetched_and_downloaded(bot_api: BotApi) -> None:
    bot_api.push_message(3, 3, "/submit SEED=1", document=("p.yaml", b"pipeline: []\n"))
    async with bot_of(bot_api) as bot:
        (update,) = await bot.get_updates(timeout=0)
        assert update.message is not None
        assert update.message.document is not None
        assert update.message.caption == "/submit SEED=1"
        assert update.message.document.file_size == len(b"pipeline: []\n")
        file = await bot.get_file(update.message.document.file_id)
        assert bytes(await file.download_as_bytearray()) == b"pipeline: []\n"


async def test_a_wrong_token_is_refused_like_telegram(bot_api: BotApi) -> None:
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{bot_api.url}/bot123:wrong/getMe")
    assert reply.status_code == 401
    assert reply.json() == {"ok": False, "error_code": 401, "description": "Unauthorized"}
    with pytest.raises(InvalidToken):
        await bot_of(bot_api, "123:wrong").get_me()


async def test_fail_next_answers_429_with_retry_after_then_works(
        bot_api: BotApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PTB_TIMEDELTA", "1")  # retry_after as a timedelta, not deprecated
    bot_api.fail_next("sendMessage", 1, retry_after=2)
    async with bot_of(bot_api) as bot:
        with pytest.raises(RetryAfter) as caught:
            await bot.send_message(9, "too soon")
        assert caught.value.retry_after == dt.timedelta(seconds=2)
        await bot.send_message(9, "later")
    assert [s.text for s in bot_api.sent(9)] == ["later"]
    assert [c.status for c in bot_api.calls("sendmessage")] == [429, 200]


def test_plain_httpx_json_callers_and_waiting_on_a_condition(bot_api: BotApi) -> None:
    bot_api.fail_next("sendPhoto", 1)
    url = f"{bot_api.url}/bot{bot_api.token}"
    first = httpx.post(f"{url}/sendPhoto", data={"chat_id": "-100"},
                       files={"photo": ("c.png", b"png")})
    assert first.status_code == 429
    assert first.json() == {"ok": False, "error_code": 429,
                            "description": "Too Many Requests: retry after 1",
                            "parameters": {"retry_after": 1}}
    httpx.post(f"{url}/sendPhoto", data={"chat_id": "-100", "caption": "c"},
               files={"photo": ("c.png", b"png")})
    reply = httpx.post(f"{url}/sendMessage", json={"chat_id": -100, "text": "done"})
    assert reply.json()["result"]["chat"]["id"] == -100
    bot_api.wait_for(lambda: len(bot_api.sent(-100)) == 2, timeout=2)
    assert [(s.kind, s.data) for s in bot_api.sent(-100)] == [("photo", b"png"),
                                                               ("message", None)]
    with pytest.raises(AssertionError, match="not within"):
        bot_api.wait_for(lambda: bot_api.sent(-200), timeout=0.1)


async def test_a_webhook_gets_updates_with_its_secret_and_polling_is_refused(
        bot_api: BotApi, unused_tcp_port: int) -> None:
    got: list[tuple[str, dict[str, object]]] = []

    async def hook(request: web.Request) -> web.Response:
        got.append((request.headers.get("X-Telegram-Bot-Api-Secret-Token", ""),
                    await request.json()))
        return web.Response()

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        async with bot_of(bot_api) as bot:
            await bot.set_webhook(f"http://127.0.0.1:{unused_tcp_port}/hook",
                                  secret_token="s3cret")  # noqa: S106 (a test secret)
            bot_api.push_message(4, 4, "/help")
            await bot_api.wait_for_async(lambda: bot_api.pending() == 0, timeout=5)
            with pytest.raises(telegram.error.Conflict):
                await bot.get_updates(timeout=0)
            await bot.delete_webhook()
        assert got[0][0] == "s3cret"
        assert got[0][1]["message"]["text"] == "/help"  # type: ignore[index]
        assert bot_api.webhook_posts == [(200, "s3cret")]
    finally:
        await runner.cleanup()
