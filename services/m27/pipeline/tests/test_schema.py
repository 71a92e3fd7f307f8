"""The editors' JSON Schema: committed copy is current, and it agrees with `load_pipeline`."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from m27.common.model import URGENCIES
from m27.common.units import parse_duration
from m27.pipeline import PipelineError, _document, load_pipeline, schema

COMMITTED = Path(__file__).resolve().parents[4] / "docs" / "pipeline.schema.json"
VALIDATOR = Draft202012Validator(schema.pipeline_schema())

# The seed example of the mission brief, exactly as users write it.
SEED = (Path(__file__).parent / "seed.yaml").read_text()

FULL = """\
# yaml-language-server: $schema=../docs/pipeline.schema.json
name: md-study
vars:
  INPUT_FILE: data/1abc.pdb
  SEEDS: ~
  TOKEN: {secret: true}
priority: high
preemptible: true
pipeline:
  - name: preprocessing
    type: cpu
    command: python prepare_pdb.py --input {{INPUT_FILE}}
    output: prepared.pdb
    inputs: ["{{INPUT_FILE}}"]
    workdir: prep
    env: {OMP_NUM_THREADS: 4, DATA: "{{INPUT_FILE}}", KEY: {value: "{{TOKEN}}", secret: true}}
    secrets: {API_TOKEN: "{{TOKEN}}"}
    resources: {cpus: 4, memory: 8GiB}
  - name: md
    type: gpu
    depends_on: [preprocessing]
    command: gmx mdrun -s {{steps.preprocessing.output}} -deffnm t{{matrix.temperature}}
    outputs: [sim.xtc, sim.edr]
    checkpoint: 5m
    timeout: 12h
    resources: {gpus: 1, gpu_memory: 16GiB, cpus: 8, memory: 32GiB, gpu_model: "A100|H100",
                driver: "535", cuda: ">=12.1"}
    priority: urgent
    preemptible: false
    retries: {failure: 1, infrastructure: 5, backoff: {initial: 30s, factor: 1.5, max: 10m}}
    matrix: {temperature: [300, 310], seed: [1, 2]}
    max_parallel: 2
    checkpoint_signal: SIGUSR2
    monitor:
      - {metric: loss, window: 50, warmup: 10, spike: 6, divergence: 10,
         on_anomaly: [checkpoint, notify]}
      - {metric: val/acc, mode: max, plateau: 20, min_delta: 0.001, on_anomaly: notify}
  - name: analysis
    type: gpu_light
    depends_on: md
    command: python analyze.py --seeds {{SEEDS}} {{steps.md.outputs}}
    resources: {gpus: 0.3}
    retries: 2
"""


def schema_accepts(data: object) -> bool:
    return bool(VALIDATOR.is_valid(data))


def parser_accepts(text: str, variables: dict[str, str] | None = None) -> bool:
    try:
        load_pipeline(text, variables, source="p.yaml")
    except PipelineError:
        return False
    return True


def step_doc(inner: str) -> str:
    """A one-step pipeline whose step has the flow-mapping keys `inner`, and `name: a` and
    `command: run` where `inner` gives none."""
    keys = [f"{k}: {v}" for k, v in (("name", "a"), ("command", "run"))
            if not re.search(rf"\b{k}:", inner)]
    return "pipeline:\n  - {" + ", ".join([*keys, inner] if inner else keys) + "}\n"


def test_committed_schema_is_what_the_generator_writes() -> None:
    """docs/pipeline.schema.json is current: `python -m m27.pipeline.schema > ...`."""
    assert COMMITTED.read_text(encoding="utf-8") == schema.render()


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    Draft202012Validator.check_schema(schema.pipeline_schema())
    assert schema.pipeline_schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _properties(node: object) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every property a user can write; the cross-field rules (`allOf`, `not`) are not."""
    if isinstance(node, dict):
        yield from node.get("properties", {}).items()
        for key, value in node.items():
            if key not in ("allOf", "not"):
                yield from _properties(value)
    elif isinstance(node, list):
        for item in node:
            yield from _properties(item)


