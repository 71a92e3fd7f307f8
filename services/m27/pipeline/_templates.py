"""`{{...}}` placeholders (pure): variables, matrix values, and earlier steps' outputs.

    {{NAME}}                 a variable (`vars:` default, `--var NAME=VALUE`, or a secret
                             one, `--secret NAME`: allowed only in `env:`/`secrets:` values)
    {{matrix.KEY}}           this sweep member's value of axis KEY
    {{steps.STEP.output}}    the first output path of STEP (a step this one depends on)
    {{steps.STEP.outputs}}   all of STEP's output paths (of every member, for a matrix step)

In commands values are quoted for their place in the shell command (`shellquote`); in
paths and environment values they are inserted as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import yaml

from m27.common.hints import did_you_mean
from m27.pipeline import shellquote
from m27.pipeline._yaml import Problem, problem_at

PLACEHOLDER_RE: Final = re.compile(r"\{\{(.*?)\}\}")
VAR_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STEP_REF_RE: Final = re.compile(r"steps\.([A-Za-z0-9][A-Za-z0-9_-]*)\.(outputs?)")
MATRIX_REF_RE: Final = re.compile(r"matrix\.([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Scope:
    """What a step's placeholders can see."""

    variables: Mapping[str, str]
    matrix: Mapping[str, str]
    outputs: Mapping[str, Sequence[str]]  # steps and sweeps planned so far → output paths
    members: Mapping[str, int]  # sweep name → how many steps it expanded to
    all_steps: Sequence[str]  # every step and sweep name, for "did you mean"
    declared_vars: bool  # the pipeline has a `vars:` section
    reaches: Callable[[str], bool]  # does this step depend (transitively) on that one?
    secret_vars: frozenset[str] = frozenset()  # variables whose values are secret


class Renderer:
    """Fills placeholders in one field, recording a Problem for each one it cannot fill."""

    def __init__(self, scope: Scope, node: yaml.Node | None, path: str,
                 problems: list[Problem], *, secrets_allowed: bool = False) -> None:
        self.scope = scope
        self.node = node
        self.path = path
        self.problems = problems
        self.secrets_allowed = secrets_allowed
        #: A secret variable was filled in: the result is secret too.
        self.used_secret = False

    def shell(self, template: str) -> str:
        return shellquote.substitute(template, PLACEHOLDER_RE, self._value)

    def raw(self, template: str) -> str:
        def plain(match: re.Match[str]) -> str:
            value = self._value(match)
            if value is None:
                return match.group(0)
            return value if isinstance(value, str) else " ".join(value)

        return PLACEHOLDER_RE.sub(plain, template)

    def _problem(self, message: str, hint: str = "") -> None:
        self.problems.append(problem_at(self.node, self.path, message, hint))

    def _value(self, match: re.Match[str]) -> str | Sequence[str] | None:
        expression = match.group(1).strip()
        if VAR_NAME_RE.fullmatch(expression):
            return self._variable(expression)
        if matrix := MATRIX_REF_RE.fullmatch(expression):
            return self._matrix(matrix.group(1))
        if step := STEP_REF_RE.fullmatch(expression):
            return self._outputs(step.group(1), step.group(2) == "outputs")
        self._problem(f"`{{{{{match.group(1)}}}}}` is not a placeholder",
                      "use {{NAME}}, {{matrix.KEY}}, {{steps.STEP.output}} or "
                      "{{steps.STEP.outputs}}")
        return None

    def _variable(self, name: str) -> str | None:
        if name in self.scope.secret_vars:
            if not self.secrets_allowed:
                self._problem(f"`{{{{{name}}}}}` is a secret variable: only `env:` and "
                              "`secrets:` values may use it (m27 stores and shows commands "
                              "and paths)", f"set `secrets: {{NAME: \"{{{{{name}}}}}\"}}` "
                              "and read $NAME in the command")
                return None
            self.used_secret = True
        if name in self.scope.variables:
            return self.scope.variables[name]
        if name in self.scope.secret_vars:
            self._problem(f"secret variable `{name}` was not given",
                          f"pass it with `--secret {name}`")
            return None
        hint = did_you_mean(name, sorted(self.scope.variables))
        if not hint:
            hint = (f"declare it under `vars:` or pass `--var {name}=VALUE`"
                    if self.scope.declared_vars else f"pass it with `--var {name}=VALUE`")
        self._problem(f"undefined variable `{name}`", hint)
        return None

    def _matrix(self, key: str) -> str | None:
        if key in self.scope.matrix:
            return self.scope.matrix[key]
        if not self.scope.matrix:
            self._problem(f"`{{{{matrix.{key}}}}}` in a step without a `matrix:`")
        else:
            self._problem(f"the matrix has no axis `{key}`",
                          did_you_mean(key, sorted(self.scope.matrix))
                          or f"axes: {', '.join(self.scope.matrix)}")
        return None

    def _outputs(self, step: str, every: bool) -> str | Sequence[str] | None:
        if step not in self.scope.outputs or not self.scope.reaches(step):
            if step in self.scope.all_steps or step in self.scope.outputs:
                self._problem(f"this step does not depend on `{step}`, so its outputs may "
                              "not exist yet", f"add {step} to depends_on")
            else:
                self._problem(f"unknown step `{step}`",
                              did_you_mean(step, self.scope.all_steps))
            return None
        paths = self.scope.outputs[step]
        if not paths:
            self._problem(f"step `{step}` declares no output", "give it `output:`")
            return None
        if every:
            return list(paths)
        if self.scope.members.get(step, 1) > 1:
            self._problem(f"`{step}` is a sweep of {self.scope.members[step]} steps",
                          f"use {{{{steps.{step}.outputs}}}} for all of their outputs")
            return None
        return paths[0]
