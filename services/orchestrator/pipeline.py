"""Pipeline YAML → a validated plan (pure). Every problem in a file is reported at once.

The seed format users already write:

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

Each problem carries `file:line:column`, the key path (`pipeline[2].depends_on`), what was
expected, and a hint where one helps. `{{NAME}}` placeholders are filled from the submitted
variables as literal text quoted for their place in the command (see `shellquote`), so a
value can never become shell syntax.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec
import yaml

from m27.common.errors import M27Error
from m27.common.ids import is_valid_name
from m27.common.model import STEP_TYPES, Resources, StepType
from m27.common.units import parse_duration
from m27.orchestrator import dag, shellquote

MAX_PIPELINE_BYTES: Final = 1024 * 1024
MAX_STEPS: Final = 5000
MAX_COMMAND_BYTES: Final = 64 * 1024
MAX_VAR_BYTES: Final = 64 * 1024
TOP_KEYS: Final = ("pipeline", "name")
STEP_KEYS: Final = ("name", "type", "command", "depends_on", "output", "checkpoint")
PLACEHOLDER_RE: Final = re.compile(r"\{\{(.*?)\}\}")
VAR_NAME_RE: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STR: Final = "tag:yaml.org,2002:str"
_NULL: Final = "tag:yaml.org,2002:null"
_KINDS: Final = {
    "tag:yaml.org,2002:int": "an integer", "tag:yaml.org,2002:float": "a number",
    "tag:yaml.org,2002:bool": "a boolean", "tag:yaml.org,2002:null": "nothing (null)",
}


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One thing wrong with a pipeline file, with where it is and what would fix it."""

    message: str
    path: str = ""
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    hint: str = ""

    def render(self, source: str) -> str:
        where = source
        if self.line is not None:
            where += f":{self.line}:{self.column or 1}"
        text = f"{where}: {self.path + ': ' if self.path else ''}{self.message}"
        return f"{text} ({self.hint})" if self.hint else text


class PipelineError(M27Error):
    """The pipeline cannot run; `problems` lists everything found, in file order."""

    def __init__(self, source: str, problems: Sequence[Problem]) -> None:
        self.source = source
        self.problems = tuple(sorted(problems, key=lambda p: (p.line or 0, p.column or 0)))
        count = len(self.problems)
        lines = [p.render(source) for p in self.problems]
        super().__init__(f"{source}: {count} problem{'s' if count != 1 else ''}:\n  "
                         + "\n  ".join(lines))


class StepSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    type: StepType
    command: str
    depends_on: tuple[str, ...] = ()
    output: str | None = None
    checkpoint_interval_s: float | None = None
    resources: Resources = Resources()


class PipelineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A valid pipeline: steps in an order where each follows its dependencies."""

    name: str
    steps: tuple[StepSpec, ...]

    def graph(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.depends_on for s in self.steps}


def load_pipeline(text: str, variables: Mapping[str, str] | None = None, *,
                  source: str = "<pipeline>", gpu_light_share: float = 0.5) -> PipelineSpec:
    """Parse, validate and fill in `text`; PipelineError lists every problem."""
    problems: list[Problem] = []
    if len(text.encode("utf-8", "surrogatepass")) > MAX_PIPELINE_BYTES:
        raise PipelineError(source, [Problem(
            message=f"file is larger than {MAX_PIPELINE_BYTES // 1024} KiB",
            hint="a pipeline describes steps; keep data in files the steps read")])
    root = _compose(text, problems)
    if root is None:
        raise PipelineError(source, problems)
    reader = _Reader(problems, gpu_light_share)
    name, steps = reader.document(root, default_name=_default_name(source))
    _check_graph(steps, reader.positions, problems)
    steps = _fill_variables(steps, dict(variables or {}), reader.positions, problems)
    if problems:
        raise PipelineError(source, problems)
    order = dag.topological_order({s.name: s.depends_on for s in steps})
    by_name = {s.name: s for s in steps}
    return PipelineSpec(name=name, steps=tuple(by_name[n] for n in order))


def _default_name(source: str) -> str:
    stem = source.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return stem if stem and not stem.startswith("<") else "pipeline"


def _compose(text: str, problems: list[Problem]) -> yaml.Node | None:
    """The YAML node tree (which keeps line numbers), or None with a problem recorded."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problems.append(Problem(
            message=f"not valid YAML: {exc.problem or exc.context}",
            line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None,
            hint=_yaml_hint(text, exc)))
        return None
    except yaml.YAMLError as exc:
        problems.append(Problem(message=f"not valid YAML: {_first_line(str(exc))}",
                                hint="the file must be UTF-8 text"))
        return None
    except RecursionError:
        problems.append(Problem(message="not valid YAML: nested too deeply"))
        return None
    if node is None:
        problems.append(Problem(message="the file is empty",
                                hint="start with `pipeline:` and a list of steps"))
    return node


