"""Fuzzing every entry point (issue 19, point 5; docs/benchmarks.md): a whole system on
loopback, and `--inputs` requests (10,000 by default) spread over every RPC its protobuf
descriptors describe, built by `tests/fuzzing.py` and sent with the strongest credentials
the method allows, a plain user's, or none. Prints per RPC the inputs and the statuses
seen, every violation (a status outside the allowed set, a misrouted credential, a call
past its deadline) with the seed to reproduce it, and the health of every service after
each RPC's batch. Exits 1 on any violation or unhealthy service.

    .venv/bin/python bench/fuzz.py --inputs 10000 --seed 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from google.protobuf import descriptor
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import fuzzing  # the same generator and checks the tests use
from tests.support import Cluster

QUICK = "pipeline:\n  - {name: a, command: 'true'}\n"


class Tally:
    """What one RPC's calls came to."""

    def __init__(self) -> None:
        self.codes: Counter[str] = Counter()
        self.seconds: list[float] = []
        self.violations: list[str] = []
        self.malformed = 0  # inputs that were bytes, not the request message
        self.exhausted = False

    @property
    def inputs(self) -> int:
        return sum(self.codes.values())


def fuzz(target: fuzzing.Target, method: descriptor.MethodDescriptor, examples: int,
         seed_value: int, tally: Tally) -> None:
    """`examples` calls of `method`, drawn from `seed_value`; violations are recorded, not
    raised (so nothing is shrunk: the seed and the request reproduce one)."""
    before = tally.inputs

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        request = data.draw(fuzzing.requests(method, target.known))
        credentials = data.draw(st.sampled_from(fuzzing.CREDENTIALS))
        outcome = target.call(method, request, credentials)
        tally.codes[outcome.code] += 1
        parts = request if isinstance(request, list) else [request]
        tally.malformed += any(isinstance(part, bytes) for part in parts)
        tally.seconds.append(outcome.seconds)
        problem = outcome.violation() or fuzzing.misrouted(method, credentials, outcome)
        if problem:
            tally.violations.append(f"seed {seed_value}, input {tally.inputs - before}, as "
                                    f"{credentials}: {problem}\n    request: "
                                    f"{fuzzing.described(request)}")

    run()
    tally.exhausted = tally.inputs - before < examples


def row(name: str, tally: Tally) -> str:
    codes = ", ".join(f"{code} {n}" for code, n in tally.codes.most_common())
    p50 = statistics.median(tally.seconds) * 1000 if tally.seconds else 0.0
    worst = max(tally.seconds, default=0.0)
    return (f"| {name} | {tally.inputs} | {tally.malformed} | {codes} | {p50:.0f} ms | "
            f"{worst:.2f} s | {len(tally.violations)} |")


def campaign(target: fuzzing.Target, inputs: int, first_seed: int, only: str | None
             ) -> tuple[dict[str, Tally], list[str]]:
    """Rounds over every RPC until `inputs` calls are made (an RPC whose requests are all
    tried drops out); health checked and nodes restored after each RPC's batch."""
    chosen = [m for m in fuzzing.methods() if only in (None, fuzzing.path(m))]
    tallies = {fuzzing.path(m): Tally() for m in chosen}
    sick: list[str] = []
    round_ = 0
    while (total := sum(t.inputs for t in tallies.values())) < inputs:
        open_ = [m for m in chosen if not tallies[fuzzing.path(m)].exhausted]
        if not open_:
            break
        share = max(1, -(-(inputs - total) // len(open_)))
        for index, method in enumerate(open_):
            fuzz(target, method, share, first_seed + 1000 * round_ + index,
                 tallies[fuzzing.path(method)])
            target.restore()
            if bad := fuzzing.unhealthy(target.health()):
                sick.append(f"after {fuzzing.path(method)} (round {round_}): {bad}")
        round_ += 1
    return tallies, sick


def report(tallies: dict[str, Tally], sick: list[str], health: dict[str, str],
           seconds: float) -> int:
    total = sum(t.inputs for t in tallies.values())
    print(f"\n{total} inputs over {len(tallies)} RPCs of "
          f"{len({p.rsplit('/', 1)[0] for p in tallies})} services in {seconds:.0f} s\n")
    print("| RPC | inputs | of them bytes | statuses | p50 | max | violations |")
    print("|---|---|---|---|---|---|---|")
    for name, tally in tallies.items():
        print(row(name.removeprefix("/m27.v1."), tally))
    violations = [f"{name}: {v}" for name, t in tallies.items() for v in t.violations]
    print(f"\nviolations: {len(violations)}")
    for line in violations[:50]:
        print(f"  {line}")
    print(f"unhealthy after a batch: {len(sick)}")
    for line in sick:
        print(f"  {line}")
    print("final health: " + ", ".join(f"{name} {state}" for name, state in health.items()))
    return 1 if violations or sick or fuzzing.unhealthy(health) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="one RPC, e.g. /m27.v1.PipelineService/GetRun")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="m27-fuzz-") as tmp:
        cluster = Cluster(Path(tmp))
        cluster.start()
        target = fuzzing.Target(cluster)
        try:
            target.known = fuzzing.seed_run(target, QUICK, Path(tmp))
            began = time.monotonic()
            tallies, sick = campaign(target, args.inputs, args.seed, args.only)
            return report(tallies, sick, target.health(), time.monotonic() - began)
        finally:
            target.close()
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