def test_every_property_and_definition_has_a_description() -> None:
    """Editors show the description as help on hover and in completion."""
    document = schema.pipeline_schema()
    missing = [key for key, value in _properties(document) if not value.get("description")]
    missing += [f"$defs/{k}" for k, v in document["$defs"].items() if not v.get("description")]
    assert missing == []


def test_the_property_sets_are_the_readers_key_sets() -> None:
    document = schema.pipeline_schema()
    defs = document["$defs"]
    backoff = defs["retries"]["anyOf"][1]["properties"]["backoff"]
    assert backoff["$ref"] == "#/$defs/backoff"
    assert list(document["properties"]) == list(_document.TOP_KEYS)
    assert list(defs["step"]["properties"]) == list(_document.STEP_KEYS)
    assert list(defs["resources"]["properties"]) == list(_document.RESOURCE_KEYS)
    assert list(defs["retries"]["anyOf"][1]["properties"]) == list(_document.RETRY_KEYS)
    assert list(defs["backoff"]["properties"]) == list(_document.BACKOFF_KEYS)


@pytest.mark.parametrize("name", ["TOP_KEYS", "STEP_KEYS", "RESOURCE_KEYS", "RETRY_KEYS",
                                  "BACKOFF_KEYS"])
def test_a_key_the_reader_learns_without_a_schema_entry_fails_loudly(
        monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(_document, name, (*getattr(_document, name), "new_key"))
    with pytest.raises(schema.SchemaOutOfDate, match="new_key"):
        schema.pipeline_schema()


def test_a_schema_entry_for_a_key_the_reader_dropped_fails_loudly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_document, "RESOURCE_KEYS", ("gpus", "cpus", "memory"))
    with pytest.raises(schema.SchemaOutOfDate, match="gpu_memory"):
        schema.pipeline_schema()


def test_main_prints_the_committed_schema(capsys: pytest.CaptureFixture[str]) -> None:
    schema.main()
    assert capsys.readouterr().out == COMMITTED.read_text(encoding="utf-8")


def test_seed_example_validates() -> None:
    assert schema_accepts(yaml.safe_load(SEED))
    assert parser_accepts(SEED, {"INPUT_FILE": "x.pdb"})


def test_full_example_uses_every_key_and_validates() -> None:
    data = yaml.safe_load(FULL)
    assert set(data) == set(_document.TOP_KEYS)
    steps = data["pipeline"]
    assert set().union(*steps) == set(_document.STEP_KEYS)
    assert set().union(*(s.get("resources", {}) for s in steps)) == set(_document.RESOURCE_KEYS)
    retries = steps[1]["retries"]
    assert set(retries) == set(_document.RETRY_KEYS)
    assert set(retries["backoff"]) == set(_document.BACKOFF_KEYS)
    assert schema_accepts(data)
    spec = load_pipeline(FULL, {"SEEDS": "1 2"}, source="full.yaml", secrets={"TOKEN": "t0k"})
    assert len(spec.steps) == 6


