"""Reading YAML for people (pure): node trees with positions, and problems that say where.

Values are read from PyYAML's composed node tree, which keeps line and column of every
key and value, so each problem can point at `file:line:column` and a key path
(`pipeline[2].depends_on`). Readers never raise on bad input: they record a Problem and
return None, so one pass reports everything that is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec
import yaml

from m27.common.errors import InvalidRequest
from m27.common.hints import did_you_mean
from m27.common.units import parse_duration, parse_size

STR: Final = "tag:yaml.org,2002:str"
NULL: Final = "tag:yaml.org,2002:null"
INT: Final = "tag:yaml.org,2002:int"
FLOAT: Final = "tag:yaml.org,2002:float"
BOOL: Final = "tag:yaml.org,2002:bool"
_KINDS: Final = {INT: "an integer", FLOAT: "a number", BOOL: "a boolean",
                 NULL: "nothing (null)"}


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


#: Bounds of an error message (a hostile document can have a problem per line).
MAX_SHOWN: Final = 50
MAX_PROBLEM_CHARS: Final = 500
MAX_SOURCE_CHARS: Final = 200


class PipelineError(InvalidRequest):
    """The pipeline cannot run; `problems` lists everything found, in file order. The
    message shows the first `MAX_SHOWN` problems, each cut to `MAX_PROBLEM_CHARS`."""

    def __init__(self, source: str, problems: Sequence[Problem]) -> None:
        self.source = source
        self.problems = tuple(sorted(problems, key=lambda p: (p.line or 0, p.column or 0)))
        count = len(self.problems)
        lines = [_cut(p.render(source[:MAX_SOURCE_CHARS]), MAX_PROBLEM_CHARS)
                 for p in self.problems[:MAX_SHOWN]]
        if count > MAX_SHOWN:
            lines.append(f"… and {count - MAX_SHOWN} more")
        super().__init__(f"{source[:MAX_SOURCE_CHARS]}: {count} "
                         f"problem{'s' if count != 1 else ''}:\n  " + "\n  ".join(lines))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


_CONSTRUCTOR: Final = yaml.constructor.SafeConstructor()
# libyaml composes 2-3× faster with the same marks; pure Python where it is not built in.
_LOADER: Final = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _scalar(node: yaml.ScalarNode) -> object:
    """A scalar's value with YAML's own rules (`017` is octal, `1:30` is 90), never raising."""
    try:
        return _CONSTRUCTOR.construct_object(node, deep=False)
    except (ValueError, yaml.YAMLError):
        return None


def kind(node: yaml.Node) -> str:
    """How a value reads to a person: 'a list', "the string 'x'", 'an integer (3)'."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if node.tag == STR:
        return f"the string {node.value!r}"
    shown = f" ({node.value})" if node.value and node.tag != NULL else ""
    return _KINDS.get(node.tag, "a value") + shown


