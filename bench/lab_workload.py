"""The seed-like lab workload in the simulator: m27 against by hand, FIFO and Slurm-like
backfill, on 1 GPU and on 16 GPUs (2 nodes × 8) over 72 simulated hours, several seeds.

    python bench/lab_workload.py [--seeds 0,1,2] [--small-seeds 0-9] [--hours 72]
        [--clusters 1,16] [--sweep] [--json]

Same workload and seed for every policy. Reports busy-GPU utilization, goodput (work at
solo speed, minus work lost to preemptions and failures, / GPU time), tasks finished, night
jobs (submitted 18:00–08:00) finished by 09:00, preemptions and GPU-hours lost, and the
demand bound (the work submitted within the run, at solo speed, / GPU time: no policy's
busy time can exceed it); then the issue's targets with a verdict. The 16-GPU runs use
`--seeds`; the 1-GPU runs, which take about a second each and vary much more from seed to
seed, use `--small-seeds`. `--sweep` adds how the result moves with the backlog of
background work, with the I/O share and with the GPU memory MD runs and sweeps hold (on
1 GPU, the small seeds; on 16 GPUs, the first seed).
Workload parameters: `m27.sim.LabParams` (docs/simulator.md). All GPUs are simulated.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from m27.sim import (
    LabParams,
    SimConfig,
    demand_bound,
    generate_lab,
    make_policy,
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


def footprint_name(md_mb: int, sweep_mb: int) -> str:
    return f"{md_mb or 'share'}/{sweep_mb or 'share'}"


DEFAULT_FOOTPRINT = footprint_name(*FOOTPRINTS[0])


def one(cluster: str, policy: str, seed: int, hours: float, *,
        backlog: float = DEFAULT.backlog_gpu_h_per_gpu, io_share: float = DEFAULT.io_share,
        footprint: tuple[int, int] = FOOTPRINTS[0]) -> Row:
    nodes, gpus = CLUSTERS[cluster]
    trace = generate_lab(LabParams(nodes=nodes, gpus_per_node=gpus, hours=hours, seed=seed,
                                   backlog_gpu_h_per_gpu=backlog, io_share=io_share,
                                   md_gpu_memory_mb=footprint[0],
                                   background_gpu_memory_mb=footprint[1]))
    cfg = SimConfig(horizon_s=hours * 3600.0, seed=seed, failure_mtbf_h=FAILURE_MTBF_H,
                    tick_s=TICK_S)
    start = time.perf_counter()
    raw = simulate(trace, make_policy(policy, trace), cfg)
    m = summarize(raw, policy=policy, trace=trace.name)
    return Row(cluster=cluster, policy=policy, seed=seed, backlog=backlog, io_share=io_share,
               footprint=footprint_name(*footprint), demand=demand_bound(trace, hours * 3600.0),
               utilization=m.utilization, goodput=m.goodput, allocation=m.allocation,
               finished=m.completed, jobs=m.jobs, night_jobs=m.night_jobs,
               night_by_9=m.night_done_by_9, preemptions=m.preemptions,
               lost_gpu_h=m.lost_gpu_h, seconds=time.perf_counter() - start)


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
    args = parser.parse_args()
    version = policy_version()  # of the code imported now, not of later edits
    seeds = {"1 GPU": parse_seeds(args.small_seeds), "16 GPUs": parse_seeds(args.seeds)}
    wanted = [c for c in CLUSTERS if c.split()[0] in args.clusters.split(",")]
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
