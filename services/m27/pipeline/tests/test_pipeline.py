"""The seed pipeline format: what parses, what is rejected, and how problems are reported."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m27.pipeline import MAX_PIPELINE_BYTES, PipelineError, load_pipeline

# The seed example of the mission brief, exactly as users write it.
SEED = (Path(__file__).parent / "seed.yaml").read_text()


def problems_of(text: str, variables: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PipelineError) as info:
        load_pipeline(text, variables, source="p.yaml")
    return [p.render("p.yaml") for p in info.value.problems]


def test_seed_example_parses_as_written() -> None:
    spec = load_pipeline(SEED, {"INPUT_FILE": "data/1abc.pdb"}, source="seed.yaml")
    assert spec.name == "seed"
    assert [s.name for s in spec.steps] == ["preprocessing", "md_simulation", "analysis"]
    prep, md, analysis = spec.steps
    assert prep.command == "python prepare_pdb.py --input data/1abc.pdb"
    assert prep.output == "/tmp/preprocessed.pdb"
    assert md.depends_on == ("preprocessing",)
    assert md.checkpoint_interval_s == 300.0
    assert md.resources.gpus == 1.0
    assert analysis.type == "gpu_light"
    assert 0 < analysis.resources.gpus < 1


def test_scalar_commands_are_taken_as_written() -> None:
    spec = load_pipeline("pipeline:\n  - {name: 2020, command: true}\n  - {name: b, "
                         "command: 42, depends_on: [2020]}\n")
    assert [(s.name, s.command) for s in spec.steps] == [("2020", "true"), ("b", "42")]


def test_steps_come_in_dependency_order_even_if_declared_otherwise() -> None:
    text = """pipeline:
  - {name: c, command: x, depends_on: [b]}
  - {name: a, command: x}
  - {name: b, command: x, depends_on: [a]}
"""
    assert [s.name for s in load_pipeline(text).steps] == ["a", "b", "c"]


@pytest.mark.parametrize("value", ["x; touch /tmp/pwned", "$(id)", "`id`", "a b 'c'", "\"q\""])
def test_variable_values_become_one_quoted_shell_word(value: str) -> None:
    import shlex

    spec = load_pipeline(SEED, {"INPUT_FILE": value})
    argv = shlex.split(spec.steps[0].command)
    assert argv == ["python", "prepare_pdb.py", "--input", value]


@pytest.mark.parametrize(("text", "expected"), [
    ("", "the file is empty"),
    ("- a\n- b\n", "p.yaml:1:1: expected a pipeline (a mapping of keys), got a list"),
    ("pipeline: 3\n", "p.yaml:1:11: pipeline: expected a list of steps"),
    ("\tpipeline:\n", "use spaces"),
    ("pipeline: [\n", "not valid YAML"),
    ("pipelin:\n  - {name: a, command: x}\n", "did you mean `pipeline`?"),
    ("pipeline: []\n", "the pipeline has no steps"),
    ("\x00\x01binary", "not valid YAML"),
    ("a: b: c\n", "mapping values are not allowed"),
    ("---\na: 1\n---\nb: 2\n", "not valid YAML"),
])
def test_malformed_documents_get_a_located_error(text: str, expected: str) -> None:
    assert any(expected in p for p in problems_of(text))


def test_every_problem_is_reported_at_once_with_location_and_hint() -> None:
    text = """pipeline:
  - name: prep
    type: gpuu
    command: echo {{X}}
  - name: train
    depends_on: [prepp]
    comand: run
  - name: prep
    command: again
"""
    found = problems_of(text)
    assert "p.yaml:3:11: pipeline[0].type: unknown step type 'gpuu' (did you mean `gpu`?)" in found
    assert any(p.startswith("p.yaml:4:14: pipeline[0].command: undefined variable `X`")
               for p in found)
    assert any("pipeline[1].depends_on: unknown step `prepp` (did you mean `prep`?)" in p
               for p in found)
    assert any("pipeline[1].comand: unknown key `comand` (did you mean `command`?)" in p
               for p in found)
    assert any("duplicate step name `prep`" in p for p in found)
    assert len(found) == 6  # + "the step has no `command`" for train


def test_cycles_are_printed_as_a_path() -> None:
    text = """pipeline:
  - {name: a, command: x, depends_on: [c]}
  - {name: b, command: x, depends_on: [a]}
  - {name: c, command: x, depends_on: [b]}
"""
    (problem,) = problems_of(text)
    assert "dependency cycle: a → b → c → a" in problem


def test_self_dependency_is_rejected() -> None:
    (problem,) = problems_of("pipeline:\n  - {name: a, command: x, depends_on: [a]}\n")
    assert "step `a` depends on itself" in problem


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("checkpoint", "soon", "expected a duration"),
    ("checkpoint", "0s", "longer than 0s"),
    ("name", "'has space'", "invalid step name"),
    ("name", "'a.b'", "invalid step name"),
    ("command", "null", "expected a string, got nothing (null)"),
    ("command", "[a, b]", "expected a string, got a list"),
    ("command", "''", "the command is empty"),
    ("depends_on", "{a: 1}", "expected a list of step names"),
])
def test_bad_field_values(field: str, value: str, expected: str) -> None:
    step = {"name": "s", "command": "echo", field: value}
    body = ", ".join(f"{k}: {v}" for k, v in step.items())
    assert any(expected in p for p in problems_of(f"pipeline:\n  - {{{body}}}\n"))


def test_huge_files_are_refused_before_parsing() -> None:
    text = "pipeline:\n" + "#" * (MAX_PIPELINE_BYTES + 1)
    assert any("larger than" in p for p in problems_of(text))


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    assert problems_of("pipeline: " + "[" * 5000 + "]" * 5000)


def test_invalid_variable_names_are_reported() -> None:
    found = problems_of(SEED, {"INPUT_FILE": "x", "bad-name": "y"})
    assert any("invalid variable name 'bad-name'" in p for p in found)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_random_text_gives_a_plan_or_a_clean_error(text: str) -> None:
    try:
        spec = load_pipeline(text)
    except PipelineError as exc:
        problems = exc.problems
    else:
        assert spec.steps
        return
    assert problems


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_seed_gives_a_plan_or_a_clean_error(data: st.DataObject) -> None:
    text = SEED.replace("{{INPUT_FILE}}", "in.pdb")
    position = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, 20))
    insert = data.draw(st.sampled_from(["", ":", "-", "\t", "[", "]", "{", "'", "\n", "  ",
                                        "name: x", "depends_on: [analysis]", "&a", "*a"]))
    mutated = text[:position] + insert + text[position + cut:]
    try:
        spec = load_pipeline(mutated)
    except PipelineError as exc:
        problems = exc.problems
    else:
        problems = ()
    if problems:
        assert all(p.message for p in problems)
        return
    names = [s.name for s in spec.steps]
    for i, step in enumerate(spec.steps):
        assert all(dep in names[:i] for dep in step.depends_on)
