"""The HTML run report: content, escaping of everything users control, structure, determinism."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from typing import Any

import pytest

from m27.common.model import RunRecord, StepRecord
from m27.report import render_run_report, summary_line
from m27.report._text import MAX_TAIL_CHARS, clean, clean_tail
from m27.report._timeline import MAX_TICKS, bars, tick_step
from m27.report.render import gpus_cell

T0 = 1_714_566_896.0  # 2024-05-01 12:34:56 UTC
GENERATED = T0 + 1000

HOSTILE = (
    "<script>alert(1)</script>",
    '"><img src=x onerror=alert(1)>',
    "'><svg onload=alert(1)>",
    "</pre></details></section><iframe src=//evil>",
)
VOID_ELEMENTS = frozenset({"meta", "br", "hr", "img", "input", "link", "wbr"})


def step(name: str = "train", **fields: Any) -> StepRecord:
    values: dict[str, Any] = {"type": "cpu", "command": f"python {name}.py"}
    values.update(fields)
    return StepRecord(name=name, **values)


def run(*steps: StepRecord, **fields: Any) -> RunRecord:
    values: dict[str, Any] = {
        "run_id": "r-20240501-123456-abcdef", "name": "sweep", "user": "alice",
        "urgency": "normal", "state": "succeeded", "created_at": T0,
        "started_at": T0 + 1, "ended_at": T0 + 500,
    }
    values.update(fields)
    return RunRecord(steps=steps, **values)


def finished(name: str, state: str = "succeeded", exit_code: int | None = 0,
             start: float = 10, end: float = 20, **fields: Any) -> StepRecord:
    values: dict[str, Any] = {"node_id": "node-a", "attempt": 1, **fields}
    return step(name, state=state, exit_code=exit_code, started_at=T0 + start,
                ended_at=T0 + end, **values)


MIXED = run(
    finished("prepare"),
    finished("train", "failed", 1, 20, 300, type="gpu", gpu_ids=(0, 1), gpu_share=2.0,
             stderr_tail="RuntimeError: CUDA out of memory\n", reason="exit code 1"),
    finished("evaluate", "cancelled", 143, 25, 60, reason="cancelled by alice"),
    step("plot", state="skipped", reason="dependency train failed"),
    step("publish", state="pending"),
    state="failed",
)
RUNS = {
    "mixed": MIXED,
    "one step": run(finished("only")),
    "zero steps": run(),
    "never started": run(step("a", state="pending"), step("b", state="queued"),
                         state="cancelled", started_at=None, ended_at=None),
    "step without an end": run(finished("a"), step("b", state="cancelled",
                                                   started_at=T0 + 5), state="cancelled"),
}


class _Balance(HTMLParser):
    """Records tags, attributes and nesting errors of a document."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))
        if tag not in VOID_ELEMENTS:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()


def parse(document: str) -> _Balance:
    parser = _Balance()
    parser.feed(document)
    parser.close()
    return parser


def render(record: RunRecord) -> str:
    return render_run_report(record, generated_at=GENERATED)


@pytest.mark.parametrize("record", RUNS.values(), ids=RUNS.keys())
def test_every_step_name_state_and_exit_code_appears(record: RunRecord) -> None:
    document = render(record)
    for s in record.steps:
        assert f">{s.name}</a>" in document, s.name
        assert f'<span class="badge state-{s.state}">{s.state}</span>' in document
        if s.exit_code is not None:
            assert re.search(rf">{s.exit_code}(</span>)?</td>", document), s.exit_code
    assert f'<span class="badge state-{record.state}">{record.state}</span>' in document


@pytest.mark.parametrize("record", RUNS.values(), ids=RUNS.keys())
def test_tags_are_balanced(record: RunRecord) -> None:
    """Every element the report opens is closed, in order, and the document is complete."""
    parser = parse(render(record))
    assert parser.errors == []
    assert parser.stack == []
    assert parser.tags[0][0] == "html"


@pytest.mark.parametrize("record", RUNS.values(), ids=RUNS.keys())
def test_timeline_has_one_bar_per_started_step(record: RunRecord) -> None:
    parser = parse(render(record))
    bar_rects = [attrs for tag, attrs in parser.tags
                 if tag == "rect" and "bar" in (dict(attrs).get("class") or "").split()]
    assert len(bar_rects) == sum(s.started_at is not None for s in record.steps)


@pytest.mark.parametrize("record", RUNS.values(), ids=RUNS.keys())
def test_output_is_deterministic(record: RunRecord) -> None:
    assert render(record) == render(record)


