"""The full experiment language: vars, resources, priorities, retries, timeouts, env,
workdirs, inputs/outputs and references between steps, sweeps."""

from __future__ import annotations

import shlex

import pytest

from m27.common.model import MonitorSpec, RetryPolicy
from m27.pipeline import PipelineError, load_pipeline


def problems_of(text: str, variables: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PipelineError) as info:
        load_pipeline(text, variables, source="p.yaml")
    return [p.render("p.yaml") for p in info.value.problems]


def one(found: list[str], fragment: str) -> None:
    assert any(fragment in p for p in found), found


FULL = """\
name: md-study
vars:
  PDB: data/1abc.pdb
  STEPS: 5000
  TAG:
priority: high
preemptible: true
pipeline:
  - name: prep
    command: python prep.py --in {{PDB}} --tag {{TAG}}
    inputs: [prep.py, "{{PDB}}"]
    output: prepared.pdb
    env: {OMP_NUM_THREADS: 4, LABEL: "run-{{TAG}}"}
  - name: md
    type: gpu
    depends_on: prep
    command: gmx mdrun -s {{steps.prep.output}} -nsteps {{STEPS}}
    resources: {gpus: 2, gpu_memory: 40GiB, cpus: 8, memory: 64GiB}
    retries: {failure: 1, infrastructure: 5, backoff: {initial: 30s, factor: 3, max: 20m}}
    timeout: 12h
    checkpoint: 5m
    priority: urgent
    preemptible: false
    workdir: md
    outputs: [traj.xtc, state.cpt]
  - name: analysis
    depends_on: [md]
    resources: {gpus: 0.3}
    command: python analyze.py {{steps.md.outputs}}
    retries: 2
"""


def test_every_key_together() -> None:
    spec = load_pipeline(FULL, {"TAG": "a b"}, workdir="/lab/exp")
    assert spec.name == "md-study"
    assert spec.urgency == "high"
    prep, md, analysis = spec.steps
    assert shlex.split(prep.command) == ["python", "prep.py", "--in", "data/1abc.pdb",
                                         "--tag", "a b"]
    assert prep.inputs == ("prep.py", "data/1abc.pdb")
    assert prep.env == {"OMP_NUM_THREADS": "4", "LABEL": "run-a b"}
    assert (prep.urgency, prep.preemptible) == ("high", True)
    assert md.command == "gmx mdrun -s /lab/exp/prepared.pdb -nsteps 5000"
    assert md.resources.gpus == 2
    assert md.resources.gpu_memory_mb == 40 * 1024
    assert (md.resources.cpus, md.resources.memory_mb) == (8, 64 * 1024)
    assert md.retry == RetryPolicy(failure=1, infrastructure=5, initial_delay_s=30.0,
                                   factor=3.0, max_delay_s=1200.0)
    assert (md.timeout_s, md.checkpoint_interval_s) == (43200.0, 300.0)
    assert (md.urgency, md.preemptible, md.workdir) == ("urgent", False, "md")
    assert analysis.type == "gpu_light"
    assert analysis.resources.gpus == 0.3
    assert shlex.split(analysis.command) == ["python", "analyze.py", "/lab/exp/md/traj.xtc",
                                             "/lab/exp/md/state.cpt"]
    assert analysis.retry.failure == 2


def test_the_submitter_urgency_overrides_the_file_but_not_a_step() -> None:
    spec = load_pipeline(FULL, {"TAG": "x"}, urgency="low")
    assert [s.urgency for s in spec.steps] == ["low", "urgent", "low"]


def test_variables_declared_required_and_unknown() -> None:
    found = problems_of(FULL, {"TGA": "x"})
    one(found, "variable TGA was given but the pipeline does not declare it "
        "(did you mean `TAG`?)")
    one(found, "p.yaml:5:7: vars.TAG: variable `TAG` has no default and was not given")


def test_a_given_value_beats_the_default() -> None:
    spec = load_pipeline(FULL, {"TAG": "t", "STEPS": "7"})
    assert spec.steps[1].command.endswith("-nsteps 7")


