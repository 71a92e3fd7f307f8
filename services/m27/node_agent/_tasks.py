"""What running one step means, as pure functions: where its files go, the environment it
gets, whether it may start here, and how its end is described.

The agent's shell (`service`, `_runner`, `_process`) applies these; tests drive them directly.
"""

from __future__ import annotations

import math
import os
import signal as signals
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from m27.common.errors import M27Error
from m27.common.events import StartTask, TaskExited
from m27.common.ids import is_valid_name
from m27.common.model import (
    CHECKPOINT_SIGNALS,
    NO_CHECKPOINT_SIGNAL,
    ExitCause,
    GpuBackend,
    GpuInfo,
    per_gpu_share,
)
from m27.common.paths import run_dir
from m27.node_agent._gpus import gpu_memory_mb
from m27.node_agent._isolation import memory_fraction, mps_env, nccl_env

STDOUT_TAIL_BYTES: Final = 2 * 1024
STDERR_TAIL_BYTES: Final = 4 * 1024
#: Exit code reported when the process could not be started at all (as the shell does).
NOT_STARTED_EXIT_CODE: Final = 127

#: Set only when they apply: a value inherited from the agent's environment would mislead.
OPTIONAL_VARS: Final = ("M27_CHECKPOINT_INTERVAL", "M27_CHECKPOINT_STORE")


class CannotStart(M27Error):
    """The task's process could not be started; the message says why."""


@dataclass(frozen=True, slots=True)
class TaskPaths:
    """Where a task runs and writes: all under its run's directory unless a workdir is given."""

    workdir: Path
    default_workdir: bool  # True: the run's scratch dir, created by the agent
    stdout: Path
    stderr: Path
    checkpoint_dir: Path
    phase_file: Path  # the training library writes "io" / "compute" here
    metrics_file: Path  # `m27.train.log` (or the program) writes metric lines here


@dataclass(frozen=True, slots=True)
class NodeContext:
    """Facts about this node that every task's environment carries."""

    node_id: str
    backend: GpuBackend
    gpus: tuple[GpuInfo, ...]
    home: Path
    python: str
    checkpoint_store: str | None = None
    mps: bool = False  # a CUDA MPS daemon runs: shares are enforced through it
    # A step's API credentials (its own step token; `api_auth.step_env`), by task, attempt.
    api_env: Callable[[str, int], Mapping[str, str]] | None = None


def task_paths(home: Path, cmd: StartTask) -> TaskPaths:
    """Logs `<run>/logs/<step>.<attempt>.out|err`, checkpoints `<run>/checkpoints/<step>`,
    phase reports `<run>/phases/<step>.<attempt>`, metrics
    `<run>/metrics/<step>.<attempt>.jsonl`.

    A relative `workdir` is taken relative to the run's scratch dir `<run>/work`.
    """
    run = run_dir(home, cmd.run_id)
    scratch = run / "work"
    workdir = scratch
    if cmd.workdir:
        given = Path(cmd.workdir).expanduser()
        workdir = given if given.is_absolute() else scratch / given
    logs = run / "logs"
    return TaskPaths(
        workdir=workdir,
        default_workdir=not cmd.workdir,
        stdout=logs / f"{cmd.step}.{cmd.attempt}.out",
        stderr=logs / f"{cmd.step}.{cmd.attempt}.err",
        checkpoint_dir=run / "checkpoints" / cmd.step,
        phase_file=run / "phases" / f"{cmd.step}.{cmd.attempt}",
        metrics_file=run / "metrics" / f"{cmd.step}.{cmd.attempt}.jsonl",
    )


def invalid_ids(cmd: StartTask) -> str | None:
    """Why a command's ids cannot name subjects and paths, or None when they can."""
    if not is_valid_name(cmd.run_id):
        return f"invalid run id {cmd.run_id!r}"
    if not is_valid_name(cmd.step):
        return f"invalid step name {cmd.step!r}"
    if cmd.attempt < 0:
        return f"invalid attempt {cmd.attempt}"
    return None


def timeout_of(cmd: StartTask) -> float | None:
    """The seconds after which the agent stops the task, or None: no (usable) timeout."""
    limit = cmd.timeout_s
    if limit is None or not math.isfinite(limit) or limit <= 0:
        return None  # the pipeline allows only > 0; anything else must not kill at once
    return limit


