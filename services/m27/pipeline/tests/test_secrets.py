"""Secret values in the pipeline language (issue 14, point 4): which environment values are
secret, that they leave the parser only in `PipelineSpec.secret_sets`, and that no field
m27 stores or shows (commands, paths, variables) can hold one."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.pipeline import PipelineError, load_pipeline
from m27.pipeline._spec import MAX_SECRET_SET_BYTES, MAX_SECRET_SETS

DECLARED = """\
vars:
  token: {secret: true}
  lr: "0.1"
pipeline:
  - name: train
    command: python train.py --lr {{lr}}
    env:
      PLAIN: "lr={{lr}}"
      TAINTED: "Bearer {{token}}"
      MARKED: {value: literal, secret: true}
      UNMARKED: {value: "{{lr}}"}
    secrets:
      S3_KEY: "{{token}}"
"""


def problems_of(text: str, variables: dict[str, str] | None = None,
                secrets: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PipelineError) as info:
        load_pipeline(text, variables, source="p.yaml", secrets=secrets)
    return [p.render("p.yaml") for p in info.value.problems]


def test_which_values_are_secret_and_where_they_go() -> None:
    spec = load_pipeline(DECLARED, secrets={"token": "t0k3n"})
    (train,) = spec.steps
    assert train.env == {"PLAIN": "lr=0.1", "UNMARKED": "0.1"}
    assert train.secret_env == ("MARKED", "S3_KEY", "TAINTED")
    assert spec.secret_sets == ({"MARKED": "literal", "S3_KEY": "t0k3n",
                                 "TAINTED": "Bearer t0k3n"},)
    assert train.secret_set == 0
    assert spec.variables == {"lr": "0.1"}  # the secret one is not kept with the run


def test_a_submitted_secret_is_secret_without_a_declaration() -> None:
    text = "pipeline:\n  - name: a\n    command: x\n    env: {K: '{{key}}'}\n"
    spec = load_pipeline(text, secrets={"key": "abcd"})
    assert spec.steps[0].env == {}
    assert spec.secret_sets == ({"K": "abcd"},)
    assert spec.variables == {}


def test_a_step_without_secrets_names_no_set() -> None:
    spec = load_pipeline("pipeline:\n  - {name: a, command: x, env: {A: b}}\n")
    assert (spec.steps[0].secret_set, spec.steps[0].secret_env, spec.secret_sets) == (
        -1, (), ())


secret_text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"),
                      min_size=1, max_size=40).map(lambda t: "Zq" + t)


@given(secret_text)
def test_a_secret_value_is_nowhere_but_in_the_secret_sets(value: str) -> None:
    spec = load_pipeline(DECLARED, secrets={"token": value})
    kept = msgspec.json.encode([spec.steps, spec.variables, spec.name, spec.max_parallel])
    assert msgspec.json.encode(value)[1:-1] not in kept
    assert any(value in v for v in spec.secret_sets[0].values())


@pytest.mark.parametrize(("field", "path"), [
    ("command: echo {{token}}", "pipeline[0].command"),
    ("command: x\n    output: out/{{token}}", "pipeline[0].outputs"),
    ("command: x\n    inputs: ['{{token}}']", "pipeline[0].inputs"),
    ("command: x\n    workdir: /w/{{token}}", "pipeline[0].workdir"),
])
def test_a_secret_variable_cannot_reach_a_command_or_a_path(field: str, path: str) -> None:
    text = f"vars:\n  token: {{secret: true}}\npipeline:\n  - name: a\n    {field}\n"
    found = problems_of(text, secrets={"token": "Zq-value"})
    assert len(found) == 1
    assert f"{path}: `{{{{token}}}}` is a secret variable" in found[0]
    assert "Zq-value" not in found[0]  # an error message shows no secret either


def test_the_same_variable_given_twice_or_undeclared_or_missing() -> None:
    assert any("given both as --var and as --secret" in p
               for p in problems_of(DECLARED, {"token": "a"}, {"token": "b"}))
    assert any("pipeline does not declare it" in p
               for p in problems_of(DECLARED, secrets={"token": "a", "other": "b"}))
    missing = problems_of(DECLARED)
    assert any("`token` has no default and was not given (pass it with `--secret token`)"
               in p for p in missing)


def test_a_name_in_env_and_in_secrets_is_refused() -> None:
    text = ("pipeline:\n  - name: a\n    command: x\n    env: {K: a}\n"
            "    secrets: {K: b}\n")
    assert any("K is set twice" in p for p in problems_of(text))


def test_the_members_of_a_sweep_share_one_stored_set() -> None:
    text = ("pipeline:\n  - name: a\n    command: echo {{matrix.i}}\n"
            "    matrix: {i: [" + ", ".join(str(i) for i in range(300)) + "]}\n"
            "    secrets: {K: '{{key}}'}\n")
    spec = load_pipeline(text, secrets={"key": "abcd"})
    assert len(spec.steps) == 300
    assert spec.secret_sets == ({"K": "abcd"},)
    assert {s.secret_set for s in spec.steps} == {0}


def test_too_many_different_sets_or_too_large_a_set_is_refused() -> None:
    members = ", ".join(str(i) for i in range(MAX_SECRET_SETS + 1))
    text = ("pipeline:\n  - name: a\n    command: x\n"
            f"    matrix: {{i: [{members}]}}\n    secrets: {{K: 'v{{{{matrix.i}}}}'}}\n")
    assert any(f"more than {MAX_SECRET_SETS} different sets" in p for p in problems_of(text))
    value = "x" * (60 * 1024)  # a variable may hold 64 KiB; five of them are too many
    assert 5 * len(value) > MAX_SECRET_SET_BYTES
    text = "pipeline:\n  - name: a\n    command: x\n    secrets: {A: '{{v}}', B: '{{v}}', " \
           "C: '{{v}}', D: '{{v}}', E: '{{v}}'}\n"
    assert any("secret values take more than" in p for p in problems_of(
        text, secrets={"v": value}))