def test_only_the_footer_depends_on_generated_at() -> None:
    first = render_run_report(MIXED, generated_at=GENERATED).splitlines()
    second = render_run_report(MIXED, generated_at=GENERATED + 3600).splitlines()
    differing = [a for a, b in zip(first, second, strict=True) if a != b]
    assert len(differing) == 1
    assert differing[0].startswith("<footer>")


HOSTILE_FIELDS: dict[str, Any] = {
    "run name": lambda v: run(finished("a"), name=v),
    "user": lambda v: run(finished("a"), user=v),
    "run reason": lambda v: run(finished("a"), reason=v),
    "workdir": lambda v: run(finished("a"), workdir=v),
    "step name (started)": lambda v: run(finished(v)),
    "step name (not started)": lambda v: run(step(v)),
    "command": lambda v: run(finished("a", command=v)),
    "stderr tail": lambda v: run(finished("a", stderr_tail=v)),
    "stdout tail": lambda v: run(finished("a", stdout_tail=v)),
    "step reason": lambda v: run(finished("a", reason=v)),
    "node id": lambda v: run(finished("a", node_id=v)),
    "env value": lambda v: run(finished("a", env={"X": v})),
    "log path": lambda v: run(finished("a", stderr_path=v, stdout_path=v)),
    "dependency": lambda v: run(finished("a", depends_on=(v,))),
}


@pytest.mark.parametrize("payload", HOSTILE)
@pytest.mark.parametrize("field", HOSTILE_FIELDS)
def test_user_strings_are_escaped(field: str, payload: str) -> None:
    """No user-controlled string can add an element or attribute to the report."""
    document = render(HOSTILE_FIELDS[field](payload))
    assert payload not in document
    assert payload in html.unescape(document)  # shown, as text
    parser = parse(document)
    assert parser.errors == []
    assert not [tag for tag, _ in parser.tags if tag in {"script", "img", "iframe"}]
    assert not [name for _, attrs in parser.tags for name, _ in attrs if name.startswith("on")]


@pytest.mark.parametrize(("field", "make"), [
    ("run name", lambda v: run(name=v)),
    ("step name", lambda v: run(finished(v))),
    ("command", lambda v: run(finished("a", command=v))),
    ("stderr tail", lambda v: run(finished("a", stderr_tail=v))),
])
def test_control_characters_are_removed(field: str, make: Any) -> None:
    document = render(make("ok\x00\x07\x1b\u202eEVIL\x7f\x9bdone"))
    for char in "\x00\x07\x1b\u202e\x7f\x9b":
        assert char not in document, (field, char)
    assert "okEVILdone" in document


def test_the_environment_is_shown_with_secrets_masked() -> None:
    document = render(run(finished("a", env={"OMP_NUM_THREADS": "4"},
                                   secret_env=("API_TOKEN",))))
    assert "API_TOKEN=***\nOMP_NUM_THREADS=4" in document
    assert "Environment" not in render(run(finished("b")))


def test_newlines_and_tabs_in_a_command_are_kept() -> None:
    assert "line 1\n\tline 2" in render(run(finished("a", command="line 1\n\tline 2")))


@pytest.mark.parametrize(("fields", "expected", "absent"), [
    ({}, "—", "simulated"),
    ({"gpu_ids": (0,), "gpu_share": 0.5}, "GPU 0", "simulated"),
    ({"gpu_ids": (0, 1), "gpu_share": 2.0}, "GPUs 0, 1", "simulated"),
    ({"gpu_ids": (3,), "gpu_share": 0.3, "gpu_simulated": True}, "simulated", None),
    ({"gpu_simulated": True}, "simulated", None),
])
def test_gpus_cell(fields: dict[str, Any], expected: str, absent: str | None) -> None:
    cell = gpus_cell(step(**fields))
    assert expected in cell
    if absent:
        assert absent not in cell
    if fields.get("gpu_share"):
        assert f"{fields['gpu_share']:g}" in cell


def test_simulated_gpus_are_labelled_in_the_report() -> None:
    real = render(run(finished("a", gpu_ids=(0,), gpu_share=1.0)))
    simulated = render(run(finished("a", gpu_ids=(0,), gpu_share=1.0, gpu_simulated=True)))
    assert "simulated" not in real
    assert '<span class="sim"' in simulated
    assert "simulated</strong> GPUs" in simulated


def test_missing_times_render_as_dashes() -> None:
    document = render(RUNS["never started"])
    assert "1970" not in document
    assert "<dt>Started</dt><dd>—</dd>" in document
    assert "<dt>Duration</dt><dd>—</dd>" in document
    assert "No step started" in document


