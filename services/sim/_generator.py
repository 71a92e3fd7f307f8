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
"""

from __future__ import annotations

import random
from typing import Final

import msgspec

from m27.common.model import Urgency
from m27.scheduler.model import Job
from m27.sim._workload import DAY_S, SimJob, Trace, make_nodes

HOUR: Final = 3600.0
USERS: Final = ("ana", "ben", "chen", "dara", "eli", "fay")


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


def _one(rng: random.Random, kind: str, p: LabParams, n: int, at: float,
         script: bool) -> SimJob:
    urgency: Urgency = "high" if rng.random() < p.high_share else "normal"
    user = rng.choice(USERS)
    job = Job(task_id=f"{kind}-{n:04d}", user=user, urgency=urgency)
    io_every, io_s, ckpt, stage = 0.0, 0.0, 0.0, 0.0
    if kind == "md":
        job = msgspec.structs.replace(job, gpu_milli=1000, checkpoints=True,
                                      gpu_memory_mb=p.md_gpu_memory_mb)
        duration = rng.uniform(3, 8) * HOUR
        (io_every, io_s), ckpt, stage = _io(600.0, p.io_share), 300.0, 30.0
    elif kind == "train":
        share = 1000 if rng.random() < 0.6 else 500
        job = msgspec.structs.replace(job, gpu_milli=share, checkpoints=True)
        duration = rng.uniform(1, 4) * HOUR
        (io_every, io_s), ckpt, stage = _io(120.0, p.io_share), 600.0, 120.0
    elif kind == "analysis":
        job = msgspec.structs.replace(job, gpu_milli=rng.choice((200, 300)))
        duration = rng.uniform(10, 40) * 60.0
    else:
        job = msgspec.structs.replace(job, cpu_milli=2000)
        duration = rng.uniform(15, 60) * 60.0
    return SimJob(job=job, submit_s=at, duration_s=duration, io_every_s=io_every, io_s=io_s,
                  checkpoint_s=ckpt, stage_s=stage, by_script=script, kind=kind)


def _backlog(rng: random.Random, p: LabParams, gpus: int) -> list[SimJob]:
    out: list[SimJob] = []
    left = p.backlog_gpu_h_per_gpu * gpus * HOUR
    while left > 0:
        share = rng.choice((500, 1000))
        duration = rng.uniform(0.5, 2.0) * HOUR
        job = Job(task_id=f"background-{len(out):04d}", gpu_milli=share, urgency="low",
                  user=rng.choice(USERS), preemptible=True, tier="background",
                  checkpoints=True, gpu_memory_mb=p.background_gpu_memory_mb)
        out.append(SimJob(job=job, submit_s=0.0, duration_s=duration, checkpoint_s=300.0,
                          kind="background"))
        left -= duration * share / 1000
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
    jobs.sort(key=lambda j: (j.submit_s, j.job.task_id))
    return Trace(name=f"lab-{gpus}gpu-seed{p.seed}", jobs=tuple(jobs),
                 nodes=make_nodes(p.nodes, p.gpus_per_node))
