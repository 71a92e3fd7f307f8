"""The live dashboard as a person looks at it (issue 15, points 6 and 7): a real headless
Chromium (Debian's `chromium`, driven by Selenium through `chromium-driver`) opens the
report service's dashboard while a pipeline runs, and sees per-GPU curves drawn, the
running step appear and leave, the run with its report and comparison; the pages are
saved as screenshots (`$M27_ARTIFACTS`, else the test's temporary directory). Without a
token nothing is shown; a user sees only their own runs' reports."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import Cluster, finished_run, report_of

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    if os.environ.get("CI"):
        pytest.fail("Debian's chromium and chromium-driver are needed (.ci/run installs them)",
                    pytrace=False)
    pytest.skip("no chromium / chromedriver here (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

TRAIN = """\
import sys, time
import m27.train
for step in range(60):
    m27.train.log(step, loss=1.0 / (step + 1) + float(sys.argv[1]))
    time.sleep(0.1)
m27.train.flush_metrics()
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = Options()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1600"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    where = Path(os.environ.get("M27_ARTIFACTS") or tmp_path) / "screenshots"
    where.mkdir(parents=True, exist_ok=True)
    return where


def dashboard(cluster: Cluster) -> str:
    address = cluster.processes["report"].http_address
    assert address, "the report service serves no dashboard"
    return f"http://{address}/"


async def until(browser: webdriver.Chrome, script: str, what: str,
                timeout: float = 60.0) -> Any:
    """The script's value once it is truthy (the page is live: it changes by itself)."""
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(browser.execute_script, script)):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)
    return value


async def get(url: str, token: str = "") -> tuple[int, str]:
    """GET without following redirects; (status, body)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session, session.get(
            url, headers=headers, allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=30)) as reply:
        return reply.status, await reply.text()


async def test_the_dashboard_shows_live_gpu_curves_the_queue_runs_and_reports(
        cluster: Cluster, browser: webdriver.Chrome, artifacts: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    base = dashboard(cluster)
    token = str(cluster.access.token)
    await asyncio.to_thread(browser.get, f"{base}?token={token}")
    assert browser.current_url == base  # the token went into a cookie, not the history
    await until(browser, "return document.querySelector('#live.on')", "never went live")
    assert "simulated" in browser.find_element("id", "simulated").text
    pipeline = (
        "pipeline:\n"
        "  - name: train\n"
        "    type: gpu\n"
        "    matrix: {offset: [0.5, 0.1]}\n"
        f"    command: {sys.executable} {script} {{{{matrix.offset}}}}\n")
    async with cluster.client() as client:
        run_id = await client.submit(pipeline, workdir=str(tmp_path))
        running = await until(browser, "return [...document.querySelectorAll('#running td')]"
                              ".map(td => td.textContent).join(' ')", "no running step shown")
        assert run_id in running
        first = int(browser.find_element("id", "updated").get_attribute("data-updates") or 0)
        await until(browser, "return document.querySelectorAll('.node canvas').length",
                    "no GPU chart drawn")
        node = browser.find_element("css selector", ".node[data-node='node-1']")
        assert int(node.get_attribute("data-points") or 0) >= 1
        await asyncio.to_thread(browser.save_screenshot, str(artifacts / "dashboard-running.png"))
        run = await finished_run(client, run_id, timeout=120)
        assert run.state == "succeeded", run
        await report_of(client, run_id)
    # live: the page updates itself, and the finished run has its report and comparison
    await until(browser, f"return Number(document.getElementById('updated').dataset.updates)"
                f" > {first} && !document.querySelector('#running tbody tr')",
                "the running step never left the page")
    link = await until(browser, "return [...document.querySelectorAll('#runs a')]"
                       f".filter(a => a.textContent == 'report' && a.href.includes('{run_id}'))"
                       ".map(a => a.href)[0]", "no report link")
    events = browser.find_element("id", "events").text
    assert "run_state_changed" in events
    await asyncio.to_thread(browser.save_screenshot, str(artifacts / "dashboard-done.png"))
    await asyncio.to_thread(browser.get, link)
    assert "m27 run report" in browser.title
    assert browser.find_elements("css selector", "svg")  # its curves, drawn
    await asyncio.to_thread(browser.get, f"{base}compare/{run_id}")
    rows = browser.find_elements("css selector", "#compare tbody tr")
    assert [r.find_elements("css selector", "td")[2].text for r in rows] == ["0.1", "0.5"]
    assert len(browser.find_elements("css selector", "figure svg")) >= 2
    await asyncio.to_thread(browser.save_screenshot, str(artifacts / "compare.png"))
    # the same data as JSON
    status, body = await get(f"{base}api/state?hours=1", token)
    assert status == 200
    state = json.loads(body)
    assert {(g["node"], g["gpu"]) for g in state["gpus"]} >= {("node-1", 0), ("node-1", 1)}
    assert run_id in [r["run_id"] for r in state["runs"]]


async def test_the_dashboard_shows_nothing_without_a_token_and_a_user_only_their_runs(
        cluster: Cluster, tmp_path: Path) -> None:
    base = dashboard(cluster)
    async with cluster.client() as client:
        run_id = await client.submit("pipeline:\n  - {name: a, command: 'true'}\n",
                                     workdir=str(tmp_path))
        await finished_run(client, run_id)
        await report_of(client, run_id)
    assert (await get(f"{base}api/state"))[0] == 401
    status, page = await get(base)
    assert status == 401
    assert "Paste an m27 API token" in page
    assert (await get(f"{base}api/state", "m27t1.c.forged.x"))[0] == 401
    mallory = str(cluster.access_as("mallory").token)
    assert (await get(f"{base}reports/{run_id}.html", mallory))[0] == 403
    status, body = await get(f"{base}api/state", mallory)
    assert status == 200
    assert json.loads(body)["runs"] == []  # only mallory's own runs
    for path in ("reports/..%2F..%2Fetc%2Fpasswd", "reports/x.html", "compare/nope",
                 "static/../../service.py", "static/none.js"):
        assert (await get(base + path, mallory))[0] == 404, path
    admin = str(cluster.access.token)
    status, text = await get(f"{base}reports/{run_id}.html", admin)
    assert (status, "m27 run report" in text) == (200, True)
