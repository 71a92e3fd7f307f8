"""Seeded chaos, measured: N fault schedules, each on a fresh m27 system (nats-server —
or, with --nats-servers 3, a JetStream cluster of three —, the five services and three
node-agents as real processes on loopback; the GPUs are simulated), with the harness of
tests/chaos.

Per schedule (seed S, S+1, …): the schedule is drawn from its seed
(tests/chaos/schedule.py) — kill -9 of a service or a node-agent (started again after
0.5–2 s, as a supervisor would), kill -9 of a node's guard, a nats-server restart
(kill -9, started again on its port and store; in a cluster, one member at a time),
SIGSTOP of a service or an agent past the node lease (then SIGCONT), a node cut off from
NATS (through TCP proxies), the checkpoint-store's filesystem full (its own 256 MiB ext4
on a loop device, or a tmpfs: root only, else left out), that filesystem slow (a blkio
throttle on the loop device: 10 write IOs/s, 512 KiB/s; cgroup v1 and a loop device
only, else left out), a node drained and uncordoned — one about every --fault-every
seconds for --duration seconds, while the work runs: short shell steps with a `matrix:`
sweep, an `m27.train` step (CPU torch) that checkpoints every 10 steps, a program with
its own checkpoint file, preemptible background work that an urgent step preempts. Then
everything is healed and every run waited for, and the checks of tests/chaos/checks.py
judge the records.

The table: faults done per kind; runs that succeeded; recovery time per kind, p50/p95
(from the fault to the affected work's next attempt starting — one sample per task that
ran on the node — or, when no work was affected, to the target serving again: a
restarted process ready, a frozen one continued, a link restored; none for a guard,
which nothing but its agent's restart starts again); work lost per failover of a
checkpointed step (p50/p95/max; each checked against one checkpoint interval + 3 s to
durable + any time the store could not take checkpoints); violations, each with its seed.

The system runs with the test leases (renewal 1 s, self-fence 3 s, node lost 5 s,
scheduler lease 3 s): a freeze or a cut is drawn to outlast the 5 s, so it is a failure.

    python bench/chaos.py [--schedules 5] [--seed 1] [--fault-every 5] [--duration 40]
        [--nats-servers 1|3] [--kinds kill,freeze,…] [--json] [--keep DIR] [--out FILE]
    python bench/chaos.py --report FILE...   # the table of what --out wrote

A fresh system per schedule: a fault that leaves damage (a full disk, a guard that
nothing restarts) must not leak into the next seed's results, and a seed must replay alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from m27.common.logging import configure
from m27.embedded.nats_server import nats_server_version

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.chaos.checks import Outcome, count_by_kind  # the harness the tests use
from tests.chaos.harness import run_schedule
from tests.chaos.schedule import KINDS, Kind


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 2)


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    faults: dict[str, int] = {}
    recovery: dict[str, list[float]] = {}
    for o in outcomes:
        for kind, n in count_by_kind(o.faults).items():
            faults[kind] = faults.get(kind, 0) + n
        for kind, times in o.recovery.items():
            recovery.setdefault(kind, []).extend(times)
    lost = [w.lost_s for o in outcomes for w in o.lost]
    return {
        "schedules": len(outcomes),
        "faults": dict(sorted(faults.items())),
        "runs": sum(o.runs for o in outcomes),
        "runs_succeeded": sum(o.runs_succeeded for o in outcomes),
        "recovery_s": {k: {"n": len(v), "p50": pct(v, 0.5), "p95": pct(v, 0.95)}
                       for k, v in sorted(recovery.items())},
        "lost_work_s": {"failovers": len(lost), "p50": pct(lost, 0.5),
                        "p95": pct(lost, 0.95), "max": max(lost, default=None)},
        "effects_redone": sum(o.redone_effects for o in outcomes),
        "violations": [v for o in outcomes for v in o.violations],
    }


def table(result: dict[str, Any]) -> str:
    s = result["summary"]
    m = result["machine"]
    out = [f"m27 chaos: {s['schedules']} schedules from seed {result['seed']}, "
           f"{result['duration']:.0f} s of faults each, one every ~{result['every']:.0f} s; "
           "GPUs simulated",
           f"machine: {m['cores']} cores, {m['platform']}, Python {m['python']}, "
           f"{m['nats_server']} ({result.get('nats_servers', 1)} server(s)); kinds drawn: "
           f"{', '.join(result.get('kinds') or ['all the machine can do'])}",
           "", f"{'kind':<14}{'faults':>7}{'samples':>9}{'p50 s':>8}{'p95 s':>8}"]
    for kind, n in s["faults"].items():
        r = s["recovery_s"].get(kind, {"n": 0, "p50": None, "p95": None})
        out.append(f"{kind:<14}{n:>7}{r['n']:>9}{_num(r['p50']):>8}{_num(r['p95']):>8}")
    lost = s["lost_work_s"]
    out += ["", f"runs: {s['runs_succeeded']} of {s['runs']} succeeded",
            f"work lost per failover of a checkpointed step: {lost['failovers']} failovers, "
            f"p50 {_num(lost['p50'])} s, p95 {_num(lost['p95'])} s, max {_num(lost['max'])} s",
            f"effects of an attempt redone by the next (killed after its effect): "
            f"{s['effects_redone']}",
            f"violations: {len(s['violations'])}", *(f"  {v}" for v in s["violations"]),
            "", "per schedule:"]
    for row in result["schedules"]:
        out.append(f"  seed {row['seed']}: {row['took_s']:.0f} s, {row['violations']} "
                   f"violations; {'; '.join(row['faults'])}")
    return "\n".join(out)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


async def bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    outcomes, rows = [], []
    for seed in range(args.seed, args.seed + args.schedules):
        started = time.monotonic()
        try:
            outcome = await run_schedule(seed, root / f"seed-{seed}",
                                         duration_s=args.duration, every_s=args.fault_every,
                                         kinds=args.kinds, nats_servers=args.nats_servers)
        except Exception as exc:
            outcome = Outcome(seed=seed, violations=[f"seed {seed}: the harness failed: "
                                                     f"{type(exc).__name__}: {exc}"],
                              lost=[], recovery={}, redone_effects=0, runs=0,
                              runs_succeeded=0, faults=[])
        took = time.monotonic() - started
        outcomes.append(outcome)
        rows.append({"seed": seed, "took_s": round(took, 1),
                     "violations": len(outcome.violations),
                     "faults": [f.fault.describe() for f in outcome.faults]})
        print(f"seed {seed}: {len(outcome.faults)} faults, {len(outcome.violations)} "
              f"violations, {took:.0f} s", file=sys.stderr, flush=True)
        if args.out is not None:  # one line per schedule, so a run cut short keeps them
            with args.out.open("a") as out:
                out.write(json.dumps({"row": rows[-1], "outcome": _plain(outcome)}) + "\n")
    return result_of(outcomes, rows)


def result_of(outcomes: list[Outcome], rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"summary": summary(outcomes), "schedules": rows,
            "outcomes": [_plain(o) for o in outcomes]}


def read_lines(paths: list[Path]) -> tuple[list[Outcome], list[dict[str, Any]]]:
    """The schedules `--out` wrote, in the files' order."""
    import msgspec

    outcomes, rows = [], []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                saved = json.loads(line)
                outcomes.append(msgspec.convert(saved["outcome"], Outcome))
                rows.append(saved["row"])
    return outcomes, rows


