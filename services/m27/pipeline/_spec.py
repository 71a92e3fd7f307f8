"""Pipeline YAML → a validated, expanded plan of steps (pure). Every problem is reported at once.

The seed format users already write keeps working as written:

    pipeline:
      - name: preprocessing
        type: cpu
        command: python prepare_pdb.py --input {{INPUT_FILE}}
        output: /tmp/preprocessed.pdb
      - name: md_simulation
        type: gpu
        depends_on: [preprocessing]
        checkpoint: 300s
        command: gmx mdrun -deffnm simulation -v

On top of it: `vars:`, `resources:`, `priority:`, `preemptible:`, `retries:`, `timeout:`,
`env:`, `workdir:`, `inputs:`/`outputs:`, `{{steps.X.output}}` references and `matrix:`
sweeps with `max_parallel:` (docs/pipelines.md). Each problem carries `file:line:column`,
the key path, what was expected and a hint where one helps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Final

import msgspec
import yaml

from m27.common.hints import did_you_mean
from m27.common.model import Resources, StepRecord, StepType, Urgency
from m27.pipeline import _matrix, dag
from m27.pipeline._document import DocumentReader, RawDocument, RawStep
from m27.pipeline._templates import VAR_NAME_RE, Renderer, Scope
from m27.pipeline._yaml import PipelineError, Problem, compose, problem_at

MAX_PIPELINE_BYTES: Final = 1024 * 1024
MAX_STEPS: Final = 20_000
#: Dependencies in the whole plan after expansion (each `depends_on` on a sweep counts
#: every member, for every member of the depending step): bounded before they are built.
MAX_DEPENDENCIES: Final = 200_000
#: Unknown dependencies that get a "did you mean" (each one searches every step name).
MAX_HINTED: Final = 50
MAX_COMMAND_BYTES: Final = 64 * 1024
MAX_VAR_BYTES: Final = 64 * 1024
#: All the variables and secrets given with one submission, names and values: they travel
#: in one bus message with the document (NATS takes 8 MB at most).
MAX_VARIABLES_BYTES: Final = 1024 * 1024
#: Different sets of secret values one run may hand its steps (each is one KV entry; the
#: steps of a sweep usually share one).
MAX_SECRET_SETS: Final = 100
MAX_SECRET_SET_BYTES: Final = 256 * 1024
TENTH_TOLERANCE: Final = 1e-9


class PipelineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A valid pipeline: its steps (sweeps expanded) in an order where each follows its
    dependencies, ready to become a run."""

    name: str
    urgency: Urgency
    steps: tuple[StepRecord, ...]
    max_parallel: dict[str, int] = msgspec.field(default_factory=dict)
    variables: dict[str, str] = msgspec.field(default_factory=dict)  # secret ones left out
    #: The secret environment values, apart from the steps (which name theirs by
    #: `secret_set`, an index here): stored apart and never shown.
    secret_sets: tuple[dict[str, str], ...] = ()

    def graph(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.depends_on for s in self.steps}


@dataclass
class _Draft:
    """One step to be: a plain step, or one member of a sweep."""

    raw: RawStep
    name: str
    matrix: dict[str, str] = field(default_factory=dict)
    depends_on: tuple[str, ...] = ()


def load_pipeline(text: str, variables: Mapping[str, str] | None = None, *,
                  source: str = "<pipeline>", gpu_light_share: float = 0.5,
                  urgency: Urgency | None = None, workdir: str = "",
                  secrets: Mapping[str, str] | None = None) -> PipelineSpec:
    """Parse, validate, expand and fill in `text`; PipelineError lists every problem.

    `urgency` (the submitter's, if given) overrides the file's `priority:` for steps that
    set none; `workdir` (the run's) makes output references absolute. `secrets` are
    values of secret variables (`--secret`): like `vars:` declared `secret: true`, they
    may fill only environment values, and every value they fill is secret."""
    problems: list[Problem] = []
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PIPELINE_BYTES:
        raise PipelineError(source, [Problem(
            message=f"file is larger than {MAX_PIPELINE_BYTES // 1024} KiB",
            hint="a pipeline describes steps; keep data in files the steps read")])
    root = compose(text, problems)
    if root is None:
        raise PipelineError(source, problems)
    doc = DocumentReader(problems).document(root, default_name=_default_name(source))
    values, secret_vars = _variables(doc, dict(variables or {}), dict(secrets or {}),
                                     problems)
    expanded = _expand(doc.steps, problems)
    if expanded is None or not _link(doc.steps, *expanded, problems):
        raise PipelineError(source, _unique(problems))  # too big to look at any further
    drafts, members = expanded
    order = _order(drafts, doc.steps, problems)
    sets = _SecretSets()
    steps = _build(order, doc, values, secret_vars, members, gpu_light_share, urgency,
                   workdir, sets, problems)
    if problems:
        raise PipelineError(source, _unique(problems))
    caps = {raw.name: raw.max_parallel for raw in doc.steps if raw.max_parallel}
    plain = {k: v for k, v in values.items() if k not in secret_vars}
    return PipelineSpec(name=doc.name, urgency=urgency or doc.urgency or "normal",
                        steps=tuple(steps), max_parallel=caps, variables=plain,
                        secret_sets=tuple(sets.values))


