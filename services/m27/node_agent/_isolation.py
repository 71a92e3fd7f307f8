"""What a node can enforce for a task's share, found out once at start and said out loud.

- CPU and memory: cgroup v2, when the agent may create child cgroups with the `cpu` and
  `memory` controllers (`cpu.max`, `memory.max` per task). Otherwise nothing is enforced and
  the agent says so at start.
- GPU: nothing in software enforces a share of a GPU except MIG (hardware partitions, not
  managed by m27 yet). With a CUDA MPS daemon running, a task gets
  `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (its share of the SMs) and
  `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (its memory) — MPS enforces those. Without MPS, the
  memory limit is handed to torch programs (`M27_GPU_MEMORY_FRACTION`, applied by
  `m27.train.apply_gpu_limits`) and watched through per-process GPU memory.
See docs/isolation.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from m27.common.logging import get_logger

log = get_logger()

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
CPU_PERIOD_US: Final = 100_000
# Where the MPS control daemon puts its pipes unless CUDA_MPS_PIPE_DIRECTORY says otherwise.
MPS_DEFAULT_PIPES: Final = Path("/tmp/nvidia-mps")  # noqa: S108 - NVIDIA's fixed default
#: Sane settings for multi-GPU steps unless the step's env says otherwise.
NCCL_DEFAULTS: Final = {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@dataclass(frozen=True)
class Cgroups:
    """Where task cgroups go, or why there are none."""

    base: Path | None
    reason: str  # why not, or what is enforced

    @property
    def enabled(self) -> bool:
        return self.base is not None


def own_cgroup(proc_self_cgroup: str) -> str | None:
    """The cgroup v2 path of this process (`0::/path` in /proc/self/cgroup)."""
    for line in proc_self_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def detect_cgroups(node_id: str, root: Path = CGROUP_ROOT,
                   proc_self_cgroup: str | None = None) -> Cgroups:
    """A writable cgroup v2 subtree with cpu and memory controllers for this node's tasks."""
    if proc_self_cgroup is None:
        try:
            proc_self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return Cgroups(None, "cannot read /proc/self/cgroup")
    if not (root / "cgroup.controllers").is_file():
        return Cgroups(None, f"{root} is not a cgroup v2 hierarchy (cgroup v1 or hybrid)")
    controllers = set((root / "cgroup.controllers").read_text().split())
    if not {"cpu", "memory"} <= controllers:
        return Cgroups(None, f"the cpu and memory controllers are not available in {root}")
    base = root / f"m27-{node_id}"
    try:
        base.mkdir(exist_ok=True)
        (root / "cgroup.subtree_control").write_text("+cpu +memory")
    except OSError as exc:
        return Cgroups(None, f"cannot create cgroups under {root}: {exc.strerror}")
    return Cgroups(base, f"CPU and memory limits enforced through cgroup v2 at {base}")


def cgroup_limits(cpus: int, memory_mb: int) -> dict[str, str]:
    """The cgroup files a task's resources turn into (pure)."""
    limits = {"cpu.max": f"{cpus * CPU_PERIOD_US} {CPU_PERIOD_US}"}
    if memory_mb > 0:
        limits["memory.max"] = str(memory_mb * 1024 * 1024)
    return limits


def place_in_cgroup(cgroups: Cgroups, name: str, pid: int, cpus: int,
                    memory_mb: int) -> Path | None:
    """Create the task's cgroup, write its limits and move the task into it."""
    if cgroups.base is None:
        return None
    group = cgroups.base / name
    group.mkdir(exist_ok=True)
    for file, value in cgroup_limits(cpus, memory_mb).items():
        (group / file).write_text(value)
    (group / "cgroup.procs").write_text(str(pid))
    return group


def remove_cgroup(group: Path | None) -> None:
    if group is not None:
        with contextlib.suppress(OSError):  # still busy for a moment: left for later
            group.rmdir()


def mps_running(environ: Mapping[str, str]) -> bool:
    """A CUDA MPS control daemon is listening (its pipe directory has a control pipe)."""
    pipes = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPES)
    return (pipes / "control").exists()


def mps_env(share: float, memory_mb: int, gpu_count: int) -> dict[str, str]:
    """What MPS enforces for a task: its share of the SMs and its memory on each of its
    GPUs (devices numbered as the task sees them, 0..n-1)."""
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, round(share * 100)))}
    if memory_mb > 0 and gpu_count:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{i}={memory_mb}M" for i in range(gpu_count))
    return env


def nccl_env(gpu_ids: Sequence[int], step_env: Mapping[str, str],
             defaults: Mapping[str, str] = NCCL_DEFAULTS) -> dict[str, str]:
    """NCCL defaults for a step on several GPUs; the step's own settings win."""
    if len(gpu_ids) < 2:
        return {}
    return {k: v for k, v in defaults.items() if k not in step_env}


def memory_fraction(share: float, memory_mb: int, total_mb: int) -> float:
    """The fraction of each GPU's memory a torch program may use (its limit / the GPU's)."""
    if memory_mb > 0 and total_mb > 0:
        return max(0.01, min(1.0, memory_mb / total_mb))
    return max(0.01, min(1.0, share))


def cgroup_name(task_id: str, attempt: int) -> str:
    return f"{task_id.replace('/', '.')}.{attempt}"


def confine(cgroups: Cgroups, task_id: str, attempt: int, pid: int, cpus: int,
            memory_mb: int) -> Path | None:
    """The task's CPU and memory limits, where the node can enforce them (cgroup v2): its
    cgroup, or None when nothing is enforced (said in the log)."""
    if not cgroups.enabled:
        return None
    try:
        return place_in_cgroup(cgroups, cgroup_name(task_id, attempt), pid, cpus, memory_mb)
    except OSError as exc:
        log.warning("task.cgroup_failed", error=str(exc), detail="limits not enforced")
        return None
