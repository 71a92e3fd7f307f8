"""Policies by name, as `m27 simulate --policy NAME` and the benchmarks choose them."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Final

import m27.scheduler
from m27.scheduler.model import Policy, PolicySettings
from m27.scheduler.policy import decide
from m27.sim._baselines import best_fit, fifo, slurm_backfill, tiresias
from m27.sim._byhand import ByHand
from m27.sim._errors import SimError
from m27.sim._workload import Trace, expected_wall_s

POLICY_HELP: Final = {
    "m27": "m27's own policy (m27.scheduler.policy.decide), default settings",
    "by-hand": "a person starts jobs on GPUs they notice free, by day; scripts at night",
    "fifo": "automated first-come-first-served on whole GPUs",
    "best-fit": "tightest-fit packing of shares and gangs",
    "slurm": "Slurm-like priority + EASY backfill on whole GPUs",
    "tiresias": "Tiresias-like 2-queue least-attained-service, preemptive",
}
POLICY_NAMES: Final = tuple(POLICY_HELP)
#: Slurm users ask for more time than they need; the limit is this × the expected wall time.
LIMIT_FACTOR: Final = 1.5


def m27_policy(settings: PolicySettings | None = None) -> Policy:
    """m27's policy core (`m27.scheduler.policy.decide`) with these settings."""
    policy: Policy = functools.partial(decide, settings=settings or PolicySettings())
    return policy


def make_policy(name: str, trace: Trace, *, settings: PolicySettings | None = None) -> Policy:
    """A fresh policy (by-hand keeps memory, so one per run)."""
    if name == "m27":
        return m27_policy(settings)
    if name == "by-hand":
        return ByHand([j.job.task_id for j in trace.jobs if j.by_script],
                      clock0_s=trace.clock0_s)
    if name == "fifo":
        return fifo
    if name == "best-fit":
        return best_fit
    if name == "slurm":
        return slurm_backfill({j.job.task_id: LIMIT_FACTOR * expected_wall_s(j)
                               for j in trace.jobs})
    if name == "tiresias":
        return tiresias()
    raise SimError(f"unknown policy {name!r}: choose one of {', '.join(POLICY_NAMES)}")


def policy_version() -> str:
    """A fingerprint of the m27 policy a benchmark measured: sha256 of the scheduler
    package's sources as imported (benchmarks print it beside their figures)."""
    assert m27.scheduler.__file__ is not None
    digest = hashlib.sha256()
    for path in sorted(Path(m27.scheduler.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]