def _default_name(source: str) -> str:
    stem = source.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return stem if stem and not stem.startswith("<") else "pipeline"


def _unique(problems: list[Problem]) -> list[Problem]:
    """A placeholder problem in a sweep is found once per member; report it once."""
    return list(dict.fromkeys(problems))


def _variables(doc: RawDocument, given: dict[str, str], secrets: dict[str, str],
               problems: list[Problem]) -> tuple[dict[str, str], frozenset[str]]:
    """The values placeholders see (`vars:` defaults overlaid with the submitted ones,
    secret ones included) and the names of the secret ones."""
    for name in sorted(given.keys() & secrets.keys()):
        problems.append(Problem(message=f"variable {name} was given both as --var and as "
                                "--secret", hint="give it once"))
    submitted = {**given, **secrets}
    total = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
                for k, v in submitted.items())
    if total > MAX_VARIABLES_BYTES:
        problems.append(Problem(message=f"the variables given are {total // 1024} KiB in all, "
                                f"more than {MAX_VARIABLES_BYTES // 1024} KiB",
                                hint="pass data in files the steps read"))
    for name, value in submitted.items():
        if not VAR_NAME_RE.fullmatch(name):
            problems.append(Problem(message=f"invalid variable name {name!r}",
                                    hint="use letters, digits and '_', not starting with "
                                    "a digit"))
        elif "\x00" in value or len(value.encode("utf-8", "surrogatepass")) > MAX_VAR_BYTES:
            problems.append(Problem(message=f"variable {name} has a NUL byte or is longer "
                                    f"than {MAX_VAR_BYTES // 1024} KiB"))
    secret = frozenset(doc.secret_vars | secrets.keys())
    if not doc.declared_vars:
        return submitted, secret
    for name in submitted:
        if name not in doc.vars and VAR_NAME_RE.fullmatch(name):
            problems.append(Problem(
                message=f"variable {name} was given but the pipeline does not declare it",
                hint=did_you_mean(name, sorted(doc.vars))
                or f"declared: {', '.join(doc.vars) or 'none'}"))
    for name, default in doc.vars.items():
        if default is None and name not in submitted:
            how = f"--secret {name}" if name in secret else f"--var {name}=VALUE"
            problems.append(problem_at(doc.var_nodes.get(name), f"vars.{name}",
                                       f"variable `{name}` has no default and was not given",
                                       f"pass it with `{how}`"))
    defaults = {k: v for k, v in doc.vars.items() if v is not None}
    return {**defaults, **submitted}, secret


class _SecretSets:
    """The distinct sets of secret environment values of a run, each stored once."""

    def __init__(self) -> None:
        self.values: list[dict[str, str]] = []
        self._index: dict[tuple[tuple[str, str], ...], int] = {}

    def add(self, env: dict[str, str]) -> int | None:
        """The index of `env`'s set; None when the run already has MAX_SECRET_SETS."""
        key = tuple(sorted(env.items()))
        if key not in self._index:
            if len(self.values) >= MAX_SECRET_SETS:
                return None
            self._index[key] = len(self.values)
            self.values.append(dict(key))
        return self._index[key]


