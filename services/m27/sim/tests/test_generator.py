"""The lab workload generator: defaults draw the trace they always drew (published figures
stay valid), and each axis of `LabParams` changes what it says it changes."""

from __future__ import annotations

import hashlib
import statistics

from m27.sim import LabParams, SimJob, Trace, generate_lab

#: sha256 of `fingerprint` of the trace below, computed with the generator as it was before
#: the axes after `background_gpu_memory_mb` were added.
SMALL = LabParams(nodes=1, gpus_per_node=2, seed=3, hours=48.0)
SMALL_SHA256 = "7382006555e5891bb98db006402d9dd9599341d3df003cce9dda430333b84114"


def fingerprint(trace: Trace) -> str:
    """What the simulator replays of each job (not the struct encoding: a new Job field
    with a default must not change it)."""
    rows = [(s.job.task_id, s.submit_s, s.duration_s, s.job.gpu_milli, s.job.gpu_memory_mb,
             s.job.cpu_milli, s.job.urgency, s.job.user, s.job.tier, s.job.preemptible,
             s.job.checkpoints, s.io_every_s, s.io_s, s.checkpoint_s, s.stage_s, s.by_script,
             s.kind) for s in trace.jobs]
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def lab(**changes: object) -> Trace:
    return generate_lab(LabParams(nodes=1, gpus_per_node=4, seed=1, **changes))  # type: ignore[arg-type]


def of(trace: Trace, kind: str) -> list[SimJob]:
    return [s for s in trace.jobs if s.kind == kind]


def hour_of_day(s: SimJob) -> float:
    return (s.submit_s % 86_400.0) / 3600.0


def test_defaults_draw_the_trace_they_always_drew() -> None:
    assert fingerprint(generate_lab(SMALL)) == SMALL_SHA256
    assert generate_lab(SMALL) == generate_lab(SMALL)


def test_defaults_spelled_out_change_nothing() -> None:
    spelled = LabParams(nodes=1, gpus_per_node=2, seed=3, hours=48.0, stage_s=None,
                        io_period_scale=1.0, durations="uniform", night_wave_per_gpu=0,
                        preprocess_share=0.0, background_io_share=0.0,
                        analysis_milli=(200, 300), background_shares=(500, 1000))
    assert fingerprint(generate_lab(spelled)) == SMALL_SHA256


def test_lognormal_durations_keep_the_mean_and_spread_wider() -> None:
    uniform, lognormal = of(lab(), "md"), of(lab(durations="lognormal"), "md")
    u = [s.duration_s / 3600 for s in uniform]
    ln = [s.duration_s / 3600 for s in lognormal]
    assert min(u) >= 3
    assert max(u) <= 8
    assert min(ln) < 3 or max(ln) > 8  # outside the uniform range
    assert all(0.75 <= d <= 24 for d in ln)  # clipped to [low / 4, 3 × high]
    assert abs(statistics.fmean(ln) - 5.5) < 1.5


def test_night_wave_adds_long_md_runs_submitted_in_the_evening() -> None:
    assert not of(lab(), "md-wave")
    wave = of(lab(night_wave_per_gpu=1), "md-wave")
    assert len(wave) == 4 * 3  # 4 GPUs, 3 evenings in 72 h
    assert all(18 <= hour_of_day(s) < 23 for s in wave)
    assert all(6 * 3600 <= s.duration_s <= 12 * 3600 for s in wave)
    assert all(s.job.gpu_milli == 1000 and s.io_s > 0 for s in wave)


def test_background_io_shares_and_preprocessing() -> None:
    assert all(s.io_s == 0 for s in of(lab(), "background"))
    sweeps = of(lab(background_io_share=0.3, background_io_every_s=120.0), "background")
    assert all(abs(s.io_s / (s.io_s + s.io_every_s) - 0.3) < 1e-9 for s in sweeps)
    assert {s.job.gpu_milli for s in of(lab(background_shares=(1000,)), "background")} == {1000}
    small = {s.job.gpu_milli for s in of(lab(background_shares=(200, 300, 400)), "background")}
    assert small == {200, 300, 400}
    trace = lab(preprocess_share=0.5)
    prep = of(trace, "preprocess")
    assert prep
    assert of(trace, "background")
    assert all(s.job.gpu_milli == 400 and s.io_s > 0 and s.stage_s == 120 for s in prep)
    assert all(s.job.preemptible and s.job.tier == "background" for s in prep)


def test_light_tasks_footprints_staging_and_io_periods() -> None:
    light = of(lab(analysis_milli=(400, 500), light_preemptible=True), "analysis")
    assert {s.job.gpu_milli for s in light} == {400, 500}
    assert all(s.job.preemptible for s in light)
    assert not any(s.job.preemptible for s in of(lab(), "analysis"))
    small = lab(train_gpu_memory_mb=1024, analysis_gpu_memory_mb=512)
    assert {s.job.gpu_memory_mb for s in of(small, "train")} == {1024}
    assert {s.job.gpu_memory_mb for s in of(small, "analysis")} == {512}
    staged = lab(stage_s=600.0)
    assert all(s.stage_s == 600 for s in staged.jobs if s.job.gpu_milli > 0)
    assert all(s.stage_s == 0 for s in staged.jobs if s.job.gpu_milli == 0)
    long_io = of(lab(io_period_scale=6.0), "md")
    assert {s.io_every_s for s in long_io} == {3600.0}
    assert all(abs(s.io_s / (s.io_s + s.io_every_s) - 0.2) < 1e-9 for s in long_io)
