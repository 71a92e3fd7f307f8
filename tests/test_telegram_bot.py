"""The Telegram bot end to end (issue 16, points 3-5), offline: `m27 up` (the real
command) with a token configured starts the bot against the Bot API stand-in
(`tests/botapi.py`); people talk to it as Telegram would deliver their messages.

One system serves the module (starting one costs a few seconds); each test uses its own
Telegram users and chats."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import telegram

from m27.client import Client
from m27.client.report import ReportClient
from m27.common import api_auth, subjects
from m27.common.api_auth import ApiAccess
from m27.common.bus import NatsBus
from m27.common.config import ApiSection, NatsSection
from m27.common.memory_bus import MemoryBus
from m27.common.notifications import Subscription
from m27.common.principals import principal
from m27.embedded import system
from m27.embedded.nats_server import pid_alive
from m27.pipeline import PipelineError, load_pipeline
from m27.telegram.allow import AllowList
from m27.telegram.bot import Actions, Handlers
from m27.telegram.calls import M27Api
from m27.telegram.commands import Incoming
from m27.telegram.service import TelegramLink, build_application
from m27.telegram.settings import BotSettings, Webhook
from tests.botapi import BotApi, Sent
from tests.support import finished_run, report_of

pytestmark = pytest.mark.integration

ALICE, BOB, STRANGER = 1001, 1002, 666
ALLOWED = f"{ALICE}:alice,{BOB}:bob"
TRAIN = b"""\
pipeline:
  - name: train
    type: cpu
    command: |
      echo "seed {{SEED}}"
      for i in 1 2 3 4 5 6; do
        echo "{\\"step\\": $i, \\"loss\\": 0.$((9 - i))}" >> "$M27_METRICS_FILE"
      done
"""


@dataclass
class BotSystem:
    api: BotApi
    home: Path
    env: dict[str, str]
    state: system.EmbeddedState

    def m27(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "m27.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=120, check=False)

    def admin(self) -> Client:
        token = api_auth.ensure_cli_token(self.home, api_auth.login_name()).read_text()
        return Client(self.state.api, access=ApiAccess(token=token.strip()))

    def report_address(self) -> str:
        return next(p.grpc_address for p in self.state.processes if p.name == "report")

    def logs(self) -> str:
        return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')}"
                         for p in sorted((self.home / "logs").glob("*.log")))


@pytest.fixture(scope="module")
def bot_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BotSystem]:
    """`m27 up` with M27_TELEGRAM_* pointing at the stand-in; `m27 down` at the end."""
    root = tmp_path_factory.mktemp("telegram")
    (root / "m2config").write_text("")
    with BotApi() as api:
        env = {**os.environ, "M27_HOME": str(root / "home"),
               "M27_CONFIG": str(root / "m2config"), "M27_TELEGRAM_TOKEN": api.token,
               "M27_TELEGRAM_API_URL": api.url, "M27_TELEGRAM_ALLOWED_USERS": ALLOWED}
        env.pop("M27_TOKEN", None)
        up = subprocess.run([sys.executable, "-m", "m27.cli", "up", "--gpus", "sim:1"],
                            env=env, capture_output=True, text=True, timeout=120, check=False)
        assert up.returncode == 0, up.stderr
        state = system.read_state(root / "home")
        assert state is not None
        bots = BotSystem(api=api, home=root / "home", env=env, state=state)
        try:
            yield bots
        finally:
            bots.m27("down")


def last_text(api: BotApi, chat: int) -> str:
    return api.sent(chat)[-1].text


async def say(api: BotApi, user: int, text: str, *, chat: int | None = None,
              document: tuple[str, bytes] | None = None, file_size: int | None = None,
              answers: int = 1) -> list[Sent]:
    """Send as `user` and wait for the bot's next `answers` messages in the chat."""
    where = chat if chat is not None else user
    before = len(api.sent(where))
    api.push_message(user, where, text, document=document, file_size=file_size)
    await api.wait_for_async(lambda: len(api.sent(where)) >= before + answers, timeout=30,
                             what=f"{answers} answer(s) to {text[:40]!r}")
    return api.sent(where)[before:]