def _expand(raws: list[RawStep], problems: list[Problem]
            ) -> tuple[list[_Draft], dict[str, list[str]]] | None:
    """Drafts in file order (sweeps expanded) and each name's members (itself, or a
    sweep's members); duplicate names are problems. None (and a problem) when the sweeps
    would expand to more than MAX_STEPS: nothing is expanded then."""
    drafts: list[_Draft] = []
    members: dict[str, list[str]] = {}
    taken: dict[str, RawStep] = {}
    total = 0
    for raw in raws:  # the sizes first: a matrix's product is known before it is built
        size = _matrix.size(raw.matrix) if raw.matrix else 1
        total += size
        if total > MAX_STEPS:
            axes = " × ".join(str(len(values)) for _, values in raw.matrix) or "1"
            problems.append(problem_at(
                raw.node, f"{raw.path}.matrix" if raw.matrix else raw.path,
                f"the sweeps expand to more than {MAX_STEPS} steps (step `{raw.name[:100]}` "
                f"adds {axes} = {size})", "split the sweep into several pipelines"))
            return None
    for raw in raws:
        if raw.matrix:
            combos = _matrix.combinations(raw.matrix)
            names = _matrix.member_names(raw.name, combos)
            group = [_Draft(raw=raw, name=n, matrix=c) for n, c in zip(names, combos,
                                                                         strict=True)]
        else:
            group = [_Draft(raw=raw, name=raw.name)]
        for name in {raw.name, *(d.name for d in group)}:
            if name in taken:
                problems.append(problem_at(raw.node, f"{raw.path}.name",
                                           f"duplicate step name `{name}`",
                                           f"also at line {taken[name].node.start_mark.line + 1}"))
            taken[name] = raw
        members[raw.name] = [d.name for d in group]
        drafts.extend(group)
    for draft in drafts:
        members.setdefault(draft.name, [draft.name])
    return drafts, members


def _link(raws: list[RawStep], drafts: list[_Draft], members: dict[str, list[str]],
          problems: list[Problem]) -> bool:
    """Resolve depends_on (a step, a sweep, or one member of a sweep) for every draft;
    False (and a problem) when there would be more than MAX_DEPENDENCIES edges."""
    own: dict[str, set[str]] = {raw.name: set(members.get(raw.name, [])) | {raw.name}
                                for raw in raws}
    edges = sum(len(members.get(raw.name, ())) * sum(len(members.get(name, ()))
                                                     for name, _ in raw.depends_on)
                for raw in raws)
    if edges > MAX_DEPENDENCIES:
        problems.append(Problem(message=f"the dependencies expand to {edges} edges, more than "
                                f"{MAX_DEPENDENCIES}", hint="depend on fewer sweep members, "
                                "or gather a sweep's results in one step"))
        return False
    resolved: dict[int, tuple[str, ...]] = {}
    unknown = 0
    for raw in raws:
        deps: list[str] = []  # duplicates dropped below, keeping the first
        for name, node in raw.depends_on:
            if name in own[raw.name]:
                problems.append(problem_at(node, f"{raw.path}.depends_on",
                                           f"step `{name}` depends on itself"))
            elif name not in members:
                unknown += 1  # hints cost a search of every name: only the first few get one
                hint = "" if unknown > MAX_HINTED else (
                    did_you_mean(name, [r.name for r in raws])
                    or f"steps are: {', '.join(r.name for r in raws)}")
                problems.append(problem_at(node, f"{raw.path}.depends_on",
                                           f"unknown step `{name}`", hint))
            else:
                deps.extend(members[name])
        resolved[raw.index] = tuple(dict.fromkeys(deps))
    for draft in drafts:
        draft.depends_on = resolved.get(draft.raw.index, ())
    return True


def _order(drafts: list[_Draft], raws: list[RawStep], problems: list[Problem]) -> list[_Draft]:
    """Drafts so that each follows its dependencies; cycles (found between the steps as
    written, so a sweep's cycle is reported once) are problems, printed as a path."""
    owner = {d.name: d.raw.name for d in drafts}
    template_graph: dict[str, set[str]] = {raw.name: set() for raw in raws}
    for draft in drafts:
        template_graph[draft.raw.name].update(owner[d] for d in draft.depends_on)
    cycles = dag.find_cycles({k: sorted(v) for k, v in template_graph.items()})
    by_name = {raw.name: raw for raw in raws}
    for cycle in cycles:
        problems.append(problem_at(by_name[cycle[0]].node, "pipeline",
                                   "dependency cycle: " + " → ".join(cycle),
                                   "a step cannot depend on itself, directly or through "
                                   "other steps"))
    index = {d.name: d for d in drafts}
    if cycles or len(index) < len(drafts):  # broken graph: report the rest in file order
        return drafts
    return [index[n] for n in dag.topological_order({d.name: d.depends_on for d in drafts})]


