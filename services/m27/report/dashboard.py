"""The live dashboard, served by the report service over HTTP (aiohttp): one page, JSON
endpoints for the same data, and server-sent events that keep the page live.

    GET /                      the page (Jinja2; uPlot vendored under /static, no build step)
    GET /api/state?hours=1&points=120   `board.State` as JSON: GPU curves (at most `points`
                               per GPU), queue, running, runs, events
    GET /api/stream?hours=1    text/event-stream: `state` every `interval` s, `event` per bus
                               event (`points` as for /api/state)
    GET /reports/<run>.html    a run's report; GET /compare/<run>: its comparison page

Who may look: anyone with a valid m27 API token — as `Authorization: Bearer`, or once as
`?token=` (then kept in an HttpOnly, SameSite=Strict cookie, and the address bar loses
it). A `user` sees the whole cluster (as `m27 queue` shows it) but only their own runs,
reports and comparisons. The bind is `[report] dashboard` (default loopback; "" turns it
off). What cannot be read (a service down) is listed on the page, never an error page.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import time
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Final

import jinja2
import msgspec
from aiohttp import web
from nats.aio.msg import Msg

from m27 import __version__
from m27.client import Client
from m27.client.scheduler import SchedulerClient
from m27.common import api_access, events
from m27.common.api_auth import ApiAccess, Keys
from m27.common.errors import M27Error
from m27.common.ids import is_valid_run_id
from m27.common.model import RunRecord
from m27.common.tokens import Identity
from m27.report import board
from m27.report._style import CSS
from m27.report.decide import report_file
from m27.report.store import History

COOKIE: Final = "m27_token"
MAX_STREAMS: Final = 64  # open event streams at once; more get 503
STATIC: Final = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
_ENV: Final = jinja2.Environment(loader=jinja2.PackageLoader("m27.report", "templates"),
                                 autoescape=True, undefined=jinja2.StrictUndefined)

#: The gRPC address of the newest instance of a service ("" when none is registered).
Locate = Callable[[str], Awaitable[str]]
Compare = Callable[[RunRecord], Awaitable[str]]


class Dashboard:
    def __init__(self, history: History, keys: Keys, access: ApiAccess, locate: Locate,
                 out_dir: Path, compare: Compare, *, interval_s: float = 5.0) -> None:
        self.history = history
        self.keys = keys
        self.access = access
        self.locate = locate
        self.out_dir = out_dir
        self.compare = compare
        self.interval_s = interval_s
        self.recent: deque[board.Event] = deque(maxlen=board.MAX_EVENTS)
        self.listeners: set[asyncio.Queue[board.Event]] = set()
        self.runner: web.AppRunner | None = None
        #: (hours, points) → (when read, the GPU curves): every open page asks for the same
        #: window each interval; one query of the history serves them all
        self._gpus: dict[tuple[float, int], tuple[float, list[board.GpuSeries]]] = {}
        self._gpus_lock = asyncio.Lock()

    # -------------------------------------------------------------- lifecycle

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=16 * 1024)
        app.add_routes([
            web.get("/", self.page), web.get("/api/state", self.state_json),
            web.get("/api/stream", self.stream), web.get("/static/{name}", self.static),
            web.get("/reports/{name}", self.report), web.get("/compare/{run_id}",
                                                             self.comparison)])
        return app

    async def start(self, bind: str) -> str:
        """Listen on `bind` (host:port, port 0: any free one); the address it got."""
        host, _, port = bind.rpartition(":")
        try:
            number = int(port)
        except ValueError:
            raise M27Error(f"[report] dashboard = {bind!r}: write HOST:PORT") from None
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host.strip("[]") or "127.0.0.1", number)
        try:
            await site.start()
        except OSError as exc:
            raise M27Error(f"cannot serve the dashboard on {bind}: {exc.strerror}") from None
        found = self.runner.addresses[0]
        return f"{found[0]}:{found[1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def on_event(self, msg: Msg) -> None:
        """A bus event (core NATS subscription on m27.events.>): kept and pushed."""
        try:
            line = board.event_line(msg.subject, events.decode_event(msg.data))
        except (ValueError, msgspec.DecodeError):
            return
        self.recent.append(line)
        for queue in list(self.listeners):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(line)

    # -------------------------------------------------------------- who

    @web.middleware
    async def _auth(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.path.startswith("/static/"):
            return await handler(request)
        given = request.query.get("token")
        header = request.headers.get("Authorization", "")
        token = given or (header[7:] if header.startswith("Bearer ") else "") or \
            request.cookies.get(COOKIE, "")
        who = self._identify(token)
        if who is None:
            if request.path == "/":
                return _login_page("" if not token else "That token is not valid here "
                                   "(expired, or from another m27).")
            raise web.HTTPUnauthorized(text="an m27 API token is needed (Authorization: "
                                       "Bearer, or ?token= once)")
        if given:  # keep it in a cookie, out of the address bar and the history
            response = web.HTTPFound(request.rel_url.with_query(
                {k: v for k, v in request.query.items() if k != "token"}))
            response.set_cookie(COOKIE, given, httponly=True, samesite="Strict",
                                max_age=12 * 3600)
            raise response
        request["who"] = who
        return await handler(request)

    def _identify(self, token: str) -> Identity | None:
        if not token or len(token) > 4096:
            return None
        try:
            return self.keys.identify(token, time.time())
        except M27Error:
            return None

    # -------------------------------------------------------------- pages

    async def page(self, request: web.Request) -> web.Response:
        who: Identity = request["who"]
        text = _ENV.get_template("dashboard.html.j2").render(
            css=CSS, user=who.user, role=who.role, version=__version__,
            interval_s=self.interval_s)
        return web.Response(text=text, content_type="text/html",
                            headers={"Content-Security-Policy": _CSP,
                                     "Cache-Control": "no-store"})

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        data = (resources.files("m27.report") / "static" / name).read_bytes()
        return web.Response(body=data, content_type=STATIC[name],
                            headers={"Cache-Control": "max-age=86400"})

    async def state_json(self, request: web.Request) -> web.Response:
        state = await self.state(request["who"], board.hours_asked(request.query.get("hours")),
                                 board.points_asked(request.query.get("points")))
        return web.Response(body=msgspec.json.encode(state), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        if len(self.listeners) >= MAX_STREAMS:
            raise web.HTTPServiceUnavailable(text="too many open dashboards")
        who: Identity = request["who"]
        hours = board.hours_asked(request.query.get("hours"))
        points = board.points_asked(request.query.get("points"))
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no"})
        await response.prepare(request)
        queue: asyncio.Queue[board.Event] = asyncio.Queue(maxsize=500)
        self.listeners.add(queue)
        try:
            next_state = 0.0
            while True:
                if time.monotonic() >= next_state:
                    state = await self.state(who, hours, points)
                    await response.write(_sse("state", msgspec.json.encode(state)))
                    next_state = time.monotonic() + self.interval_s
                with contextlib.suppress(TimeoutError):
                    line = await asyncio.wait_for(
                        queue.get(), max(0.05, next_state - time.monotonic()))
                    await response.write(_sse("event", msgspec.json.encode(line)))
        except ConnectionResetError:
            pass  # the page was closed
        finally:
            self.listeners.discard(queue)
        return response

    async def report(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        run_id = name.removesuffix(".html")
        run = await self._own_run(request, run_id)
        path = report_file(self.out_dir, run.run_id)
        try:
            text = await asyncio.to_thread(path.read_text)
        except OSError:
            raise web.HTTPNotFound(text=f"no report for {run_id} yet") from None
        return web.Response(text=text, content_type="text/html",
                            headers={"Content-Security-Policy": _REPORT_CSP})

    async def comparison(self, request: web.Request) -> web.Response:
        run = await self._own_run(request, request.match_info["run_id"])
        try:
            text = await self.compare(run)
        except M27Error as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        return web.Response(text=text, content_type="text/html",
                            headers={"Content-Security-Policy": _CSP})

    async def _own_run(self, request: web.Request, run_id: str) -> RunRecord:
        if not is_valid_run_id(run_id):
            raise web.HTTPNotFound(text=f"not a run id: {run_id[:80]!r}")
        try:
            api = await self.locate("orchestrator")
            async with Client(api, access=self.access) as client:
                run = await client.get_run(run_id)
        except M27Error as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        problem = api_access.run_problem(request["who"], run.user, run_id, acting=False)
        if problem:
            raise web.HTTPForbidden(text=problem)
        return run

    # -------------------------------------------------------------- data

    async def state(self, who: Identity, hours: float,
                    points: int = board.POINTS_PER_GPU) -> board.State:
        now = time.time()
        problems: list[str] = []
        gpus = await self._gpu_curves(now, hours, points)
        waiting: list[board.Task] = []
        running: list[board.Task] = []
        try:
            async with SchedulerClient(await self.locate("scheduler"),
                                       access=self.access, timeout=5.0) as scheduler:
                waiting, running = board.tasks(await scheduler.queue())
        except M27Error as exc:
            problems.append(f"queue: {exc}")
        runs: list[board.Run] = []
        simulated = False
        try:
            async with Client(await self.locate("orchestrator"), access=self.access) as api:
                summaries, _ = await api.list_runs(
                    20, user="" if who.reads_everything else who.user)
                simulated = any(g.simulated for n in await api.list_nodes() for g in n.gpus)
            reported = {r.run_id for r in summaries
                        if report_file(self.out_dir, r.run_id).exists()}
            runs = board.runs(summaries, reported=reported)
        except M27Error as exc:
            problems.append(f"runs: {exc}")
        return board.State(now=now, hours=hours, simulated=simulated, gpus=gpus,
                           waiting=waiting, running=running, runs=runs,
                           events=list(self.recent)[-50:], problems=problems)

    async def _gpu_curves(self, now: float, hours: float,
                          points: int) -> list[board.GpuSeries]:
        """Every GPU over the window, read at most once per interval for all open pages
        (at 1,000 GPUs one read is most of a second of SQLite)."""
        key = (hours, points)
        async with self._gpus_lock:
            cached = self._gpus.get(key)
            if cached is not None and now - cached[0] < self.interval_s / 2:
                return cached[1]
            found = board.gpu_series(await asyncio.to_thread(
                self.history.gpu_history, now - hours * 3600.0, now, points))
            self._gpus = {k: v for k, v in self._gpus.items() if now - v[0] < self.interval_s}
            self._gpus[key] = (now, found)
            return found


def _sse(kind: str, data: bytes) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


_CSP: Final = ("default-src 'self'; script-src 'self' 'unsafe-inline'; "
               "style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
               "frame-ancestors 'none'")
_REPORT_CSP: Final = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                      "frame-ancestors 'none'")


def _login_page(note: str) -> web.Response:
    body = (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>m27 "
        f"dashboard</title><style>{CSS}</style></head><body><main><section><h1>m27 "
        "dashboard</h1><p>Paste an m27 API token (`m27 dashboard` prints a link that signs "
        "you in; `m27 api token create` makes one).</p>"
        + (f'<p class="reason">{html.escape(note)}</p>' if note else "")
        + '<form method="get" action="/"><input name="token" type="password" '
        'autocomplete="off" size="60" aria-label="token"> <button>Open</button></form>'
        "</section></main></body></html>")
    return web.Response(text=body, content_type="text/html", status=401,
                        headers={"Content-Security-Policy": _CSP})