@pytest.mark.parametrize(("why", "text"), [
    ("unknown step key", step_doc("comand: x")),
    ("unknown top-level key", "steps: []\npipeline:\n  - {name: a, command: x}\n"),
    ("bad type", step_doc("type: tpu")),
    ("gpus not a number", step_doc("resources: {gpus: x}")),
    ("missing name", "pipeline:\n  - {command: x}\n"),
    ("missing command", "pipeline:\n  - {name: a}\n"),
    ("blank command", "pipeline:\n  - {name: a, command: '  '}\n"),
    ("no pipeline", "name: x\n"),
    ("empty pipeline", "pipeline: []\n"),
    ("pipeline not a list", "pipeline: {name: a, command: x}\n"),
    ("a step that is not a mapping", "pipeline:\n  - a\n"),
    ("a file that is a list", "- name: a\n  command: x\n"),
    ("name with a dot", "pipeline:\n  - {name: a.b, command: x}\n"),
    ("name starting with -", "pipeline:\n  - {name: -a, command: x}\n"),
    ("name of 101 characters", f"pipeline:\n  - {{name: {'a' * 101}, command: x}}\n"),
    ("name with a trailing newline", 'pipeline:\n  - {name: "a\\n", command: x}\n'),
    ("negative number as name", "pipeline:\n  - {name: -1, command: x}\n"),
    ("float as name", "pipeline:\n  - {name: 1.5, command: x}\n"),
    ("null as name", "pipeline:\n  - {name: ~, command: x}\n"),
    ("bad variable name", "vars: {1X: a}\npipeline:\n  - {name: a, command: x}\n"),
    ("bad top-level priority", "priority: asap\npipeline:\n  - {name: a, command: x}\n"),
    ("preemptible as text", "preemptible: 'yes'\npipeline:\n  - {name: a, command: x}\n"),
])
def test_invalid_documents_are_rejected_by_both(why: str, text: str) -> None:
    assert not schema_accepts(yaml.safe_load(text)), why
    assert not parser_accepts(text), why