@pytest.mark.parametrize(("resources", "expected"), [
    ("{gpus: 0.25}", "gpus: 0.25 is not in tenths"),
    ("{gpus: 1.5}", "more than one GPU must be a whole number"),
    ("{gpus: 100}", "expected a number from 0 to 64"),
    ("{gpus: lots}", "expected a number, got the string 'lots'"),
    ("{cpus: 0}", "expected a number from 1 to 1024"),
    ("{gpu_memory: huge}", "expected a size such as 128KB"),
    ("{cpus: 2, gpu_memory: 8GiB}", "gpu_memory is set but the step uses no GPU"),
    ("{gpu: 1}", "unknown key `gpu` (did you mean `gpus`?)"),
    ("{gpus: 1, cuda: latest}", "resources.cuda: cuda requirement 'latest' is not "
     "understood: expected a version with an optional operator"),
    ("{gpus: 1, driver: '=>550'}", "driver requirement '=>550' is not understood"),
    ("{gpus: 1, gpu_model: '|'}", "gpu_model '|' is not understood"),
    ("{gpus: 1, gpu_model: [A100]}", "resources.gpu_model: expected a string, got a list"),
    ("{cpus: 2, cuda: '>=12'}", "cuda >=12 is required but the step uses no GPU"),
])
def test_bad_resources(resources: str, expected: str) -> None:
    one(problems_of(f"pipeline:\n  - {{name: a, command: x, resources: {resources}}}\n"),
        expected)


def test_gpu_model_driver_and_cuda_requirements_as_written() -> None:
    spec = load_pipeline("pipeline:\n  - {name: a, command: x, resources: {gpus: 1, "
                         "gpu_model: 'A100|H100', cuda: '>=12.1', driver: 535.104}}\n")
    resources = spec.steps[0].resources
    assert (resources.gpu_model, resources.cuda, resources.driver) == (
        "A100|H100", ">=12.1", "535.104")
    assert resources.requirements.text() == "GPU model A100|H100, driver >=535.104, cuda >=12.1"


@pytest.mark.parametrize(("step_type", "gpus", "expected"), [
    ("cpu", "1", "type cpu does not fit gpus: 1 (use type gpu, or leave type out)"),
    ("gpu", "0.5", "type gpu does not fit gpus: 0.5 (use type gpu_light"),
    ("gpu_light", "2", "type gpu_light does not fit gpus: 2"),
])
def test_type_and_gpus_must_agree(step_type: str, gpus: str, expected: str) -> None:
    text = (f"pipeline:\n  - {{name: a, type: {step_type}, command: x, "
            f"resources: {{gpus: {gpus}}}}}\n")
    one(problems_of(text), expected)


@pytest.mark.parametrize(("gpus", "step_type"), [("0", "cpu"), ("0.4", "gpu_light"),
                                                 ("1", "gpu"), ("4", "gpu")])
def test_gpus_alone_imply_the_type(gpus: str, step_type: str) -> None:
    spec = load_pipeline(f"pipeline:\n  - {{name: a, command: x, resources: {{gpus: {gpus}}}}}\n")
    assert spec.steps[0].type == step_type


@pytest.mark.parametrize(("field", "expected"), [
    ("retries: -1", "expected a number from 0 to 100"),
    ("retries: {failures: 1}", "unknown key `failures` (did you mean `failure`?)"),
    ("retries: {backoff: {initial: 1m, max: 10s}}", "shorter than the first one"),
    ("retries: {backoff: {factor: 20}}", "expected a number from 1 to 10"),
    ("timeout: forever", "expected a duration"),
    ("priority: asap", "unknown priority 'asap'"),
    ("priority: urgnet", "did you mean `urgent`?"),
    ("preemptible: maybe", "expected true or false"),
    ("env: {M27_TASK_ID: x}", "M27_TASK_ID is set by m27"),
    ("env: {CUDA_VISIBLE_DEVICES: 0}", "CUDA_VISIBLE_DEVICES is set by m27"),
    ("env: {'bad-name': x}", "invalid variable name 'bad-name'"),
    ("env: [a, b]", "expected environment variables (a mapping)"),
    ("max_parallel: 2", "max_parallel limits a matrix step's members"),
    ("outputs: {a: b}", "expected a list of paths"),
])
def test_bad_step_fields(field: str, expected: str) -> None:
    one(problems_of(f"pipeline:\n  - name: a\n    command: x\n    {field}\n"), expected)


