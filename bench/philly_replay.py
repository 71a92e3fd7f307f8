"""A sampled week of the Philly trace replayed in the simulator: mean and p95 job completion
time (JCT) of m27 against FIFO and Tiresias-like least-attained-service.

    python bench/philly_replay.py [--trace ../shared/bench-data/philly-pollux/philly.csv]
        [--start 2017-10-09] [--days 7] [--sample 0.1] [--nodes 8] [--gpus-per-node 8]
        [--seeds 0,1,2] [--policies m27,fifo,tiresias] [--json]

Sampling: the jobs submitted in the week, each kept with probability --sample (seeded), on a
cluster scaled down with it: the 10 % sample of the week of 2017-10-09 holds ~1,300 jobs
asking for ~78 GPUs on average over the week, here on 64 GPUs (8 nodes × 8): a busy
cluster. Jobs run to completion (no horizon); a job larger than a node (16+ GPUs, ~1 %
of the week's jobs) is skipped, a multi-GPU job is gang-placed on one node, and every
job checkpoints every 10 minutes (so a preemption loses at most that). Philly carries no
priorities or GPU shares: every job is whole-GPU, normal urgency, preemptible. Simulated.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

from m27.sim import (
    SimConfig,
    Trace,
    make_nodes,
    make_policy,
    policy_version,
    read_philly,
    simulate,
    summarize,
)

CHECKPOINT_S = 600.0


def sampled(path: Path, args: argparse.Namespace, seed: int) -> Trace:
    trace = read_philly(path, nodes=make_nodes(args.nodes, args.gpus_per_node),
                        start=args.start, days=args.days, checkpoint_s=CHECKPOINT_S)
    rng = random.Random(seed)
    jobs = tuple(j for j in trace.jobs if rng.random() < args.sample)
    return msgspec.structs.replace(trace, jobs=jobs, name=f"philly-{args.start}-s{seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path,
                        default=Path("../shared/bench-data/philly-pollux/philly.csv"))
    parser.add_argument("--start", default="2017-10-09")
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--sample", type=float, default=0.1)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default="m27,fifo,tiresias")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    version = policy_version()  # of the code imported now, not of later edits
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        trace = sampled(args.trace, args, seed)
        for policy in args.policies.split(","):
            start = time.perf_counter()
            raw = simulate(trace, make_policy(policy, trace),
                           SimConfig(tick_s=300.0, bucket_s=3600.0, seed=seed))
            m = summarize(raw, policy=policy, trace=trace.name)
            rows.append({"seed": seed, "policy": policy, "jobs": m.jobs,
                         "completed": m.completed, "mean_jct_h": (m.mean_jct_s or 0) / 3600,
                         "p95_jct_h": (m.p95_jct_s or 0) / 3600,
                         "mean_queue_h": (m.mean_queue_s or 0) / 3600,
                         "utilization": m.utilization, "preemptions": m.preemptions,
                         "lost_gpu_h": m.lost_gpu_h, "seconds": time.perf_counter() - start})
            print(f"  seed {seed} {policy}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    if args.json:
        print(json.dumps({"args": vars(args) | {"trace": str(args.trace)}, "rows": rows},
                         indent=2))
        return
    print(f"Philly week from {args.start}, {args.days:g} days, sample {args.sample:g}, "
          f"{args.nodes}×{args.gpus_per_node} simulated GPUs, seeds {args.seeds}; m27 policy "
          f"sources sha256 {version}\n")
    print("| policy | jobs | mean JCT h | p95 JCT h | mean queueing h | preemptions | "
          "GPU-h lost |")
    print("|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        sel = [r for r in rows if r["policy"] == policy]

        def avg(key: str, sel: list[dict[str, float | int | str]] = sel) -> float:
            return statistics.fmean(float(r[key]) for r in sel)

        print(f"| {policy} | {avg('jobs'):.0f} | {avg('mean_jct_h'):.2f} | "
              f"{avg('p95_jct_h'):.2f} | {avg('mean_queue_h'):.2f} | "
              f"{avg('preemptions'):.0f} | {avg('lost_gpu_h'):.1f} |")
    base = {p: statistics.fmean(float(r["mean_jct_h"]) for r in rows if r["policy"] == p)
            for p in args.policies.split(",")}
    if "m27" in base:
        for other in (p for p in base if p != "m27"):
            print(f"m27 mean JCT / {other}: {base['m27'] / base[other]:.2f}")


if __name__ == "__main__":
    main()