def _plain(outcome: Outcome) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(outcome)  # type: ignore[no-any-return]


def kinds_of(text: str) -> list[Kind]:
    """`kill,freeze` → those kinds; argparse's error for an unknown one."""
    chosen = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in KINDS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {', '.join(unknown) or '(none)'}"
                                         f"; the kinds are {', '.join(KINDS)}")
    return chosen  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each schedule starts a system of its own; a seed replays its schedule "
        "(not its exact timing: the machine's load moves when work ends).")
    parser.add_argument("--schedules", type=int, default=5, help="how many seeds to run")
    parser.add_argument("--seed", type=int, default=1, help="the first seed (then +1 …)")
    parser.add_argument("--fault-every", type=float, default=5.0, metavar="S",
                        help="seconds between faults, on average (jittered ±25%%)")
    parser.add_argument("--duration", type=float, default=40.0, metavar="S",
                        help="seconds of faults per schedule (work runs on after them "
                        "until every run ended)")
    parser.add_argument("--nats-servers", type=int, choices=(1, 3), default=1,
                        help="one nats-server, or a JetStream cluster of three (R3 streams "
                        "and buckets; nats_restart then kills one member)")
    parser.add_argument("--kinds", type=kinds_of, metavar="KIND,…",
                        help="draw only these fault kinds (default: every kind this machine "
                        f"can do: {', '.join(KINDS)}); a seed's schedule depends on it")
    parser.add_argument("--json", action="store_true", help="the whole result as JSON")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="run in DIR and keep it (logs, markers, stores; default: a "
                        "temporary directory, deleted)")
    parser.add_argument("--out", metavar="FILE", type=Path,
                        help="append each schedule's result to FILE as a JSON line as soon "
                        "as it ends")
    parser.add_argument("--report", metavar="FILE", type=Path, nargs="+",
                        help="run nothing: the table of the schedules --out wrote to FILEs")
    args = parser.parse_args()
    configure("bench", "warning", stream=sys.stderr)  # stdout is the result
    if args.report:
        result = result_of(*read_lines(args.report))
    else:
        with contextlib.ExitStack() as stack:
            root = args.keep or Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="m27-chaos-")))
            result = asyncio.run(bench(args, root))
    result.update(seed=args.seed, duration=args.duration, every=args.fault_every,
                  nats_servers=args.nats_servers, kinds=args.kinds)
    result["machine"] = {"python": platform.python_version(), "cores": os.cpu_count() or 0,
                         "platform": f"{platform.system()} {platform.machine()}",
                         "nats_server": nats_server_version(), "root": os.geteuid() == 0}
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