def test_references_need_a_dependency_and_an_output() -> None:
    text = """pipeline:
  - {name: a, command: x, output: a.txt}
  - {name: b, command: "cat {{steps.a.output}}"}
  - {name: c, command: "cat {{steps.d.output}} {{steps.e.output}}", depends_on: [e]}
  - {name: e, command: x}
  - {name: f, command: "{{steps.a.outputs}} {{matrix.lr}} {{nope.x}}", depends_on: [a]}
"""
    found = problems_of(text)
    one(found, "pipeline[1].command: this step does not depend on `a`, so its outputs may not "
        "exist yet (add a to depends_on)")
    one(found, "unknown step `d`")
    one(found, "step `e` declares no output")
    one(found, "`{{matrix.lr}}` in a step without a `matrix:`")
    one(found, "`{{nope.x}}` is not a placeholder")


def test_references_reach_through_dependencies() -> None:
    text = """pipeline:
  - {name: a, command: x, outputs: [out/a.txt]}
  - {name: b, command: x, depends_on: [a]}
  - {name: c, command: "cat {{steps.a.output}}", depends_on: [b]}
"""
    assert load_pipeline(text).steps[2].command == "cat out/a.txt"


SWEEP = """pipeline:
  - {name: prep, command: x, output: data.csv}
  - name: train
    depends_on: [prep]
    matrix: {lr: [1e-3, 1e-4], seed: [1, 2, 3]}
    max_parallel: 2
    command: train --lr {{matrix.lr}} --seed {{matrix.seed}} --data {{steps.prep.output}}
    output: model-{{matrix.lr}}-{{matrix.seed}}.pt
  - name: compare
    depends_on: [train]
    command: compare {{steps.train.outputs}}
"""


def test_a_matrix_fans_out_with_derived_names_and_a_cap() -> None:
    spec = load_pipeline(SWEEP)
    names = [s.name for s in spec.steps]
    assert names == ["prep", "train-lr1e-3-seed1", "train-lr1e-3-seed2", "train-lr1e-3-seed3",
                     "train-lr1e-4-seed1", "train-lr1e-4-seed2", "train-lr1e-4-seed3",
                     "compare"]
    first = spec.steps[1]
    assert first.group == "train"
    assert first.matrix == {"lr": "1e-3", "seed": "1"}
    assert first.command == "train --lr 1e-3 --seed 1 --data data.csv"
    assert first.outputs == ("model-1e-3-1.pt",)
    assert spec.max_parallel == {"train": 2}
    compare = spec.steps[-1]
    assert compare.depends_on == tuple(names[1:7])
    assert shlex.split(compare.command)[1:] == [f"model-{lr}-{seed}.pt" for lr in ("1e-3", "1e-4")
                                                for seed in (1, 2, 3)]


def test_sweep_problems_are_reported_once_and_sweeps_need_outputs_plural() -> None:
    text = SWEEP.replace("{{matrix.seed}} --data", "{{matrix.sed}} {{UNDEF}} --data")
    text = text.replace("{{steps.train.outputs}}", "{{steps.train.output}}")
    found = problems_of(text)
    assert sum("the matrix has no axis `sed` (did you mean `seed`?)" in p for p in found) == 1
    assert sum("undefined variable `UNDEF`" in p for p in found) == 1
    one(found, "`train` is a sweep of 6 steps (use {{steps.train.outputs}}")