def placement_problem(cmd: StartTask, gpus: Sequence[GpuInfo]) -> str | None:
    """Why this node cannot run the task on the GPUs it names, or None when it can."""
    have = {g.index for g in gpus}
    missing = sorted(set(cmd.gpu_ids) - have)
    if missing:
        listed = ", ".join(str(i) for i in sorted(have)) or "none"
        return f"GPU {', '.join(map(str, missing))} not on this node (it has: {listed})"
    if len(set(cmd.gpu_ids)) != len(cmd.gpu_ids):
        return f"GPU ids repeat: {cmd.gpu_ids}"
    return None


#: What a step gets of the agent's environment: enough to find programs, libraries and
#: the locale, and the proxies and GPU settings of the machine; never the agent's own
#: credentials or configuration (`[node] pass_env` adds names). Prefixes end in `*`.
STEP_ENV: Final = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
    "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "HTTP_PROXY", "HTTPS_PROXY",
    "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "LC_*", "XDG_*", "NVIDIA_*",
    "OMP_*", "MKL_*",
)


def shell_command(cmd: StartTask) -> str:
    """What `/bin/sh -c` runs: the step's command, after a trap that keeps the shell alive
    through the step's checkpoint signal. The agent signals the whole process group, and
    dash (Debian's /bin/sh) does not exec even a single command, so without it the first
    checkpoint request kills the shell (the step "exits" with 128 + the signal) while the
    program it started goes on. A caught signal is reset to its default in the programs
    the shell starts, so they see it exactly as if it had exec'd them; a `trap` of the
    command's own overrides this one."""
    name = cmd.checkpoint_signal
    if name == NO_CHECKPOINT_SIGNAL or name not in CHECKPOINT_SIGNALS:
        return cmd.command
    return f"trap : {name.removeprefix('SIG')}; {cmd.command}"


def passed_env(base: Mapping[str, str], extra: str = "") -> dict[str, str]:
    """The part of `base` a step may see: STEP_ENV and the comma-separated `extra`
    (`[node] pass_env`), each a name or a prefix ending in `*`."""
    patterns = [*STEP_ENV, *(p.strip() for p in extra.split(",") if p.strip())]
    names = {p for p in patterns if not p.endswith("*")}
    prefixes = tuple(p[:-1] for p in patterns if p.endswith("*"))
    return {k: v for k, v in base.items() if k in names or (prefixes and k.startswith(prefixes))}


def task_env(base: Mapping[str, str], cmd: StartTask, node: NodeContext,
             paths: TaskPaths, secrets: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (what the agent passes on: `passed_env`), then the step's `env` and its
    `secrets` (read from m27_secrets), then the M27_* placement variables.

    CUDA_VISIBLE_DEVICES lists the task's GPUs ("" for CPU tasks, which hides every GPU);
    CUDA_DEVICE_ORDER=PCI_BUS_ID makes CUDA number GPUs the way NVML (and the scheduler)
    does.
    """
    env = dict(base)
    env.update(cmd.env)
    env.update(secrets or {})
    for name in OPTIONAL_VARS:
        env.pop(name, None)
    gpu_ids = ",".join(str(i) for i in cmd.gpu_ids)
    share = per_gpu_share(cmd.gpu_ids, cmd.gpu_share)
    env.update({
        "M27_RUN_ID": cmd.run_id,
        "M27_STEP": cmd.step,
        "M27_TASK_ID": cmd.task_id,
        "M27_ATTEMPT": str(cmd.attempt),
        "M27_NODE_ID": node.node_id,
        "M27_GPU_IDS": gpu_ids,
        "M27_GPU_SHARE": f"{share:g}",
        "M27_GPU_BACKEND": node.backend if cmd.gpu_ids else "none",
        "M27_GPU_MEMORY_MB": str(gpu_memory_mb(node.gpus, cmd.gpu_ids, share,
                                               cmd.gpu_memory_mb)),
        "M27_CHECKPOINT_DIR": str(paths.checkpoint_dir),
        "M27_PYTHON": node.python,
        "M27_HOME": str(node.home),
        "CUDA_VISIBLE_DEVICES": gpu_ids,
    })
    memory_mb = gpu_memory_mb(node.gpus, cmd.gpu_ids, share, cmd.gpu_memory_mb)
    if cmd.gpu_ids:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        total = min((g.memory_total_mb for g in node.gpus if g.index in cmd.gpu_ids),
                    default=0)
        env["M27_GPU_MEMORY_FRACTION"] = f"{memory_fraction(share, memory_mb, total):.4g}"
        env.update(nccl_env(cmd.gpu_ids, cmd.env))
        if node.mps:
            env.update(mps_env(share, memory_mb, len(cmd.gpu_ids)))
    env["M27_PHASE_FILE"] = str(paths.phase_file)
    env["M27_METRICS_FILE"] = str(paths.metrics_file)
    env["M27_CHECKPOINT_SIGNAL"] = cmd.checkpoint_signal
    if cmd.checkpoint_interval_s is not None:
        env["M27_CHECKPOINT_INTERVAL"] = f"{cmd.checkpoint_interval_s:g}"
    if node.checkpoint_store:
        env["M27_CHECKPOINT_STORE"] = node.checkpoint_store
    if node.api_env is not None:
        env.update(node.api_env(cmd.task_id, cmd.attempt))
    return env


# ---------------------------------------------------------------- how a task ended


def exit_status(returncode: int) -> tuple[int, int | None]:
    """(exit code, signal) from a returncode: killed by signal N reads 128+N, like a shell."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_reason(exit_code: int, signal: int | None, stop_note: str | None = None,
                killed_after_s: float | None = None) -> str:
    """`exit code 3`, `killed by SIGTERM: stopped: <why>`, ... for logs and `m27 status`.

    `killed_after_s`: the group outlived its SIGTERM grace and was SIGKILLed.
    """
    base = f"killed by {signal_name(signal)}" if signal is not None else f"exit code {exit_code}"
    if stop_note:
        base = f"{base}: {stop_note}"
    if killed_after_s is not None:
        base = f"{base} (SIGKILL after {killed_after_s:g}s grace)"
    return base


