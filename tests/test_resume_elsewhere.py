"""A step's checkpoints outlive its node: real agents on simulated GPUs, each with its own
M27_HOME (as on machines of their own, no shared disk), and the checkpoint-store between
them.

- A step training with `m27.train` is stopped with its node (checkpoint-then-stop on
  SIGTERM, the path preemption and drain use), runs again on the other node, resumes there
  from the checkpoint-store at the step it stopped at, and ends bitwise identical to a run
  that was never interrupted.
- A program that only writes its own files into M27_CHECKPOINT_DIR has them uploaded by
  its agent every `checkpoint:` interval; after its node is SIGKILLed the other agent
  restores them before starting the next attempt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.embedded.nats_server import pid_alive
from m27.embedded.processes import ServiceProcess, wait_ready
from tests.support import Cluster, finished_run, lines, wait_for

pytestmark = pytest.mark.integration
pytest.importorskip("torch")

LEASE = {"M27_NODE_LEASE_FENCE_AFTER": "3s", "M27_SCHEDULER_NODE_TIMEOUT": "5s",
         "M27_NODE_STOP_GRACE": "30s"}
STEPS = 60
TRAIN = '''\
import hashlib, os, pathlib, sys, time
import torch
from m27.train import Checkpointer, Cursor

HOLD = 35  # not a multiple of every_steps: attempt 2 resumes from the stop's checkpoint
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(1, keepdim=True)
ckpt = Checkpointer(model=model, optimizer=optimizer, every_steps=10)
cursor = ckpt.resume() or Cursor()
attempt = os.environ.get("M27_ATTEMPT", "-")
print(f"attempt {attempt} resumes at {cursor.step}", flush=True)
while cursor.step < int(sys.argv[1]):
    batch = torch.randint(0, 64, (16,))  # torch's global generator: restored too
    optimizer.zero_grad()
    ((model(data[batch]) - target[batch]) ** 2).mean().backward()
    optimizer.step()
    cursor.advance()
    ckpt.after_step(cursor)  # on SIGTERM: checkpoint this step, durable, then exit 143
    with open("progress.log", "a") as log:
        log.write(f"{attempt} {cursor.step}\\n")
    time.sleep(0.05)
    while attempt == "1" and cursor.step == HOLD:  # waits there to be stopped
        ckpt.after_step(cursor)  # the stop signal: checkpoint this step, durable, exit 143
        time.sleep(0.05)
ckpt.close()
digest = hashlib.sha256()
state = [*model.state_dict().values()]
state += [v for s in optimizer.state_dict()["state"].values() for v in s.values()]
for tensor in state:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
pathlib.Path("final.sha256").write_text(digest.hexdigest())
'''
FILES_WORKER = '''\
import json, os, pathlib, sys, time
state = pathlib.Path(os.environ["M27_CHECKPOINT_DIR"]) / "state.json"
start = json.loads(state.read_text())["i"] if state.exists() else 0
print(f"attempt {os.environ['M27_ATTEMPT']} starts from {start}", flush=True)
with open("ticks.log", "a") as ticks:
    for i in range(start, int(sys.argv[1])):
        ticks.write(f"{i}\\n")
        ticks.flush()
        time.sleep(0.1)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"i": i + 1}))
        os.replace(tmp, state)
'''


@pytest.fixture
def system(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "system", nodes=0, env=LEASE)
    cluster.start()
    yield cluster
    cluster.stop()


def start_agent(cluster: Cluster, node: str) -> ServiceProcess:
    """An agent with a home of its own: its checkpoint directories are not the other's."""
    home = cluster.root / f"home-{node}"
    home.mkdir()
    proc = cluster.launch(f"agent-{node}", "m27.node_agent",
                          ["--node-id", node, "--instance", node, "--gpus", "sim:1",
                           "--heartbeat-interval", "1s"], env={"M27_HOME": str(home)})
    wait_ready([proc])
    return proc


@pytest.fixture(scope="module")
def uninterrupted_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same program run standalone (a local checkpoint directory, no services)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    (work / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("M27_")}
    subprocess.run([sys.executable, "train.py", str(STEPS)], cwd=work, env=env, check=True,
                   timeout=180, capture_output=True)
    return (work / "final.sha256").read_text()


async def test_a_training_step_stopped_with_its_node_resumes_on_another_from_the_store(
        system: Cluster, client: Client, tmp_path: Path, uninterrupted_digest: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TRAIN)
    first = start_agent(system, "a")
    pipeline = ("pipeline:\n  - {name: train, type: gpu, "
                f"command: '\"$M27_PYTHON\" train.py {STEPS}'}}\n")
    run_id = await client.submit(pipeline, workdir=str(work))
    progress = work / "progress.log"
    await wait_for(lambda: len(lines(progress)) >= 35, "the step does not train")
    second = start_agent(system, "b")
    os.kill(first.pid, signal.SIGTERM)  # the node goes away; its step gets SIGTERM + grace

    run = await finished_run(client, run_id)
    assert run.state == "succeeded", system.logs()
    step = run.steps[0]
    assert (step.attempt, step.node_id) == (2, "b")
    assert (step.history[0].node_id, step.history[0].cause) == ("a", "node_stopped")
    assert step.history[0].exit_code == 128 + signal.SIGTERM
    stopped_after = max(int(line.split()[1]) for line in lines(progress)
                        if line.startswith("1 "))
    resumed_at = int(step.stdout_tail.split("resumes at ")[1].split()[0])
    # the checkpoint of the step it was at when stopped (35, between two periodic ones at
    # 30 and 40): not one step of work lost
    assert resumed_at == stopped_after == 35, step.stdout_tail
    assert not (system.root / "home-b" / "runs" / run_id / "checkpoints" / "train"
                / "m27-train").exists(), "it restored from the store, not a local directory"
    assert (work / "final.sha256").read_text() == uninterrupted_digest
    assert pid_alive(second.pid)


async def test_a_programs_own_checkpoint_files_follow_it_to_another_node(
        system: Cluster, client: Client, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "worker.py").write_text(FILES_WORKER)
    first = start_agent(system, "a")
    pipeline = ("pipeline:\n  - {name: md, type: gpu, checkpoint: 1s, checkpoint_signal: none,"
                " command: '\"$M27_PYTHON\" worker.py 70'}\n")
    run_id = await client.submit(pipeline, workdir=str(work))
    ticks = work / "ticks.log"
    await wait_for(lambda: len(lines(ticks)) >= 25, "the worker does not tick")
    start_agent(system, "b")
    os.kill(first.pid, signal.SIGKILL)  # no goodbye: b must get the files from the store

    run = await finished_run(client, run_id)
    assert run.state == "succeeded", system.logs()
    step = run.steps[0]
    assert (step.attempt, step.node_id) == (2, "b")
    assert step.history[0].cause == "lost"
    resumed = int(step.stdout_tail.split("starts from ")[1].split()[0])
    # uploaded every second: at most ~1 s of ticks (10) plus the one in progress lost
    assert 25 - 12 <= resumed <= len(lines(ticks)), step.stdout_tail
    restored = system.root / "home-b" / "runs" / run_id / "checkpoints" / "md" / "state.json"
    assert restored.is_file()
    assert not restored.is_symlink()