def test_values_that_make_bad_names_get_numbered_members() -> None:
    text = "pipeline:\n  - name: t\n    matrix: {x: ['a b', 'a_b']}\n    command: echo\n"
    assert [s.name for s in load_pipeline(text).steps] == ["t-0", "t-1"]


def test_matrix_problems() -> None:
    found = problems_of("pipeline:\n  - name: t\n    matrix: {x: [], y: [1, 1], 2z: [1]}\n"
                        "    command: echo\n")
    one(found, "an axis needs values")
    one(found, "a value is repeated")
    one(found, "invalid axis name '2z'")


def test_a_sweep_cycle_is_reported_once() -> None:
    text = """pipeline:
  - {name: a, command: x, depends_on: [b], matrix: {i: [1, 2, 3]}}
  - {name: b, command: x, depends_on: [a]}
"""
    found = problems_of(text)
    assert [p for p in found if "cycle" in p] == [
        "p.yaml:2:5: pipeline: dependency cycle: a → b → a (a step cannot depend on itself, "
        "directly or through other steps)"]


def test_a_member_name_clashing_with_a_step_is_a_duplicate() -> None:
    text = """pipeline:
  - {name: t-x1, command: x}
  - {name: t, command: x, matrix: {x: [1, 2]}}
"""
    one(problems_of(text), "duplicate step name `t-x1`")


def test_ten_thousand_steps_plan_fine() -> None:
    text = ("pipeline:\n  - name: s\n    matrix: {a: [" + ", ".join(map(str, range(100)))
            + "], b: [" + ", ".join(map(str, range(100))) + "]}\n    command: echo\n"
            "  - {name: end, command: x, depends_on: [s]}\n")
    spec = load_pipeline(text)
    assert len(spec.steps) == 10_001
    assert len(spec.steps[-1].depends_on) == 10_000


def test_a_long_chain_is_not_a_recursion_problem() -> None:
    lines = ["pipeline:", "  - {name: s0, command: x}"] + [
        f"  - {{name: s{i}, command: x, depends_on: [s{i - 1}]}}" for i in range(1, 3000)]
    spec = load_pipeline("\n".join(lines) + "\n")
    assert spec.steps[-1].name == "s2999"


@pytest.mark.parametrize(("field", "expected"), [
    ("resources: {cpus: 017}", None),  # YAML 1.1 octal: 15
    ("retries: 2:30", "expected a number from 0 to 100, got 150"),  # sexagesimal
    ("resources: {cpus: 1.0}", "expected a whole number"),
    ("resources: {gpus: 0x1}", None),
    ("resources: {gpus: .nan}", "expected a number"),
    ("timeout: 1.0e+3", None),
    ("resources: {gpu_memory: 0x10, gpus: 1}", None),
    ("command: \"a\\0b\"", "the command contains a NUL byte"),
    ("matrix: {}", "a matrix needs an axis"),
])
def test_odd_yaml_numbers_are_read_as_yaml_reads_them(field: str, expected: str | None) -> None:
    text = f"pipeline:\n  - name: a\n    command: x\n    {field}\n"
    if "command:" in field:
        text = f"pipeline:\n  - name: a\n    {field}\n"
    if expected is None:
        assert load_pipeline(text).steps
    else:
        one(problems_of(text), expected)


# ---------------------------------------------------------------- bombs (issue 14)


def _axis(name: str, count: int) -> str:
    return f"{name}: [{', '.join(str(i) for i in range(count))}]"


@pytest.mark.timeout(10)
def test_a_matrix_bomb_is_refused_from_its_size_before_anything_is_expanded() -> None:
    """1.6 KB, four axes of 100 values: 10^8 steps. Refused in well under a second, with
    the product spelled out, instead of building 10^8 combinations."""
    axes = ", ".join(_axis(n, 100) for n in "abcd")
    text = f"pipeline:\n  - name: t\n    matrix: {{{axes}}}\n    command: echo\n"
    assert len(text) < 2000
    found = problems_of(text)
    one(found, "the sweeps expand to more than 20000 steps (step `t` adds "
               "100 × 100 × 100 × 100 = 100000000)")
    assert len(found) == 1
    # several sweeps that each fit but together do not
    two = "pipeline:\n" + "".join(
        f"  - name: s{i}\n    matrix: {{{_axis('x', 1000)}}}\n    command: echo\n"
        for i in range(21))
    one(problems_of(two), "the sweeps expand to more than 20000 steps (step `s20` adds 1000")


