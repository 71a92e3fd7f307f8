"""How long validating and planning a large pipeline takes: `load_pipeline` + `make_plan` on
matrix sweeps of ~100, ~1,000 and ~10,000 steps (prep → sweep over two axes → analysis) and
on explicit linear chains, against `yaml.safe_load` of the same text (the parse cost no
reader avoids), measured in the same run.

    python bench/plan_scale.py [--repeat 5] [--json]

A file may hold at most 5,000 written steps (`_document.MAX_STEP_TEMPLATES`), so chains are
measured at 1,250, 2,500 and 5,000 steps, with and without each step reading the previous
step's output through `{{steps.PREV.output}}`; doubling the steps should double the time.
A 10,000-step chain is planned from a spec built in code (`make_plan` only). The issue asks
for well under a second to validate and plan a 10,000-step pipeline; the verdict is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import yaml

from m27.common.model import StepRecord
from m27.pipeline import PipelineError, PipelineSpec, load_pipeline
from m27.pipeline.plan import make_plan

SWEEPS = ((10, 10), (40, 25), (100, 100))  # axis sizes: 100, 1,000, 10,000 members
CHAINS = (1250, 2500, 5000)
PLAN_ONLY_CHAIN = 10_000
WELL_UNDER_S = 0.5  # what "well under a second" is taken to mean here


@dataclass(frozen=True)
class Row:
    case: str
    steps: int
    yaml_bytes: int
    safe_load_s: float | None
    load_s: float | None
    plan_s: float
    total_s: float
    ratio: float | None  # (load + plan) / safe_load


def sweep(lrs: int, seeds: int) -> str:
    """prep → a `matrix:` sweep of lrs × seeds members → analysis of the whole sweep."""
    lr_values = ", ".join(f"{(i + 1) * 1e-4:.4f}" for i in range(lrs))
    return (
        "name: sweep\n"
        "pipeline:\n"
        "  - name: prep\n"
        "    command: python prepare.py --out data.h5\n"
        "    output: data.h5\n"
        "  - name: train\n"
        "    type: gpu_light\n"
        "    depends_on: [prep]\n"
        "    command: python train.py --data {{steps.prep.output}} --lr {{matrix.lr}}"
        " --seed {{matrix.seed}}\n"
        "    output: runs/lr{{matrix.lr}}-seed{{matrix.seed}}.json\n"
        "    checkpoint: 5m\n"
        "    retries: {failure: 1, infrastructure: 3}\n"
        f"    matrix: {{lr: [{lr_values}], seed: [{', '.join(map(str, range(seeds)))}]}}\n"
        "    max_parallel: 64\n"
        "  - name: analysis\n"
        "    depends_on: [train]\n"
        "    command: python analyze.py runs/\n"
    )


def chain(steps: int, *, references: bool) -> str:
    """steps written out one after another, each depending on the one before."""
    lines = ["name: chain", "pipeline:"]
    for i in range(steps):
        reads = f" --in {{{{steps.s{i - 1}.output}}}}" if references and i else ""
        lines += [f"  - name: s{i}", f"    command: python step.py{reads} --out out{i}.txt",
                  f"    output: out{i}.txt"]
        if i:
            lines.append(f"    depends_on: [s{i - 1}]")
    return "\n".join(lines) + "\n"


def chain_spec(steps: int) -> PipelineSpec:
    """A validated chain built in code: what load_pipeline would return, were it allowed."""
    records = tuple(StepRecord(name=f"s{i}", type="cpu", command="true",
                               depends_on=(f"s{i - 1}",) if i else ()) for i in range(steps))
    return PipelineSpec(name="chain", urgency="normal", steps=records)


def median_s(action: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_text(case: str, text: str, repeat: int) -> Row:
    spec = load_pipeline(text, source=f"{case}.yaml")
    safe_load = median_s(lambda: yaml.safe_load(text), repeat)
    load = median_s(lambda: load_pipeline(text, source=f"{case}.yaml"), repeat)
    plan = median_s(lambda: make_plan(spec), repeat)
    return Row(case=case, steps=len(spec.steps), yaml_bytes=len(text.encode()),
               safe_load_s=safe_load, load_s=load, plan_s=plan, total_s=load + plan,
               ratio=(load + plan) / safe_load)


def measure_plan_only(steps: int, repeat: int) -> Row:
    spec = chain_spec(steps)
    plan = median_s(lambda: make_plan(spec), repeat)
    return Row(case="chain, plan only (spec built in code)", steps=steps, yaml_bytes=0,
               safe_load_s=None, load_s=None, plan_s=plan, total_s=plan, ratio=None)


def compact_chain(steps: int) -> str:
    """The shortest way to write a chain (flow mappings), to stay under the 1 MiB limit."""
    lines = ["pipeline:", "  - {name: s0, command: 'true'}"]
    lines += [f"  - {{name: s{i}, command: 'true', depends_on: s{i - 1}}}"
              for i in range(1, steps)]
    return "\n".join(lines) + "\n"


def written_chain_limit() -> str:
    """What load_pipeline says to a 10,000-step chain written out."""
    try:
        load_pipeline(compact_chain(PLAN_ONLY_CHAIN), source="chain.yaml")
    except PipelineError as exc:
        return "; ".join(p.message for p in exc.problems)
    return "accepted"


def run(repeat: int) -> list[Row]:
    rows = [measure_text(f"sweep {a}x{b}", sweep(a, b), repeat) for a, b in SWEEPS]
    for references in (False, True):
        label = "chain, reads previous output" if references else "chain"
        rows += [measure_text(label, chain(n, references=references), repeat) for n in CHAINS]
    rows.append(measure_plan_only(PLAN_ONLY_CHAIN, repeat))
    return rows


def growth(rows: list[Row], case: str) -> float:
    """How much longer the longest chain takes than the one half as long (linear: 2)."""
    times = {r.steps: r.total_s for r in rows if r.case == case}
    return times[CHAINS[-1]] / times[CHAINS[-2]]


def verdict(rows: list[Row]) -> dict[str, object]:
    big = next(r for r in rows if r.case.startswith("sweep") and r.steps >= 10_000)
    return {"case": big.case, "steps": big.steps, "load_plus_plan_s": big.total_s,
            "well_under_s": WELL_UNDER_S, "holds": big.total_s < WELL_UNDER_S}


def print_table(rows: list[Row], repeat: int) -> None:
    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value * 1e3:,.1f}"

    print(f"median of {repeat}, milliseconds; ratio = (load_pipeline + make_plan) / "
          "yaml.safe_load of the same text")
    print(f"{'case':<38} {'steps':>7} {'KiB':>6} {'safe_load':>10} {'load':>9} "
          f"{'plan':>8} {'total':>9} {'ratio':>6}")
    for r in rows:
        ratio = "—" if r.ratio is None else f"{r.ratio:.1f}x"
        print(f"{r.case:<38} {r.steps:>7,} {r.yaml_bytes / 1024:>6.0f} {ms(r.safe_load_s):>10} "
              f"{ms(r.load_s):>9} {ms(r.plan_s):>8} {ms(r.total_s):>9} {ratio:>6}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.repeat)
    growths = {c: growth(rows, c) for c in ("chain", "chain, reads previous output")}
    limit = written_chain_limit()
    check = verdict(rows)
    result = {
        "repeat": args.repeat, "machine": platform.platform(), "cpus": os.cpu_count(),
        "python": sys.version.split()[0], "rows": [asdict(r) for r in rows],
        "chain_growth_per_doubling": growths, "written_10000_step_chain": limit,
        "requirement": check,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_table(rows, args.repeat)
    for case, factor in growths.items():
        print(f"{case}: {CHAINS[-2]:,} → {CHAINS[-1]:,} steps takes {factor:.2f}x as long "
              "(linear: 2x)")
    print(f"a written {PLAN_ONLY_CHAIN:,}-step chain: {limit}")
    print(f"requirement, {check['steps']:,} steps validated and planned well under a second "
          f"(< {WELL_UNDER_S}s): {check['load_plus_plan_s']:.3f}s → "
          f"{'holds' if check['holds'] else 'does not hold'}")


if __name__ == "__main__":
    main()