def compose(text: str, problems: list[Problem]) -> yaml.Node | None:
    """The YAML node tree, or None with a problem recorded."""
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problems.append(Problem(
            message=f"not valid YAML: {exc.problem or exc.context}",
            line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None,
            hint=_yaml_hint(text, exc)))
        return None
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unreadable input"
        problems.append(Problem(message=f"not valid YAML: {first}",
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
    problem = str(exc.problem or "")
    if "\t" in text and ("\t" in problem or "cannot start any token" in problem):
        return "YAML does not allow tabs for indentation; use spaces"
    if "mapping values are not allowed" in problem:
        return "check the indentation, or quote a value that contains ': '"
    return ""


def problem_at(node: yaml.Node | None, path: str, message: str, hint: str = "") -> Problem:
    mark = node.start_mark if node is not None else None
    return Problem(message=message, path=path, hint=hint,
                   line=mark.line + 1 if mark else None,
                   column=mark.column + 1 if mark else None)


class Reader:
    """Typed reads from nodes; a wrong value becomes a Problem and None."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems

    def problem(self, node: yaml.Node | None, path: str, message: str, hint: str = "") -> None:
        self.problems.append(problem_at(node, path, message, hint))

    def mapping(self, node: yaml.Node, path: str, known: Sequence[str],
                what: str) -> dict[str, yaml.Node]:
        """Known keys → value nodes; unknown keys and duplicates are problems."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, path, f"expected {what} (a mapping of keys), got {kind(node)}")
            return {}
        result: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            key_path = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.problem(key_node, path, "keys must be plain words")
            elif key not in known:
                self.problem(key_node, key_path, f"unknown key `{key}`",
                             did_you_mean(key, known) or f"known keys: {', '.join(known)}")
            elif key in result:
                self.problem(key_node, key_path, f"`{key}` is given twice")
            else:
                result[key] = value_node
        return result

    def pairs(self, node: yaml.Node, path: str, what: str) -> list[tuple[str, yaml.Node]]:
        """A mapping with free keys (env, vars, matrix): (key, value node) in file order."""
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, path, f"expected {what} (a mapping), got {kind(node)}")
            return []
        result: list[tuple[str, yaml.Node]] = []
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or not key:
                self.problem(key_node, path, "keys must be plain words")
            elif any(key == seen for seen, _ in result):
                self.problem(key_node, f"{path}.{key}", f"`{key}` is given twice")
            else:
                result.append((key, value_node))
        return result

    def string(self, node: yaml.Node, path: str) -> str | None:
        """A scalar's text as written: `command: true` is the shell's `true`, not a bool."""
        if isinstance(node, yaml.ScalarNode) and node.tag != NULL:
            return str(node.value)
        self.problem(node, path, f"expected a string, got {kind(node)}")
        return None

    def choice(self, node: yaml.Node, path: str, choices: Sequence[str],
               what: str) -> str | None:
        value = self.string(node, path)
        if value is None:
            return None
        if value in choices:
            return value
        self.problem(node, path, f"unknown {what} {value!r}",
                     did_you_mean(value, choices) or f"one of: {', '.join(choices)}")
        return None

    def integer(self, node: yaml.Node, path: str, low: int, high: int) -> int | None:
        value = _scalar(node) if isinstance(node, yaml.ScalarNode) and node.tag == INT else None
        if not isinstance(value, int) or isinstance(value, bool):
            self.problem(node, path, f"expected a whole number, got {kind(node)}")
            return None
        if not low <= value <= high:
            self.problem(node, path, f"expected a number from {low} to {high}, got {value}")
            return None
        return value

    def number(self, node: yaml.Node, path: str, low: float, high: float) -> float | None:
        value = (_scalar(node) if isinstance(node, yaml.ScalarNode)
                 and node.tag in {INT, FLOAT} else None)
        if not isinstance(value, int | float) or isinstance(value, bool) \
                or not math.isfinite(value):
            self.problem(node, path, f"expected a number, got {kind(node)}")
            return None
        if not low <= value <= high:
            self.problem(node, path, f"expected a number from {low:g} to {high:g}, "
                         f"got {value:g}")
            return None
        return float(value)

    def boolean(self, node: yaml.Node, path: str) -> bool | None:
        if isinstance(node, yaml.ScalarNode) and node.tag == BOOL:
            return str(node.value).lower() in {"true", "yes", "on", "y"}
        self.problem(node, path, f"expected true or false, got {kind(node)}")
        return None

    def duration(self, node: yaml.Node, path: str, example: str = "300s") -> float | None:
        """A positive duration such as 300s, 5m, 1h (a bare number is seconds)."""
        if not isinstance(node, yaml.ScalarNode) or node.tag not in {STR, INT, FLOAT}:
            self.problem(node, path, f"expected a duration such as {example}, got {kind(node)}")
            return None
        raw = node.value if node.tag == STR else _scalar(node)
        try:
            seconds = parse_duration(raw)  # type: ignore[arg-type]
        except ValueError as exc:
            self.problem(node, path, str(exc))
            return None
        if seconds <= 0:
            self.problem(node, path, "the duration must be longer than 0s")
            return None
        return seconds

    def size_mb(self, node: yaml.Node, path: str) -> int | None:
        """A size such as 8GiB or 512MB, in MiB (a bare number is bytes)."""
        if not isinstance(node, yaml.ScalarNode) or node.tag not in {STR, INT}:
            self.problem(node, path, f"expected a size such as 8GiB, got {kind(node)}")
            return None
        raw = node.value if node.tag == STR else _scalar(node)
        try:
            size = parse_size(raw)  # type: ignore[arg-type]
        except ValueError as exc:
            self.problem(node, path, str(exc))
            return None
        if size <= 0:
            self.problem(node, path, "the size must be larger than 0")
            return None
        return max(1, size // (1024 * 1024))

    def strings(self, node: yaml.Node, path: str, what: str) -> list[tuple[str, yaml.Node]]:
        """A list of strings, or one string standing for a list of one."""
        if isinstance(node, yaml.ScalarNode) and node.tag != NULL:
            return [(str(node.value), node)]
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, path, f"expected a list of {what}, got {kind(node)}")
            return []
        result = []
        for i, item in enumerate(node.value):
            value = self.string(item, f"{path}[{i}]")
            if value is not None:
                result.append((value, item))
        return result
