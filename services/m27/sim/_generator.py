"""A generator for the seed-like lab workload (the lab reports behind docs/mission.md).

People submit four kinds of work on working days, by day (09:00–18:00) and by night
(18:00–23:00, some of it queued by a script), plus a backlog of background work that is
there from the start:

| kind       | GPU (memory)          | compute at solo speed | I/O phases                          |
|------------|-----------------------|-----------------------|-------------------------------------|
| md         | 1 GPU (2 GiB)         | 3–8 h                 | trajectory write after each 10 min  |
| train      | 1 GPU or 0.5 (share)  | 1–4 h                 | data-loading stall after each 2 min |
| analysis   | 0.2–0.3 GPU (share)   | 10–40 min             | none                                |
| cpu        | none, 2 cores         | 15–60 min             | none                                |
| background | 0.5 or 1 GPU (4 GiB)  | 0.5–2 h, preemptible  | none; checkpoints every 5 min       |

An I/O phase lasts so that `io_share` of an MD or training run's wall time is I/O. Counts
are Poisson with the given means per GPU per day; durations uniform in the ranges. All of
it is drawn from one `random.Random(seed)`: same parameters and seed, same trace.

The fields after `background_gpu_memory_mb` move these assumptions (footprints, light-task
size, background shares and I/O, I/O periods, staging, lognormal durations, an overnight
wave of long MD runs, preprocessing in the backlog). Their defaults reproduce the table
above draw for draw: a trace generated with defaults is the same as before they existed.
"""

from __future__ import annotations

import math
import random
from typing import Final, Literal

import msgspec

from m27.common.model import Urgency
from m27.scheduler.model import Job
from m27.sim._workload import DAY_S, SimJob, Trace, make_nodes

HOUR: Final = 3600.0
MINUTE: Final = 60.0
USERS: Final = ("ana", "ben", "chen", "dara", "eli", "fay")
Durations = Literal["uniform", "lognormal"]