AGREEMENT = [
    # (the step's extra keys, valid?)
    ("", True),
    ("type: gpu_light", True), ("type: GPU", False), ("type: [cpu]", False),
    ("resources: {gpus: 0.5}", True), ("resources: {gpus: 0.1}", True),
    ("resources: {gpus: 0.25}", False), ("resources: {gpus: 1.5}", False),
    ("resources: {gpus: 64}", True), ("resources: {gpus: 65}", False),
    ("resources: {gpus: -1}", False), ("resources: {gpus: 2.0}", True),
    ("resources: {gpus: true}", False), ("resources: {cpus: 1024}", True),
    ("resources: {cpus: 1025}", False), ("resources: {cpus: 0}", False),
    ("resources: {cpus: 2.5}", False), ("resources: {cpus: '2'}", False),
    ("resources: {memory: 512MB}", True), ("resources: {memory: 8GiB}", True),
    ("resources: {memory: 8 gib}", True), ("resources: {memory: 1.5GB}", True),
    ("resources: {memory: 0.5KB}", True), ("resources: {memory: 0.001K}", True),
    ("resources: {memory: 0.0009K}", False), ("resources: {memory: 0.5B}", False),
    ("resources: {memory: 0B}", False), ("resources: {memory: 8 gigs}", False),
    ("resources: {memory: 8XB}", False), ("resources: {memory: 1}", True),
    ("resources: {memory: 0}", False), ("resources: {memory: 1.5}", False),
    ("resources: {memory: -1GiB}", False), ("resources: {memory: .5GiB}", False),
    ("resources: {disk: 1GiB}", False), ("resources: 4", False),
    ("checkpoint: 300s", True), ("checkpoint: 5m", True), ("checkpoint: 1.5h", True),
    ("checkpoint: 50MS", True), ("checkpoint: 2d", True), ("checkpoint: 300", True),
    ("checkpoint: 2.5", True), ("checkpoint: .5s", True), ("checkpoint: ' 5 m '", True),
    ("checkpoint: 0s", False), ("checkpoint: 0", False), ("checkpoint: 0.0m", False),
    ("checkpoint: -5", False), ("checkpoint: 5 minutes", False), ("checkpoint: 1w", False),
    ("checkpoint: 5.s", False), ("checkpoint: true", False), ("checkpoint: ~", False),
    ("timeout: 2h", True), ("timeout: []", False),
    ("retries: 2", True), ("retries: 0", True), ("retries: 100", True),
    ("retries: 101", False), ("retries: -1", False), ("retries: '2'", False),
    ("retries: [1]", False), ("retries: {}", True),
    ("retries: {failure: 1, infrastructure: 0}", True),
    ("retries: {infrastructure: 101}", False), ("retries: {attempts: 2}", False),
    ("retries: {backoff: {initial: 1s, factor: 1.5, max: 1m}}", True),
    ("retries: {backoff: {factor: 1}}", True), ("retries: {backoff: {factor: 10}}", True),
    ("retries: {backoff: {factor: 11}}", False), ("retries: {backoff: {factor: 0.5}}", False),
    ("retries: {backoff: {jitter: 1}}", False), ("retries: {backoff: {initial: 0s}}", False),
    ("env: {A_B: x, n: 1, _x: true}", True), ("env: {M27_X: y}", False),
    ("env: {CUDA_VISIBLE_DEVICES: 0}", False), ("env: {CUDA_DEVICE_ORDER: x}", False),
    ("env: {M27: y}", True), ("env: {1A: x}", False), ("env: {A-B: x}", False),
    ("env: {A: ~}", False), ("env: {A: [1]}", False), ("env: [A]", False),
    ("env: {A: {value: x, secret: true}}", True), ("env: {A: {value: x}}", True),
    ("env: {A: {secret: true}}", False), ("env: {A: {value: x, secret: 1}}", False),
    ("env: {A: {value: x, hidden: true}}", False),
    ("secrets: {S3_KEY: x, N: 1}", True), ("secrets: {M27_X: y}", False),
    ("secrets: {A: {value: x}}", False), ("secrets: [A]", False),
    ("matrix: {lr: [0.1, 0.01], seed: 1}", True), ("matrix: {}", False),
    ("matrix: {lr: []}", False), ("matrix: {lr: [1, 1]}", False),
    ("matrix: {1lr: [1]}", False), ("matrix: {lr: [~]}", False),
    ("matrix: {lr: {a: 1}}", False), ("matrix: [1, 2]", False),
    ("matrix: {k: [1, 2]}, max_parallel: 2", True), ("max_parallel: 2", False),
    ("matrix: {k: [1, 2]}, max_parallel: 0", False),
    ("matrix: {k: [1, 2]}, max_parallel: 100001", False),
    ("output: a, outputs: [b]", False), ("output: [a, b]", True), ("outputs: a", True),
    ("outputs: []", True), ("output: ~", False), ("inputs: [x, 1, true]", True),
    ("inputs: [[x]]", False), ("depends_on: []", True), ("depends_on: {a: 1}", False),
    ("preemptible: true", True), ("preemptible: 'true'", False), ("preemptible: 1", False),
    ("priority: urgent", True), ("priority: low", True), ("priority: asap", False),
    ("workdir: sub", True), ("workdir: ''", True), ("workdir: ~", False),
    ("command: true", True), ("command: 42", True), ("command: ~", False),
    ("name: 2020", True), ("name: yes", True), ("name: a_b-C9", True),
    ("monitor: true", True), ("monitor: false", True), ("monitor: []", True),
    ("monitor: {metric: loss}", True), ("monitor: {metric: val/acc, mode: max}", True),
    ("monitor: {mode: up}", False), ("monitor: {metric: 'a b'}", False),
    ("monitor: {metric: 1x}", False), ("monitor: {spike: -1}", False),
    ("monitor: {spike: 0}", True), ("monitor: {window: 1}", False),
    ("monitor: {divergence: 2.5}", False), ("monitor: {plateau: 100001}", False),
    ("monitor: {window: 1000}", True), ("monitor: {window: 1001}", False),
    ("monitor: {min_delta: 2}", False), ("monitor: {on_anomaly: [checkpoint, stop]}", True),
    ("monitor: {on_anomaly: stop}", True), ("monitor: {on_anomaly: []}", True),
    ("monitor: {on_anomaly: reboot}", False),
    ("monitor: {on_anomaly: [stop, stop]}", False),
    ("monitor: [{metric: a}, {metric: b, spike: 3}]", True), ("monitor: [true]", False),
    ("monitor: {threshold: 3}", False), ("monitor: 3", False), ("monitor: loss", False),
]


@pytest.mark.parametrize(("inner", "valid"), AGREEMENT)
def test_schema_and_parser_agree_on_each_value(inner: str, valid: bool) -> None:
    text = step_doc(inner)
    assert schema_accepts(yaml.safe_load(text)) is valid
    assert parser_accepts(text) is valid


