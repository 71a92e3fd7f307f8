"""NATS and the API over TLS (issue 14, points 1, 2 and 4): the embedded system with
`[nats]` and `[api]` certificates set runs a pipeline — a step given a secret, writing a
checkpoint, a report —
with every bus connection and every gRPC call on mutual TLS, and a client without TLS or
without a certificate gets nothing from either."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from m27.client import Client
from m27.common.api_auth import ApiAccess
from m27.common.bus import Access, connect
from m27.common.config import load_config
from m27.common.errors import BusError
from m27.common.principals import principal
from m27.embedded import system
from m27.v1 import pipeline_pb2 as pb
from m27.v1 import pipeline_pb2_grpc as pb_grpc
from tests.support import embedded, finished_run

pytestmark = pytest.mark.integration


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Path]:
    with embedded(tmp_path, tls=True) as home:
        yield home


async def test_everything_runs_over_mutual_tls_and_nothing_else_gets_in(secured: Path) -> None:
    state = system.read_state(secured)
    assert state is not None
    step = secured / "step.py"  # a step calling the checkpoint-store, as the library does
    step.write_text("import os\nfrom m27.client.checkpoints import RemoteStore\n"
                    "store = RemoteStore(os.environ['M27_CHECKPOINT_STORE'])\n"
                    "store.put_bytes(store.task_id, b'state', attempt=store.attempt)\n"
                    "print(len(store.list(store.task_id)))\n"
                    "print('token', os.environ['TOKEN'])\n")
    async with Client(state.api) as client:
        run_id = await client.submit(
            "pipeline:\n  - name: hello\n    type: gpu_light\n"
            f"    command: {sys.executable} {step}\n"
            "    secrets: {TOKEN: '{{token}}'}\n", workdir=str(secured),
            secrets={"token": "Zq-over-tls"})
        run = await finished_run(client, run_id)
        assert run.state == "succeeded", run
        deadline = time.monotonic() + 30
        while not (await client.get_run(run_id)).report_path:  # report → orchestrator
            assert time.monotonic() < deadline, "no report over TLS"
            await asyncio.sleep(0.1)
    # the node got the secret from the orchestrator over TLS; its log has it masked
    assert (secured / "runs" / run_id / "logs" / "hello.1.out").read_text() == "1\ntoken ***\n"
    api = load_config(Path(os.environ["M27_CONFIG"])).config.api
    token = (secured / "credentials" / "api" / "cli.token").read_text().strip()
    for caller in (ApiAccess(token=token),  # plaintext to a TLS server
                   ApiAccess(token=token, tls_ca=api.tls_ca)):  # no client certificate
        async with caller.channel(state.api) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.PipelineServiceStub(channel).ListRuns(pb.ListRunsRequest(),
                                                                    timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "tls" in (secured / "nats" / "nats.conf").read_text()

    settings = load_config(Path(os.environ["M27_CONFIG"])).config.nats
    admin = system.access(secured, principal("admin"), settings)
    nc = await connect(state.nats_url, name="tls-admin", access=admin, timeout=5)
    assert nc.is_connected
    await nc.close()
    without_tls = Access(seed_file=admin.seed_file, inbox_prefix=admin.inbox_prefix)
    without_cert = Access(seed_file=admin.seed_file, inbox_prefix=admin.inbox_prefix,
                          tls_ca=admin.tls_ca)
    for access in (without_tls, without_cert):
        with pytest.raises(BusError):
            await connect(state.nats_url, name="no-tls", access=access, timeout=3)