def _kind(raw: RawStep, share: float, problems: list[Problem]) -> tuple[StepType, Resources]:
    """The step's type and resources; `type` sets defaults, `resources.gpus` refines them."""
    defaults: dict[StepType, float] = {"cpu": 0.0, "gpu": 1.0, "gpu_light": share}
    step_type = raw.type
    gpus = raw.gpus
    path = f"{raw.path}.resources.gpus"
    if gpus is None:
        step_type = step_type or "cpu"
        gpus = defaults[step_type]
    else:
        if abs(gpus * 10 - round(gpus * 10)) > TENTH_TOLERANCE:
            problems.append(problem_at(raw.gpus_node, path, f"gpus: {gpus:g} is not in tenths",
                                       "GPU shares come in tenths: 0.1, 0.2, … 0.9, 1, 2, …"))
        elif gpus > 1 and gpus != int(gpus):
            problems.append(problem_at(raw.gpus_node, path,
                                       f"gpus: {gpus:g}: more than one GPU must be a whole "
                                       "number", "a step gets either a share of one GPU or "
                                       "whole GPUs"))
        fitting: StepType = "cpu" if gpus == 0 else "gpu_light" if gpus < 1 else "gpu"
        if step_type is not None and step_type != fitting:
            problems.append(problem_at(raw.gpus_node, path,
                                       f"type {step_type} does not fit gpus: {gpus:g}",
                                       f"use type {fitting}, or leave type out"))
        step_type = step_type or fitting
    if raw.gpu_memory_mb and gpus == 0:
        problems.append(problem_at(raw.gpus_node or raw.node, f"{raw.path}.resources",
                                   "gpu_memory is set but the step uses no GPU"))
    needs = raw.requirements
    if needs and gpus == 0:
        problems.append(problem_at(raw.gpus_node or raw.node, f"{raw.path}.resources",
                                   f"{needs.text()} is required but the step uses no GPU",
                                   "GPU model, driver and CUDA requirements are for GPU "
                                   "steps"))
    return step_type, Resources(gpus=round(gpus, 1), cpus=raw.cpus,
                                gpu_memory_mb=raw.gpu_memory_mb, memory_mb=raw.memory_mb,
                                gpu_model=needs.gpu_model, driver=needs.driver,
                                cuda=needs.cuda)


def _reference_path(path: str, step_workdir: str, run_workdir: str) -> str:
    """Where another step finds this output: joined with the step's and the run's workdir."""
    result = PurePosixPath(path)
    if not result.is_absolute() and step_workdir:
        result = PurePosixPath(step_workdir) / result
    if not result.is_absolute() and run_workdir:
        result = PurePosixPath(run_workdir) / result
    return str(result)


def _build(order: Sequence[_Draft], doc: RawDocument, values: dict[str, str],
           secret_vars: frozenset[str], members: dict[str, list[str]], share: float,
           urgency: Urgency | None, run_workdir: str, sets: _SecretSets,
           problems: list[Problem]) -> list[StepRecord]:
    kinds = {raw.index: _kind(raw, share, problems) for raw in doc.steps}
    sweeps = {raw.name: len(members[raw.name]) for raw in doc.steps if raw.matrix}
    graph = {d.name: d.depends_on for d in order}
    names = [r.name for r in doc.steps]
    referable: dict[str, list[str]] = {}  # step or sweep → output paths, as steps are built
    steps: list[StepRecord] = []
    for draft in order:
        raw = draft.raw
        scope = Scope(variables=values, matrix=draft.matrix, outputs=referable,
                      members=sweeps, all_steps=names,
                      declared_vars=doc.declared_vars,
                      reaches=_reach(graph, draft.name, members), secret_vars=secret_vars)
        step = _step(draft, kinds[raw.index], scope, doc, urgency, sets, problems)
        steps.append(step)
        paths = [_reference_path(o, step.workdir, run_workdir) for o in step.outputs]
        referable[draft.name] = paths
        if raw.matrix:
            referable.setdefault(raw.name, []).extend(paths)
    return steps


