"""NATS over TLS (issue 14, point 1): the embedded system with `[nats] server_cert`,
`server_key`, `tls_ca`, `tls_cert` and `tls_key` set runs a pipeline with every
connection on mutual TLS, and a client without TLS or without a certificate gets nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from m27.client import Client
from m27.common.bus import Access, connect
from m27.common.config import load_config
from m27.common.errors import BusError
from m27.common.principals import principal
from m27.embedded import system
from tests.support import finished_run, make_certificates

pytestmark = pytest.mark.integration


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    certs = make_certificates(tmp_path / "tls")
    config = tmp_path / "m2config"
    config.write_text("[nats]\n"
                      f"server_cert = {certs.server_cert}\nserver_key = {certs.server_key}\n"
                      f"tls_ca = {certs.ca}\n"
                      f"tls_cert = {certs.client_cert}\ntls_key = {certs.client_key}\n")
    home = tmp_path / "home"
    monkeypatch.setenv("M27_HOME", str(home))
    monkeypatch.setenv("M27_CONFIG", str(config))  # the services read it too
    system.up(home, nodes=1, gpus="sim:1", config=load_config(config).config.nats)
    yield home
    system.down(home)


async def test_everything_runs_over_mutual_tls_and_nothing_else_gets_in(secured: Path) -> None:
    state = system.read_state(secured)
    assert state is not None
    async with Client(state.api) as client:
        run_id = await client.submit(
            "pipeline:\n  - name: hello\n    type: gpu_light\n    command: echo hi\n",
            workdir=str(secured))
        run = await finished_run(client, run_id)
        assert run.state == "succeeded"
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
