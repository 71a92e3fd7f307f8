"""A node-agent and a step's secret values: asked for by key when the step starts (an
answer that refuses is a start that fails, no answer a start retried later), put in the
step's environment after its plain `env`, and masked in its log files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from m27.common import subjects
from m27.common.errors import Unavailable
from m27.common.events import SecretsReply, SecretsRequest, StartTask
from m27.common.memory_bus import MemoryBus
from m27.common.model import GpuInfo
from m27.node_agent._process import output_written, spawn
from m27.node_agent._runner import TaskRunner
from m27.node_agent._tasks import CannotStart, NodeContext, task_env, task_paths

RUN = "r-20261204-021500-abcdef"
KEY = f"{RUN}.0.{'b' * 32}"


def node(home: Path) -> NodeContext:
    gpus = (GpuInfo(index=0, name="m27 simulated GPU", uuid="SIM-n1-0",
                    memory_total_mb=16384, simulated=True),)
    return NodeContext(node_id="n1", backend="simulated", gpus=gpus, home=home,
                       python="/venv/bin/python")


def start(**changes: object) -> StartTask:
    fields: dict[str, object] = {"at": 1.0, "task_id": f"{RUN}/train", "run_id": RUN,
                                 "step": "train", "attempt": 1, "step_type": "cpu",
                                 "command": "true", "secrets": KEY}
    fields.update(changes)
    return StartTask(**fields)  # type: ignore[arg-type]


def runner(home: Path, bus: MemoryBus) -> TaskRunner:
    return TaskRunner(bus, node(home), stop_grace_s=1.0, environ={})


def answering(reply: SecretsReply) -> MemoryBus:
    bus = MemoryBus()

    async def respond(subject: str, data: bytes) -> bytes:
        return msgspec.json.encode(reply)

    bus.responder = respond
    return bus


async def test_the_values_are_asked_for_by_the_key_the_command_carries(
        tmp_path: Path) -> None:
    bus = answering(SecretsReply(env={"TOKEN": "Zq-value"}))
    assert await runner(tmp_path, bus)._secrets(start()) == {"TOKEN": "Zq-value"}
    ((subject, data),) = bus.requests
    assert subject == subjects.SECRETS_REQUEST
    assert msgspec.json.decode(data, type=SecretsRequest) == SecretsRequest(
        task_id=f"{RUN}/train", attempt=1, key=KEY)
    assert await runner(tmp_path, bus)._secrets(start(secrets="")) == {}
    assert len(bus.requests) == 1  # a step without secrets asks nothing


async def test_a_refusal_fails_the_start_and_no_answer_retries_it(tmp_path: Path) -> None:
    refused = answering(SecretsReply(error="attempt 1 is not assigned to node n1"))
    with pytest.raises(CannotStart, match="not assigned"):
        await runner(tmp_path, refused)._secrets(start())
    busy = answering(SecretsReply(error="could not answer", transient=True))
    with pytest.raises(Unavailable, match="could not answer"):
        await runner(tmp_path, busy)._secrets(start())
    with pytest.raises(Unavailable, match="no orchestrator answered"):
        await runner(tmp_path, MemoryBus())._secrets(start())
    garbled = MemoryBus()

    async def nonsense(subject: str, data: bytes) -> bytes:
        return b"not json"

    garbled.responder = nonsense
    with pytest.raises(Unavailable, match="unreadable answer"):
        await runner(tmp_path, garbled)._secrets(start())


def test_secrets_join_the_env_but_cannot_override_the_placement(tmp_path: Path) -> None:
    cmd = start(env={"A": "plain", "TOKEN": "plain"})
    env = task_env({"PATH": "/usr/bin"}, cmd, node(tmp_path), task_paths(tmp_path, cmd),
                   {"TOKEN": "Zq-value", "M27_NODE_ID": "elsewhere"})
    assert (env["A"], env["TOKEN"], env["M27_NODE_ID"]) == ("plain", "Zq-value", "n1")


async def test_a_masked_step_writes_its_logs_without_the_values(tmp_path: Path) -> None:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    command = ('printf "start %s" "$TOKEN"; sleep 0.1; printf " and %s\\n" "$TOKEN"; '
               'echo "err $TOKEN" >&2; trap "" TERM; kill -TERM 0; echo after')
    process = await spawn(command, cwd=tmp_path, env={"TOKEN": "Zq-value", "PATH": "/bin:"
                                                      "/usr/bin"},
                          stdout=out, stderr=err, mask=["Zq-value"])
    assert await asyncio.wait_for(process.wait(), 30) == 0
    assert await output_written(process.pid)
    assert out.read_text() == "start *** and ***\nafter\n"
    assert err.read_text() == "err ***\n"


async def test_an_unmasked_step_writes_straight_to_its_logs(tmp_path: Path) -> None:
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    process = await spawn("echo abc", cwd=tmp_path, env={"PATH": "/bin:/usr/bin"},
                          stdout=out, stderr=err, mask=["ab"])  # too short to mask
    assert await asyncio.wait_for(process.wait(), 30) == 0
    assert await output_written(process.pid)
    assert out.read_text() == "abc\n"