def stop_note(reason: str) -> str:
    """What a StopTask's reason becomes in the exit reason."""
    return f"stopped: {reason}" if reason else "stopped"


@dataclass(frozen=True, slots=True)
class StopRequest:
    """Why the agent stops a task. Only the first one counts: it is what the exit reports."""

    cause: ExitCause
    note: str


def stop_requested(reason: str, cause: ExitCause = "stopped") -> StopRequest:
    """A StopTask: the scheduler cancels ("stopped") or preempts/drains ("preempted")."""
    return StopRequest(cause, stop_note(reason))


def superseded_by(attempt: int) -> StopRequest:
    return StopRequest("superseded", f"superseded by attempt {attempt}")


def timed_out(timeout_s: float) -> StopRequest:
    return StopRequest("timeout", f"timed out after {timeout_s:g}s")


def node_stopping(note: str) -> StopRequest:
    return StopRequest("node_stopped", note)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a started task's end is reported (the TaskExited fields the agent decides)."""

    exit_code: int
    signal: int | None
    cause: ExitCause
    reason: str
    check_outputs: bool  # only a program that ended by itself with 0 vouches for its outputs


def ending(returncode: int, stop: StopRequest | None,
           killed_after_s: float | None = None) -> Ending:
    """The end of a task whose main process returned `returncode`, stopped by `stop` if set.

    A stopped task keeps its stop's cause even if it then exits 0 by itself: it did not
    run to its end.
    """
    exit_code, sig = exit_status(returncode)
    cause: ExitCause = stop.cause if stop is not None else "exit"
    reason = exit_reason(exit_code, sig, stop.note if stop is not None else None,
                         killed_after_s)
    return Ending(exit_code=exit_code, signal=sig, cause=cause, reason=reason,
                  check_outputs=exit_code == 0 and cause == "exit")


def not_started_exit(cmd: StartTask, node_id: str, paths: TaskPaths, why: str,
                     now: float) -> TaskExited:
    """The TaskExited of a task that could not be started at all."""
    return TaskExited(
        at=now, task_id=cmd.task_id, run_id=cmd.run_id, step=cmd.step, attempt=cmd.attempt,
        node_id=node_id, exit_code=NOT_STARTED_EXIT_CODE, started=False,
        stdout_path=str(paths.stdout), stderr_path=str(paths.stderr),
        reason=f"could not start: {why}", cause="not_started",
    )


def output_path(workdir: Path, output: str) -> str:
    """Where a declared output is: an absolute path as given, a relative one under the
    task's workdir (its cwd). Joined as text, not normalised: `..` and a trailing `/`
    (a directory) mean to the OS what they meant to the task."""
    return os.path.join(workdir, output)  # joining an absolute path yields that path


def decode_tail(data: bytes, truncated: bool) -> str:
    """Lenient UTF-8; a tail cut inside a character loses that character, not the line."""
    if truncated:
        skip = 0
        while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
            skip += 1
        data = data[skip:]
    return data.decode("utf-8", "replace")