@pytest.mark.parametrize(("step_type", "gpus", "gpu_memory"), list(itertools.product(
    [None, "cpu", "gpu", "gpu_light"], [None, 0, 0.5, 1, 2], [None, "1GiB"])))
def test_schema_and_parser_agree_on_type_gpus_and_gpu_memory(
        step_type: str | None, gpus: float | None, gpu_memory: str | None) -> None:
    """The rules between fields: `type` must fit `gpus`; gpu_memory needs a GPU."""
    resources = {k: v for k, v in [("gpus", gpus), ("gpu_memory", gpu_memory)] if v is not None}
    step: dict[str, object] = {"name": "a", "command": "run"}
    if step_type:
        step["type"] = step_type
    if resources:
        step["resources"] = resources
    text = yaml.safe_dump({"pipeline": [step]})
    assert schema_accepts(yaml.safe_load(text)) is parser_accepts(text)


# ---------------------------------------------------------------- generated documents
# Built only from values the schema allows. Left out, because the schema cannot check them:
# dependencies, `{{...}}` placeholders, names a sweep's members could take, backoff max
# shorter than initial, and numbers YAML would print with an exponent (see _durations).

def _yaml_text(value: object) -> str:
    """The text the reader sees for a scalar value once dumped to YAML."""
    node = yaml.compose(yaml.safe_dump(value))
    assert isinstance(node, yaml.ScalarNode)
    return str(node.value)


def _json_key(value: object) -> tuple[str, object]:
    if isinstance(value, bool):
        return "bool", value
    return ("number", float(value)) if isinstance(value, int | float) else ("text", value)


_plain = st.text(min_size=1, max_size=20).filter(lambda s: "{{" not in s and s.strip() != "")
_texts = st.one_of(_plain, st.integers(-10**6, 10**6), st.booleans(),
                   st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False))
_labels = st.one_of(
    st.text(st.characters(blacklist_categories=["Cc", "Cs"]), min_size=1, max_size=20)
    .filter(lambda s: s.strip() != ""), st.integers(-10**6, 10**6), st.booleans())
_names = st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", fullmatch=True),
                   st.integers(0, 10**9), st.booleans())
_identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
# Whole numbers and decimals YAML prints without an exponent, which units reads.
_durations = st.one_of(st.from_regex(schema.DURATION_RE), st.integers(1, 10**9),
                       st.floats(0.001, 1e6))
_sizes = st.one_of(st.from_regex(schema.SIZE_RE), st.integers(1, 2**50))
_gpus = st.one_of(st.integers(0, schema.GPUS_MAX), st.sampled_from(schema.GPU_TENTHS))
_many = st.one_of(_texts, st.lists(_texts, max_size=3))


@st.composite
def _kind(draw: st.DrawFn) -> dict[str, object]:
    """`type` and `resources` that fit each other."""
    gpus = draw(st.none() | _gpus)
    fitting = None if gpus is None else "cpu" if gpus == 0 else "gpu_light" if gpus < 1 \
        else "gpu"
    step_type = draw(st.sampled_from([None, fitting] if fitting else [None, "cpu", "gpu",
                                                                       "gpu_light"]))
    resources: dict[str, object] = {} if gpus is None else {"gpus": gpus}
    uses_gpu = (gpus or 0) > 0 or (gpus is None and step_type in ("gpu", "gpu_light"))
    extras = {"cpus": st.integers(1, schema.CPUS_MAX), "memory": _sizes,
              **({"gpu_memory": _sizes} if uses_gpu else {})}
    resources.update(draw(st.fixed_dictionaries({}, optional=extras)))
    result: dict[str, object] = {"type": step_type} if step_type else {}
    written_empty = draw(st.booleans())  # `resources: {}` is allowed too
    if resources or written_empty:
        result["resources"] = resources
    return result


