"""The policy properties of `m27/sim/tests/test_policy_properties.py` over many more drawn
workloads than CI runs, with figures: how often each property holds, the goodput margin
over FIFO, preemptions per job and the longest wait beside free capacity it fits.

    python bench/policy_properties.py [--examples 1000] [--seed 0]

Each example is a whole trace (1–4 nodes × 1–8 GPUs, shares to gangs, every tier, I/O,
staging, checkpoints, arrivals at once, in waves or spread; half of them under pressure),
simulated to completion under m27 and FIFO. All GPUs are simulated.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed, settings

from m27.sim import Trace, policy_version
from m27.sim.tests.test_policy_properties import (
    GOODPUT_TOLERANCE,
    WAIT_BOUND_S,
    Findings,
    measure,
    traces,
)


@dataclass
class Tally:
    findings: list[Findings] = field(default_factory=list)

    def add(self, trace: Trace) -> None:
        self.findings.append(measure(trace))

    def misses(self) -> list[tuple[str, int]]:
        f = self.findings
        return [
            ("every job FIFO finishes, m27 finishes", sum(bool(x.unfinished) for x in f)),
            (f"goodput ≥ FIFO's − {GOODPUT_TOLERANCE:g} (by FIFO's end)",
             sum(x.goodput < x.fifo_goodput - GOODPUT_TOLERANCE for x in f)),
            ("preemptions per job within the bound", sum(bool(x.over_bound) for x in f)),
            (f"no wait beside fitting free capacity > {WAIT_BOUND_S:g} s",
             sum(x.worst_wait_s > WAIT_BOUND_S for x in f))]


def run(examples: int, at_seed: int) -> Tally:
    tally = Tally()

    @seed(at_seed)
    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(traces())
    def each(trace: Trace) -> None:
        tally.add(trace)

    each()
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    version = policy_version()
    start = time.perf_counter()
    t = run(args.examples, args.seed)
    print(f"policy properties, {len(t.findings)} drawn workloads (seed {args.seed}), "
          f"simulated GPUs ({platform.python_implementation()} "
          f"{platform.python_version()}); m27 policy sources sha256 {version}; "
          f"{time.perf_counter() - start:.0f} s\n")
    report(t)


def report(t: Tally) -> None:
    f = t.findings
    print("| property | held in | misses |")
    print("|---|---|---|")
    for name, misses in t.misses():
        print(f"| {name} | {len(f) - misses} / {len(f)} | {misses} |")
    margins = sorted(x.goodput - x.fifo_goodput for x in f)
    print(f"\ngoodput by FIFO's end, m27 − FIFO (0: m27 done by then too): min "
          f"{margins[0]:+.3f}, 5th pct {margins[len(margins) // 20]:+.3f}")
    for name, values in (("makespan", [x.makespan_ratio for x in f]),
                         ("mean JCT", [x.jct_ratio for x in f if x.jct_ratio is not None])):
        v = sorted(values)
        print(f"{name} m27 / FIFO: median {statistics.median(v):.2f}, 95th pct "
              f"{v[len(v) * 19 // 20]:.2f}, max {v[-1]:.2f}; worse than FIFO in "
              f"{sum(r > 1.0 + 1e-9 for r in v)} of {len(v)}")
    per_job = [p for x in f for p in x.preemptions]
    print(f"preemptions per job: mean {statistics.fmean(per_job):.2f}, max "
          f"{max(per_job)}; jobs never preempted "
          f"{sum(p == 0 for p in per_job) / len(per_job):.1%}")
    print(f"longest wait beside fitting free capacity: "
          f"{max(x.worst_wait_s for x in f):.0f} s")


if __name__ == "__main__":
    main()
