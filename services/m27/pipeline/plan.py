"""The execution plan of a pipeline (pure), as `m27 plan` shows it — like `snakemake -n`.

Levels of steps that can run at the same time, each step's resources, the critical path,
and — when a running system supplies them — start estimates from earlier runs' durations,
which steps would reuse cached results, and which ask for more than any node has.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from m27.common.model import GpuInfo, NodeInfo, StepRecord
from m27.common.platform import Requirements, node_misses
from m27.common.units import format_duration, format_size
from m27.pipeline import dag
from m27.pipeline._spec import PipelineSpec

MAX_TEXT_STEPS_PER_LEVEL: Final = 12


class PlannedStep(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    type: str
    level: int
    depends_on: tuple[str, ...]
    gpus: float
    cpus: int
    gpu_memory_mb: int
    memory_mb: int
    urgency: str
    preemptible: bool
    command: str
    group: str = ""
    matrix: dict[str, str] = msgspec.field(default_factory=dict)
    outputs: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    timeout_s: float | None = None
    retries: str = ""
    estimated_s: float | None = None  # from earlier runs, when known
    start_after_s: float | None = None  # estimated start, after submission
    reuse: str = ""  # `<run>/<step>` whose results it would reuse, or why it runs


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    steps: tuple[PlannedStep, ...]
    levels: tuple[tuple[str, ...], ...]
    critical_path: tuple[str, ...]
    critical_path_s: float | None = None
    sweeps: dict[str, int] = msgspec.field(default_factory=dict)  # sweep → members
    max_parallel: dict[str, int] = msgspec.field(default_factory=dict)
    capacity_problems: tuple[str, ...] = ()
    estimate_basis: str = ""  # where durations come from, or why there are none


def make_plan(spec: PipelineSpec, *, durations: Mapping[str, Sequence[float]] | None = None,
              reuse: Mapping[str, str] | None = None,
              nodes: Sequence[NodeInfo] | None = None) -> Plan:
    """The plan of `spec`; `durations` (step name → earlier durations), `reuse` (step → what
    it would reuse) and `nodes` (the cluster) come from a running system, if there is one."""
    graph = spec.graph()
    level_of = dag.levels(graph)
    known = {n: statistics.median(d) for n, d in (durations or {}).items() if d}
    weights = {s.name: known.get(s.name, known.get(s.group, 1.0)) for s in spec.steps}
    path = dag.critical_path(graph, weights)
    starts = _start_estimates(graph, known, spec.steps) if known else {}
    steps = tuple(_planned(s, level_of[s.name], known, starts, reuse or {})
                  for s in spec.steps)
    by_level: dict[int, list[str]] = {}
    for planned in steps:
        by_level.setdefault(planned.level, []).append(planned.name)
    sweeps: dict[str, int] = {}
    for record in spec.steps:
        if record.group:
            sweeps[record.group] = sweeps.get(record.group, 0) + 1
    all_known = bool(known) and all(n in known for n in path)
    return Plan(
        name=spec.name, steps=steps, critical_path=tuple(path),
        levels=tuple(tuple(by_level[i]) for i in sorted(by_level)),
        critical_path_s=sum(weights[n] for n in path) if all_known else None,
        sweeps=sweeps, max_parallel=dict(spec.max_parallel),
        capacity_problems=tuple(capacity_problems(spec.steps, nodes)) if nodes else (),
        estimate_basis=_basis(durations, nodes))


def _basis(durations: Mapping[str, Sequence[float]] | None,
           nodes: Sequence[NodeInfo] | None) -> str:
    if durations is None:
        return "no running system: no estimates"
    if not durations:
        return "no earlier runs of this pipeline to estimate from"
    runs = max(len(d) for d in durations.values())
    return (f"durations are medians of up to {runs} earlier run(s); start times assume "
            "free capacity")


def _planned(step: StepRecord, level: int, known: Mapping[str, float],
             starts: Mapping[str, float], reuse: Mapping[str, str]) -> PlannedStep:
    retry = step.retry
    retries = f"{retry.failure} on failure, {retry.infrastructure} on node loss"
    return PlannedStep(
        name=step.name, type=step.type, level=level, depends_on=step.depends_on,
        gpus=step.resources.gpus, cpus=step.resources.cpus,
        gpu_memory_mb=step.resources.gpu_memory_mb, memory_mb=step.resources.memory_mb,
        urgency=step.urgency, preemptible=step.preemptible, command=step.command,
        group=step.group, matrix=dict(step.matrix), outputs=step.outputs, inputs=step.inputs,
        timeout_s=step.timeout_s, retries=retries,
        estimated_s=known.get(step.name, known.get(step.group)),
        start_after_s=starts.get(step.name), reuse=reuse.get(step.name, ""))


def _start_estimates(graph: Mapping[str, Sequence[str]], known: Mapping[str, float],
                     steps: Sequence[StepRecord]) -> dict[str, float]:
    """Each step starts when its last dependency ends (unknown durations count as 0)."""
    group = {s.name: s.group for s in steps}
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    for name in dag.topological_order(graph):
        start[name] = max((end[d] for d in graph[name]), default=0.0)
        end[name] = start[name] + known.get(name, known.get(group[name], 0.0))
    return start


def capacity_problems(steps: Sequence[StepRecord], nodes: Sequence[NodeInfo]) -> list[str]:
    """Steps that ask for more than any node has (they would wait forever)."""
    problems = []
    for step in steps:
        why = _unfit(step, nodes)
        if why:
            problems.append(f"step {step.name}: {why}")
    return problems


def _unfit(step: StepRecord, nodes: Sequence[NodeInfo]) -> str:
    need = step.resources
    if not any(n.cpu_slots >= need.cpus for n in nodes):
        return (f"needs {need.cpus} CPU slots; the largest node has "
                f"{max(n.cpu_slots for n in nodes)}")
    if need.gpus == 0:
        return ""
    count = max(1, int(need.gpus))
    fitting = [n for n in nodes if len(n.gpus) >= count and n.cpu_slots >= need.cpus]
    if not fitting:
        most = max(len(n.gpus) for n in nodes)
        return f"needs {need.gpus:g} GPU(s) on one node; the most on a node is {most}"
    if need.gpu_memory_mb and not any(_memory_fits(n.gpus, need.gpu_memory_mb, need.gpus)
                                      for n in fitting):
        largest = max((g.memory_total_mb for n in fitting for g in n.gpus), default=0)
        return (f"needs {format_size(need.gpu_memory_mb << 20)} of GPU memory; the largest "
                f"GPU has {format_size(largest << 20)}")
    return _unmet(need.requirements, fitting, count)


def _unmet(needs: Requirements, nodes: Sequence[NodeInfo], count: int) -> str:
    """Requirements (GPU model, driver, CUDA) no node with room for the step meets."""
    if not needs:
        return ""
    misses = []
    for node in nodes:
        missed = node_misses([g.name for g in node.gpus], node.platform, needs, count)
        if not missed:
            return ""
        misses.append(f"{node.node_id}: {missed}")
    return f"needs {needs.text()}; no node meets it ({' | '.join(misses[:4])})"


def _memory_fits(gpus: Sequence[GpuInfo], memory_mb: int, share: float) -> bool:
    per_gpu = memory_mb / max(1, int(share)) if share >= 1 else memory_mb
    return any(g.memory_total_mb >= per_gpu for g in gpus)


def render_text(plan: Plan) -> str:
    """The plan for a terminal: levels, steps (sweeps folded), the critical path."""
    lines = [f"plan for {plan.name}: {len(plan.steps)} steps in {len(plan.levels)} level(s)"]
    steps = {s.name: s for s in plan.steps}
    for number, level in enumerate(plan.levels):
        lines.append(f"level {number}" + (" (can run in parallel)" if len(level) > 1 else ""))
        lines.extend(_level_lines(level, steps, plan))
    path = " → ".join(_shorten(plan.critical_path))
    took = f" ≈ {format_duration(plan.critical_path_s)}" if plan.critical_path_s else ""
    lines.append(f"critical path: {path}{took}")
    lines.append(f"estimates: {plan.estimate_basis}")
    for problem in plan.capacity_problems:
        lines.append(f"cannot run: {problem}")
    return "\n".join(lines)


def _level_lines(level: Sequence[str], steps: Mapping[str, PlannedStep], plan: Plan
                 ) -> list[str]:
    lines: list[str] = []
    shown_groups: set[str] = set()
    for name in level[:MAX_TEXT_STEPS_PER_LEVEL]:
        step = steps[name]
        if step.group and plan.sweeps.get(step.group, 0) > 3:
            if step.group in shown_groups:
                continue
            shown_groups.add(step.group)
            count = sum(1 for n in level if steps[n].group == step.group)
            cap = plan.max_parallel.get(step.group)
            label = f"{step.group} ×{count}" + (f" (at most {cap} at once)" if cap else "")
            lines.append(f"  {label:<28} {_resources(step)}")
            continue
        lines.append(f"  {step.name:<28} {_resources(step)}{_extras(step)}")
    hidden = [n for n in level[MAX_TEXT_STEPS_PER_LEVEL:]
              if not steps[n].group or steps[n].group not in shown_groups]
    if hidden:
        lines.append(f"  … and {len(hidden)} more (--format json lists every step)")
    return lines


def _resources(step: PlannedStep) -> str:
    parts = [step.type]
    if step.gpus:
        parts.append(f"{step.gpus:g} GPU")
    parts.append(f"{step.cpus} CPU")
    if step.gpu_memory_mb:
        parts.append(f"{format_size(step.gpu_memory_mb << 20)} GPU memory")
    if step.memory_mb:
        parts.append(f"{format_size(step.memory_mb << 20)} memory")
    if step.urgency != "normal":
        parts.append(step.urgency)
    return ", ".join(parts)


def _extras(step: PlannedStep) -> str:
    extras = []
    if step.estimated_s is not None:
        extras.append(f"≈ {format_duration(step.estimated_s)}")
    if step.start_after_s is not None:
        extras.append(f"starts ≈ +{format_duration(step.start_after_s)}")
    if step.reuse.startswith("r-"):
        extras.append(f"reuses {step.reuse}")
    return ("   " + "; ".join(extras)) if extras else ""


def _shorten(path: Sequence[str], keep: int = 8) -> list[str]:
    if len(path) <= keep:
        return list(path)
    return [*path[:keep // 2], f"… {len(path) - keep} more …", *path[-keep // 2:]]
