"""The notifier on a real nats-server, delivering to a real webhook server (aiohttp), a real
SMTP server (aiosmtpd) and the Bot API stand-in: each notice once per place, whatever is
redelivered, repeated or restarted; failures retried; Telegram's 429 honoured."""

from __future__ import annotations

import asyncio
import email
import email.policy
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from aiosmtpd.controller import Controller

from m27.common import api_auth, bus, events, subjects
from m27.common.bus import NatsBus
from m27.common.config import NotifySection
from m27.common.errors import Unavailable
from m27.common.model import GpuSample, RunRecord, StepRecord
from m27.common.notifications import Delivery, Notice, Subscription
from m27.embedded.processes import stop, wait_ready
from m27.report.channels import Email, NotTaken, Refused, Telegram, Webhook
from m27.report.notify import CLAIM_LEASE_S, Busy, Mark, Notifier, mark_key
from tests.botapi import BotApi
from tests.support import Cluster, finished_run, stored, wait_for

pytestmark = pytest.mark.integration



class Hook:
    """A webhook receiver that answers each POST with the next of `statuses` (then 200);
    one it takes is answered `hold_s` after it was recorded (an answer slow to come back)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []
        self.keys: list[str] = []
        self.statuses: list[int] = []
        self.hold_s = 0.0
        self.url = ""

    async def post(self, request: web.Request) -> web.Response:
        status = self.statuses.pop(0) if self.statuses else 200
        if status == 200:
            self.bodies.append(await request.json())
            self.keys.append(request.headers.get("Idempotency-Key", ""))
            await asyncio.sleep(self.hold_s)
        return web.Response(status=status)


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    receiver = Hook()
    app = web.Application()
    app.router.add_post("/hook/{secret}", receiver.post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    receiver.url = f"http://127.0.0.1:{port}/hook/s3cret"
    yield receiver
    await runner.cleanup()


class Mailbox:
    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []

    async def handle_DATA(self, server: object, session: object, envelope: object) -> str:
        raw = envelope.content  # type: ignore[attr-defined]
        self.messages.append(email.message_from_bytes(raw, policy=email.policy.default))
        return "250 OK"


@pytest.fixture
def mailbox() -> Iterator[tuple[Mailbox, int]]:
    box = Mailbox()
    with socket.socket() as probe:  # aiosmtpd checks it is up by connecting: no port 0
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    yield box, port
    controller.stop()


def record(state: str = "succeeded") -> RunRecord:
    return RunRecord(run_id="r-n1", name="sweep", user="alice", urgency="normal",
                     state=state, created_at=100.0, started_at=100.0,  # type: ignore[arg-type]
                     ended_at=160.0, steps=(StepRecord(name="train", type="gpu", command="x",
                                                       state=state),))  # type: ignore[arg-type]


def make(nats: NatsBus, section: NotifySection, telegram: Telegram | None = None,
         run: Callable[[], RunRecord] = record) -> Notifier:
    async def run_of(run_id: str) -> RunRecord | None:
        return run() if run_id == "r-n1" else None

    async def picture(run_id: str) -> tuple[dict[str, float], bytes | None]:
        return {"loss": 0.125}, b"\x89PNG\r\n\x1a\nfake"

    channels = {"webhook": Webhook(5.0)}
    if section.smtp_host:
        channels["email"] = Email(section)  # type: ignore[assignment]
    if telegram is not None:
        channels["telegram"] = telegram  # type: ignore[assignment]
    return Notifier(nats, channels, section=section, run_of=run_of,  # type: ignore[arg-type]
                    picture=picture)


async def consumed(nats: NatsBus, durable: str) -> bool:
    info = await nats.js.consumer_info(subjects.EVENTS_STREAM, durable)
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


async def run_consumer(nats: NatsBus, notifier: Notifier
                       ) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    task = asyncio.create_task(bus.consume(
        nats.js, stream=subjects.EVENTS_STREAM, durable=subjects.REPORT_NOTIFY,
        filter_subject=subjects.EVENTS_ALL, handle=notifier.handle, stop=stop,
        retry_s=0.2))
    return stop, task


async def drained(nats: NatsBus) -> None:
    deadline = time.monotonic() + 30
    while not await consumed(nats, subjects.REPORT_NOTIFY):
        assert time.monotonic() < deadline, "the notifier did not catch up"
        await asyncio.sleep(0.05)


ENDED = events.RunStateChanged(at=160.0, run_id="r-n1", state="succeeded", previous="running")


async def test_a_run_end_reaches_webhook_and_mail_once_across_copies_and_restarts(
        nats_url: str, hook: Hook, mailbox: tuple[Mailbox, int]) -> None:
    box, port = mailbox
    section = NotifySection(webhook=hook.url, smtp_host="127.0.0.1", smtp_port=port,
                            email_to="alice@lab.example", email_from="m27@lab.example")
    nats = await NatsBus.open(nats_url, name="test-notify")
    try:
        notifier = make(nats, section)
        stop, task = await run_consumer(nats, notifier)
        await nats.publish(subjects.run_state("r-n1"), ENDED, msg_id="copy-1")
        await wait_for(lambda: len(hook.bodies) == 1 and len(box.messages) == 1,
                       "the webhook and the mail arrive")
        body = hook.bodies[0]
        assert {k: body[k] for k in ("type", "run_id", "state", "user")} == {
            "type": "run_succeeded", "run_id": "r-n1", "state": "succeeded", "user": "alice"}
        assert str(body["text"]).startswith("✅ run r-n1 (sweep) succeeded after 1 min")
        assert body["metrics"] == {"loss": 0.125}
        assert hook.keys == [body["id"]]
        mail = box.messages[0]
        assert mail["To"] == "alice@lab.example"
        assert mail["Message-ID"] == f"<{body['id']}@m27>"
        assert mail["Subject"].startswith("[m27] ✅ run r-n1 (sweep) succeeded")
        assert [p.get_content_type() for p in mail.iter_attachments()] == ["image/png"]
        # a second copy of the event (another message id), and a restarted notifier
        await nats.publish(subjects.run_state("r-n1"), ENDED, msg_id="copy-2")
        await drained(nats)
        stop.set()
        await task
        restarted = make(nats, section)
        stop, task = await run_consumer(nats, restarted)
        await nats.publish(subjects.run_state("r-n1"), ENDED, msg_id="copy-3")
        await drained(nats)
        stop.set()
        await task
        assert len(hook.bodies) == 1
        assert len(box.messages) == 1
        assert notifier.sent == 2
        assert restarted.sent == 0
    finally:
        await nats.close()


async def test_a_failing_webhook_is_retried_and_the_mail_is_not_sent_again(
        nats_url: str, hook: Hook, mailbox: tuple[Mailbox, int]) -> None:
    box, port = mailbox
    hook.statuses = [503, 500]
    section = NotifySection(webhook=hook.url, smtp_host="127.0.0.1", smtp_port=port,
                            email_to="alice@lab.example")
    nats = await NatsBus.open(nats_url, name="test-notify")
    try:
        stop, task = await run_consumer(nats, make(nats, section))
        await nats.publish(subjects.run_state("r-n1"), ENDED)
        await wait_for(lambda: len(hook.bodies) == 1, "the webhook takes it at the third try")
        await drained(nats)
        stop.set()
        await task
        assert hook.statuses == []
        assert len(box.messages) == 1
    finally:
        await nats.close()


async def test_a_refused_webhook_is_given_up_and_a_fresh_claim_waits(
        nats_url: str, hook: Hook) -> None:
    hook.statuses = [404]
    nats = await NatsBus.open(nats_url, name="test-notify")
    try:
        notifier = make(nats, NotifySection(webhook=hook.url))
        notice = Notice(id="n-refused", kind="run_failed", text="x", at=1.0, user="alice")
        assert await notifier.notify(notice) == 0  # 404: refused, marked, not retried
        assert await notifier.notify(notice) == 0
        assert hook.bodies == []
        # another notifier's claim in progress: not sent twice at once, but not lost
        other = Notice(id="n-busy", kind="run_failed", text="x", at=1.0, user="alice")
        key = mark_key(other, Delivery(channel="webhook", target=hook.url))
        await nats.kv_put(subjects.NOTIFIED_BUCKET, key, Mark(
            state="sending", at=time.time(), notice=other.id, place="webhook"))
        with pytest.raises(Unavailable):
            await notifier.notify(other)
        await nats.kv_put(subjects.NOTIFIED_BUCKET, key, Mark(
            state="sending", at=time.time() - CLAIM_LEASE_S - 1, notice=other.id,
            place="webhook"))  # its sender died: taken over
        assert await notifier.notify(other) == 1
        assert [b["id"] for b in hook.bodies] == ["n-busy"]
        assert issubclass(Busy, Unavailable)
    finally:
        await nats.close()


async def test_a_subscribed_chat_gets_the_curve_and_a_429_is_waited_out(
        nats_url: str, bot_api: BotApi) -> None:
    botapi = bot_api
    nats = await NatsBus.open(nats_url, name="test-notify")
    telegram = Telegram(botapi.token, botapi.url)
    try:
        await nats.kv_put(subjects.SUBSCRIPTIONS_BUCKET,
                          subjects.subscription_key("telegram", "777"),
                          Subscription(channel="telegram", target="777", user="alice"))
        await nats.kv_put(subjects.SUBSCRIPTIONS_BUCKET,
                          subjects.subscription_key("telegram", "888"),
                          Subscription(channel="telegram", target="888", user="bob"))
        botapi.fail_next("sendPhoto", 1, status=429, retry_after=1)
        stop, task = await run_consumer(nats, make(nats, NotifySection(), telegram))
        began = time.monotonic()
        await nats.publish(subjects.run_state("r-n1"), ENDED)
        await botapi.wait_for_async(lambda: len(botapi.sent(777)) == 1, timeout=30)
        assert time.monotonic() - began >= 1.0
        await drained(nats)
        stop.set()
        await task
        (photo,) = botapi.sent(777)
        assert photo.kind == "photo"
        assert photo.data is not None
        assert photo.data.startswith(b"\x89PNG")
        assert photo.text.startswith("✅ run r-n1 (sweep) succeeded")
        assert botapi.sent(888) == []  # bob's chat: not bob's run
    finally:
        await telegram.close()
        await nats.close()


PIPELINE = """\
pipeline:
  - name: train
    command: |
      for i in 1 2 3 4 5; do
        echo "{\\"step\\": $i, \\"loss\\": 1.$((9 - i))}" >> "$M27_METRICS_FILE"
      done
