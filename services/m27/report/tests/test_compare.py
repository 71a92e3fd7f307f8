"""Comparing runs (`m27.report.compare`): which steps are members, what varied, final and
best with the right goal, the order, and CSV/JSON a script or a spreadsheet can trust."""

from __future__ import annotations

import csv
import io
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.curves import Curve, summarize
from m27.common.model import RunRecord, StepRecord
from m27.report.compare import (
    cells,
    compare,
    goal_of,
    header,
    members_of,
    to_csv,
    to_json,
)


def step(name: str, matrix: dict[str, str] | None = None, state: str = "succeeded",
         group: str = "", energy_j: float | None = None,
         gpu_simulated: bool = False) -> StepRecord:
    return StepRecord(name=name, type="gpu", command="true", matrix=matrix or {},
                      group=group, state=state,  # type: ignore[arg-type]
                      energy_j=energy_j, gpu_simulated=gpu_simulated)


def run(run_id: str, *steps: StepRecord, vars: dict[str, str] | None = None) -> RunRecord:
    return RunRecord(run_id=run_id, name="p", user="u", urgency="normal", state="succeeded",
                     created_at=0.0, steps=steps, vars=vars or {})


def curve(step_name: str, name: str, ys: list[float]) -> Curve:
    return summarize(step_name, name, list(range(len(ys))), ys)


R1 = "r-20261201-081500-a1b2c3"
R2 = "r-20261201-081600-d4e5f6"


def sweep() -> tuple[RunRecord, dict[str, list[Curve]]]:
    steps = [step("prep")]
    curves = [curve("prep", "rows", [10.0])]
    for lr, seed, loss in (("1e-3", "1", 0.30), ("1e-3", "2", 0.25), ("1e-4", "1", 0.50),
                           ("1e-4", "2", math.nan)):
        name = f"train-lr{lr}-seed{seed}"
        steps.append(step(name, {"lr": lr, "seed": seed}, group="train"))
        curves += [curve(name, "loss", [1.0, loss + 0.1, loss]),
                   curve(name, "acc", [0.1, 1 - loss])]
    return run(R1, *steps), {R1: curves}


def test_goals_follow_the_name_unless_told() -> None:
    assert [goal_of(n, {}) for n in ("loss", "val/loss", "test_error", "ppl", "acc",
                                     "f1", "reward", "wall_time")] == [
        "min", "min", "min", "min", "max", "max", "max", "min"]
    assert goal_of("loss", {"loss": "max"}) == "max"


def test_one_run_compares_its_sweep_members_on_what_varied() -> None:
    record, curves = sweep()
    members = members_of([record], curves)
    assert [m.label for m in members] == [s.name for s in record.steps[1:]]  # not prep
    table = compare(members)
    assert table.metrics == ("loss", "acc")
    assert table.params == ("lr", "seed")
    assert table.goals == {"loss": "min", "acc": "max"}
    assert [r.label for r in table.rows] == [
        "train-lr1e-3-seed2", "train-lr1e-3-seed1", "train-lr1e-4-seed1",
        "train-lr1e-4-seed2"]  # best loss first; the NaN run's best is 1.0 (its first)
    last = table.rows[-1].values["loss"]
    assert math.isnan(last.final)
    assert (last.best, last.best_step) == (1.0, 0)


def test_several_runs_compare_what_differs_between_them() -> None:
    a = run(R1, step("train"), vars={"LR": "0.1", "DATA": "x"})
    b = run(R2, step("train"), vars={"LR": "0.2", "DATA": "x"})
    curves = {R1: [curve("train", "loss", [1.0, 0.2])],
              R2: [curve("train", "loss", [1.0, 0.1])]}
    table = compare(members_of([a, b], curves))
    assert table.params == ("var:LR",)
    assert [(r.label, r.params) for r in table.rows] == [(R2, {"var:LR": "0.2"}),
                                                          (R1, {"var:LR": "0.1"})]
    only_acc = compare(members_of([a, b], curves), metrics=["acc"])
    assert [r.values for r in only_acc.rows] == [{}, {}]


def test_csv_quotes_formulas_and_json_has_no_nan() -> None:
    record = run(R1, step("train", {"opt": "=HYPERLINK(\"x\")"}, group="train"),
                 step("train-2", {"opt": "-1"}, group="train"))
    curves = {R1: [curve("train", "loss", [math.nan]), curve("train-2", "loss", [0.5])]}
    table = compare(members_of([record], curves))
    rows = list(csv.reader(io.StringIO(to_csv(table))))
    assert rows[0] == ["member", "run_id", "step", "state", "opt", "loss_final",
                       "loss_final_step", "loss_best", "loss_best_step"]
    assert rows[1][4] == "-1"  # a number stays a number
    assert rows[2][4] == "'=HYPERLINK(\"x\")"
    assert rows[2][5] == "nan"
    data = json.loads(to_json(table))
    assert data["rows"][1]["metrics"]["loss"] == {
        "final": None, "final_text": "NaN", "final_step": 0, "best": None,
        "best_step": None}


names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1,
                max_size=20)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(names, st.lists(st.one_of(st.floats(allow_nan=True),
                                                    st.just(math.inf)),
                                          min_size=1, max_size=20)),
                min_size=1, max_size=8, unique_by=lambda t: t[0]),
       st.sampled_from(["min", "max"]))
def test_rows_are_ordered_best_first_and_every_member_has_a_row(
        members: list[tuple[str, list[float]]], goal: str) -> None:
    record = run(R1, *(step(f"s{i}", {"x": n}, group="s") for i, (n, _) in
                       enumerate(members)))
    curves = {R1: [curve(f"s{i}", "m", ys) for i, (_, ys) in enumerate(members)]}
    table = compare(members_of([record], curves), goals={"m": goal})  # type: ignore[dict-item]
    assert len(table.rows) == len(members)
    bests = [r.values["m"].best for r in table.rows]
    finite = [b for b in bests if b is not None]
    assert bests[:len(finite)] == finite  # members without a finite value last
    assert finite == sorted(finite, reverse=goal == "max")
    parsed = list(csv.reader(io.StringIO(to_csv(table))))
    assert len(parsed) == len(members) + 1
    json.loads(to_json(table))


def test_energy_and_work_per_joule_beside_the_metrics_or_no_work_counter() -> None:
    record = run(R1, step("a", {"lr": "1"}, group="t", energy_j=200.0, gpu_simulated=True),
                 step("b", {"lr": "2"}, group="t", energy_j=100.0))
    curves = {R1: [curve("a", "loss", [0.5]), curve("a", "work.flops", [1e14, 4e14]),
                   curve("b", "loss", [0.4])]}
    table = compare(members_of([record], curves), metrics=["loss"])
    assert table.work_units == ("flops",)
    assert header(table)[-2:] == ["GPU energy (J)", "FLOP/J"]
    by_member = {c[0]: c for c in cells(table)}
    assert by_member["a"][-2:] == ["200 (simulated)", "2e+12"]
    assert by_member["b"][-2:] == ["100", "no work counter"]
    rows = list(csv.reader(io.StringIO(to_csv(table))))
    assert rows[0][-3:] == ["gpu_energy_j", "gpu_energy_simulated", "work_flops_per_j"]
    data = json.loads(to_json(table))
    assert {r["member"]: (r["work_per_joule"], r["work_note"]) for r in data["rows"]} == {
        "a": ({"flops": 2e12}, ""), "b": ({}, "no work counter")}