def _yaml_hint(text: str, exc: yaml.MarkedYAMLError) -> str:
    if "\t" in text and "\t" in str(exc.problem or "") + str(exc):
        return "YAML does not allow tabs for indentation; use spaces"
    if "\t" in text and exc.problem and "cannot start any token" in exc.problem:
        return "YAML does not allow tabs for indentation; use spaces"
    if exc.problem and "mapping values are not allowed" in exc.problem:
        return "check the indentation, or quote a value that contains ': '"
    return ""


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unreadable input"


class _Reader:
    """Walks the node tree, converting what is valid and recording what is not."""

    def __init__(self, problems: list[Problem], gpu_light_share: float) -> None:
        self.problems = problems
        self.gpu_light_share = gpu_light_share
        self.positions: dict[str, yaml.Node] = {}  # key path → node, for later problems

    def problem(self, node: yaml.Node | None, path: str, message: str, hint: str = "") -> None:
        mark = node.start_mark if node is not None else None
        self.problems.append(Problem(
            message=message, path=path, hint=hint,
            line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None))

    def mapping(self, node: yaml.Node, path: str, known: Sequence[str],
                what: str) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, path, f"expected {what} (a mapping of keys), got {_kind(node)}")
            return {}
        result: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            key_path = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.problem(key_node, path, "keys must be plain words")
            elif key not in known:
                self.problem(key_node, key_path, f"unknown key `{key}`",
                             _did_you_mean(key, known) or f"known keys: {', '.join(known)}")
            elif key in result:
                self.problem(key_node, key_path, f"`{key}` is given twice")
            else:
                result[key] = value_node
                self.positions[key_path] = value_node
        return result

    def string(self, node: yaml.Node, path: str) -> str | None:
        """A scalar's text as written: `command: true` is the shell's `true`, not a bool."""
        if isinstance(node, yaml.ScalarNode) and node.tag != _NULL:
            return str(node.value)
        self.problem(node, path, f"expected a string, got {_kind(node)}")
        return None

    def document(self, root: yaml.Node, default_name: str) -> tuple[str, list[StepSpec]]:
        top = self.mapping(root, "", TOP_KEYS, "a pipeline")
        if not top and isinstance(root, yaml.MappingNode):
            self.problem(root, "", "no `pipeline:` list of steps")
        name = default_name
        if "name" in top:
            name = self.string(top["name"], "name") or default_name
        if "pipeline" not in top:
            if top:
                self.problem(root, "pipeline", "missing the `pipeline:` list of steps")
            return name, []
        return name, self.steps(top["pipeline"])

    def steps(self, node: yaml.Node) -> list[StepSpec]:
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, "pipeline", f"expected a list of steps, got {_kind(node)}",
                         "each step starts with `- name: ...`")
            return []
        if not node.value:
            self.problem(node, "pipeline", "the pipeline has no steps")
        if len(node.value) > MAX_STEPS:
            self.problem(node, "pipeline", f"more than {MAX_STEPS} steps")
            return []
        steps = [self.step(item, f"pipeline[{i}]") for i, item in enumerate(node.value)]
        return [s for s in steps if s is not None]

    def step(self, node: yaml.Node, path: str) -> StepSpec | None:
        fields = self.mapping(node, path, STEP_KEYS, "a step")
        name = self._name(fields, node, path)
        step_type = self._type(fields, path)
        command = self._command(fields, node, path)
        depends_on = self._depends_on(fields, path)
        output = self.string(fields["output"], f"{path}.output") if "output" in fields else None
        checkpoint = self._checkpoint(fields, path)
        if name is None:
            return None
        # A step with problems is still returned: the graph checks can then report
        # unknown dependencies and duplicates in the same pass. Problems decide the outcome.
        self.positions[f"step:{name}"] = node
        return StepSpec(name=name, type=step_type, command=command or "",
                        depends_on=depends_on,
                        output=output, checkpoint_interval_s=checkpoint,
                        resources=self._resources(step_type))

    def _name(self, fields: dict[str, yaml.Node], node: yaml.Node, path: str) -> str | None:
        if "name" not in fields:
            if isinstance(node, yaml.MappingNode):
                self.problem(node, path, "the step has no `name`")
            return None
        name = self.string(fields["name"], f"{path}.name")
        if name is not None and not is_valid_name(name):
            self.problem(fields["name"], f"{path}.name", f"invalid step name {name!r}",
                         "use letters, digits, '-' and '_' (at most 100), starting with a "
                         "letter or digit")
            return None
        return name

    def _type(self, fields: dict[str, yaml.Node], path: str) -> StepType:
        if "type" not in fields:
            return "cpu"
        value = self.string(fields["type"], f"{path}.type")
        for known in STEP_TYPES:
            if value == known:
                return known
        if value is not None:
            self.problem(fields["type"], f"{path}.type", f"unknown step type {value!r}",
                         _did_you_mean(value, STEP_TYPES)
                         or f"one of: {', '.join(STEP_TYPES)}")
        return "cpu"

    def _command(self, fields: dict[str, yaml.Node], node: yaml.Node,
                 path: str) -> str | None:
        if "command" not in fields:
            if isinstance(node, yaml.MappingNode):
                self.problem(node, path, "the step has no `command`")
            return None
        command = self.string(fields["command"], f"{path}.command")
        if command is not None and not command.strip():
            self.problem(fields["command"], f"{path}.command", "the command is empty")
            return None
        return command

    def _depends_on(self, fields: dict[str, yaml.Node], path: str) -> tuple[str, ...]:
        node = fields.get("depends_on")
        if node is None:
            return ()
        key = f"{path}.depends_on"
        if isinstance(node, yaml.ScalarNode) and node.tag == _STR:
            self.positions[f"{key}[0]"] = node
            return (node.value,)
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, key, f"expected a list of step names, got {_kind(node)}")
            return ()
        deps: list[str] = []
        for i, item in enumerate(node.value):
            value = self.string(item, f"{key}[{i}]")
            if value is not None:
                self.positions[f"{key}[{len(deps)}]"] = item
                deps.append(value)
        return tuple(deps)

    def _checkpoint(self, fields: dict[str, yaml.Node], path: str) -> float | None:
        node = fields.get("checkpoint")
        if node is None:
            return None
        key = f"{path}.checkpoint"
        if not isinstance(node, yaml.ScalarNode) or node.tag not in {_STR, *_NUMERIC}:
            self.problem(node, key, f"expected a duration such as 300s, got {_kind(node)}")
            return None
        try:
            seconds = parse_duration(node.value)
        except ValueError as exc:
            self.problem(node, key, str(exc))
            return None
        if seconds <= 0:
            self.problem(node, key, "the checkpoint interval must be longer than 0s")
            return None
        return seconds

    def _resources(self, step_type: StepType) -> Resources:
        if step_type == "gpu":
            return Resources(gpus=1.0, cpus=1)
        if step_type == "gpu_light":
            return Resources(gpus=self.gpu_light_share, cpus=1)
        return Resources(gpus=0.0, cpus=1)