"""


async def test_a_send_whose_answer_is_lost_keeps_its_claim_until_the_lease(
        nats_url: str, hook: Hook) -> None:
    """The webhook took the notice but its answer never came back in time: the notice may
    have arrived, so it is not sent again before the lease ends (a freed claim would send
    it again at the next redelivery, seconds later), and then with the same key."""
    hook.hold_s = 3.0
    nats = await NatsBus.open(nats_url, name="test-notify")
    notifier = Notifier(nats, {"webhook": Webhook(0.5)}, section=NotifySection(
        webhook=hook.url), run_of=_no_run, picture=_no_picture)
    notice = Notice(id="n-lost-answer", kind="run_failed", text="x", at=1.0, user="alice")
    key = mark_key(notice, Delivery(channel="webhook", target=hook.url))
    try:
        with pytest.raises(Unavailable) as lost:
            await notifier.notify(notice)
        assert not isinstance(lost.value, NotTaken), lost.value
        got = await nats.kv_get(subjects.NOTIFIED_BUCKET, key, Mark)
        assert got is not None
        assert got[0].state == "sending"
        with pytest.raises(Busy):
            await notifier._deliver(notice, Delivery(channel="webhook", target=hook.url),
                                    None)
        assert len(hook.bodies) == 1
        await nats.kv_put(subjects.NOTIFIED_BUCKET, key, Mark(
            state="sending", at=time.time() - CLAIM_LEASE_S - 1, notice=notice.id,
            place="webhook"))  # the lease is over: sent again, and the receiver can tell
        hook.hold_s = 0.0
        assert await notifier.notify(notice) == 1
        assert hook.keys == [notice.id, notice.id]
        got = await nats.kv_get(subjects.NOTIFIED_BUCKET, key, Mark)
        assert got is not None
        assert got[0].state == "sent"
    finally:
        await notifier.close()
        await nats.close()


async def _no_run(run_id: str) -> RunRecord | None:
    return None


async def _no_picture(run_id: str) -> tuple[dict[str, float], bytes | None]:
    return {}, None


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_channels_tell_a_notice_not_taken_from_one_whose_fate_is_unknown(
        hook: Hook, bot_api: BotApi) -> None:
    notice = Notice(id="n-fate", kind="run_failed", text="x", at=1.0, user="alice")
    webhook = Webhook(0.5)
    telegram = Telegram(bot_api.token, bot_api.url)
    try:
        with pytest.raises(NotTaken, match="ConnectError"):  # nothing listens there
            await webhook.send(notice, f"http://127.0.0.1:{_closed_port()}/hook", None)
        hook.statuses = [503, 429]
        for status in ("503", "429"):
            with pytest.raises(NotTaken, match=status):
                await webhook.send(notice, hook.url, None)
        hook.statuses = [404]
        with pytest.raises(Refused, match="404"):
            await webhook.send(notice, hook.url, None)
        hook.hold_s = 2.0
        with pytest.raises(Unavailable, match="ReadTimeout") as timed_out:
            await webhook.send(notice, hook.url, None)
        assert not isinstance(timed_out.value, NotTaken)
        bot_api.fail_next("sendMessage", 1, status=502)
        with pytest.raises(NotTaken, match="502"):
            await telegram.send(notice, "4242", None)
        with pytest.raises(NotTaken, match="ConnectError"):
            await Telegram(bot_api.token, f"http://127.0.0.1:{_closed_port()}").send(
                notice, "4242", None)
        mail = Email(NotifySection(smtp_host="127.0.0.1", smtp_port=_closed_port()))
        with pytest.raises(NotTaken):
            await mail.send(notice, "alice@lab.example", None)
        assert bot_api.sent(4242) == []
    finally:
        await webhook.close()
        await telegram.close()


async def test_the_real_system_tells_a_webhook_and_a_subscribed_chat_once_across_a_restart(
        tmp_path: Path, hook: Hook, bot_api: BotApi) -> None:
    system = Cluster(tmp_path, gpus="sim:1", env={
        "M27_NOTIFY_WEBHOOK": hook.url, "M27_NOTIFY_RULES": "run_ended -> webhook",
        "M27_TELEGRAM_TOKEN": bot_api.token, "M27_TELEGRAM_API_URL": bot_api.url})
    system.start()
    nats = await NatsBus.open(system.nats_url, name="test-notify")
    try:
        me = api_auth.login_name()
        await nats.kv_put(subjects.SUBSCRIPTIONS_BUCKET,
                          subjects.subscription_key("telegram", "4242"),
                          Subscription(channel="telegram", target="4242", user=me))
        bot_api.fail_next("sendPhoto", 1, status=429, retry_after=1)
        hook.hold_s = 2.0  # the report is stopped while the webhook's answer is on its way
        async with system.client() as client:
            run_id = await client.submit(PIPELINE, workdir=str(tmp_path))
            run = await finished_run(client, run_id)
        assert run.state == "succeeded", system.logs()
        await wait_for(lambda: bool(hook.bodies), "the webhook hears of the run")
        # in a thread: the webhook answers from this event loop
        await asyncio.to_thread(stop, [system.processes.pop("report")])
        # it finished what it was sending (the webhook, then the chat) before it closed
        marks = [(await nats.kv_get(subjects.NOTIFIED_BUCKET, key, Mark))
                 for key in await nats.kv_keys(subjects.NOTIFIED_BUCKET)]
        assert sorted((m[0].place.partition(":")[0], m[0].state) for m in marks if m) == [
            ("telegram", "sent"), ("webhook", "sent")], system.logs()
        (photo,) = bot_api.sent(4242)
        assert photo.kind == "photo", photo
        assert photo.text.startswith(f"✅ run {run_id} ")
        assert "loss 1.4" in photo.text  # the last logged value, from the history
        assert [c.status for c in bot_api.calls("sendPhoto")] == [429, 200]
        assert [(b["type"], b["run_id"], b["user"]) for b in hook.bodies] == [
            ("run_succeeded", run_id, me)]
        # the report service restarts, and the run's end is published once more
        ended = [data for subject, data in await stored(nats, subjects.EVENTS_STREAM)
                 if subject == subjects.run_state(run_id)
                 and b'"state":"succeeded"' in data]
        await nats.js.publish(subjects.run_state(run_id), ended[-1])
        system.launch("report", "m27.report")
        wait_ready([system.processes["report"]])
        await drained(nats)
        assert len(bot_api.sent(4242)) == 1
        assert len(hook.bodies) == 1
        log = (tmp_path / "logs" / "report.log").read_text()
        assert bot_api.token not in log
        assert "s3cret" not in log
    finally:
        await nats.close()
        system.stop()


async def test_anomalies_lost_nodes_leaks_waiting_tasks_and_hot_gpus_are_told(
        nats_url: str, hook: Hook) -> None:
    nats = await NatsBus.open(nats_url, name="test-notify")
    notifier = make(nats, NotifySection(webhook=hook.url, rules="all -> webhook",
                                        waiting_after=600.0, gpu_hot_c=85.0))
    try:
        stop, task = await run_consumer(nats, notifier)
        node = subjects.node_sender("n1")
        spike = events.TrainingAnomaly(at=1.0, task_id="r-n1/train", run_id="r-n1",
                                       step="train", attempt=1, node_id="n1", kind="spike",
                                       metric="loss", train_step=50, value=9.0,
                                       baseline=0.5, actions=("checkpoint", "notify"))
        await nats.publish(subjects.task_events("r-n1", "train", node), spike)
        quiet = msgspec.structs.replace(spike, train_step=60, actions=("checkpoint",))
        await nats.publish(subjects.task_events("r-n1", "train", node), quiet)
        forged = msgspec.structs.replace(spike, train_step=70)  # n2 speaking for n1
        await nats.publish(subjects.task_events("r-n1", "train", "node-n2"), forged)
        await nats.publish(subjects.node_events("n1"), events.NodeLost(
            at=100.0, node_id="n1", last_heartbeat=40.0))
        await nats.publish(subjects.node_events("n1"), events.GpuMemoryLeak(
            at=5.0, node_id="n1", gpu_index=0, task_id="r-n1/train", pids=(77,),
            memory_mb=900, cleaned=True))
        await drained(nats)
        stop.set()
        await task
        kv = await nats.kv(subjects.TASKS_BUCKET)
        await kv.put("r-n1.analyse", msgspec.json.encode(_waiting_entry()))
        assert await notifier.check_waiting() == 1
        assert await notifier.check_waiting() == 0  # once per time it was queued
        hot = events.GpuTelemetry(at=7200.0, node_id="n1", incarnation="i", seq=1,
                                  backend="simulated", gpus=(GpuSample(
                                      index=0, utilization_pct=99.0, memory_used_mb=1,
                                      temperature_c=91.0, simulated=True),))
        await nats.js.publish(subjects.telemetry(node), msgspec.json.encode(hot))
        await nats.js.publish(subjects.telemetry("node-n2"), msgspec.json.encode(hot))
        tele_stop = asyncio.Event()
        tele = asyncio.create_task(bus.consume(
            nats.js, stream=subjects.TELEMETRY_STREAM, durable=subjects.REPORT_NOTIFY_TELEMETRY,
            filter_subject=subjects.TELEMETRY_ALL, handle=notifier.handle_telemetry,
            stop=tele_stop))
        await wait_for(lambda: len(hook.bodies) == 5, "the hot GPU is told")
        tele_stop.set()
        await tele
        assert [(b["type"], b["user"]) for b in hook.bodies] == [
            ("training_anomaly", "alice"), ("node_lost", ""), ("gpu_memory_leak", "alice"),
            ("task_waiting", "alice"), ("gpu_hot", "")]
        assert "at step 50" in str(hook.bodies[0]["text"])
    finally:
        await nats.close()


def _waiting_entry() -> dict[str, object]:
    return {"task": {"task_id": "r-n1/analyse", "run_id": "r-n1", "user": "alice",
                     "step": "analyse"},
            "queued_at": time.time() - 3600, "placement": None, "wait_reason": "no GPU free"}
