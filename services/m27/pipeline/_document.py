"""The pipeline language's keys, read from YAML nodes into raw (not yet expanded) steps.

Raw steps keep their templates and the nodes they came from; expansion, variables and the
dependency graph are handled by `pipeline`, which turns them into StepRecords.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec
import yaml

from m27.common.ids import is_valid_name
from m27.common.metric_points import METRIC_NAME_RE
from m27.common.model import (
    ANOMALY_ACTIONS,
    CHECKPOINT_SIGNALS,
    MONITOR_MODES,
    STEP_TYPES,
    URGENCIES,
    AnomalyAction,
    MonitorSpec,
    RetryPolicy,
    StepType,
    Urgency,
)
from m27.common.platform import (
    PlatformError,
    Requirements,
    model_alternatives,
    parse_requirement,
)
from m27.pipeline._yaml import NULL, Reader, kind

TOP_KEYS: Final = ("name", "vars", "priority", "preemptible", "pipeline")
STEP_KEYS: Final = ("name", "type", "command", "depends_on", "output", "outputs", "inputs",
                    "checkpoint", "resources", "priority", "preemptible", "retries",
                    "timeout", "env", "workdir", "matrix", "max_parallel",
                    "checkpoint_signal", "secrets", "monitor")
RESOURCE_KEYS: Final = ("gpus", "gpu_memory", "cpus", "memory", "gpu_model", "driver", "cuda")
RETRY_KEYS: Final = ("failure", "infrastructure", "backoff")
BACKOFF_KEYS: Final = ("initial", "factor", "max")
MONITOR_KEYS: Final = ("metric", "mode", "window", "warmup", "spike", "divergence",
                       "plateau", "min_delta", "on_anomaly")
#: Metrics one step's monitor may watch.
MAX_MONITORS: Final = 16
#: The spike baseline's window at most: the agent takes its median at every value, so the
#: window bounds what one logged value costs it.
MAX_MONITOR_WINDOW: Final = 1000
VAR_KEYS: Final = ("default", "secret")
ENV_KEYS: Final = ("value", "secret")
MAX_STEP_TEMPLATES: Final = 5000
MAX_MATRIX_VALUES: Final = 1000
MAX_LABEL: Final = 200
CONTROL_RE: Final = re.compile("[\x00-\x1f\x7f-\x9f]")
IDENTIFIER_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV: Final = ("M27_", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")

Located = tuple[str, yaml.Node]


@dataclass
class RawStep:
    """One step as written: templates not yet filled, matrix not yet expanded."""

    index: int
    node: yaml.Node
    name: str
    command: str = ""
    command_node: yaml.Node | None = None
    type: StepType | None = None
    depends_on: list[Located] = field(default_factory=list)
    outputs: list[Located] = field(default_factory=list)
    inputs: list[Located] = field(default_factory=list)
    checkpoint_s: float | None = None
    gpus: float | None = None
    gpus_node: yaml.Node | None = None
    gpu_memory_mb: int = 0
    cpus: int = 1
    memory_mb: int = 0
    requirements: Requirements = field(default_factory=Requirements)
    urgency: Urgency | None = None
    preemptible: bool | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout_s: float | None = None
    env: list[Located] = field(default_factory=list)  # (NAME, value node)
    env_values: dict[str, str] = field(default_factory=dict)
    secret_env: set[str] = field(default_factory=set)  # names whose value is secret
    workdir: Located | None = None
    matrix: list[tuple[str, list[str]]] = field(default_factory=list)
    max_parallel: int | None = None
    checkpoint_signal: str = "SIGUSR1"
    monitor: tuple[MonitorSpec, ...] = ()

    @property
    def path(self) -> str:
        return f"pipeline[{self.index}]"


@dataclass
class RawDocument:
    name: str
    declared_vars: bool = False  # a `vars:` section is present
    vars: dict[str, str | None] = field(default_factory=dict)  # None: must be given
    var_nodes: dict[str, yaml.Node] = field(default_factory=dict)
    secret_vars: set[str] = field(default_factory=set)  # `vars: {x: {secret: true}}`
    urgency: Urgency | None = None
    preemptible: bool | None = None
    steps: list[RawStep] = field(default_factory=list)


class DocumentReader(Reader):
    def document(self, root: yaml.Node, default_name: str) -> RawDocument:
        top = self.mapping(root, "", TOP_KEYS, "a pipeline")
        doc = RawDocument(name=default_name)
        if "name" in top:
            doc.name = self._label(top["name"]) or default_name
        if "vars" in top:
            doc.declared_vars = True
            self._vars(top["vars"], doc)
        if "priority" in top:
            doc.urgency = self._urgency(top["priority"], "priority")
        if "preemptible" in top:
            doc.preemptible = self.boolean(top["preemptible"], "preemptible")
        if "pipeline" not in top:
            if isinstance(root, yaml.MappingNode):
                self.problem(root, "pipeline", "missing the `pipeline:` list of steps")
            return doc
        doc.steps = self._steps(top["pipeline"])
        return doc

    def _label(self, node: yaml.Node) -> str | None:
        """The pipeline's name: a label for people (reports, `m27 runs`), so printable."""
        name = self.string(node, "name")
        if name is not None and (len(name) > MAX_LABEL or CONTROL_RE.search(name)):
            self.problem(node, "name", f"the pipeline name must be text of at most "
                         f"{MAX_LABEL} characters, without control characters")
            return None
        return name

    def _urgency(self, node: yaml.Node, path: str) -> Urgency | None:
        value = self.choice(node, path, URGENCIES, "priority")
        return next((u for u in URGENCIES if u == value), None)

    def _vars(self, node: yaml.Node, doc: RawDocument) -> None:
        """`name: default`, `name:` (must be given), or `name: {default: …, secret: true}`."""
        for name, value in self.pairs(node, "vars", "variables with their defaults"):
            if not IDENTIFIER_RE.fullmatch(name):
                self.problem(value, f"vars.{name}", f"invalid variable name {name!r}",
                             "use letters, digits and '_', not starting with a digit")
                continue
            doc.var_nodes[name] = value
            if isinstance(value, yaml.MappingNode):
                fields = self.mapping(value, f"vars.{name}", VAR_KEYS, "a variable")
                if "secret" in fields and self.boolean(fields["secret"],
                                                       f"vars.{name}.secret"):
                    doc.secret_vars.add(name)
                value = fields.get("default", yaml.ScalarNode(NULL, "", value.start_mark))
            if isinstance(value, yaml.ScalarNode) and value.tag == NULL:
                doc.vars[name] = None
            else:
                doc.vars[name] = self.string(value, f"vars.{name}")

    def _steps(self, node: yaml.Node) -> list[RawStep]:
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, "pipeline", f"expected a list of steps, got {kind(node)}",
                         "each step starts with `- name: ...`")
            return []
        if not node.value:
            self.problem(node, "pipeline", "the pipeline has no steps")
        if len(node.value) > MAX_STEP_TEMPLATES:
            self.problem(node, "pipeline", f"more than {MAX_STEP_TEMPLATES} steps")
            return []
        steps = [self._step(item, i) for i, item in enumerate(node.value)]
        return [s for s in steps if s is not None]

    def _step(self, node: yaml.Node, index: int) -> RawStep | None:
        path = f"pipeline[{index}]"
        fields = self.mapping(node, path, STEP_KEYS, "a step")
        name = self._name(fields, node, path)
        if name is None:
            return None
        step = RawStep(index=index, node=node, name=name)
        self._command(fields, step)
        self._basics(fields, step)
        self._resources(fields.get("resources"), step)
        if "retries" in fields:
            step.retry = self._retries(fields["retries"], f"{path}.retries")
        self._env(fields.get("env"), step)
        self._env(fields.get("secrets"), step, secret=True)
        self._matrix(fields, step)
        if "monitor" in fields:
            step.monitor = self._monitors(fields["monitor"], f"{path}.monitor")
        return step

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

    def _command(self, fields: dict[str, yaml.Node], step: RawStep) -> None:
        if "command" not in fields:
            if isinstance(step.node, yaml.MappingNode):
                self.problem(step.node, step.path, "the step has no `command`")
            return
        command = self.string(fields["command"], f"{step.path}.command")
        if command is not None and not command.strip():
            self.problem(fields["command"], f"{step.path}.command", "the command is empty")
        step.command, step.command_node = command or "", fields["command"]

    def _basics(self, fields: dict[str, yaml.Node], step: RawStep) -> None:
        path = step.path
        if "type" in fields:
            value = self.choice(fields["type"], f"{path}.type", STEP_TYPES, "step type")
            step.type = next((t for t in STEP_TYPES if t == value), None)
        if "depends_on" in fields:
            step.depends_on = self.strings(fields["depends_on"], f"{path}.depends_on",
                                           "step names")
        if "output" in fields and "outputs" in fields:
            self.problem(fields["outputs"], f"{path}.outputs",
                         "give `output` or `outputs`, not both")
        for key in ("output", "outputs"):
            if key in fields:
                step.outputs = self.strings(fields[key], f"{path}.{key}", "paths")
        if "inputs" in fields:
            step.inputs = self.strings(fields["inputs"], f"{path}.inputs", "paths")
        if "checkpoint" in fields:
            step.checkpoint_s = self.duration(fields["checkpoint"], f"{path}.checkpoint")
        if "timeout" in fields:
            step.timeout_s = self.duration(fields["timeout"], f"{path}.timeout", "2h")
        if "priority" in fields:
            step.urgency = self._urgency(fields["priority"], f"{path}.priority")
        if "preemptible" in fields:
            step.preemptible = self.boolean(fields["preemptible"], f"{path}.preemptible")
        if "checkpoint_signal" in fields:
            signal_name = self.choice(fields["checkpoint_signal"], f"{path}.checkpoint_signal",
                                      CHECKPOINT_SIGNALS, "signal")
            step.checkpoint_signal = signal_name or step.checkpoint_signal
        if "workdir" in fields:
            workdir = self.string(fields["workdir"], f"{path}.workdir")
            step.workdir = (workdir, fields["workdir"]) if workdir else None

    def _resources(self, node: yaml.Node | None, step: RawStep) -> None:
        if node is None:
            return
        path = f"{step.path}.resources"
        fields = self.mapping(node, path, RESOURCE_KEYS, "resources")
        if "gpus" in fields:
            step.gpus = self.number(fields["gpus"], f"{path}.gpus", 0, 64)
            step.gpus_node = fields["gpus"]
        if "cpus" in fields:
            step.cpus = self.integer(fields["cpus"], f"{path}.cpus", 1, 1024) or 1
        if "gpu_memory" in fields:
            step.gpu_memory_mb = self.size_mb(fields["gpu_memory"], f"{path}.gpu_memory") or 0
        if "memory" in fields:
            step.memory_mb = self.size_mb(fields["memory"], f"{path}.memory") or 0
        step.requirements = self._requirements(fields, path)

    def _requirements(self, fields: Mapping[str, yaml.Node], path: str) -> Requirements:
        """`gpu_model`, `driver`, `cuda`: where the step may run (m27.common.platform)."""
        written: dict[str, str] = {}
        for key in ("gpu_model", "driver", "cuda"):
            if key not in fields:
                continue
            value = self.string(fields[key], f"{path}.{key}")
            if value is None:
                continue
            try:
                if key == "gpu_model":
                    model_alternatives(value)
                else:
                    parse_requirement(value, key)
            except PlatformError as exc:
                self.problem(fields[key], f"{path}.{key}", str(exc))
                continue
            written[key] = value.strip()
        return Requirements(**written)

    def _retries(self, node: yaml.Node, path: str) -> RetryPolicy:
        """`retries: 2` (program failures) or the full form with its backoff."""
        if isinstance(node, yaml.ScalarNode):
            count = self.integer(node, path, 0, 100)
            return RetryPolicy(failure=count or 0)
        fields = self.mapping(node, path, RETRY_KEYS, "a retry policy")
        values: dict[str, float] = {}
        for key in ("failure", "infrastructure"):
            if key in fields:
                got = self.integer(fields[key], f"{path}.{key}", 0, 100)
                if got is not None:
                    values[key] = got
        if "backoff" in fields:
            values.update(self._backoff(fields["backoff"], f"{path}.backoff"))
        defaults = RetryPolicy()
        policy = RetryPolicy(
            failure=int(values.get("failure", defaults.failure)),
            infrastructure=int(values.get("infrastructure", defaults.infrastructure)),
            initial_delay_s=values.get("initial", defaults.initial_delay_s),
            factor=values.get("factor", defaults.factor),
            max_delay_s=values.get("max", defaults.max_delay_s))
        if policy.max_delay_s < policy.initial_delay_s:
            self.problem(fields.get("backoff"), f"{path}.backoff.max",
                         "the longest delay is shorter than the first one")
        return policy

    def _monitors(self, node: yaml.Node, path: str) -> tuple[MonitorSpec, ...]:
        """`monitor: true` (the defaults: `loss`), one metric's mapping, or a list of them."""
        if isinstance(node, yaml.ScalarNode):
            on = self.boolean(node, path)
            return (MonitorSpec(),) if on else ()
        if not isinstance(node, yaml.SequenceNode):
            return self._monitor(node, path)
        if len(node.value) > MAX_MONITORS:
            self.problem(node, path, f"more than {MAX_MONITORS} monitored metrics")
            return ()
        specs = [spec for i, item in enumerate(node.value)
                 for spec in self._monitor(item, f"{path}[{i}]")]
        names = [s.metric for s in specs]
        for name in sorted({n for n in names if names.count(n) > 1}):
            self.problem(node, path, f"the metric {name!r} is monitored twice",
                         "give each metric once, with all its limits")
        return tuple(specs)

    def _monitor(self, node: yaml.Node, path: str) -> tuple[MonitorSpec, ...]:
        fields = self.mapping(node, path, MONITOR_KEYS, "a monitored metric")
        if not fields and not isinstance(node, yaml.MappingNode):
            return ()
        values: dict[str, object] = {}
        if "metric" in fields:
            metric = self.string(fields["metric"], f"{path}.metric")
            if metric is not None and not METRIC_NAME_RE.fullmatch(metric):
                self.problem(fields["metric"], f"{path}.metric",
                             f"invalid metric name {metric[:100]!r}",
                             "a name as the step logs it: letters, digits, '_', '.', '/', '-'")
            elif metric is not None:
                values["metric"] = metric
        if "mode" in fields:
            values["mode"] = self.choice(fields["mode"], f"{path}.mode", MONITOR_MODES, "mode")
        for key, low, high in (("window", 2, MAX_MONITOR_WINDOW), ("warmup", 1, 100_000),
                               ("divergence", 0, 100_000), ("plateau", 0, 100_000)):
            if key in fields:
                values[key] = self.integer(fields[key], f"{path}.{key}", low, high)
        for name, top in (("spike", 1000.0), ("min_delta", 1.0)):
            if name in fields:
                values[name] = self.number(fields[name], f"{path}.{name}", 0, top)
        if "on_anomaly" in fields:
            actions = [a for a, n in self.strings(fields["on_anomaly"], f"{path}.on_anomaly",
                                                  "actions")
                       if self._action(a, n, f"{path}.on_anomaly")]
            if len(set(actions)) < len(actions):
                self.problem(fields["on_anomaly"], f"{path}.on_anomaly",
                             "an action is given twice")
            values["on_anomaly"] = tuple(dict.fromkeys(actions))
        try:
            return (msgspec.convert({k: v for k, v in values.items() if v is not None},
                                    MonitorSpec),)
        except msgspec.ValidationError as exc:  # every value was checked above
            self.problem(node, path, str(exc))
            return ()

    def _action(self, action: str, node: yaml.Node, path: str) -> AnomalyAction | None:
        found = next((a for a in ANOMALY_ACTIONS if a == action), None)
        if found is None:
            self.problem(node, path, f"unknown action {action[:100]!r}",
                         f"one or more of {', '.join(ANOMALY_ACTIONS)}")
        return found

    def _backoff(self, node: yaml.Node, path: str) -> dict[str, float]:
        fields = self.mapping(node, path, BACKOFF_KEYS, "a backoff")
        values: dict[str, float] = {}
        for key in ("initial", "max"):
            if key in fields:
                got = self.duration(fields[key], f"{path}.{key}", "10s")
                if got is not None:
                    values[key] = got
        if "factor" in fields:
            factor = self.number(fields["factor"], f"{path}.factor", 1, 10)
            if factor is not None:
                values["factor"] = factor
        return values

    def _env(self, node: yaml.Node | None, step: RawStep, *, secret: bool = False) -> None:
        """`env:` (`NAME: value` or `NAME: {value: …, secret: true}`) or `secrets:` (every
        value secret)."""
        if node is None:
            return
        key = "secrets" if secret else "env"
        path = f"{step.path}.{key}"
        for name, value in self.pairs(node, path, "environment variables"):
            if not IDENTIFIER_RE.fullmatch(name):
                self.problem(value, f"{path}.{name}", f"invalid variable name {name!r}")
            elif name.startswith(RESERVED_ENV):
                self.problem(value, f"{path}.{name}", f"{name} is set by m27",
                             "M27_* and CUDA_VISIBLE_DEVICES describe the step's placement")
            elif name in step.env_values:
                self.problem(value, f"{path}.{name}", f"{name} is set twice",
                             "give each variable once, in `env:` or in `secrets:`")
            else:
                marked = secret
                if isinstance(value, yaml.MappingNode) and not secret:
                    fields = self.mapping(value, f"{path}.{name}", ENV_KEYS, "a variable")
                    if "secret" in fields:
                        marked = bool(self.boolean(fields["secret"], f"{path}.{name}.secret"))
                    if "value" not in fields:
                        self.problem(value, f"{path}.{name}", "the variable has no `value`",
                                     f"e.g. {name}: {{value: \"{{{{token}}}}\", secret: true}}")
                        continue
                    value = fields["value"]
                text = self.string(value, f"{path}.{name}")
                if text is not None:
                    step.env.append((name, value))
                    step.env_values[name] = text
                    if marked:
                        step.secret_env.add(name)

    def _matrix(self, fields: dict[str, yaml.Node], step: RawStep) -> None:
        path = step.path
        if "matrix" in fields:
            axes = self.pairs(fields["matrix"], f"{path}.matrix", "matrix axes")
            if not axes and isinstance(fields["matrix"], yaml.MappingNode):
                self.problem(fields["matrix"], f"{path}.matrix", "a matrix needs an axis",
                             "e.g. matrix: {seed: [1, 2, 3]}")
            for key, values in axes:
                if not IDENTIFIER_RE.fullmatch(key):
                    self.problem(values, f"{path}.matrix.{key}", f"invalid axis name {key!r}")
                    continue
                items = [v for v, _ in self.strings(values, f"{path}.matrix.{key}", "values")]
                if not items:
                    self.problem(values, f"{path}.matrix.{key}", "an axis needs values")
                elif len(items) > MAX_MATRIX_VALUES:
                    self.problem(values, f"{path}.matrix.{key}",
                                 f"more than {MAX_MATRIX_VALUES} values")
                elif len(set(items)) < len(items):
                    self.problem(values, f"{path}.matrix.{key}", "a value is repeated")
                else:
                    step.matrix.append((key, items))
        if "max_parallel" in fields:
            step.max_parallel = self.integer(fields["max_parallel"], f"{path}.max_parallel",
                                             1, 100_000)
            if not step.matrix:
                self.problem(fields["max_parallel"], f"{path}.max_parallel",
                             "max_parallel limits a matrix step's members",
                             "add a `matrix:` or remove it")