async def test_up_starts_the_bot_and_it_answers_who_may_use_it(
        bot_system: BotSystem) -> None:
    status = json.loads(bot_system.m27("status", "--json").stdout)
    assert {"name": "telegram", "alive": True}.items() <= next(
        p for p in status["processes"] if p["name"] == "telegram").items()
    api = bot_system.api
    assert {c["command"] for c in api.commands} >= {"submit", "status", "report",
                                                    "subscribe"}
    assert [c.method for c in api.calls()][:3] == ["getme", "setmycommands", "deletewebhook"]
    (answer,) = await say(api, ALICE, "/start")
    assert answer.text.startswith("Hello! You use m27 here as alice.")


async def test_an_allowed_user_submits_a_file_hears_it_end_and_gets_its_report(
        bot_system: BotSystem) -> None:
    api = bot_system.api
    lab = -5001  # alice's group: where the report service's notices of her runs go
    await say(api, ALICE, "/subscribe", chat=lab)
    (submitted,) = await say(api, ALICE, "/submit SEED=3", document=("train.yaml", TRAIN))
    assert submitted.text.startswith("Submitted: r-"), submitted.text
    run_id = submitted.text.split()[1]
    assert "plan for train: 1 steps in 1 level(s)" in submitted.text
    assert submitted.reply_markup is not None
    assert f"cancel:{run_id}" in json.dumps(submitted.reply_markup)
    async with bot_system.admin() as admin:
        run = await finished_run(admin, run_id, timeout=60)
        await report_of(admin, run_id)  # the report service has written it
    assert (run.state, run.user, run.source_name) == ("succeeded", "alice", "train.yaml")
    assert "seed 3" in run.steps[0].stdout_tail  # SEED=3 became --var SEED=3
    (status,) = await say(api, ALICE, f"/status {run_id}")
    assert f"{run_id} (train) by alice: succeeded" in status.text
    assert "train: succeeded on node-1" in status.text
    await metrics_stored(bot_system, run_id, points=6)
    photo, html = await say(api, ALICE, f"/report {run_id}", answers=2)
    assert photo.kind == "photo"
    assert photo.data is not None
    assert photo.data.startswith(b"\x89PNG")
    assert photo.text == f"{run_id} (train): succeeded\nloss 0.3"
    assert (html.kind, html.filename) == ("document", f"{run_id}.html")
    assert html.data is not None
    assert b"<html" in html.data[:2000].lower()
    await api.wait_for_async(lambda: len(api.sent(lab)) == 2, timeout=30,
                             what="the notice of the run's end")
    notice = api.sent(lab)[1]  # (after the subscription's confirmation)
    assert notice.kind == "photo", notice
    assert notice.data is not None
    assert notice.data.startswith(b"\x89PNG")
    assert notice.text.startswith(f"✅ run {run_id} (train) succeeded after ")
    assert notice.text.endswith("loss 0.3")
    assert notice.reply_markup == {"inline_keyboard": [[
        {"text": "Report", "callback_data": f"report:{run_id}"}]]}
    events = bot_system.m27("events", "--run", run_id, "--json")  # under m27 up's users
    assert events.returncode == 0, events.stderr
    kinds = [json.loads(line)["type"] for line in events.stdout.splitlines()]
    assert kinds[0] == "run_submitted"
    assert "report_ready" in kinds
    (listed,) = await say(api, ALICE, "/runs")
    assert run_id in listed.text
    before = len(api.sent(ALICE))
    api.push_callback(ALICE, ALICE, f"status:{run_id}")  # the Status button
    await api.wait_for_async(lambda: len(api.sent(ALICE)) > before, timeout=30)
    assert "succeeded" in last_text(api, ALICE)
    assert api.calls("answercallbackquery")


async def metrics_stored(bots: BotSystem, run_id: str, points: int) -> None:
    """Wait until the report service's history holds the run's points (they travel on
    their own stream, and may land after the run ended)."""
    token = api_auth.ensure_cli_token(bots.home, api_auth.login_name()).read_text().strip()
    deadline = time.monotonic() + 30
    async with ReportClient(bots.report_address(), access=ApiAccess(token=token)) as report:
        while not any(c.count >= points for c in await report.metrics(run_id)):
            assert time.monotonic() < deadline, bots.logs()[-3000:]
            await asyncio.sleep(0.1)


async def test_another_user_cannot_see_or_touch_alices_runs(bot_system: BotSystem) -> None:
    api = bot_system.api
    (submitted,) = await say(api, ALICE, "/submit SEED=1", document=("train.yaml", TRAIN))
    run_id = submitted.text.split()[1]
    for command in ("status", "cancel", "report"):
        (answer,) = await say(api, BOB, f"/{command} {run_id}")
        assert "belongs to another user" in answer.text, answer.text
    (runs,) = await say(api, BOB, "/runs")
    assert run_id not in runs.text


