"""The seed-like lab workload in the simulator: m27 against by hand, FIFO and Slurm-like
backfill, on 1 GPU and on 16 GPUs (2 nodes × 8) over 72 simulated hours, several seeds.

    python bench/lab_workload.py [--seeds 0,1,2] [--small-seeds 0-9] [--hours 72]
        [--clusters 1,16] [--sweep] [--json]
    python bench/lab_workload.py --grid [--cells default,issue-like] [--grid-seeds 0-2]
        [--grid-big-seeds 0] [--clusters 1,16] [--json]

Same workload and seed for every policy. Reports busy-GPU utilization, goodput (work at
solo speed, minus work lost to preemptions and failures, / GPU time), tasks finished, night
jobs (submitted 18:00–08:00) finished by 09:00, preemptions and GPU-hours lost, and the
demand bound (the work submitted within the run, at solo speed, / GPU time: no policy's
busy time can exceed it); then the issue's targets with a verdict. The 16-GPU runs use
`--seeds`; the 1-GPU runs, which take about a second each and vary much more from seed to
seed, use `--small-seeds`. `--sweep` adds how the result moves with the backlog of
background work, with the I/O share and with the GPU memory MD runs and sweeps hold (on
1 GPU, the small seeds; on 16 GPUs, the first seed).
`--grid` runs m27, FIFO and Slurm-like on each cell of `GRID` (LabParams far from their
defaults, one axis at a time and a few together) and prints one row per cell and cluster
with the issue's targets: goodput ≥ FIFO's and Slurm-like's, ≤ 1 preemption per GPU-hour,
night jobs ≥ 95 % by 09:00 where the night fits (`night_check`), and busy ≥ 90 % (16 GPUs)
/ 85 % (1 GPU) where the demand bound is ≥ 95 %; per-cell wall time goes to stderr. Beside
the demand bound it prints the *reachable* busy time (the demand bound less the GPU time
m27's tasks held in I/O or staging before the idle could be detected, which nothing can
use) and the GPU time held while staging and in I/O, to show what limits a cell.
Workload parameters: `m27.sim.LabParams` (docs/simulator.md). All GPUs are simulated.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from m27.sim import (
    LabParams,
    Nights,
    RawRun,
    SimConfig,
    Trace,
    demand_bound,
    generate_lab,
    make_policy,
    night_check,
    policy_version,
    simulate,
    summarize,
)

POLICIES = ("m27", "by-hand", "fifo", "slurm")
CLUSTERS = {"1 GPU": (1, 1), "16 GPUs": (2, 8)}
FAILURE_MTBF_H = 168.0  # a task crashes once per week of running, on average
TICK_S = 300.0  # the policy is asked at least every 5 minutes (and after every change)
DEFAULT = LabParams()
BACKLOGS = (0.0, 12.0, 24.0, 48.0, 72.0, 96.0)
IO_SHARES = (0.0, 0.1, 0.2, 0.35)
#: (MD GPU memory, sweep GPU memory) in MiB; (0, 0): every task holds its share's memory.
FOOTPRINTS = ((DEFAULT.md_gpu_memory_mb, DEFAULT.background_gpu_memory_mb), (0, 0))


@dataclass(frozen=True)
class Row:
    cluster: str
    policy: str
    seed: int
    backlog: float
    io_share: float
    footprint: str  # "MD/sweep GPU MiB", "share/share" when proportional
    demand: float
    utilization: float
    goodput: float
    allocation: float
    finished: int
    jobs: int
    night_jobs: int
    night_by_9: int
    preemptions: int
    lost_gpu_h: float
    seconds: float
    held_staging: float = 0.0  # GPU time held by own shares while staging / GPU time
    held_io: float = 0.0  # ... while in I/O (idle unless something backfills it)
    held_unseen: float = 0.0  # ... in I/O before the idle was detected: nothing can use it


def footprint_name(md_mb: int, sweep_mb: int) -> str:
    return f"{md_mb or 'share'}/{sweep_mb or 'share'}"


DEFAULT_FOOTPRINT = footprint_name(*FOOTPRINTS[0])


def lab(cluster: str, seed: int, hours: float, **changes: Any) -> LabParams:
    """The lab workload's parameters on `cluster`, `changes` (LabParams fields) applied."""
    nodes, gpus = CLUSTERS[cluster]
    base = LabParams(nodes=nodes, gpus_per_node=gpus, hours=hours, seed=seed)
    return msgspec.structs.replace(base, **changes)


