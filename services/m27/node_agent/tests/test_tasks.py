"""A task's paths, environment, admission checks and how its end is described."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from m27.common.api_auth import ephemeral_keys, step_env
from m27.common.config import ApiSection
from m27.common.events import StartTask
from m27.common.model import GpuInfo
from m27.node_agent._process import read_tail
from m27.node_agent._tasks import (
    NodeContext,
    decode_tail,
    exit_reason,
    exit_status,
    invalid_ids,
    passed_env,
    placement_problem,
    shell_command,
    stop_note,
    task_env,
    task_paths,
)

HOME = Path("/data/m27")
RUN = "r-20250101-120000-abcdef"
GPUS = tuple(GpuInfo(index=i, name="m27 simulated GPU", uuid=f"SIM-n1-{i}",
                     memory_total_mb=16384, simulated=True) for i in range(2))
NODE = NodeContext(node_id="n1", backend="simulated", gpus=GPUS, home=HOME,
                   python="/venv/bin/python")


def start(**changes: Any) -> StartTask:
    fields: dict[str, Any] = {
        "at": 1.0, "task_id": f"{RUN}/train", "run_id": RUN, "step": "train", "attempt": 2,
        "step_type": "gpu", "command": "true", "gpu_ids": (1,), "gpu_share": 0.5,
    }
    fields.update(changes)
    return StartTask(**fields)


def test_paths_live_under_the_run_directory() -> None:
    paths = task_paths(HOME, start())
    run = HOME / "runs" / RUN
    assert paths.workdir == run / "work"
    assert paths.default_workdir
    assert paths.stdout == run / "logs" / "train.2.out"
    assert paths.stderr == run / "logs" / "train.2.err"
    assert paths.checkpoint_dir == run / "checkpoints" / "train"


@pytest.mark.parametrize(("workdir", "expected"), [
    ("/srv/exp", Path("/srv/exp")),
    ("sub/dir", HOME / "runs" / RUN / "work" / "sub" / "dir"),
])
def test_a_given_workdir_is_used_and_not_created(workdir: str, expected: Path) -> None:
    paths = task_paths(HOME, start(workdir=workdir))
    assert paths.workdir == expected
    assert not paths.default_workdir


@pytest.mark.parametrize(("changes", "problem"), [
    ({}, None),
    ({"run_id": "../../etc"}, "invalid run id"),
    ({"run_id": "a.b"}, "invalid run id"),
    ({"step": "a/b"}, "invalid step name"),
    ({"step": ""}, "invalid step name"),
    ({"attempt": -1}, "invalid attempt"),
])
def test_ids_that_would_escape_paths_or_subjects_are_refused(changes: dict[str, Any],
                                                             problem: str | None) -> None:
    found = invalid_ids(start(**changes))
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


@pytest.mark.parametrize(("gpu_ids", "problem"), [
    ((), None), ((0,), None), ((0, 1), None),
    ((2,), "GPU 2 not on this node (it has: 0, 1)"),
    ((0, 0), "repeat"),
])
def test_placement_must_name_gpus_of_this_node(gpu_ids: tuple[int, ...],
                                               problem: str | None) -> None:
    found = placement_problem(start(gpu_ids=gpu_ids), GPUS)
    assert found == problem if problem is None else problem in (found or "")


def test_placement_on_a_node_without_gpus() -> None:
    assert placement_problem(start(gpu_ids=(0,)), ()) == "GPU 0 not on this node (it has: none)"


def env_for(cmd: StartTask, base: dict[str, str] | None = None,
            node: NodeContext = NODE) -> dict[str, str]:
    return task_env(base or {"PATH": "/usr/bin"}, cmd, node, task_paths(HOME, cmd))


def test_gpu_task_env_names_its_placement() -> None:
    env = env_for(start(gpu_ids=(1,), gpu_share=0.5, checkpoint_interval_s=300.0))
    assert env["PATH"] == "/usr/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    expected = {
        "M27_RUN_ID": RUN, "M27_STEP": "train", "M27_TASK_ID": f"{RUN}/train",
        "M27_ATTEMPT": "2", "M27_NODE_ID": "n1", "M27_GPU_IDS": "1", "M27_GPU_SHARE": "0.5",
        "M27_GPU_BACKEND": "simulated", "M27_GPU_MEMORY_MB": "8192",
        "M27_CHECKPOINT_DIR": str(HOME / "runs" / RUN / "checkpoints" / "train"),
        "M27_CHECKPOINT_INTERVAL": "300", "M27_PYTHON": "/venv/bin/python",
        "M27_HOME": str(HOME),
    }
    assert {k: env[k] for k in expected} == expected
    assert "M27_CHECKPOINT_STORE" not in env


def test_cpu_task_env_hides_every_gpu() -> None:
    env = env_for(start(step_type="cpu", gpu_ids=(), gpu_share=0.0))
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["M27_GPU_IDS"] == ""
    assert env["M27_GPU_BACKEND"] == "none"
    assert env["M27_GPU_MEMORY_MB"] == "0"
    assert env["M27_GPU_SHARE"] == "0"
    assert "CUDA_DEVICE_ORDER" not in env


def test_whole_gpus_and_explicit_memory() -> None:
    env = env_for(start(gpu_ids=(0, 1), gpu_share=2.0, gpu_memory_mb=4000))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["M27_GPU_IDS"] == "0,1"
    assert env["M27_GPU_SHARE"] == "1"
    assert env["M27_GPU_MEMORY_MB"] == "4000"


def test_step_env_is_kept_but_cannot_override_the_placement() -> None:
    env = env_for(start(env={"SEED": "7", "CUDA_VISIBLE_DEVICES": "0,1",
                             "M27_NODE_ID": "elsewhere"}))
    assert env["SEED"] == "7"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["M27_NODE_ID"] == "n1"


def test_inherited_optional_vars_are_dropped_and_the_store_address_is_set() -> None:
    base = {"M27_CHECKPOINT_INTERVAL": "1", "M27_CHECKPOINT_STORE": "stale:1"}
    assert "M27_CHECKPOINT_STORE" not in env_for(start(), base)
    assert "M27_CHECKPOINT_INTERVAL" not in env_for(start(), base)
    node = NodeContext(node_id="n1", backend="nvml", gpus=GPUS, home=HOME, python="py",
                       checkpoint_store="10.0.0.5:4100")
    env = env_for(start(), base, node)
    assert env["M27_CHECKPOINT_STORE"] == "10.0.0.5:4100"
    assert env["M27_GPU_BACKEND"] == "nvml"


@pytest.mark.parametrize(("returncode", "expected"), [
    (0, (0, None)), (3, (3, None)), (143, (143, None)), (-15, (143, 15)), (-9, (137, 9)),
])
def test_exit_status_follows_the_shell(returncode: int,
                                       expected: tuple[int, int | None]) -> None:
    assert exit_status(returncode) == expected


@pytest.mark.parametrize(("args", "expected"), [
    ((0, None), "exit code 0"),
    ((3, None), "exit code 3"),
    ((143, 15, "stopped: preempted"), "killed by SIGTERM: stopped: preempted"),
    ((137, 9, "node agent stopped", 10.0),
     "killed by SIGKILL: node agent stopped (SIGKILL after 10s grace)"),
    ((0, None, "stopped"), "exit code 0: stopped"),
    ((128 + 77, 77), "killed by signal 77"),
])
def test_exit_reason(args: tuple[Any, ...], expected: str) -> None:
    assert exit_reason(*args) == expected


def test_stop_note() -> None:
    assert stop_note("") == "stopped"
    assert stop_note("preempted by r-x/train") == "stopped: preempted by r-x/train"


@pytest.mark.parametrize(("data", "truncated", "expected"), [
    (b"hello\n", False, "hello\n"),
    ("é…".encode()[1:], True, "…"),  # cut inside "é": that character is dropped
    (b"\xff\xfeok", False, "\ufffd\ufffdok"),
    (b"\x80\x80\x80\x80x", True, "\ufffdx"),  # at most 3 continuation bytes are skipped
    (b"", True, ""),
])
def test_decode_tail_is_lenient(data: bytes, truncated: bool, expected: str) -> None:
    assert decode_tail(data, truncated) == expected


def test_read_tail_reads_only_the_end(tmp_path: Path) -> None:
    log = tmp_path / "x.err"
    log.write_bytes(b"a" * 10_000 + "the end ✓\n".encode())
    tail = read_tail(log, 64)
    assert tail.endswith("the end ✓\n")
    assert len(tail.encode()) <= 64
    assert read_tail(tmp_path / "missing", 64) == ""


def test_a_step_gets_a_minimal_environment_not_the_agents_secrets() -> None:
    agent = {"PATH": "/usr/bin", "HOME": "/home/lab", "LANG": "C.UTF-8", "LC_ALL": "C",
             "HTTPS_PROXY": "http://proxy:3128", "NVIDIA_DRIVER_CAPABILITIES": "compute",
             "AWS_SECRET_ACCESS_KEY": "s3cr3t", "M27_NATS_CREDS": "/etc/m27/agent.creds",
             "GITHUB_TOKEN": "ghp_x", "WANDB_API_KEY": "w", "WANDB_PROJECT": "p",
             "SLURM_JOB_ID": "1"}
    passed = passed_env(agent)
    assert sorted(passed) == ["HOME", "HTTPS_PROXY", "LANG", "LC_ALL",
                              "NVIDIA_DRIVER_CAPABILITIES", "PATH"]
    more = passed_env(agent, "WANDB_*, SLURM_JOB_ID")
    assert {"WANDB_API_KEY", "WANDB_PROJECT", "SLURM_JOB_ID"} <= set(more)
    assert "AWS_SECRET_ACCESS_KEY" not in more
    env = env_for(start(gpu_ids=(0,), env={"M27_NODE_ID": "forged", "MINE": "1"}), passed)
    assert env["M27_NODE_ID"] == NODE.node_id  # placement variables win over the step's
    assert env["MINE"] == "1"
    assert "GITHUB_TOKEN" not in env


def test_a_step_gets_its_own_api_token_never_the_agents() -> None:
    """The agent's own token and key files stay with it; the step gets the one its node
    signs for this task attempt (`api_auth.step_env`)."""
    keys = ephemeral_keys()
    node = replace(NODE, api_env=lambda task, attempt: step_env(
        keys, ApiSection(tls_ca="/etc/m27/ca.pem"), task, attempt))
    agent = passed_env({"PATH": "/usr/bin", "M27_TOKEN": "the-agents",
                        "M27_API_KEY_FILE": "/etc/m27/control.key"})
    cmd = start(env={"M27_TOKEN": "forged by the pipeline"})
    env = task_env(agent, cmd, node, task_paths(HOME, cmd))
    who = keys.identify(env["M27_TOKEN"], now=2.0)
    assert (who.role, who.task_id, who.attempt) == ("step", cmd.task_id, cmd.attempt)
    assert env["M27_API_TLS_CA"] == "/etc/m27/ca.pem"
    assert "M27_API_KEY_FILE" not in env


@pytest.mark.parametrize(("signal_name", "expected"), [
    ("SIGUSR1", "trap : USR1; python train.py"),
    ("SIGHUP", "trap : HUP; python train.py"),
    ("none", "python train.py"),  # never signalled: nothing to live through
    ("SIGKILL", "python train.py"),  # not a checkpoint signal the language allows
])
def test_the_shell_lives_through_the_checkpoint_signal(signal_name: str,
                                                       expected: str) -> None:
    assert shell_command(start(command="python train.py",
                               checkpoint_signal=signal_name)) == expected
