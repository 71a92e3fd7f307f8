"""What every `m27` subcommand shares: finding the API, calling it, reading files."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeAlias, TypeVar

import msgspec

from m27.client import Client
from m27.common.config import Config, load_config
from m27.common.errors import M27Error
from m27.common.units import parse_duration
from m27.embedded import system
from m27.embedded.nats_server import pid_alive

T = TypeVar("T")
MAX_FILE_BYTES: Final = 1024 * 1024
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class NotRunningError(M27Error):
    pass


def add(sub: Subparsers, name: str, text: str,
        handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=text, description=text)
    parser.set_defaults(handler=handler)
    return parser


def config(args: argparse.Namespace) -> Config:
    return load_config(Path(args.config) if args.config else None).config


def api_address(args: argparse.Namespace, cfg: Config) -> str:
    """--api, $M27_API, [client] api, else the embedded system of this $M27_HOME."""
    explicit = args.api or os.environ.get("M27_API") or cfg.client.api
    if explicit:
        return str(explicit)
    home = args.home
    state = system.read_state(home)
    if state is None:
        raise NotRunningError(f"nothing is running under {home}: start the system with "
                              "`m27 up`, or pass --api HOST:PORT / set $M27_API")
    down = [s.name for s in system.statuses(state) if not s.alive]
    if "orchestrator" in down or "nats-server" in down:
        raise NotRunningError(f"the system is only partly running ({', '.join(down)} "
                              "stopped): run `m27 up` to restart it")
    return state.api


def service_address(explicit: str | None, environ: Mapping[str, str], home: Path, *,
                    variable: str, process: str, flag: str) -> str:
    """The `flag` given, else $`variable`, else the gRPC address of the embedded system's
    `process` — with an error that says how to start it when it is not running."""
    if explicit or environ.get(variable):
        return str(explicit or environ[variable])
    state = system.read_state(home)
    if state is None:
        raise M27Error(f"nothing is running under {home}: start the system with `m27 up`, "
                       f"or pass {flag} HOST:PORT / set ${variable}")
    proc = next((p for p in state.processes if p.name == process), None)
    if proc is None or not proc.grpc_address or not pid_alive(proc.pid):
        raise M27Error(f"the embedded {process} is not running: run `m27 up` to restart it")
    return proc.grpc_address


def with_client(args: argparse.Namespace, work: Callable[[Client], Awaitable[T]]) -> T:
    address = api_address(args, config(args))

    async def run() -> T:
        async with Client(address) as client:
            return await work(client)

    return asyncio.run(run())


def parse_vars(pairs: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise M27Error(f"--var expects NAME=VALUE, got {pair!r}")
        result[name] = value
    return result


def parse_secrets(items: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`--secret NAME` (the value of the environment variable NAME: nothing in the shell's
    history or the process list) or `--secret NAME=VALUE`."""
    result: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name:
            raise M27Error(f"--secret expects NAME or NAME=VALUE, got {item!r}")
        if not sep:
            if name not in environ:
                raise M27Error(f"--secret {name}: the environment variable {name} is not set "
                               f"(export it first, or give --secret {name}=VALUE)")
            value = environ[name]
        result[name] = value
    return result


def read_pipeline(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise M27Error(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise M27Error(f"{path}: no such file") from exc
    except UnicodeDecodeError as exc:
        raise M27Error(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except IsADirectoryError as exc:
        raise M27Error(f"{path}: is a directory, not a pipeline file") from exc
    except OSError as exc:
        raise M27Error(f"{path}: {exc.strerror}") from exc


def parse_since(text: str, now: float) -> float:
    """`2h` / `3d` (that long ago) or a date `2026-12-01` / `2026-12-01T08:00` (local)."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    for fmt in ("%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S"):
        try:
            return time.mktime(time.strptime(text, fmt))
        except ValueError:
            continue
    raise M27Error(f"--since expects a duration such as 2h or a date such as 2026-12-01, "
                   f"got {text!r}")


def print_json(data: Any) -> None:
    print(json.dumps(msgspec.to_builtins(data), indent=2))


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "—"