def run(cluster: str, policy: str, params: LabParams, trace: Trace) -> tuple[Row, RawRun]:
    """One policy on one generated trace: its Row and the raw run (per-task outcomes)."""
    hours = params.hours
    cfg = SimConfig(horizon_s=hours * 3600.0, seed=params.seed,
                    failure_mtbf_h=FAILURE_MTBF_H, tick_s=TICK_S)
    start = time.perf_counter()
    raw = simulate(trace, make_policy(policy, trace), cfg)
    m = summarize(raw, policy=policy, trace=trace.name)
    row = Row(cluster=cluster, policy=policy, seed=params.seed,
              backlog=params.backlog_gpu_h_per_gpu, io_share=params.io_share,
              footprint=footprint_name(params.md_gpu_memory_mb,
                                       params.background_gpu_memory_mb),
              demand=demand_bound(trace, hours * 3600.0), utilization=m.utilization,
              goodput=m.goodput, allocation=m.allocation, finished=m.completed, jobs=m.jobs,
              night_jobs=m.night_jobs, night_by_9=m.night_done_by_9,
              preemptions=m.preemptions, lost_gpu_h=m.lost_gpu_h,
              seconds=time.perf_counter() - start,
              held_staging=raw.held_staging_gpu_s / (raw.gpus * raw.span_s),
              held_io=raw.held_io_gpu_s / (raw.gpus * raw.span_s),
              held_unseen=raw.held_unseen_gpu_s / (raw.gpus * raw.span_s))
    return row, raw


def one(cluster: str, policy: str, seed: int, hours: float, *,
        backlog: float = DEFAULT.backlog_gpu_h_per_gpu, io_share: float = DEFAULT.io_share,
        footprint: tuple[int, int] = FOOTPRINTS[0]) -> Row:
    params = lab(cluster, seed, hours, backlog_gpu_h_per_gpu=backlog, io_share=io_share,
                 md_gpu_memory_mb=footprint[0], background_gpu_memory_mb=footprint[1])
    return run(cluster, policy, params, generate_lab(params))[0]


def parse_seeds(text: str) -> list[int]:
    """"0,1,2" or "0-9"."""
    if "-" in text:
        first, last = text.split("-", 1)
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def mean(rows: list[Row], field: str) -> float:
    return statistics.fmean(float(getattr(r, field)) for r in rows)


def night_share(rows: list[Row]) -> float:
    night = sum(r.night_jobs for r in rows)
    return sum(r.night_by_9 for r in rows) / night if night else float("nan")


