"""Prometheus for every service that exposes metrics (node-agent, scheduler): the text
exposition format 0.0.4, written by hand (no client library: a few families do not need
one), and a minimal HTTP/1.1 server that answers `GET /metrics`.

Rendering is pure: a service keeps its own numbers and turns them into families of
samples on each scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Literal

from m27.common.logging import get_logger

log = get_logger()

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT_S: Final = 10.0
MAX_REQUEST_BYTES: Final = 16 * 1024

Kind = Literal["counter", "gauge"]


def escape(value: str) -> str:
    """A label value as the exposition format wants it: backslash, quote, newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_labels(pairs: Mapping[str, str]) -> str:
    """`{a="1",b="2"}` in the given order; "" for no labels."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def number(value: float) -> str:
    """Integers without a fraction (what Prometheus and people expect of counts)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def sample(name: str, pairs: Mapping[str, str], value: float) -> str:
    return f"{name}{format_labels(pairs)} {number(value)}"


def render_families(families: Mapping[str, tuple[Kind, str]],
                    series: Mapping[str, Sequence[str]]) -> str:
    """HELP, TYPE and the samples of each family (name → (type, help)), in the families'
    order; a family without samples is left out."""
    lines: list[str] = []
    for name, (kind, text) in families.items():
        if series.get(name):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *series[name]]
    return "\n".join(lines) + "\n" if lines else ""


# ---------------------------------------------------------------- HTTP


def split_bind(bind: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces); ValueError otherwise."""
    host, sep, port = bind.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected host:port, got {bind!r}")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - ":port" means every one


def _response(status: str, body: bytes, content_type: str, head_only: bool) -> bytes:
    header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return header + (b"" if head_only else body)


class MetricsServer:
    """`GET /metrics` → 200 with `render()`'s text; any other path 404, other methods 405.
    One request per connection; slow or oversized requests are dropped."""

    def __init__(self, bind: str, render: Callable[[], str]) -> None:
        self._host, self._port = split_bind(bind)
        self._render = render
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Listen; the address it listens on as `host:port` (the real port for port 0)."""
        self._server = await asyncio.start_server(self._handle, self._host, self._port,
                                                  limit=MAX_REQUEST_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            try:
                answer = self._answer(await asyncio.wait_for(_read_request(reader),
                                                             REQUEST_TIMEOUT_S))
            except (ValueError, asyncio.LimitOverrunError):
                answer = _response("400 Bad Request", b"bad request\n",
                                   "text/plain; charset=utf-8", False)
            writer.write(answer)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that is too slow or goes away gets its connection closed
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _answer(self, request: tuple[str, str]) -> bytes:
        method, target = request
        path = target.split("?", 1)[0]
        text_type = "text/plain; charset=utf-8"
        if path != "/metrics":
            return _response("404 Not Found", b"not found; try /metrics\n", text_type,
                             method == "HEAD")
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"GET only\n", text_type, False)
        try:
            body = self._render().encode()
        except Exception as exc:  # a bug in rendering must not take the endpoint down
            log.exception("metrics.render_failed", error=str(exc))
            return _response("500 Internal Server Error", b"render failed\n", text_type,
                             method == "HEAD")
        return _response("200 OK", body, CONTENT_TYPE, method == "HEAD")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
    """The method and target of one request; its headers are read and ignored."""
    line = (await reader.readuntil(b"\r\n")).decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError("not an HTTP request")
    total = len(line)
    while (header := await reader.readuntil(b"\r\n")) != b"\r\n":
        total += len(header)
        if total > MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return parts[0], parts[1]