async def test_a_stranger_is_refused_and_nothing_runs_or_is_shown(
        bot_system: BotSystem) -> None:
    api = bot_system.api
    async with bot_system.admin() as admin:
        runs_before, _ = await admin.list_runs(100)
    files_before = len(api.calls("getfile"))
    answers = [*await say(api, STRANGER, "/submit SEED=1", document=("t.yaml", TRAIN)),
               *await say(api, STRANGER, "/runs"), *await say(api, STRANGER, "/nodes"),
               *await say(api, STRANGER, f"/status {runs_before[0].run_id}"),
               *await say(api, STRANGER, "hello")]
    for answer in answers:
        assert answer.text == (
            "Sorry, you are not allowed to use this bot; ask the lab's admin to add your "
            f"Telegram id {STRANGER} to [telegram] allowed_users.")
    before = len(api.sent(STRANGER))
    api.push_callback(STRANGER, STRANGER, f"cancel:{runs_before[0].run_id}")
    await api.wait_for_async(lambda: len(api.sent(STRANGER)) > before, timeout=30)
    assert "not allowed" in last_text(api, STRANGER)
    assert len(api.calls("getfile")) == files_before
    async with bot_system.admin() as admin:
        runs_after, _ = await admin.list_runs(100)
        assert [r.run_id for r in runs_after] == [r.run_id for r in runs_before]
        assert (await admin.get_run(runs_before[0].run_id)).state != "cancelled" or \
            runs_before[0].state == "cancelled"


async def test_bad_pipelines_and_files_get_the_clis_located_errors(
        bot_system: BotSystem) -> None:
    api = bot_system.api
    bad = "pipeline:\n  - name: a\n    typ: cpu\n    command: echo {{X}}\n"
    (answer,) = await say(api, BOB, f"/submit\n```yaml\n{bad}```")
    with pytest.raises(PipelineError) as expected:  # what `m27 plan` reports for it
        load_pipeline(bad, {}, source="pipeline.yaml", workdir="/")
    assert answer.text == f"Not submitted:\nm27: {expected.value}"
    assert "pipeline.yaml:3:5: pipeline[0].typ: unknown key `typ`" in answer.text
    (huge,) = await say(api, BOB, "/submit", document=("big.yaml", b"x"),
                        file_size=5 * 1024 * 1024)
    assert huge.text == "big.yaml is 5120 KiB; a pipeline may be at most 1024 KiB."
    (binary,) = await say(api, BOB, "/submit", document=("p.yaml", b"pipeline: \xff\xfe"))
    assert binary.text == "Not submitted: p.yaml: not UTF-8 text (byte 10)."
    (vars_,) = await say(api, BOB, "/submit 2=x", document=("p.yaml", TRAIN))
    assert vars_.text == "/submit: expected NAME=VALUE, got '2=x'"


async def test_subscribe_stores_the_chats_subscription_for_the_notifier(
        bot_system: BotSystem) -> None:
    api = bot_system.api
    group = -100123
    (answer,) = await say(api, BOB, "/subscribe run_failed training_anomaly run=sweep-*",
                          chat=group)
    assert answer.text == ("This chat now gets notices about bob's runs of runs matching "
                           "sweep-*: run_failed, training_anomaly. /unsubscribe stops them.")
    access = system.access(bot_system.home, principal("admin"), NatsSection())
    bus = await NatsBus.open(bot_system.state.nats_url, name="test-telegram", access=access)
    try:
        key = subjects.subscription_key("telegram", str(group))
        stored = await bus.kv_get(subjects.SUBSCRIPTIONS_BUCKET, key, Subscription)
        assert stored is not None
        assert stored[0] == Subscription(channel="telegram", target=str(group), user="bob",
                                         kinds=("run_failed", "training_anomaly"),
                                         runs=("sweep-*",), created_at=stored[0].created_at)
        (gone,) = await say(api, BOB, "/unsubscribe", chat=group)
        assert gone.text == "This chat gets no more notices."
        assert await bus.kv_get(subjects.SUBSCRIPTIONS_BUCKET, key, Subscription) is None
    finally:
        await bus.close()


