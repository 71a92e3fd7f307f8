"""`m27 nodes`, `m27 top` and `m27 logs`: the cluster's nodes and GPUs, and step output.

Rendering is pure (lists of lines from `NodeStatus` values); the commands only fetch and
print. `m27 top` redraws in place on a terminal and prints one frame after another
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO, Final, TextIO

import msgspec

from m27.cli._common import Subparsers, add, print_json, with_client
from m27.cli._live import LiveView, lines
from m27.client import Client, ClientError, GpuStatus, LogChunk, NodeStatus, TaskShare
from m27.common.errors import M27Error
from m27.common.units import format_duration, parse_duration, parse_size

BACKENDS: Final[dict[str, str]] = {
    "simulated": "simulated (not real GPUs)",
    "nvml": "nvml",
    "none": "no GPUs",
}
NONE: Final = "—"
#: Cursor home, then after the frame: erase whatever an earlier, longer frame left below.


def add_commands(sub: Subparsers) -> None:
    nodes = add(sub, "nodes", "list the nodes: state, heartbeat, CPU slots, and every GPU "
                "with its utilization, memory, temperature, power and the tasks holding "
                "shares of it", cmd_nodes)
    nodes.add_argument("--json", action="store_true", help="machine-readable output")
    top = add(sub, "top", "the nodes view, refreshed live (Ctrl-C quits)", cmd_top)
    top.add_argument("--interval", default="2", metavar="SECONDS",
                     help="seconds between refreshes (default 2; 500ms, 5s also work)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    logs = add(sub, "logs", "print a step's output (stdout and stderr); -f follows it "
               "until the step ends", cmd_logs)
    logs.add_argument("run_id", metavar="RUN")
    logs.add_argument("step", metavar="STEP", nargs="?", default="",
                      help="the step (may be left out when the run has one step; "
                      "otherwise its steps are listed)")
    logs.add_argument("--attempt", type=int, default=0, metavar="N",
                      help="which attempt (default: the latest that ran)")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--stdout", action="store_true", help="only stdout")
    which.add_argument("--stderr", action="store_true", help="only stderr")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing new output until the step's attempt ends")
    logs.add_argument("--tail", default="0", metavar="BYTES",
                      help="start this many bytes before the end (e.g. 4096, 64KiB; "
                      "default: everything)")


# ---------------------------------------------------------------- rendering (pure)


def backend_label(backend: str) -> str:
    return BACKENDS.get(backend, backend)


def _age(seconds: float) -> str:
    return f"{format_duration(seconds)} ago"


def _memory(gpu: GpuStatus) -> str:
    return f"{gpu.memory_used_mb / 1024:.1f}/{gpu.memory_total_mb / 1024:.1f} GiB"


def _power(gpu: GpuStatus) -> str:
    if gpu.power_w is None:
        return NONE
    if gpu.power_limit_w is None:
        return f"{gpu.power_w:.0f} W"
    return f"{gpu.power_w:.0f}/{gpu.power_limit_w:.0f} W"


def _share(holding: TaskShare) -> str:
    paused = " paused" if holding.paused else ""
    return f"{holding.task_id}#{holding.attempt} ×{holding.share:g}{paused}"


def gpu_line(gpu: GpuStatus) -> str:
    index = f"{gpu.index}{' sim' if gpu.simulated else ''}"
    tasks = ", ".join(_share(h) for h in gpu.holdings) or NONE
    throttle = ",".join(gpu.throttle) or NONE
    return (f"    {index:<6} {gpu.utilization_pct:>4.0f}%  {_memory(gpu):<16} "
            f"{gpu.temperature_c:>4.0f}°C  {_power(gpu):<11} {throttle:<9} {tasks}")


GPU_HEADER: Final = (f"    {'GPU':<6} {'UTIL':>5}  {'MEMORY':<16} {'TEMP':>6}  {'POWER':<11} "
                     f"{'THROTTLE':<9} TASKS")


def platform_line(node: NodeStatus) -> str:
    """`    GPUs: 2 x NVIDIA A100-SXM4-80GB; driver 550.54.15, CUDA 12.4, NVML 12.550.54.15`
    (no versions where the node knows none: a simulated one), and what differs from most
    nodes, in capitals (m27.common.platform)."""
    models: dict[str, int] = {}
    for gpu in node.gpus:
        models[gpu.name] = models.get(gpu.name, 0) + 1
    kinds = ", ".join(f"{n} x {name}" for name, n in models.items())
    known = [(label, value) for label, value in (("driver", node.driver_version),
                                                 ("CUDA", node.cuda_version),
                                                 ("NVML", node.nvml_version))]
    versions = ("; " + ", ".join(f"{label} {value or 'unknown'}" for label, value in known)
                if any(value for _, value in known) else "")
    line = f"    GPUs: {kinds}{versions}"
    if node.platform_differences:
        line += f"  DIFFERS: {'; '.join(node.platform_differences)}"
    return line


def node_line(node: NodeStatus, width: int, maintenance: str = "") -> str:
    extras = [name for name, on in (("cgroups", node.cgroups), ("mps", node.mps)) if on]
    state = node.state.upper() if node.state == "lost" else node.state
    if maintenance:  # `m27 node cordon|drain`: no new work
        state = f"{state}/{maintenance}"
    cpu = f"{node.cpu_used}/{node.cpu_slots}"
    line = (f"{node.node_id:<{width}}  {state:<8}  {backend_label(node.backend):<26}  "
            f"{_age(node.heartbeat_age_s):<11}  {cpu:<7}  {' '.join(extras)}")
    return line.rstrip()


def render_nodes(nodes: Sequence[NodeStatus],
                 maintenance: Mapping[str, str] | None = None) -> list[str]:
    """`m27 nodes`: one line per node, then a line per GPU. `maintenance`: node →
    cordoned / draining."""
    marks = maintenance or {}
    if not nodes:
        return ["no nodes registered: start a node-agent (`m27 up` starts one)"]
    width = max(4, *(len(n.node_id) for n in nodes))
    state_width = max(8, *(len(n.state) + len(marks.get(n.node_id, "")) + 1
                           for n in nodes if n.node_id in marks)) if marks else 8
    lines = [f"{'NODE':<{width}}  {'STATE':<{state_width}}  {'BACKEND':<26}  {'HEARTBEAT':<11}  "
             f"{'CPU':<7}".rstrip()]
    for node in nodes:
        lines.append(node_line(node, width, marks.get(node.node_id, "")))
        if node.gpus:
            lines.append(platform_line(node))
            lines.append(GPU_HEADER)
            lines.extend(gpu_line(g) for g in node.gpus)
    return lines


def top_header(nodes: Sequence[NodeStatus], now: float, interval_s: float) -> str:
    gpus = [g for n in nodes for g in n.gpus]
    busy = sum(bool(g.holdings) for g in gpus)
    up = sum(n.state == "up" for n in nodes)
    stamp = time.strftime("%H:%M:%S", time.localtime(now))
    return (f"m27 top  {stamp}  nodes {up}/{len(nodes)} up  GPUs {busy}/{len(gpus)} busy  "
            f"(every {interval_s:g}s, Ctrl-C quits)")


def top_frame(nodes: Sequence[NodeStatus], now: float, interval_s: float) -> list[str]:
    return [top_header(nodes, now, interval_s), "", *render_nodes(nodes)]


def destination(chunk: LogChunk, asked: str) -> str:
    """Where `m27 logs` writes a chunk: stderr chunks go to stderr only when both streams
    were asked for; a single stream always goes to stdout."""
    return "stderr" if asked == "both" and chunk.stream == "stderr" else "stdout"


# ---------------------------------------------------------------- commands


def cmd_nodes(args: argparse.Namespace) -> int:
    from m27.cli._queue import maintenance_states

    nodes = with_client(args, lambda c: c.list_nodes())
    maintenance = maintenance_states(args)
    if args.json:
        print_json([{**msgspec.to_builtins(n), "maintenance": maintenance.get(n.node_id, "")}
                    for n in nodes])
    else:
        print("\n".join(render_nodes(nodes, maintenance)))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    try:
        interval = max(0.2, parse_duration(args.interval))
    except ValueError as exc:
        raise M27Error(f"--interval: {exc}") from exc
    if args.once:
        nodes = with_client(args, lambda c: c.list_nodes())
        print("\n".join(top_frame(nodes, time.time(), interval)))
        return 0
    try:
        return with_client(args, lambda c: _top(c, interval, sys.stdout))
    except KeyboardInterrupt:
        return 0


async def _top(client: Client, interval: float, out: TextIO) -> int:
    """Redrawn in place with rich on a terminal; one frame after another otherwise."""
    with LiveView(out) as view:
        while True:
            try:
                frame = top_frame(await client.list_nodes(), time.time(), interval)
            except ClientError as exc:  # keep watching: the API may come back
                frame = [f"m27 top  {time.strftime('%H:%M:%S')}", "", f"m27: {exc}"]
            if view.live:
                view.draw(lines(frame))
            else:
                out.write("\n".join(frame) + "\n\n")
                out.flush()
            await asyncio.sleep(interval)


def cmd_logs(args: argparse.Namespace) -> int:
    asked = "stderr" if args.stderr else "stdout" if args.stdout else "both"
    try:
        tail = parse_size(args.tail)
    except ValueError as exc:
        raise M27Error(f"--tail: {exc}") from exc
    if args.attempt < 0:
        raise M27Error(f"--attempt must be 1 or more, got {args.attempt}")
    outputs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}

    async def work(client: Client) -> int:
        step = args.step or await _only_step(client, args.run_id)
        async for chunk in client.stream_logs(args.run_id, step, attempt=args.attempt,
                                              stream=asked, follow=args.follow,
                                              tail_bytes=tail):
            _write(outputs[destination(chunk, asked)], chunk.data)
        return 0

    try:
        return with_client(args, work)
    except KeyboardInterrupt:  # how a follow is ended
        return 0
    except BrokenPipeError:  # `m27 logs … | head`
        _silence_stdout()
        return 0


async def _only_step(client: Client, run_id: str) -> str:
    """The step of a one-step run; for more, an error that names them."""
    names = [s.name for s in (await client.get_run(run_id)).steps]
    if len(names) == 1:
        return names[0]
    raise M27Error(f"which step of {run_id}? its steps: {', '.join(names)} "
                   f"(e.g. m27 logs {run_id} {names[0]})" if names else
                   f"run {run_id} has no steps")


def _write(out: BinaryIO, data: bytes) -> None:
    out.write(data)
    out.flush()


def _silence_stdout() -> None:
    """After a broken pipe, the interpreter's final flush of stdout must not fail too."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
