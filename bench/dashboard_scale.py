"""The live dashboard with a 1,000-GPU cluster's history, in a real headless Chromium: how
long the page takes to draw every GPU's curve and to redraw on a live update, and how big
the state it is sent is, with the server's downsampling (`--points`, 120 per GPU, what the
page asks for) against six times as many points per GPU (720: the raw 5 s samples of an
hour, the baseline), in the same run on the same data.

    python bench/dashboard_scale.py [--gpus 1000] [--hours 1] [--points 120] [--json]

`m27 up` (no GPUs) in a temporary home; its report service's history is filled with
`--gpus` GPUs (8 per node) × `--hours` of 5 s samples ending now, then the dashboard is
opened in Debian's chromium (Selenium, chromium-driver) once per point count. Figures:
the /api/state answer (bytes, server time: median of 3), the time from navigation until
every node's chart is drawn, and the median duration of the page's draw (the main thread
busy: `window.m27Draws`) over the first three live updates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
import urllib.request
from typing import Any

from _embedded import temporary_system
from history_query import fill
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from m27.common.api_auth import api_dir
from m27.embedded.system import dashboard_url
from m27.report.service import history_path
from m27.report.store import History


def browser() -> webdriver.Chrome:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        raise SystemExit("needs Debian's chromium and chromium-driver "
                         "(apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1600"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def state_size(url: str, token: str, points: int) -> tuple[int, float]:
    """(bytes, median seconds) of /api/state."""
    times, size = [], 0
    for _ in range(3):
        request = urllib.request.Request(  # noqa: S310 (the dashboard on loopback)
            f"{url}api/state?hours=1&points={points}",
            headers={"Authorization": f"Bearer {token}"})
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as reply:  # noqa: S310
            size = len(reply.read())
        times.append(time.perf_counter() - began)
    return size, statistics.median(times)


def page(driver: webdriver.Chrome, url: str, token: str, points: int, nodes: int,
         timeout: float = 300.0) -> tuple[float, float]:
    """(seconds until every node's chart is drawn, median draw ms of three live updates)."""
    began = time.perf_counter()
    driver.get(f"{url}?token={token}&points={points}")
    deadline = time.monotonic() + timeout
    while driver.execute_script("return document.querySelectorAll('.node canvas').length"
                                ) < nodes:
        if time.monotonic() > deadline:
            raise SystemExit("the dashboard did not draw every node in time")
        time.sleep(0.05)
    first = time.perf_counter() - began
    while driver.execute_script("return window.m27Draws.length") < 4:
        if time.monotonic() > deadline:
            raise SystemExit("the dashboard did not update in time")
        time.sleep(0.2)
    draws = driver.execute_script("return window.m27Draws.map(d => d.ms)")
    return first, statistics.median(draws[1:4])


def measure(gpus: int, hours: float, points: int) -> dict[str, Any]:
    with temporary_system() as (state, home, _):
        url = dashboard_url(state)
        token = (api_dir(home) / "cli.token").read_text().strip()
        history = History(history_path(home))
        written, fill_s = fill(history, gpus, hours, time.time() - hours * 3600)
        history.close()
        nodes = (gpus + 7) // 8
        out: dict[str, Any] = {
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "gpus": gpus, "hours": hours,
            "samples": written, "fill_s": fill_s}
        driver = browser()
        try:
            for label, count in (("downsampled", points), ("baseline", 6 * points)):
                size, server_s = state_size(url, token, count)
                first_s, redraw_ms = page(driver, url, token, count, nodes)
                out[label] = {"points": count, "state_bytes": size, "server_s": server_s,
                              "first_draw_s": first_s, "redraw_ms": redraw_ms}
        finally:
            driver.quit()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--points", type=int, default=120)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.gpus, args.hours, args.points)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.gpus} GPUs × {args.hours} h of 5 s samples ({result['samples']:,}); "
          f"{result['machine']}, {result['cpus']} CPUs")
    print("| points per GPU | /api/state | server | first draw, every node | redraw (main "
          "thread) |")
    print("|---|---|---|---|---|")
    for label in ("downsampled", "baseline"):
        r = result[label]
        print(f"| {r['points']} ({label}) | {r['state_bytes'] / 2**20:.1f} MiB | "
              f"{r['server_s'] * 1e3:.0f} ms | {r['first_draw_s']:.1f} s | "
              f"{r['redraw_ms']:.0f} ms |")
    down, base = result["downsampled"], result["baseline"]
    print(f"ratio baseline / downsampled: state {base['state_bytes'] / down['state_bytes']:.1f}×,"
          f" redraw {base['redraw_ms'] / max(down['redraw_ms'], 1e-9):.1f}×")


if __name__ == "__main__":
    main()