@pytest.mark.timeout(10)
def test_a_fan_in_bomb_is_refused_before_its_edges_are_built() -> None:
    """500 steps each depending on a sweep of 1,000: 500,000 edges."""
    text = ("pipeline:\n  - name: sweep\n    matrix: {" + _axis("x", 1000) + "}\n"
            "    command: echo\n" + "".join(
                f"  - name: gather-{i}\n    depends_on: [sweep]\n    command: echo\n"
                for i in range(500)))
    found = problems_of(text)
    one(found, "the dependencies expand to 500000 edges, more than 200000")


def test_an_error_message_stays_short_however_many_problems_there_are() -> None:
    text = "pipeline:\n" + "".join(
        f"  - name: s{i}\n    depends_on: [{'nope' * 50}]\n    command: echo\n"
        for i in range(2000))
    with pytest.raises(PipelineError) as caught:
        load_pipeline(text, source="p" * 10_000)
    message = str(caught.value)
    assert len(caught.value.problems) == 2000  # all of them are kept for callers
    assert "2000 problems" in message
    assert message.endswith("… and 1950 more")
    assert len(message) < 60 * 520


def test_a_monitor_is_read_into_every_member_of_a_sweep_with_defaults_filled_in() -> None:
    spec = load_pipeline(
        "pipeline:\n"
        "  - name: train\n"
        "    command: python train.py --lr {{matrix.lr}}\n"
        "    matrix: {lr: [0.1, 0.01]}\n"
        "    monitor:\n"
        "      - {metric: loss, spike: 4, on_anomaly: [checkpoint, stop]}\n"
        "      - {metric: val/acc, mode: max, plateau: 30, on_anomaly: notify}\n"
        "  - {name: plain, command: x, monitor: true}\n"
        "  - {name: none, command: x}\n", source="p.yaml")
    by_name = {s.name: s for s in spec.steps}
    for member in ("train-lr0_1", "train-lr0_01"):
        loss, acc = by_name[member].monitor
        assert (loss.metric, loss.spike, loss.on_anomaly) == ("loss", 4.0, ("checkpoint", "stop"))
        assert loss.window == MonitorSpec().window  # unset: the default
        assert (acc.metric, acc.mode, acc.plateau, acc.on_anomaly) == (
            "val/acc", "max", 30, ("notify",))
    assert by_name["plain"].monitor == (MonitorSpec(),)
    assert by_name["none"].monitor == ()


@pytest.mark.parametrize(("monitor", "expected"), [
    ("{metric: loss, mode: up}", "p.yaml:2:57: pipeline[0].monitor.mode: unknown mode 'up'"),
    ("{spike: -1}", "pipeline[0].monitor.spike"),
    ("{on_anomaly: [checkpoint, reboot]}", "unknown action 'reboot'"),
    ("[{metric: loss}, {metric: loss, spike: 3}]", "the metric 'loss' is monitored twice"),
    ("{metric: 'bad name'}", "invalid metric name 'bad name'"),
    ("{threshold: 3}", "pipeline[0].monitor.threshold: unknown key `threshold`"),
    ("[{metric: a}, 7]", "pipeline[0].monitor[1]: expected a monitored metric"),
    ("loss", "pipeline[0].monitor: expected true or false"),
])
def test_a_bad_monitor_says_what_and_where(monitor: str, expected: str) -> None:
    one(problems_of(f"pipeline:\n  - {{name: a, command: x, monitor: {monitor}}}\n"),
        expected)