@st.composite
def _backoff(draw: st.DrawFn) -> dict[str, object]:
    initial, longest = draw(st.lists(_durations, min_size=2, max_size=2))
    if parse_duration(initial) > parse_duration(longest):
        initial, longest = longest, initial
    backoff: dict[str, object] = draw(st.fixed_dictionaries({}, optional={
        "initial": st.just(initial), "max": st.just(longest),
        "factor": st.floats(schema.FACTOR_MIN, schema.FACTOR_MAX) | st.integers(1, 10)}))
    first = parse_duration(initial) if "initial" in backoff else 10.0  # the defaults
    last = parse_duration(longest) if "max" in backoff else 600.0
    if first > last:  # only one of them is given: leave it out too
        backoff.pop("initial", None)
        backoff.pop("max", None)
    return backoff


_retries = st.one_of(
    st.integers(0, schema.RETRIES_MAX),
    st.fixed_dictionaries({}, optional={"failure": st.integers(0, schema.RETRIES_MAX),
                                        "infrastructure": st.integers(0, schema.RETRIES_MAX),
                                        "backoff": _backoff()}))
_env = st.dictionaries(_identifiers.filter(lambda k: not k.startswith(_document.RESERVED_ENV)),
                       _texts, max_size=3)
_axis = st.one_of(_texts, st.lists(_texts, min_size=1, max_size=3,
                                   unique_by=(_yaml_text, _json_key)))
_matrix = st.dictionaries(_identifiers, _axis, min_size=1, max_size=2)


@st.composite
def _step(draw: st.DrawFn, name: object) -> dict[str, object]:
    step: dict[str, object] = {"name": name, "command": draw(_texts.filter(
        lambda v: not isinstance(v, str) or (v.strip() != "" and "\x00" not in v)))}
    step.update(draw(_kind()))
    step.update(draw(st.fixed_dictionaries({}, optional={
        "outputs": _many,
        "inputs": _many, "checkpoint": _durations, "timeout": _durations,
        "priority": st.sampled_from(URGENCIES), "preemptible": st.booleans(),
        "retries": _retries, "env": _env, "workdir": _texts, "depends_on": st.just([])})))
    if "outputs" in step and draw(st.booleans()):
        step["output"] = step.pop("outputs")
    if draw(st.booleans()):
        step["matrix"] = draw(_matrix)
        if draw(st.booleans()):
            step["max_parallel"] = draw(st.integers(1, 100_000))
    return step


def _sweeps_collide(steps: list[dict[str, object]]) -> bool:
    """Whether a sweep's members could be named like another step."""
    texts = [_yaml_text(s["name"]) for s in steps]
    return any(other.startswith(f"{texts[i]}-") for i, s in enumerate(steps)
               if "matrix" in s for other in texts)


@st.composite
def documents(draw: st.DrawFn) -> tuple[dict[str, object], dict[str, str]]:
    """A pipeline and the variables to submit with it (those without a default)."""
    names = draw(st.lists(_names, min_size=1, max_size=4, unique_by=_yaml_text))
    steps = [draw(_step(name)) for name in names]
    doc: dict[str, object] = draw(st.fixed_dictionaries({}, optional={
        "name": _labels, "priority": st.sampled_from(URGENCIES),
        "preemptible": st.booleans(),
        "vars": st.dictionaries(_identifiers, st.none() | _texts, max_size=3)}))
    doc["pipeline"] = steps
    declared = doc.get("vars", {})
    assert isinstance(declared, dict)
    return doc, {k: "x" for k, v in declared.items() if v is None}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_load_pipeline_accepts_every_generated_document_the_schema_accepts(
        generated: tuple[dict[str, object], dict[str, str]]) -> None:
    doc, variables = generated
    steps = doc["pipeline"]
    assert isinstance(steps, list)
    if _sweeps_collide(steps):
        return
    text = yaml.safe_dump(doc, sort_keys=False)
    assert schema_accepts(yaml.safe_load(text)), list(VALIDATOR.iter_errors(yaml.safe_load(text)))
    try:
        load_pipeline(text, variables, source="generated.yaml")
    except PipelineError as exc:
        pytest.fail(f"{exc}\n---\n{text}")
