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
import sys
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, given, seed, settings

from m27.scheduler.model import PolicySettings
from m27.sim import SimConfig, Trace, make_policy, policy_version, simulate, summarize
from m27.sim.tests.test_policy_properties import (
    GOODPUT_TOLERANCE,
    TICK_S,
    Watch,
    preemption_bound,
    serial_bound,
    traces,
)


@dataclass
class Tally:
    examples: int = 0
    unfinished: int = 0
    goodput_misses: int = 0
    preemption_misses: int = 0
    wait_misses: int = 0
    margins: list[float] = field(default_factory=list)  # m27 goodput − FIFO's
    makespans: list[float] = field(default_factory=list)  # m27's / FIFO's
    jcts: list[float] = field(default_factory=list)  # m27's mean JCT / FIFO's
    per_job: list[int] = field(default_factory=list)
    worst_wait_s: float = 0.0
    worst: list[str] = field(default_factory=list)

    def add(self, trace: Trace) -> None:
        self.examples += 1
        cfg = SimConfig(tick_s=TICK_S, horizon_s=serial_bound(trace))
        fifo_raw = simulate(trace, make_policy("fifo", trace), cfg)
        watch = Watch(make_policy("m27", trace))
        raw = simulate(trace, watch, cfg)
        done_fifo = {o.task_id for o in fifo_raw.outcomes if o.end_s is not None}
        if not done_fifo <= {o.task_id for o in raw.outcomes if o.end_s is not None}:
            self.unfinished += 1
            self.worst.append(f"unfinished: {len(trace.jobs)} jobs on {len(trace.nodes)} nodes")
        span = SimConfig(tick_s=TICK_S, horizon_s=fifo_raw.span_s)
        fifo = summarize(fifo_raw, policy="fifo", trace=trace.name)
        m27 = summarize(simulate(trace, make_policy("m27", trace), span), policy="m27",
                        trace=trace.name)
        self.margins.append(m27.goodput - fifo.goodput)
        whole = summarize(raw, policy="m27", trace=trace.name)
        if fifo_raw.span_s > 0:
            self.makespans.append(raw.span_s / fifo_raw.span_s)
        if whole.mean_jct_s and fifo.mean_jct_s:
            self.jcts.append(whole.mean_jct_s / fifo.mean_jct_s)
        self.goodput_misses += m27.goodput < fifo.goodput - GOODPUT_TOLERANCE
        bounds = {j.job.task_id: preemption_bound(j) for j in trace.jobs}
        self.per_job += [o.preemptions for o in raw.outcomes]
        self.preemption_misses += any(o.preemptions > bounds[o.task_id]
                                      for o in raw.outcomes)
        limit = PolicySettings().preempt_grace_s + 2 * TICK_S
        self.wait_misses += watch.worst > limit
        self.worst_wait_s = max(self.worst_wait_s, watch.worst)


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
    margins = sorted(t.margins)
    print(f"policy properties, {t.examples} drawn workloads (seed {args.seed}), simulated "
          f"GPUs ({platform.python_implementation()} {platform.python_version()}); m27 "
          f"policy sources sha256 {version}; {time.perf_counter() - start:.0f} s\n")
    print("| property | held in | misses |")
    print("|---|---|---|")
    rows = (("every job FIFO finishes, m27 finishes", t.unfinished),
            (f"goodput ≥ FIFO's − {GOODPUT_TOLERANCE:g} (by FIFO's end)", t.goodput_misses),
            ("preemptions per job within the bound", t.preemption_misses),
            (f"no wait beside fitting free capacity > {PolicySettings().preempt_grace_s:g} s "
             f"+ 2 ticks", t.wait_misses))
    for name, misses in rows:
        print(f"| {name} | {t.examples - misses} / {t.examples} | {misses} |")
    print(f"\ngoodput by FIFO's end, m27 − FIFO (0: m27 done by then too): min "
          f"{margins[0]:+.3f}, 5th pct {margins[len(margins) // 20]:+.3f}")
    for name, values in (("makespan", t.makespans), ("mean JCT", t.jcts)):
        v = sorted(values)
        print(f"{name} m27 / FIFO: median {statistics.median(v):.2f}, 95th pct "
              f"{v[len(v) * 19 // 20]:.2f}, max {v[-1]:.2f}; worse than FIFO in "
              f"{sum(x > 1.0 + 1e-9 for x in v)} of {len(v)}")
    print(f"preemptions per job: mean {statistics.fmean(t.per_job):.2f}, max "
          f"{max(t.per_job)}; jobs never preempted "
          f"{sum(p == 0 for p in t.per_job) / len(t.per_job):.1%}")
    print(f"longest wait beside fitting free capacity: {t.worst_wait_s:.0f} s")
    for line in t.worst[:5]:
        print("  " + line, file=sys.stderr)


if __name__ == "__main__":
    main()