def summary_table(rows: list[Row]) -> str:
    lines = ["| cluster | policy | seeds | busy GPU % | goodput % | demand bound % | "
             "tasks finished (min–max) | night jobs by 09:00 | preemptions | GPU-h lost |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cluster in CLUSTERS:
        for policy in POLICIES:
            sel = [r for r in rows if r.cluster == cluster and r.policy == policy]
            if not sel:
                continue
            done = [r.finished for r in sel]
            lines.append(
                f"| {cluster} | {policy} | {len(sel)} | {100 * mean(sel, 'utilization'):.1f} | "
                f"{100 * mean(sel, 'goodput'):.1f} | {100 * mean(sel, 'demand'):.1f} | "
                f"{statistics.fmean(done):.1f} "
                f"({min(done)}–{max(done)}) | {100 * night_share(sel):.1f} % | "
                f"{mean(sel, 'preemptions'):.0f} | {mean(sel, 'lost_gpu_h'):.1f} |")
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    def pick(cluster: str, policy: str) -> list[Row]:
        return [r for r in rows if r.cluster == cluster and r.policy == policy]

    out = []
    big, small = pick("16 GPUs", "m27"), pick("1 GPU", "m27")
    if big:
        u, g = mean(big, "utilization"), mean(big, "goodput")
        out.append(f"16 GPUs busy ≥ 95 % with goodput ≥ 90 %: {100 * u:.1f} % / "
                   f"{100 * g:.1f} % -> {'met' if u >= 0.95 and g >= 0.90 else 'NOT met'}")
    if small:
        u = mean(small, "utilization")
        out.append(f"1 GPU busy ≥ 90 %: {100 * u:.1f} % (goodput {100 * mean(small, 'goodput'):.1f}"
                   f" %) -> {'met' if u >= 0.90 else 'NOT met'}")
    for cluster in CLUSTERS:
        m27, hand, fifo = pick(cluster, "m27"), pick(cluster, "by-hand"), pick(cluster, "fifo")
        if m27 and hand and fifo:
            ratio = mean(m27, "finished") / mean(hand, "finished")
            over_fifo = mean(m27, "finished") / mean(fifo, "finished")
            out.append(f"{cluster}: tasks finished ≥ 2.2× by hand and above FIFO: {ratio:.2f}× "
                       f"by hand, {over_fifo:.2f}× FIFO -> "
                       f"{'met' if ratio >= 2.2 and over_fifo > 1.0 else 'NOT met'}")
        if m27:
            share = night_share(m27)
            if share == share:  # not NaN: some night job's 09:00 lies inside the span
                out.append(f"{cluster}: night jobs by morning ≥ 98 %: {100 * share:.1f} % -> "
                           f"{'met' if share >= 0.98 else 'NOT met'}")
    return out


def sweep(seeds: dict[str, list[int]], hours: float) -> list[Row]:
    """Each sweep varies one parameter; the others keep their defaults (the main runs)."""
    rows = []
    for cluster, these in (("1 GPU", seeds["1 GPU"]), ("16 GPUs", seeds["16 GPUs"][:1])):
        for policy in ("m27", "by-hand", "fifo"):
            for seed in these:
                rows += [one(cluster, policy, seed, hours, backlog=b) for b in BACKLOGS
                         if b != DEFAULT.backlog_gpu_h_per_gpu]
                rows += [one(cluster, policy, seed, hours, io_share=s) for s in IO_SHARES
                         if s != DEFAULT.io_share]
                rows += [one(cluster, policy, seed, hours, footprint=f)
                         for f in FOOTPRINTS[1:]]
            print(f"  swept {cluster} {policy}", file=sys.stderr)
    return rows


def sweep_table(rows: list[Row], field: str, values: tuple[object, ...]) -> str:
    defaults: dict[str, object] = {"backlog": DEFAULT.backlog_gpu_h_per_gpu,
                                   "io_share": DEFAULT.io_share,
                                   "footprint": DEFAULT_FOOTPRINT}
    others = {k: v for k, v in defaults.items() if k != field}
    lines = [f"| cluster | policy | {field} → | " + " | ".join(f"{v:g}" if isinstance(
        v, float) else str(v) for v in values) + " |",
             "|---|---|---|" + "---|" * len(values)]
    for cluster in CLUSTERS:
        for policy in ("m27", "by-hand", "fifo"):
            cells = []
            for v in values:
                sel = [r for r in rows if r.cluster == cluster and r.policy == policy
                       and getattr(r, field) == v
                       and all(getattr(r, k) == d for k, d in others.items())]
                cells.append(f"{100 * mean(sel, 'utilization'):.0f}/"
                             f"{100 * mean(sel, 'goodput'):.0f}/{mean(sel, 'finished'):.0f}"
                             if sel else "—")
            lines.append(f"| {cluster} | {policy} | busy%/goodput%/tasks | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the grid: targets across a family of workloads (`--grid`) -------------------------

GRID_POLICIES = ("m27", "fifo", "slurm")
NIGHT_TARGET, PREEMPT_TARGET, DEMAND_FOR_BUSY = 0.95, 1.0, 0.95
BUSY_TARGET = {"1 GPU": 0.85, "16 GPUs": 0.90}
#: Named cells, each LabParams changes: one axis at a time far from its default, then a
#: few together. `default` is the published workload.
GRID: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", {}),
    ("footprint-small", {"md_gpu_memory_mb": 512, "background_gpu_memory_mb": 512,
                         "train_gpu_memory_mb": 1024, "analysis_gpu_memory_mb": 512}),
    ("footprint-share", {"md_gpu_memory_mb": 0, "background_gpu_memory_mb": 0}),
    ("light-0.5", {"analysis_milli": (400, 500)}),
    ("light-preemptible", {"light_preemptible": True}),
    ("bg-whole-gpus", {"background_shares": (1000,)}),
    ("bg-small-shares", {"background_shares": (200, 300, 400)}),
    ("bg-io", {"background_io_share": 0.3, "background_io_every_s": 120.0}),
    ("io-0", {"io_share": 0.0}),
    ("io-0.4-short", {"io_share": 0.4, "io_period_scale": 0.25}),
    ("io-0.4-long", {"io_share": 0.4, "io_period_scale": 6.0}),
    ("stage-0", {"stage_s": 0.0}),
    ("stage-600", {"stage_s": 600.0}),
    ("lognormal", {"durations": "lognormal"}),
    ("night-wave", {"night_wave_per_gpu": 1}),
    ("preprocess", {"preprocess_share": 0.5}),
    ("backlog-0", {"backlog_gpu_h_per_gpu": 0.0}),
    ("backlog-24", {"backlog_gpu_h_per_gpu": 24.0}),
    ("backlog-144", {"backlog_gpu_h_per_gpu": 144.0}),
    ("issue-like", {"durations": "lognormal", "stage_s": 300.0, "background_io_share": 0.3,
                    "background_io_every_s": 120.0, "preprocess_share": 0.5,
                    "night_wave_per_gpu": 1}),
    ("io-heavy", {"io_share": 0.4, "io_period_scale": 6.0, "background_shares": (1000,),
                  "md_gpu_memory_mb": 0, "background_gpu_memory_mb": 0}),
    ("light-crowd", {"analysis_milli": (400, 500), "light_preemptible": True,
                     "analysis_per_gpu_day": 6.0, "background_shares": (200, 300, 400),
                     "backlog_gpu_h_per_gpu": 24.0}),
    ("small-and-slow-start", {"md_gpu_memory_mb": 512, "background_gpu_memory_mb": 512,
                              "train_gpu_memory_mb": 1024, "analysis_gpu_memory_mb": 512,
                              "stage_s": 600.0, "io_share": 0.4, "io_period_scale": 0.25,
                              "durations": "lognormal"}),
)


@dataclass(frozen=True)
class Cell:
    cluster: str
    cell: str
    seeds: int
    demand: float
    busy: float
    goodput: dict[str, float]  # policy -> mean goodput
    preempt_per_gpu_h: float
    night: Nights  # summed over seeds
    night_all: tuple[int, int]  # (done by 09:00, night jobs) of every night, fitting or not
    held: tuple[float, float]  # m27: GPU time held while staging, in I/O (fractions)
    #: What busy time can reach: the demand bound, less the I/O and staging time held
    #: before its idle could be seen (m27's run; no policy can lend it).
    reachable: float
    preempted: dict[str, int]  # m27 preemptions by kind of task, summed over seeds
    seconds: float

    def misses(self) -> list[str]:
        g, out = self.goodput, []
        if g["m27"] < g["fifo"]:
            out.append("goodput < FIFO")
        if g["m27"] < g["slurm"]:
            out.append("goodput < Slurm")
        if self.preempt_per_gpu_h > PREEMPT_TARGET:
            out.append("preemptions")
        if self.night.jobs and self.night.done / self.night.jobs < NIGHT_TARGET:
            out.append("night")
        if self.demand >= DEMAND_FOR_BUSY and self.busy < BUSY_TARGET[self.cluster]:
            out.append("busy")
        return out


def grid_cell(cluster: str, name: str, changes: dict[str, Any], seeds: list[int],
              hours: float) -> Cell:
    start = time.perf_counter()
    rows: dict[str, list[Row]] = {p: [] for p in GRID_POLICIES}
    nights = Nights(nights=0, nights_fit=0, jobs=0, done=0)
    kinds: Counter[str] = Counter()
    for seed in seeds:
        params = lab(cluster, seed, hours, **changes)
        trace = generate_lab(params)
        for policy in GRID_POLICIES:
            row, raw = run(cluster, policy, params, trace)
            rows[policy].append(row)
            if policy == "m27":
                nights += night_check(trace, raw.outcomes)
                for o in raw.outcomes:
                    kinds[o.kind] += o.preemptions
    m27, (nodes, per_node) = rows["m27"], CLUSTERS[cluster]
    return Cell(cluster=cluster, cell=name, seeds=len(seeds), demand=mean(m27, "demand"),
                busy=mean(m27, "utilization"),
                goodput={p: mean(r, "goodput") for p, r in rows.items()},
                preempt_per_gpu_h=mean(m27, "preemptions") / (nodes * per_node * hours),
                night=nights,
                night_all=(sum(r.night_by_9 for r in m27), sum(r.night_jobs for r in m27)),
                held=(mean(m27, "held_staging"), mean(m27, "held_io")),
                reachable=statistics.fmean(min(r.demand, 1.0 - r.held_unseen) for r in m27),
                preempted={k: v for k, v in kinds.most_common() if v},
                seconds=time.perf_counter() - start)


def grid_row(c: Cell) -> str:
    n = c.night
    night = (f"{100 * n.done / n.jobs:.1f} ({n.done}/{n.jobs}, {n.nights_fit}/{n.nights} "
             "nights)" if n.jobs else f"— (0/{n.nights} nights fit)")
    kinds = ", ".join(f"{k} {v}" for k, v in c.preempted.items()) or "—"
    return (f"| {c.cluster} | {c.cell} | {c.seeds} | {100 * c.demand:.1f} | "
            f"{100 * c.reachable:.1f} | "
            f"{100 * c.busy:.1f} | {100 * c.held[0]:.1f} / {100 * c.held[1]:.1f} | "
            f"{100 * c.goodput['m27']:.1f} | "
            f"{100 * c.goodput['fifo']:.1f} | {100 * c.goodput['slurm']:.1f} | "
            f"{c.preempt_per_gpu_h:.3f} | {night} | {c.night_all[0]}/{c.night_all[1]} | "
            f"{kinds} | "
            f"{', '.join(c.misses()) or 'all met'} |")


GRID_HEAD = ("| cluster | cell | seeds | demand bound % | reachable busy % | m27 busy % | "
             "m27 GPU held while staging / in I/O % | m27 goodput % | "
             "FIFO goodput % | Slurm goodput % | m27 preemptions / GPU-h | "
             "m27 night jobs by 09:00 % (fitting nights) | m27 all nights | "
             "m27 preempted (by kind) | "
             "misses |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def run_grid(clusters: list[str], seeds: dict[str, list[int]], hours: float,
             names: list[str] | None) -> list[Cell]:
    """Every cell (or those named) on every cluster, printing each row as it is done."""
    known = dict(GRID)
    missing = [n for n in names or () if n not in known]
    if missing:
        raise SystemExit(f"unknown cells: {', '.join(missing)}")
    cells = [(n, known[n]) for n in names] if names else list(GRID)  # in the order asked
    print(GRID_HEAD, flush=True)
    out = []
    for cluster in clusters:
        for name, changes in cells:
            cell = grid_cell(cluster, name, changes, seeds[cluster], hours)
            print(grid_row(cell), flush=True)
            print(f"  {cluster} {name}: {cell.seconds:.0f} s", file=sys.stderr, flush=True)
            out.append(cell)
    return out


def grid_main(args: argparse.Namespace, clusters: list[str], version: str) -> None:
    seeds = {"1 GPU": parse_seeds(args.grid_seeds), "16 GPUs": parse_seeds(args.grid_big_seeds)}
    names = [n for n in args.cells.split(",") if n] or None
    if not args.json:
        print(f"lab workload grid, {args.hours:g} h, seeds {args.grid_seeds} (1 GPU), "
              f"{args.grid_big_seeds} (16 GPUs), failure MTBF {FAILURE_MTBF_H:g} running-h "
              f"per task; m27 policy sources sha256 {version}\n")
    start = time.perf_counter()
    cells = run_grid(clusters, seeds, args.hours, names)
    if args.json:
        print(json.dumps({"cells": [asdict(c) | {"night": msgspec.to_builtins(c.night),
                                           "misses": c.misses()} for c in cells]},
                         indent=2))
    print(f"  grid: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the 16-GPU runs")
    parser.add_argument("--small-seeds", default="0-9",
                        help="seeds of the 1-GPU runs: a list (0,1,2) or a range (0-9)")
    parser.add_argument("--hours", type=float, default=72.0)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--clusters", default="1,16", help="GPU counts: 1, 16 or both")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--grid", action="store_true",
                        help="only the grid of workloads: m27, FIFO, Slurm-like per cell")
    parser.add_argument("--cells", default="", help="grid cells to run (default: all)")
    parser.add_argument("--grid-seeds", default="0-2", help="seeds of the 1-GPU grid runs")
    parser.add_argument("--grid-big-seeds", default="0", help="seeds of the 16-GPU grid runs")
    args = parser.parse_args()
    version = policy_version()  # of the code imported now, not of later edits
    wanted = [c for c in CLUSTERS if c.split()[0] in args.clusters.split(",")]
    if args.grid:
        grid_main(args, wanted, version)
        return
    seeds = {"1 GPU": parse_seeds(args.small_seeds), "16 GPUs": parse_seeds(args.seeds)}
    rows = []
    for cluster in wanted:
        for policy in POLICIES:
            for seed in seeds[cluster]:
                rows.append(one(cluster, policy, seed, args.hours))
            print(f"  ran {cluster} {policy}", file=sys.stderr)
    swept = sweep(seeds, args.hours) if args.sweep else []
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows + swept]}, indent=2))
        return
    print(f"lab workload, {args.hours:g} h, seeds {args.seeds} (16 GPUs), "
          f"{args.small_seeds} (1 GPU), failure MTBF "
          f"{FAILURE_MTBF_H:g} running-h per task, simulated GPUs "
          f"({platform.python_implementation()} {platform.python_version()}); m27 policy "
          f"sources sha256 {version}\n")
    print(summary_table(rows))
    print()
    for line in verdicts(rows):
        print(line)
    if swept:
        print("\nbacklog of background work (GPU-h per GPU at time 0), the rest default:")
        print(sweep_table(swept + rows, "backlog", BACKLOGS))
        print("\nI/O share of MD and training wall time, the rest default:")
        print(sweep_table(swept + rows, "io_share", IO_SHARES))
        print("\nGPU memory of MD runs / sweeps (MiB; share: the share's proportion), "
              "the rest default:")
        print(sweep_table(swept + rows, "footprint",
                          tuple(footprint_name(*f) for f in FOOTPRINTS)))


if __name__ == "__main__":
    main()
