"""The FGD allocation protocol (ATC'23 "Beware of Fragmentation") on the openb traces.

Replays every openb pod list the paper reports (17 traces) on the 1,213 GPU nodes of
`openb_node_list_gpu_node.csv`, as `../shared/bench-data/README.md` ("The FGD allocation
protocol, exactly") describes: per seed (42–51) sort the pods by name, shuffle, tune the load
to 1.3x the cluster's GPU milli (append random clones / drop random pods), then let the pods
arrive in that order and never leave; a pod that fits nowhere is dropped. The allocation
rate at k % is the allocated GPU milli / 6,212,000 averaged over the pods whose rounded
arrival percentage is k. Ties between equally scored nodes go to a fixed random node order
per seed.

Measured in the same run: our best-fit baseline (`Packer(strategy="bestfit")`) and m27's
packing (`Packer(strategy="m27")`, the one `decide()` uses); optionally our FGD
reimplementation (`--with-fgd`). Beside them the paper's means over its 10 seeds
(`fgd-simulator-results/analysis_allo_discrete.csv`, policies 05-BestFit and 06-FGD).

    .venv/bin/python bench/fgd_protocol.py --data ../shared/bench-data [--seeds 10]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from m27.scheduler._packing import Packer, Request, Strategy, m27_demand, typical_demand
from m27.scheduler.model import Gpu, Node
from m27.sim import policy_version

TRACES = (
    "default", "cpu050", "cpu100", "cpu200", "cpu250", "gpushare40", "gpushare60",
    "gpushare80", "gpushare100", "gpuspec10", "gpuspec20", "gpuspec25", "gpuspec33",
    "multigpu20", "multigpu30", "multigpu40", "multigpu50",
)
POINTS = (80, 90, 100, 110, 130)
TUNE = 1.3


def load_nodes(path: Path) -> list[Node]:
    """GPU nodes; GPU memory is not part of the protocol (0: not tracked)."""
    with path.open() as f:
        return [Node(node_id=row["sn"], cpu_milli=int(row["cpu_milli"]),
                     memory_mb=int(row["memory_mib"]),
                     gpus=tuple(Gpu(index=i, memory_mb=0, model=row["model"])
                                for i in range(int(row["gpu"]))))
                for row in csv.DictReader(f)]


def load_pods(path: Path) -> list[tuple[str, Request]]:
    """(name, request) for every pod, CPU-only ones included."""
    pods = []
    with path.open() as f:
        for row in csv.DictReader(f):
            gpus = int(row["num_gpu"])
            milli = min(1000, int(row.get("gpu_milli") or 1000) or 1000) if gpus else 0
            spec = row.get("gpu_spec") or ""
            pods.append((row["name"], Request(
                gpus=gpus, milli=milli, cpu_milli=int(row["cpu_milli"]),
                memory_mb=int(row["memory_mib"]),
                models=tuple(m for m in spec.split("|") if m))))
    return pods


def arrival_order(pods: Sequence[tuple[str, Request]], seed: int,
                  capacity: int) -> list[Request]:
    """Sorted by name, shuffled, then tuned to 1.3x the cluster's GPU milli."""
    rng = np.random.default_rng(seed)
    base = [r for _, r in sorted(pods, key=lambda p: p[0])]
    shuffled = [base[i] for i in rng.permutation(len(base))]
    target = TUNE * capacity
    total = sum(r.gpus * r.milli for r in shuffled)
    while total < target:
        clone = base[int(rng.integers(len(base)))]
        shuffled.append(clone)
        total += clone.gpus * clone.milli
    while total > target:
        gone = shuffled.pop(int(rng.integers(len(shuffled))))
        total -= gone.gpus * gone.milli
    return shuffled


def replay(nodes: Sequence[Node], arrivals: Sequence[Request],
           demand: Sequence[tuple[Request, float]], strategy: Strategy,
           seed: int) -> tuple[dict[int, float], int]:
    """Allocation % by rounded arrival % for one run, and how many GPU pods it dropped
    before the 90 % point (none: its 80/90 % cells only reflect the arrival order)."""
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    tie = np.random.default_rng(seed + 1000).permutation(len(nodes))
    packer = Packer(nodes, demand, strategy=strategy, tie_rank=tie.tolist())
    arrived = allocated = 0
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    dropped_by_90 = 0
    for req in arrivals:
        arrived += req.gpus * req.milli
        k = int(np.floor(100.0 * arrived / capacity + 0.5))
        if packer.place(req) is not None:
            allocated += req.gpus * req.milli
        elif req.gpus and k <= 90:
            dropped_by_90 += 1
        sums[k] = sums.get(k, 0.0) + 100.0 * allocated / capacity
        counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}, dropped_by_90