def test_a_run_without_steps_renders() -> None:
    document = render(run())
    assert "No steps." in document
    assert "<svg" not in document
    assert "<table" not in document


def test_header_shows_the_run() -> None:
    document = render(MIXED)
    for text in ("sweep", "r-20240501-123456-abcdef", "alice", "normal",
                 "2024-05-01 12:34:56 UTC", "8m19s"):
        assert text in document, text


def test_failed_steps_are_open_and_succeeded_ones_folded() -> None:
    document = render(MIXED)
    assert '<details id="step-1" open>' in document  # train failed
    assert '<details id="step-0">' in document  # prepare succeeded


@pytest.mark.parametrize(("states", "expected"), [
    ((), "No steps."),
    (("succeeded",), "1 step: 1 succeeded"),
    (("failed", "succeeded", "succeeded", "skipped"),
     "4 steps: 2 succeeded, 1 failed, 1 skipped"),
    (("pending", "cancelled"), "2 steps: 1 cancelled, 1 pending"),
])
def test_summary_line(states: tuple[str, ...], expected: str) -> None:
    steps = tuple(step(f"s{i}", state=state) for i, state in enumerate(states))
    assert summary_line(steps) == expected


@pytest.mark.parametrize(("raw", "expected"), [
    ("plain\n", "plain\n"),
    ("\x1b[31mred\x1b[0m", "red"),
    ("a\r\nb\r\n", "a\nb\n"),
    ("10%\r50%\r100%\ndone", "100%\ndone"),
    ("\x1b]0;title\x07text", "text"),
    ("nul\x00byte", "nulbyte"),
    ("lone \ud800 surrogate", "lone  surrogate"),
])
def test_clean_tail(raw: str, expected: str) -> None:
    assert clean_tail(raw) == expected


def test_a_long_tail_keeps_its_end() -> None:
    tail = "x" * (MAX_TAIL_CHARS * 2) + "THE END"
    cleaned = clean_tail(tail)
    assert cleaned.endswith("THE END")
    assert cleaned.startswith("… (earlier output cut)")
    assert len(cleaned) < MAX_TAIL_CHARS + 100


def test_clean_keeps_newlines_tabs_and_unicode() -> None:
    assert clean("é ✓ 中文\n\tok") == "é ✓ 中文\n\tok"


@pytest.mark.parametrize("span", [0.004, 0.5, 1, 7, 59, 60, 61, 3599, 3600, 86400, 10 * 86400])
def test_tick_step_gives_few_ticks(span: float) -> None:
    step_s = tick_step(span)
    assert step_s > 0
    assert span / step_s <= MAX_TICKS


def test_bars_are_relative_to_the_first_start_and_open_ends_reach_the_run_end() -> None:
    record = RUNS["step without an end"]
    result = bars(record, generated_at=GENERATED)
    assert [(b.name, b.start, b.end, b.open) for b in result] == [
        ("a", 5.0, 15.0, False),
        ("b", 0.0, 495.0, True),
    ]


def test_an_unknown_creation_time_is_not_shown_as_1970() -> None:
    """The API sends 0 for a time it does not have."""
    document = render(run(created_at=0.0, started_at=None, ended_at=None))
    assert "1970" not in document
    assert "<dt>Created</dt><dd>—</dd>" in document


def test_gpu_energy_is_shown_and_marked_simulated_when_modelled() -> None:
    record = run(finished("train", energy_j=2500.0, gpu_simulated=True, gpu_ids=(0,),
                          gpu_share=1.0),
                 finished("measured", energy_j=420.0),
                 finished("prep"))
    document = render(record)
    assert "2.5 kJ (simulated)" in document
    assert "420 J" in document
    assert "420 J (simulated)" not in document
    assert "Work per energy" in document
    assert document.count("no work counter") == 2  # the GPU steps; prep used no energy


def test_work_per_joule_comes_from_the_programs_counters_only() -> None:
    from m27.common.curves import summarize
    from m27.report.evidence import RunEvidence, StepEvidence

    record = run(finished("train", energy_j=1000.0, gpu_ids=(0,), gpu_share=1.0),
                 finished("sim", energy_j=2000.0, gpu_simulated=True, gpu_ids=(0,)))
    evidence = RunEvidence(steps={
        "train": StepEvidence(curves=(summarize("train", "work.flops", [0, 1],
                                                [1e15, 1.9e15]),)),
        "sim": StepEvidence(curves=(summarize("sim", "work.samples", [0], [4000.0]),))})
    document = render_run_report(record, generated_at=T0, evidence=evidence)
    assert "1.9 TFLOP/J" in document
    assert "2 sample/J (simulated energy)" in document
    assert "no work counter" not in document


