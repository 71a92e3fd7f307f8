"""Prometheus exposition with DCGM-exporter names, and the /metrics endpoint (served for
real on 127.0.0.1:0)."""

from __future__ import annotations

import asyncio
import re
import urllib.error
import urllib.request

import pytest

from m27.common.metrics import CONTENT_TYPE, MetricsServer, escape, split_bind
from m27.common.model import GpuInfo, GpuProcess, GpuSample, TaskHolding
from m27.node_agent.metrics import render

H100 = GpuInfo(index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-abc", memory_total_mb=81920,
               simulated=False)
SIM = GpuInfo(index=1, name="m27 simulated GPU", uuid="SIM-n1-1", memory_total_mb=16384,
              simulated=True)
SAMPLE = GpuSample(index=0, utilization_pct=87.0, memory_used_mb=10240, temperature_c=64.0,
                   power_w=312.5, memory_total_mb=81920, power_limit_w=700.0,
                   throttle=("thermal", "power"), energy_j=123456.789,
                   processes=(GpuProcess(pid=10, memory_mb=6000, task_id="r1/train",
                                         attempt=2),
                              GpuProcess(pid=11, memory_mb=1000, task_id="r1/train",
                                         attempt=2),
                              GpuProcess(pid=12, memory_mb=500)))
HOLDING = TaskHolding(task_id="r1/train", attempt=2, gpu_ids=(0,), gpu_share=0.5)
LINE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\} '
                  r"-?[0-9.e+]+$")


def text() -> str:
    return render("n1", "host-1", "nvml", [H100], [SAMPLE], [HOLDING],
                  {("r1/train", 2): 4321.5})


def value(body: str, name: str) -> str:
    [line] = [ln for ln in body.splitlines() if ln.startswith(name + "{")]
    return line.rsplit(" ", 1)[1]


@pytest.mark.parametrize(("name", "expected"), [
    ("DCGM_FI_DEV_GPU_UTIL", "87"),
    ("DCGM_FI_DEV_FB_USED", "10240"),
    ("DCGM_FI_DEV_FB_FREE", "71680"),
    ("DCGM_FI_DEV_GPU_TEMP", "64"),
    ("DCGM_FI_DEV_POWER_USAGE", "312.5"),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "700"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "123456789"),  # mJ, as DCGM
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", str(0x20 | 0x04)),  # NVML bits, as DCGM
    ("m27_task_gpu_share", "0.5"),
    ("m27_task_gpu_memory_used_bytes", str(7000 * 1024 * 1024)),
    ("m27_task_energy_joules", "4321.5"),
])
def test_each_reading_under_its_dcgm_name(name: str, expected: str) -> None:
    assert value(text(), name) == expected


def test_gpu_series_carry_the_dcgm_labels_and_say_whether_simulated() -> None:
    body = text()
    line = next(ln for ln in body.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_UTIL{"))
    assert line.startswith('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-abc",device="nvidia0",'
                           'modelName="NVIDIA H100 80GB HBM3",Hostname="host-1",'
                           'm27_node="n1",m27_simulated="false"}')
    sim = render("n1", "h", "simulated", [SIM],
                 [GpuSample(index=1, utilization_pct=0, memory_used_mb=0, temperature_c=35,
                            simulated=True)], [], {})
    assert all('m27_simulated="true"' in ln for ln in sim.splitlines()
               if not ln.startswith("#"))


def test_the_exposition_is_well_formed() -> None:
    body = text()
    assert body.endswith("\n")
    families = [ln.split()[2] for ln in body.splitlines() if ln.startswith("# TYPE")]
    assert len(families) == len(set(families))
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter" in body
    assert "# TYPE DCGM_FI_DEV_GPU_UTIL gauge" in body
    for line in body.splitlines():
        assert line.startswith("# ") or LINE.match(line), line


def test_missing_readings_are_left_out_not_zeroed() -> None:
    bare = GpuSample(index=0, utilization_pct=5, memory_used_mb=1, temperature_c=40)
    body = render("n1", "h", "nvml", [H100], [bare], [], {})
    assert "DCGM_FI_DEV_POWER_USAGE" not in body
    assert "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" not in body
    assert value(body, "DCGM_FI_DEV_FB_FREE") == "81919"  # total from the registered GPU
    assert render("n1", "h", "none", [], [], [], {}) == ""
    mig = render("n1", "h", "nvml", [H100], [bare], [], {}, {0: frozenset({"utilization"})})
    assert "DCGM_FI_DEV_GPU_UTIL" not in mig  # not reported by the GPU: not a 0 %
    assert "DCGM_FI_DEV_GPU_TEMP" in mig


@pytest.mark.parametrize(("raw", "escaped"), [
    ("plain", "plain"), ('a"b', 'a\\"b'), ("a\\b", "a\\\\b"), ("a\nb", "a\\nb"),
])
def test_label_values_are_escaped(raw: str, escaped: str) -> None:
    assert escape(raw) == escaped
    body = render("n1", raw, "nvml", [H100], [SAMPLE], [], {})
    assert f'Hostname="{escaped}"' in body


@pytest.mark.parametrize(("bind", "expected"), [
    ("127.0.0.1:0", ("127.0.0.1", 0)),
    (":9401", ("0.0.0.0", 9401)),  # noqa: S104 - what ":port" means
    ("[::1]:9401", ("::1", 9401)),
])
def test_split_bind(bind: str, expected: tuple[str, int]) -> None:
    assert split_bind(bind) == expected


@pytest.mark.parametrize("bind", ["9401", "host:", "host:http", "h:70000"])
def test_split_bind_rejects_what_is_not_host_port(bind: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_bind(bind)


# ---------------------------------------------------------------- the server


def fetch(url: str, method: str = "GET") -> tuple[int, str, str]:
    request = urllib.request.Request(url, method=method)  # noqa: S310 - always http://
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310 - http
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


async def test_the_server_answers_get_metrics_and_404_otherwise() -> None:
    calls = []

    def body() -> str:
        calls.append(1)
        return text()

    server = MetricsServer("127.0.0.1:0", body)
    address = await server.start()
    try:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
        assert not address.endswith(":0")
        status, kind, got = await asyncio.to_thread(fetch, f"http://{address}/metrics")
        assert (status, kind) == (200, CONTENT_TYPE)
        assert got == text()
        assert (await asyncio.to_thread(fetch, f"http://{address}/"))[0] == 404
        assert (await asyncio.to_thread(fetch, f"http://{address}/metrics", "POST"))[0] == 405
        assert len(calls) == 1  # rendered per scrape, and only for /metrics
    finally:
        await server.close()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(fetch, f"http://{address}/metrics")


async def test_the_server_survives_garbage_and_a_failing_render() -> None:
    def broken() -> str:
        raise RuntimeError("bug")

    server = MetricsServer("127.0.0.1:0", broken)
    host, port = (await server.start()).rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"\x00\x01 not http\r\n\r\n")
        await writer.drain()
        assert (await reader.read()).startswith(b"HTTP/1.1 400 ")
        writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        writer.close()  # gone before its request ended
        status, _, _ = await asyncio.to_thread(fetch, f"http://{host}:{port}/metrics")
        assert status == 500
    finally:
        await server.close()