def run_one(args: tuple[Path, str, int, tuple[Strategy, ...]]) -> tuple[str, int, dict[
        str, tuple[dict[int, float], int]], float]:
    data, trace, seed, strategies = args
    base = data / "alibaba-gpu-v2023"
    nodes = load_nodes(base / "openb_node_list_gpu_node.csv")
    pods = load_pods(base / f"openb_pod_list_{trace}.csv")
    requests = [r for _, r in pods]
    # FGD's typical shapes cover 95 % of the pods; m27's 95 % of the GPU milli (and the
    # rarer ones count, unweighted, for its scarce-capability rule).
    demand = {"m27": m27_demand(requests), "fgd": typical_demand(requests, by_milli=False),
              "bestfit": []}
    arrivals = arrival_order(pods, seed, sum(len(n.gpus) for n in nodes) * 1000)
    start = time.perf_counter()
    curves: dict[str, tuple[dict[int, float], int]] = {
        s: replay(nodes, arrivals, demand[s], s, seed) for s in strategies}
    return trace, seed, curves, time.perf_counter() - start


def paper_means(path: Path) -> dict[tuple[str, str], list[float]]:
    """(trace, policy) → mean over its seeds at POINTS."""
    acc: dict[tuple[str, str], list[list[float]]] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            trace = row["workload"].removeprefix("openb_pod_list_")
            acc.setdefault((trace, row["sc_policy"]), []).append(
                [float(row[str(p)]) for p in POINTS])
    return {k: list(np.mean(v, axis=0)) for k, v in acc.items()}


def _fmt(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/bench-data"))
    parser.add_argument("--seeds", type=int, default=10, help="seeds 42 .. 42+N-1")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--with-fgd", action="store_true",
                        help="also run our reimplementation of FGD")
    args = parser.parse_args(argv)
    version = policy_version()  # of the code imported now, not of later edits
    strategies: tuple[Strategy, ...] = ("bestfit", "m27") + (
        ("fgd",) if args.with_fgd else ())
    traces = [t for t in args.traces.split(",") if t]
    work = [(args.data, t, 42 + s, strategies) for t in traces for s in range(args.seeds)]
    results: dict[str, dict[str, list[tuple[dict[int, float], int]]]] = {}
    elapsed = 0.0
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for trace, seed, curves, secs in pool.map(run_one, work):
            elapsed += secs
            for s, curve in curves.items():
                results.setdefault(trace, {}).setdefault(s, []).append(curve)
            print(f"# {trace} seed {seed}: {secs:.1f} s", file=sys.stderr)
    paper = paper_means(args.data / "fgd-simulator-results" / "analysis_allo_discrete.csv")
    print(_table(traces, strategies, results, paper, args.seeds))
    runs = len(work) * len(strategies)
    print(f"\n{runs} replays, {elapsed / runs:.1f} s each on average; m27 policy sources "
          f"sha256 {version}.")
    return 0


def _table(traces: Sequence[str], strategies: Sequence[Strategy],
           results: dict[str, dict[str, list[tuple[dict[int, float], int]]]],
           paper: dict[tuple[str, str], list[float]], seeds: int) -> str:
    cols = ["paper BestFit", "paper FGD", "our best-fit"] + (
        ["our FGD"] if "fgd" in strategies else []) + [
        "m27", "m27 − paper FGD at 80/90", "m27 − paper FGD, min at 100–130",
        "m27 GPU pods dropped by 90 %"]
    lines = [f"Allocation % at {'/'.join(map(str, POINTS))} % arrival "
             f"(means over {seeds} seed(s); paper: its 10 seeds)\n",
             "| trace | " + " | ".join(cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    below = []
    for trace in traces:
        ours = {s: [float(np.mean([c.get(p, np.nan) for c, _ in results[trace][s]]))
                    for p in POINTS] for s in strategies}
        dropped = sum(d for _, d in results[trace]["m27"])
        fgd = paper.get((trace, "06-FGD"), [np.nan] * len(POINTS))
        diff = [m - f for m, f in zip(ours["m27"], fgd, strict=True)]
        margin = min(diff[2:])
        if margin < 0:
            below.append(f"{trace} ({margin:+.2f})")
        row = [_fmt(paper.get((trace, "05-BestFit"), [np.nan] * len(POINTS))), _fmt(fgd),
               _fmt(ours["bestfit"])] + ([_fmt(ours["fgd"])] if "fgd" in ours else []) + [
               _fmt(ours["m27"]), "/".join(f"{d:+.2f}" for d in diff[:2]), f"{margin:+.2f}",
               f"{dropped} in {len(results[trace]['m27'])} runs"]
        lines.append(f"| {trace} | " + " | ".join(row) + " |")
    lines.append("\nBelow the paper's FGD at 100–130 % arrival: " + (", ".join(below) or "none"))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