async def test_a_429_on_send_message_is_waited_out(bot_system: BotSystem) -> None:
    api = bot_system.api
    api.fail_next("sendMessage", 1, retry_after=1)
    (answer,) = await say(api, BOB, "/help")
    assert answer.text.startswith("You are bob here.")
    refused, sent = api.calls("sendmessage")[-2:]
    assert (refused.status, sent.status) == (429, 200)
    assert sent.at - refused.at >= 0.95


async def test_down_stops_the_bot_and_its_token_is_in_no_log(bot_system: BotSystem) -> None:
    """Last in the module: it stops the shared system."""
    bot = next(p for p in bot_system.state.processes if p.name == "telegram")
    down = bot_system.m27("down")
    assert down.returncode == 0, down.stderr
    assert not pid_alive(bot.pid)
    logs = bot_system.logs()
    assert "telegram.refused" in logs  # the bot's log was read
    assert bot_system.api.token not in logs
    assert bot_system.api.token.split(":")[1] not in logs


# ---------------------------------------------------------------- without a system


async def test_an_unreachable_api_and_a_bug_are_one_line_in_the_chat(bot_api: BotApi) -> None:
    """No m27 runs: the bot answers in one line (and a bug in it, too), and goes on."""
    actions = Actions(M27Api(MemoryBus(), api_auth.ephemeral_keys(), ApiSection(),
                             api="127.0.0.1:9"), MemoryBus())
    handlers = Handlers(AllowList(users={ALICE: "alice"}), actions)
    async with bot_of(bot_api) as bot:
        await handlers.handle(incoming("/runs"), bot)
        await handlers.handle(incoming("/queue"), bot)

        async def broken(*_: object) -> list[object]:
            raise RuntimeError("a bug")

        actions.run = broken  # type: ignore[method-assign, assignment]
        await handlers.handle(incoming("/nodes"), bot)
    texts = [s.text for s in bot_api.sent(ALICE)]
    assert texts[0] == ("m27 cannot be reached right now (cannot reach the m27 API at "
                        "127.0.0.1:9: is it up? (start it with `m27 up`)); try again in a "
                        "minute.")
    assert texts[1] == ("m27 cannot be reached right now (no scheduler is running); try "
                        "again in a minute.")
    assert texts[2].startswith("Something went wrong inside the bot (error ")
    assert "a bug" not in texts[2]


async def test_webhook_mode_takes_only_updates_that_carry_the_secret(
        bot_api: BotApi, unused_tcp_port: int) -> None:
    hook = Webhook(url=f"http://127.0.0.1:{unused_tcp_port}/tg", host="127.0.0.1",
                   port=unused_tcp_port, path="/tg", secret="s3cret-_")  # noqa: S106
    settings = BotSettings(token=bot_api.token, api_url=bot_api.url,
                           allow=AllowList(users={ALICE: "alice"}), webhook=hook)
    actions = Actions(M27Api(MemoryBus(), api_auth.ephemeral_keys(), ApiSection()),
                      MemoryBus())
    link = TelegramLink(build_application(settings, Handlers(settings.allow, actions)),
                        settings)
    stop = asyncio.Event()
    contact = asyncio.create_task(link.connect(stop))
    await link.run(contact, stop)
    try:
        assert bot_api.webhook == (hook.url, "s3cret-_")
        bot_api.push_message(ALICE, ALICE, "/help")
        await bot_api.wait_for_async(lambda: bot_api.sent(ALICE), timeout=10)
        assert bot_api.sent(ALICE)[0].text.startswith("You are alice here.")
        async with aiohttp.ClientSession() as session:
            forged = {"update_id": 1, "message": {
                "message_id": 1, "date": 0, "chat": {"id": ALICE, "type": "private"},
                "from": {"id": ALICE, "is_bot": False, "first_name": "x"}, "text": "/help"}}
            for headers in ({}, {"X-Telegram-Bot-Api-Secret-Token": "wrong"}):
                async with session.post(hook.url, json=forged, headers=headers) as reply:
                    assert reply.status == 403
        assert len(bot_api.sent(ALICE)) == 1
    finally:
        stop.set()
        await link.close()


def incoming(text: str) -> Incoming:
    return Incoming(user_id=ALICE, chat_id=ALICE, text=text)


def bot_of(api: BotApi) -> telegram.Bot:
    return telegram.Bot(api.token, base_url=f"{api.url}/bot",
                        base_file_url=f"{api.url}/file/bot")
