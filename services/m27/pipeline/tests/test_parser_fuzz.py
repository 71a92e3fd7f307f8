"""The pipeline parser fuzzed (issue 19, point 5): documents built from the language's own
keys with hostile values in every place — Unicode and NUL, traversing and absolute paths,
huge and non-finite numbers, deep nesting, alias bombs, sizes at the limit — give a spec
(which plans) or a PipelineError, never another exception, and each within seconds."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m27.pipeline import MAX_PIPELINE_BYTES, PipelineError, load_pipeline
from m27.pipeline._document import (
    BACKOFF_KEYS,
    ENV_KEYS,
    MONITOR_KEYS,
    RESOURCE_KEYS,
    RETRY_KEYS,
    STEP_KEYS,
    TOP_KEYS,
    VAR_KEYS,
)
from m27.pipeline.plan import make_plan

#: Seconds one document may take to parse, check and plan (the orchestrator's child
#: process is killed at 30 s; a document should never come near).
BUDGET_S = 5.0
HOSTILE = ["", " ", "\x00", "a\x00b", "../../etc/passwd", "/etc/passwd", "/", "..", "~",
           "/dev/zero", "$(id)", "`id`", "{{X}}", "{{ X }}", "{{", "}}", "${HOME}", "\n",
           "\t", "\ufeff", "\u202e", "\U0001f600", "é", "null", "~", "NaN", ".inf", "-.inf",
           "1e309", "9" * 400, "a" * 70_000, "0x10", "0o7", "1_000", "10s", "-5m", "2h",
           "1.5GB", "0.5", "yes", "no", "on", "true", "gpu", "gpu-light", "cpu", "urgent",
           "a-b", "A_B", "M27_X", "CUDA_VISIBLE_DEVICES"]
KEYS = sorted({*TOP_KEYS, *STEP_KEYS, *RESOURCE_KEYS, *RETRY_KEYS, *BACKOFF_KEYS,
               *MONITOR_KEYS, *VAR_KEYS, *ENV_KEYS, "", "x", "\x00", "../k", "<<"})

scalars = st.one_of(
    st.sampled_from(HOSTILE), st.text(max_size=30), st.booleans(), st.none(),
    st.integers(-2**70, 2**70), st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**64, 10**400]),
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, 5e-324]))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                     st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=25)
steps = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["a", "b", "c"]), st.sampled_from(HOSTILE))},
    optional={key: values for key in STEP_KEYS if key != "name"})
documents = st.fixed_dictionaries(
    {"pipeline": st.one_of(st.lists(steps, max_size=5), values)},
    optional={key: values for key in TOP_KEYS if key != "pipeline"})


def dumped(document: Any, style: str) -> str:
    """`document` as YAML (block or flow) or as JSON (which YAML reads too)."""
    if style == "json":
        return json.dumps(document, default=str)
    return yaml.safe_dump(document, allow_unicode=True, default_flow_style=style == "flow",
                          width=10**6)


def parsed_or_refused(text: str, variables: dict[str, str] | None = None,
                      secrets: dict[str, str] | None = None, workdir: str = "") -> None:
    """The property: a spec that plans, or a PipelineError that says what is wrong."""
    began = time.monotonic()
    problems = None
    try:
        spec = load_pipeline(text, variables, source="fuzz.yaml", workdir=workdir,
                             secrets=secrets)
    except PipelineError as error:
        problems, said = error.problems, str(error)
    else:
        assert spec.steps
        make_plan(spec)
    if problems is not None:
        assert problems
        assert all(p.message for p in problems)
        assert len(said) < 200_000
    assert time.monotonic() - began < BUDGET_S, f"{time.monotonic() - began:.1f} s"


FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(documents, st.sampled_from(["block", "flow", "json"]))
def test_documents_of_the_language_with_hostile_values_parse_or_are_refused(
        document: dict[str, Any], style: str) -> None:
    parsed_or_refused(dumped(document, style))


@FUZZ
@given(documents, st.dictionaries(st.sampled_from(["X", "Y", "bad-name", "", "\x00"]),
                                  st.sampled_from(HOSTILE), max_size=3),
       st.dictionaries(st.sampled_from(["S", "X", "M27_S"]), st.sampled_from(HOSTILE),
                       max_size=2),
       st.sampled_from(HOSTILE))
def test_hostile_variables_secrets_and_workdirs_are_refused_or_kept_in_their_place(
        document: dict[str, Any], variables: dict[str, str], secrets: dict[str, str],
        workdir: str) -> None:
    parsed_or_refused(dumped(document, "block"), variables, secrets, workdir)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_read_as_text_parse_or_are_refused(raw: bytes) -> None:
    parsed_or_refused(raw.decode("utf-8", "replace") + raw.decode("latin-1"))


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["[", "{a: ", "- ", "a:\n" + " ", "!!seq [", "&a ["]),
       st.integers(1, 20_000))
def test_deep_nesting_is_refused_quickly(opening: str, depth: int) -> None:
    parsed_or_refused("pipeline: " + opening * depth)


def laughs(levels: int, fan: int, where: str) -> str:
    """A billion-laughs document: each alias repeats the level below `fan` times."""
    lines = ["a0: &a0 [x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, levels)]
    top = f"*a{levels - 1}"
    body = {"matrix": f"  - name: t\n    command: 'true'\n    matrix: {{x: {top}}}\n",
            "depends_on": f"  - name: t\n    command: 'true'\n    depends_on: {top}\n",
            "env": f"  - name: t\n    command: 'true'\n    env: {{A: {top}}}\n",
            "steps": f"  - {top}\n"}[where]
    return "\n".join(lines) + "\npipeline:\n" + body


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 12), st.integers(2, 10),
       st.sampled_from(["matrix", "depends_on", "env", "steps"]))
def test_alias_bombs_are_refused_not_expanded(levels: int, fan: int, where: str) -> None:
    parsed_or_refused(laughs(levels, fan, where))


@settings(max_examples=10, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(["#", "é", "\x00", " "]), st.integers(-2, 2))
def test_documents_at_the_size_limit_parse_or_are_refused(filler: str, off: int) -> None:
    head = "pipeline:\n  - {name: a, command: 'true'}\n#"
    room = MAX_PIPELINE_BYTES - len(head.encode()) + off
    parsed_or_refused(head + filler * max(0, room // len(filler.encode())))


def test_variables_past_a_mebibyte_in_all_are_refused() -> None:
    """Each under its own 64 KiB, 10 MB together: they travel in one bus message (NATS
    takes 8 MB), so the fuzzed SubmitPipeline that sent them ended UNKNOWN."""
    many = {f"K{i}": "v" * 1000 for i in range(10_000)}
    problems: list[str] = []
    try:
        load_pipeline("pipeline:\n  - {name: a, command: 'true'}\n", many)
    except PipelineError as error:
        problems = [p.message for p in error.problems]
    assert any("KiB in all, more than 1024 KiB" in p for p in problems)
