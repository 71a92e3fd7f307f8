"""What a node can enforce (cgroup v2, MPS), the variables a task gets for it, and the
lease that fences a node's tasks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m27.node_agent._isolation import (
    cgroup_limits,
    detect_cgroups,
    memory_fraction,
    mps_env,
    mps_running,
    nccl_env,
    own_cgroup,
    place_in_cgroup,
)
from m27.node_agent._lease import GUARD_SCRIPT, Lease, read_lease_file


def test_cgroup_v1_or_missing_controllers_mean_not_enforced(tmp_path: Path) -> None:
    no_v2 = detect_cgroups("n1", root=tmp_path, proc_self_cgroup="0::/\n")
    assert not no_v2.enabled
    assert "not a cgroup v2 hierarchy" in no_v2.reason
    (tmp_path / "cgroup.controllers").write_text("io pids\n")
    no_cpu = detect_cgroups("n1", root=tmp_path, proc_self_cgroup="0::/\n")
    assert "cpu and memory controllers are not available" in no_cpu.reason


def test_a_delegated_v2_tree_gets_task_cgroups_with_limits(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory io\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    found = detect_cgroups("n1", root=tmp_path, proc_self_cgroup="0::/\n")
    assert found.enabled
    assert found.base == tmp_path / "m27-n1"
    group = place_in_cgroup(found, "r.step.1", 4242, cpus=2, memory_mb=512)
    assert group is not None
    assert (group / "cpu.max").read_text() == "200000 100000"
    assert (group / "memory.max").read_text() == str(512 * 1024 * 1024)
    assert (group / "cgroup.procs").read_text() == "4242"


@pytest.mark.parametrize(("cpus", "memory", "expected"), [
    (1, 0, {"cpu.max": "100000 100000"}),
    (4, 1024, {"cpu.max": "400000 100000", "memory.max": str(1 << 30)}),
])
def test_cgroup_limits(cpus: int, memory: int, expected: dict[str, str]) -> None:
    assert cgroup_limits(cpus, memory) == expected


def test_own_cgroup() -> None:
    assert own_cgroup("4:memory:/x\n0::/user.slice/a\n") == "/user.slice/a"
    assert own_cgroup("4:memory:/x\n") is None


def test_mps_is_found_by_its_control_pipe_and_turns_shares_into_limits(tmp_path: Path) -> None:
    assert not mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    (tmp_path / "control").write_text("")
    assert mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert mps_env(0.3, 4096, 1) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
                                     "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M"}
    assert mps_env(1.0, 8000, 2)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8000M,1=8000M"
    assert mps_env(0.0, 0, 0) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"}


def test_nccl_defaults_only_for_several_gpus_and_never_over_the_steps_own() -> None:
    assert nccl_env((0,), {}) == {}
    assert nccl_env((0, 1), {}) == {"NCCL_DEBUG": "WARN",
                                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl_env((0, 1), {"NCCL_DEBUG": "INFO"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@pytest.mark.parametrize(("share", "memory", "total", "expected"), [
    (0.5, 0, 16000, 0.5), (0.3, 4000, 16000, 0.25), (1.0, 40000, 16000, 1.0),
    (0.0, 0, 0, 0.01),
])
def test_memory_fraction(share: float, memory: int, total: int, expected: float) -> None:
    assert memory_fraction(share, memory, total) == pytest.approx(expected)


def test_the_lease_lapses_fence_after_its_last_renewal(tmp_path: Path) -> None:
    lease = Lease(node_id="n1", fence_after_s=10.0, path=tmp_path / "lease.json")
    assert not lease.expired(100.0)  # never renewed: nothing can have started
    lease.renewed(100.0)
    assert lease.deadline == 110.0
    assert not lease.expired(110.0)
    assert lease.expired(110.1)
    written = read_lease_file(tmp_path / "lease.json")
    assert written is not None
    assert written["deadline"] == 110.0
    lease.close()
    closed = read_lease_file(tmp_path / "lease.json")
    assert closed is not None
    assert closed["state"] == "closed"


def test_the_guard_kills_a_tasks_processes_when_the_lease_lapses(tmp_path: Path) -> None:
    """The dead-man switch on its own: a task process carrying this node's M27_* variables
    dies once the lease file's deadline passes, and the guard exits when the agent is gone."""
    env = {**os.environ, "M27_TASK_ID": "r-20261201-000000-abcdef/s", "M27_ATTEMPT": "1",
           "M27_NODE_ID": "guarded"}
    task = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    agent = subprocess.Popen(["sleep", "60"])
    ledger = tmp_path / "agent-state.json"
    ledger.write_text(json.dumps({"node_id": "guarded", "running": [
        {"task_id": "r-20261201-000000-abcdef/s", "attempt": 1, "pid": task.pid}]}))
    lease = tmp_path / "lease.json"
    lease.write_text(json.dumps({"deadline": time.monotonic() + 1.0}))
    guard = subprocess.Popen([sys.executable, "-S", str(GUARD_SCRIPT), "--lease", str(lease),
                              "--ledger", str(ledger), "--node-id", "guarded",
                              "--agent-pid", str(agent.pid)], stderr=subprocess.PIPE)
    try:
        assert task.wait(timeout=10) == -signal.SIGKILL
        agent.kill()
        agent.wait()
        _, err = guard.communicate(timeout=10)
        assert guard.returncode == 0
        assert b"lease expired: fenced the node's tasks (1 process(es) killed)" in err
    finally:
        for proc in (task, agent, guard):
            if proc.poll() is None:
                proc.kill()