def _reach(graph: Mapping[str, Sequence[str]], start: str,
           members: Mapping[str, list[str]]) -> Callable[[str], bool]:
    """Whether `start` depends, directly or not, on a step (or on every member of a sweep).
    Computed only when a placeholder asks: most steps never refer to others."""
    found: set[str] | None = None
    direct = set(graph[start])

    def reaches(name: str) -> bool:
        nonlocal found
        wanted = members.get(name, [name])
        if all(m in direct for m in wanted):
            return True  # the usual case, without walking the whole graph
        if found is None:
            found = dag.ancestors(graph, start)
        return all(m in found for m in wanted)

    return reaches


def _step(draft: _Draft, kind: tuple[StepType, Resources], scope: Scope, doc: RawDocument,
          urgency: Urgency | None, sets: _SecretSets, problems: list[Problem]) -> StepRecord:
    raw = draft.raw

    def renderer(node: yaml.Node | None, path: str) -> Renderer:
        return Renderer(scope, node, f"{raw.path}.{path}", problems)

    command = renderer(raw.command_node, "command").shell(raw.command)
    if "\x00" in command:
        problems.append(problem_at(raw.command_node, f"{raw.path}.command",
                                   "the command contains a NUL byte"))
    if len(command.encode("utf-8", "surrogatepass")) > MAX_COMMAND_BYTES:
        problems.append(problem_at(raw.command_node, f"{raw.path}.command",
                                   f"the command is longer than {MAX_COMMAND_BYTES // 1024} KiB"))
    workdir = renderer(raw.workdir[1], "workdir").raw(raw.workdir[0]) if raw.workdir else ""
    env, secret = _environment(raw, scope, problems)
    secret_set = -1
    if secret:
        got = sets.add(secret)
        if got is None:
            problems.append(problem_at(raw.node, f"{raw.path}.secrets",
                                       f"the run's steps have more than {MAX_SECRET_SETS} "
                                       "different sets of secret values",
                                       "give a sweep's members the same secrets"))
        secret_set = -1 if got is None else got
    return StepRecord(
        name=draft.name, type=kind[0], command=command, depends_on=draft.depends_on,
        outputs=tuple(renderer(n, "outputs").raw(v) for v, n in raw.outputs),
        inputs=tuple(renderer(n, "inputs").raw(v) for v, n in raw.inputs),
        checkpoint_interval_s=raw.checkpoint_s, resources=kind[1],
        urgency=raw.urgency or urgency or doc.urgency or "normal",
        preemptible=raw.preemptible if raw.preemptible is not None
        else bool(doc.preemptible),
        retry=raw.retry, timeout_s=raw.timeout_s,
        env=env, secret_env=tuple(sorted(secret)), secret_set=secret_set, workdir=workdir,
        group=raw.name if raw.matrix else "", matrix=draft.matrix,
        checkpoint_signal=raw.checkpoint_signal, monitor=raw.monitor)


def _environment(raw: RawStep, scope: Scope, problems: list[Problem]
                 ) -> tuple[dict[str, str], dict[str, str]]:
    """The step's plain and secret environment values. A value is secret when it is
    marked so (`secrets:`, `secret: true`) or fills in a secret variable."""
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    for name, node in raw.env:
        where = f"{raw.path}.{'secrets' if name in raw.secret_env else 'env'}.{name}"
        renderer = Renderer(scope, node, where, problems, secrets_allowed=True)
        value = renderer.raw(raw.env_values[name])
        if name in raw.secret_env or renderer.used_secret:
            secret[name] = value
        else:
            plain[name] = value
    size = sum(len(k) + len(v.encode("utf-8", "surrogatepass")) for k, v in secret.items())
    if size > MAX_SECRET_SET_BYTES:
        problems.append(problem_at(raw.node, f"{raw.path}.secrets",
                                   f"the step's secret values take more than "
                                   f"{MAX_SECRET_SET_BYTES // 1024} KiB",
                                   "pass a path to a file the step reads instead"))
    return plain, secret