_NUMERIC: Final = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if node.tag == _STR:
        return f"the string {node.value!r}"
    shown = f" ({node.value})" if node.value and node.tag != _NULL else ""
    return _KINDS.get(node.tag, "a value") + shown


def _did_you_mean(value: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else ""


def _check_graph(steps: list[StepSpec], positions: Mapping[str, yaml.Node],
                 problems: list[Problem]) -> None:
    """Duplicate names, unknown or self dependencies, cycles (printed as a path)."""
    first: dict[str, int] = {}
    for i, step in enumerate(steps):
        if step.name in first:
            node = positions.get(f"step:{step.name}")
            problems.append(_at(node, f"pipeline[{i}].name",
                                f"duplicate step name `{step.name}`",
                                "step names must be unique"))
        first.setdefault(step.name, i)
    names = list(first)
    for i, step in enumerate(steps):
        for j, dep in enumerate(step.depends_on):
            node = positions.get(f"pipeline[{i}].depends_on[{j}]")
            path = f"pipeline[{i}].depends_on"
            if dep == step.name:
                problems.append(_at(node, path, f"step `{dep}` depends on itself"))
            elif dep not in first:
                problems.append(_at(node, path, f"unknown step `{dep}`",
                                    _did_you_mean(dep, names)
                                    or f"steps are: {', '.join(names)}"))
    graph = {s.name: tuple(d for d in s.depends_on if d != s.name) for s in steps}
    for cycle in dag.find_cycles(graph):
        node = positions.get(f"step:{cycle[0]}")
        problems.append(_at(node, "pipeline", "dependency cycle: " + " → ".join(cycle),
                            "a step cannot depend on itself, directly or through other steps"))


def _at(node: yaml.Node | None, path: str, message: str, hint: str = "") -> Problem:
    mark = node.start_mark if node is not None else None
    return Problem(message=message, path=path, hint=hint,
                   line=mark.line + 1 if mark else None,
                   column=mark.column + 1 if mark else None)


def _fill_variables(steps: list[StepSpec], variables: dict[str, str],
                    positions: Mapping[str, yaml.Node],
                    problems: list[Problem]) -> list[StepSpec]:
    """Replace `{{NAME}}` in commands by the shell-quoted value; output paths get it raw."""
    for name, value in variables.items():
        if not VAR_NAME_RE.match(name):
            problems.append(Problem(message=f"invalid variable name {name!r}",
                                    hint="use letters, digits and '_', not starting with "
                                    "a digit"))
        elif "\x00" in value or len(value.encode()) > MAX_VAR_BYTES:
            problems.append(Problem(message=f"variable {name} has a NUL byte or is longer "
                                    f"than {MAX_VAR_BYTES // 1024} KiB"))
    filled = []
    for i, step in enumerate(steps):
        command = _render(step.command, variables, True, f"pipeline[{i}].command",
                          positions, problems)
        output = step.output
        if output is not None:
            output = _render(output, variables, False, f"pipeline[{i}].output", positions,
                             problems)
        if len(command.encode()) > MAX_COMMAND_BYTES:
            problems.append(_at(positions.get(f"pipeline[{i}].command"),
                                f"pipeline[{i}].command",
                                f"the command is longer than {MAX_COMMAND_BYTES // 1024} KiB"))
        filled.append(msgspec.structs.replace(step, command=command, output=output))
    return filled


def _render(template: str, variables: Mapping[str, str], shell: bool, path: str,
            positions: Mapping[str, yaml.Node], problems: list[Problem]) -> str:
    """Fill placeholders; with `shell`, each value is quoted for its spot in the command."""

    def value_for(match: re.Match[str]) -> str | None:
        name = match.group(1).strip()
        node = positions.get(path)
        if not VAR_NAME_RE.match(name):
            problems.append(_at(node, path, f"`{{{{{match.group(1)}}}}}` is not a variable",
                                "variables look like {{NAME}}"))
            return None
        if name not in variables:
            problems.append(_at(node, path, f"undefined variable `{name}`",
                                _did_you_mean(name, sorted(variables))
                                or f"pass it with `--var {name}=VALUE`"))
            return None
        return variables[name]

    if shell:
        return shellquote.substitute(template, PLACEHOLDER_RE, value_for)
    return PLACEHOLDER_RE.sub(lambda m: value_for(m) or m.group(0), template)