# -- v2: what the history holds of the run ------------------------------------------------

def _evidence(steps: int = 1, metrics: int = 2, readings: int = 5) -> tuple[RunRecord, Any]:
    from m27.common.curves import summarize
    from m27.report.evidence import GpuTrace, RunEvidence, StepEvidence
    from m27.report.store import AnomalyMark, CheckpointMark, GpuPoint

    names = [f"s{i}" for i in range(steps)]
    record = run(*(finished(n, type="gpu", gpu_ids=(0,), gpu_share=1.0,
                            outputs=("out/model.pt", "/abs/path with space.txt"))
                   for n in names), workdir="/home/alice/exp")
    points = tuple(GpuPoint(at=T0 + 10 + i, utilization_pct=50.0, memory_used_mb=100,
                            temperature_c=40.0 + i, power_w=None) for i in range(readings))
    found = {n: StepEvidence(
        curves=tuple(summarize(n, f"loss{k}" if k else "loss", [0, 1, 2], [2.0, 0.5, 0.7])
                     for k in range(metrics)),
        gpus=(GpuTrace(attempt=1, node_id="node-a", gpu=0, share=1.0, first_at=T0 + 10,
                       last_at=T0 + 15, points=points),),
        checkpoints=(CheckpointMark(checkpoint_id="c" * 64, attempt=1, at=T0 + 12,
                                    train_step=1, size_bytes=3 << 20, new_bytes=1 << 20),),
        anomalies=(AnomalyMark(attempt=1, metric="loss", train_step=1, kind="spike",
                               at=T0 + 13, value=float("nan"), baseline=0.5,
                               actions="checkpoint"),)) for n in names}
    return record, RunEvidence(steps=found)


def test_the_report_shows_results_curves_gpus_checkpoints_and_anomalies() -> None:
    record, found = _evidence()
    document = render_run_report(record, generated_at=GENERATED, evidence=found)
    assert parse(document).errors == []
    assert "<h2>Results</h2>" in document
    # loss: final 0.7 at step 2, best 0.5 (min) at step 1, over 3 points
    assert ('<td>loss</td><td class="num">0.7</td><td class="num">2</td>'
            '<td class="num">0.5 <span class="muted">(min)</span></td>'
            '<td class="num">1</td><td class="num">3</td>') in document
    assert "<h2>Curves</h2>" in document
    assert document.count("<svg") == 1 + 2 + 3  # timeline, two metrics, three GPU panels
    assert document.count('class="mark checkpoint"') == 1
    assert document.count('class="mark anomaly"') == 1
    assert "<title>spike in loss at training step 1</title>" in document
    assert "<h3>Checkpoints</h3>" in document
    assert "3.0 MiB" in document
    assert '<td class="num">NaN</td>' in document  # the anomaly's value
    assert 'href="file:///home/alice/exp/out/model.pt"' in document
    assert 'href="file:///abs/path%20with%20space.txt"' in document
    assert document == render_run_report(record, generated_at=GENERATED, evidence=found)


@pytest.mark.parametrize("readings", [1, 2])
def test_a_gpu_held_for_a_reading_or_two_is_shown_in_numbers_not_drawn(readings: int) -> None:
    """Found in the soak: three SVG curves per short GPU step were most of the report
    service's CPU. Fewer readings than a curve needs: the table only."""
    record, found = _evidence(readings=readings)
    document = render_run_report(record, generated_at=GENERATED, evidence=found)
    assert parse(document).errors == []
    assert document.count("<svg") == 1 + 2  # the timeline, the two metrics; no GPU curve
    assert "<h3>GPUs held</h3>" in document
    assert (f'<td>attempt 1 · node-a GPU 0</td><td class="num">1</td>'
            f'<td class="num">{readings}</td><td class="num">50</td><td class="num">50</td>'
            f'<td class="num">100</td><td class="num">{39 + readings}</td>') in document


def test_a_report_draws_at_most_its_figure_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from m27.report import render as module
    monkeypatch.setattr(module, "MAX_FIGURES", 12)
    record, found = _evidence(steps=3, metrics=module.MAX_METRIC_FIGURES + 3)
    document = render_run_report(record, generated_at=GENERATED, evidence=found)
    assert document.count("<svg") == 1 + 12  # the timeline, and the budget of 12 figures
    assert "3 more metric(s) in Results, not drawn here." in document
    # every metric of every step is in the results table all the same
    assert document.count('<td class="name"><a href="#step-') == 3 + 3 * (8 + 3)  # + steps