class LabParams(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int = 1
    gpus_per_node: int = 1
    hours: float = 72.0
    seed: int = 0
    md_per_gpu_day: float = 1.0
    train_per_gpu_day: float = 1.5
    analysis_per_gpu_day: float = 3.0
    cpu_per_gpu_day: float = 2.0
    night_share: float = 0.35  # of submissions made 18:00–23:00 rather than 09:00–18:00
    script_share: float = 0.5  # of night submissions that a script queues
    io_share: float = 0.2  # of an MD or training run's wall time spent in I/O
    #: Background work queued at time 0, GPU-hours per GPU. The default is the run's
    #: length: a standing queue of sweeps, so the GPUs never run dry within 72 h.
    backlog_gpu_h_per_gpu: float = 72.0
    high_share: float = 0.1  # of submissions marked urgency "high"
    #: GPU memory asked for (0: the share's proportion of the GPU's memory). What an idle
    #: holder leaves free is what backfill can use: a lender keeps its memory. An MD engine
    #: holds a few GiB whatever the GPU (GROMACS: 1–2 GiB for a typical system); a sweep
    #: point is a small model. Training and analysis hold their share's proportion.
    md_gpu_memory_mb: int = 2048
    background_gpu_memory_mb: int = 4096
    #: GPU memory of training runs and analyses, MiB (0: their share's proportion).
    train_gpu_memory_mb: int = 0
    analysis_gpu_memory_mb: int = 0
    #: The shares (milli-GPU) an analysis, the light interactive task, asks; one at random.
    analysis_milli: tuple[int, ...] = (200, 300)
    #: Analyses are preemptible (immediate tier still; no checkpoints: a stop loses the run).
    light_preemptible: bool = False
    #: The shares a background sweep asks, one at random: (1000,) whole GPUs only.
    background_shares: tuple[int, ...] = (500, 1000)
    #: I/O share of a background task's wall time, a phase after every
    #: `background_io_every_s` s of compute (0: sweeps never stall).
    background_io_share: float = 0.0
    background_io_every_s: float = 300.0
    #: Scales the compute between I/O phases of MD runs and training (600 s and 120 s):
    #: 0.25 gives short frequent stalls, 6 long rare ones; the I/O share stays `io_share`.
    io_period_scale: float = 1.0
    #: Input staging of every GPU task, seconds (None: MD 30, training 120, preprocessing
    #: 120, analyses and sweeps 0).
    stage_s: float | None = None
    #: "uniform" in each kind's range, or "lognormal" with the same mean (the range's
    #: midpoint) and `lognormal_sigma`, clipped to [low / 4, 3 × high].
    durations: Durations = "uniform"
    lognormal_sigma: float = 0.6
    #: Long MD runs per GPU submitted every evening 18:00–23:00 (kind "md-wave", 1 GPU,
    #: MD's I/O, checkpoints and memory), compute uniform in `night_wave_h` hours.
    night_wave_per_gpu: int = 0
    night_wave_h: tuple[float, float] = (6.0, 12.0)
    #: Share of the backlog's tasks that are preprocessing (kind "preprocess": 0.4 GPU,
    #: 15–60 min, no checkpoints, `preprocess_io_share` I/O after every 60 s of compute,
    #: 120 s staging) rather than sweeps. Background tier, preemptible, like the sweeps.
    preprocess_share: float = 0.0
    preprocess_io_share: float = 0.3


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's method; the means here are small."""
    limit, k, p = pow(2.718281828459045, -mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def _io(every_s: float, share: float) -> tuple[float, float]:
    """(compute between I/O phases, I/O phase length) for an I/O share of wall time."""
    if share <= 0:
        return 0.0, 0.0
    return every_s, every_s * share / (1.0 - share)


def _duration(rng: random.Random, p: LabParams, low: float, high: float,
              unit: float) -> float:
    """Compute in `unit`s: uniform in [low, high] (one draw, as always), or lognormal with
    the same mean, clipped."""
    if p.durations == "uniform":
        return rng.uniform(low, high) * unit
    sigma = p.lognormal_sigma
    mu = math.log((low + high) / 2.0) - sigma * sigma / 2.0
    return min(max(rng.lognormvariate(mu, sigma), low / 4.0), 3.0 * high) * unit


def _stage(p: LabParams, default: float) -> float:
    return default if p.stage_s is None else p.stage_s


def _one(rng: random.Random, kind: str, p: LabParams, n: int, at: float,
         script: bool) -> SimJob:
    urgency: Urgency = "high" if rng.random() < p.high_share else "normal"
    user = rng.choice(USERS)
    job = Job(task_id=f"{kind}-{n:04d}", user=user, urgency=urgency)
    io_every, io_s, ckpt, stage = 0.0, 0.0, 0.0, 0.0
    if kind in ("md", "md-wave"):
        job = msgspec.structs.replace(job, gpu_milli=1000, checkpoints=True,
                                      gpu_memory_mb=p.md_gpu_memory_mb)
        low, high = (3, 8) if kind == "md" else p.night_wave_h
        duration = _duration(rng, p, low, high, HOUR)
        (io_every, io_s), ckpt = _io(600.0 * p.io_period_scale, p.io_share), 300.0
        stage = _stage(p, 30.0)
    elif kind == "train":
        share = 1000 if rng.random() < 0.6 else 500
        job = msgspec.structs.replace(job, gpu_milli=share, checkpoints=True,
                                      gpu_memory_mb=p.train_gpu_memory_mb)
        duration = _duration(rng, p, 1, 4, HOUR)
        (io_every, io_s), ckpt = _io(120.0 * p.io_period_scale, p.io_share), 600.0
        stage = _stage(p, 120.0)
    elif kind == "analysis":
        job = msgspec.structs.replace(job, gpu_milli=rng.choice(p.analysis_milli),
                                      gpu_memory_mb=p.analysis_gpu_memory_mb,
                                      preemptible=p.light_preemptible)
        duration = _duration(rng, p, 10, 40, MINUTE)
        stage = _stage(p, 0.0)
    else:
        job = msgspec.structs.replace(job, cpu_milli=2000)
        duration = _duration(rng, p, 15, 60, MINUTE)
    return SimJob(job=job, submit_s=at, duration_s=duration, io_every_s=io_every, io_s=io_s,
                  checkpoint_s=ckpt, stage_s=stage, by_script=script, kind=kind)


def _sweep(rng: random.Random, p: LabParams, n: int) -> SimJob:
    share = rng.choice(p.background_shares)
    duration = _duration(rng, p, 0.5, 2.0, HOUR)
    job = Job(task_id=f"background-{n:04d}", gpu_milli=share, urgency="low",
              user=rng.choice(USERS), preemptible=True, tier="background",
              checkpoints=True, gpu_memory_mb=p.background_gpu_memory_mb)
    io_every, io_s = _io(p.background_io_every_s, p.background_io_share)
    return SimJob(job=job, submit_s=0.0, duration_s=duration, io_every_s=io_every,
                  io_s=io_s, checkpoint_s=300.0, stage_s=_stage(p, 0.0), kind="background")


def _preprocess(rng: random.Random, p: LabParams, n: int) -> SimJob:
    duration = _duration(rng, p, 15, 60, MINUTE)
    job = Job(task_id=f"preprocess-{n:04d}", gpu_milli=400, urgency="low",
              user=rng.choice(USERS), preemptible=True, tier="background",
              gpu_memory_mb=p.background_gpu_memory_mb)
    io_every, io_s = _io(60.0, p.preprocess_io_share)
    return SimJob(job=job, submit_s=0.0, duration_s=duration, io_every_s=io_every,
                  io_s=io_s, stage_s=_stage(p, 120.0), kind="preprocess")


def _backlog(rng: random.Random, p: LabParams, gpus: int) -> list[SimJob]:
    out: list[SimJob] = []
    left = p.backlog_gpu_h_per_gpu * gpus * HOUR
    while left > 0:
        # No draw for the choice unless preprocessing is asked for: defaults draw as before.
        if p.preprocess_share > 0 and rng.random() < p.preprocess_share:
            sim = _preprocess(rng, p, len(out))
        else:
            sim = _sweep(rng, p, len(out))
        out.append(sim)
        left -= sim.duration_s * sim.job.gpu_milli / 1000
    return out


def _night_wave(rng: random.Random, p: LabParams, gpus: int, first: int) -> list[SimJob]:
    out: list[SimJob] = []
    for day in range(int(p.hours // 24.0 + 1)):
        for _ in range(p.night_wave_per_gpu * gpus):
            at = day * DAY_S + rng.uniform(18.0, 23.0) * HOUR
            if at < p.hours * HOUR:
                script = rng.random() < p.script_share
                out.append(_one(rng, "md-wave", p, first + len(out), at, script))
    return out


def generate_lab(p: LabParams) -> Trace:
    """The lab workload on `p.nodes` × `p.gpus_per_node` GPUs over `p.hours`; time 0 is a
    Monday 00:00 and every day is a working day."""
    rng = random.Random(p.seed)  # noqa: S311 - reproducible, not secret
    gpus = p.nodes * p.gpus_per_node
    jobs: list[SimJob] = _backlog(rng, p, gpus)
    rates = (("md", p.md_per_gpu_day), ("train", p.train_per_gpu_day),
             ("analysis", p.analysis_per_gpu_day), ("cpu", p.cpu_per_gpu_day))
    for day in range(int(p.hours // 24.0 + 1)):
        for kind, rate in rates:
            for _ in range(_poisson(rng, rate * gpus)):
                night = rng.random() < p.night_share
                start, end = (18.0, 23.0) if night else (9.0, 18.0)
                at = day * DAY_S + rng.uniform(start, end) * HOUR
                if at >= p.hours * HOUR:
                    continue
                script = night and rng.random() < p.script_share
                jobs.append(_one(rng, kind, p, len(jobs), at, script))
    jobs += _night_wave(rng, p, gpus, len(jobs))
    jobs.sort(key=lambda j: (j.submit_s, j.job.task_id))
    return Trace(name=f"lab-{gpus}gpu-seed{p.seed}", jobs=tuple(jobs),
                 nodes=make_nodes(p.nodes, p.gpus_per_node))
