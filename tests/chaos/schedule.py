"""A fault schedule drawn from a seed: pure and deterministic (same seed, same faults).

A fault is (at_s, kind, target, duration_s): `at_s` seconds after the work was submitted,
do `kind` to `target`, and heal it `duration_s` later (a killed process is started again
then, as a supervisor would; a frozen one continued; a cut link restored; a full disk
emptied; a drained node uncordoned).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Final, Literal

import msgspec

Kind = Literal["kill", "kill_guard", "nats_restart", "freeze", "cut", "disk_full", "drain",
               "slow_disk"]

#: Every kind, in the order a draw considers them (the order is part of the determinism:
#: a kind added later goes last, so the draws of a seed without it stay what they were).
KINDS: Final[tuple[Kind, ...]] = ("kill", "kill_guard", "nats_restart", "freeze", "cut",
                                  "disk_full", "drain", "slow_disk")
SERVICES: Final = ("orchestrator", "scheduler", "checkpoint-store", "report")
#: Services a SIGSTOP is drawn for (the report is not on any task's path).
FREEZABLE_SERVICES: Final = ("orchestrator", "scheduler", "checkpoint-store")
NATS: Final = "nats"
#: How often each kind is drawn, relative to the others: process deaths most.
WEIGHTS: Final[dict[Kind, float]] = {"kill": 3.0, "kill_guard": 0.5, "nats_restart": 1.0,
                                     "freeze": 2.0, "cut": 1.5, "disk_full": 1.0, "drain": 1.0,
                                     "slow_disk": 1.0}


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """One fault: what, to whom, when (s after the start) and for how long (s)."""

    at_s: float
    kind: Kind
    target: str
    duration_s: float

    def describe(self) -> str:
        return f"t+{self.at_s:.1f}s {self.kind} {self.target} for {self.duration_s:.1f}s"


class Leases(msgspec.Struct, frozen=True, kw_only=True):
    """The lease settings the system under test runs with (a freeze or a cut is drawn to
    outlast `node_timeout_s`, so that it is a failure and not a stall)."""

    fence_after_s: float = 3.0
    node_timeout_s: float = 5.0


def node_names(nodes: int) -> tuple[str, ...]:
    return tuple(f"node-{i}" for i in range(1, nodes + 1))


def nats_names(servers: int) -> tuple[str, ...]:
    """One server: `nats`; a cluster: `nats-1` … (a kill takes one member down)."""
    return (NATS,) if servers == 1 else tuple(f"{NATS}-{i}" for i in range(1, servers + 1))


def targets_of(kind: Kind, nodes: Sequence[str],
               nats: Sequence[str] = (NATS,)) -> tuple[str, ...]:
    """Whom a fault of `kind` may hit."""
    if kind == "kill":
        return (*SERVICES, *nodes)
    if kind == "freeze":
        return (*FREEZABLE_SERVICES, *nodes)
    if kind in ("kill_guard", "cut", "drain"):
        return tuple(nodes)
    if kind == "nats_restart":
        return tuple(nats)
    return ("checkpoint-store",)  # disk_full, slow_disk: the checkpoint-store's directory


def duration_of(kind: Kind, rng: random.Random, leases: Leases) -> float:
    """How long a fault lasts: a killed process's restart delay, a freeze or cut past the
    node lease (so the node is declared lost), a full or slow disk or a drain for a few
    seconds."""
    if kind == "kill":
        return round(rng.uniform(0.5, 2.0), 2)
    if kind == "nats_restart":
        return round(rng.uniform(0.5, 1.5), 2)
    if kind == "kill_guard":
        return 0.0  # nothing starts a guard again but its agent
    if kind in ("freeze", "cut"):
        return round(leases.node_timeout_s + rng.uniform(1.0, 3.0), 2)
    return round(rng.uniform(4.0, 8.0), 2)


def draw(seed: int, *, duration_s: float = 40.0, every_s: float = 5.0, nodes: int = 3,
         kinds: Sequence[Kind] = KINDS, leases: Leases | None = None,
         nats_servers: int = 1) -> tuple[Fault, ...]:
    """The faults of `seed`: one about every `every_s` seconds (jittered by up to a
    quarter) from `every_s / 2` until `duration_s`, kinds drawn among `kinds` (weighted
    by WEIGHTS), targets uniform among theirs (with `nats_servers` > 1 a restart takes
    one cluster member down). At most one node is out (killed, frozen, cut or drained)
    at a time, so the work always has somewhere to go."""
    if every_s <= 0 or not kinds:
        return ()
    leases = leases or Leases()
    rng = random.Random(seed)
    names = node_names(nodes)
    servers = nats_names(nats_servers)
    allowed = [k for k in KINDS if k in kinds]
    faults: list[Fault] = []
    node_busy_until = 0.0
    at = every_s / 2
    while (at_s := round(at, 2)) < duration_s:  # rounded first: never at duration_s
        kind = rng.choices(allowed, weights=[WEIGHTS[k] for k in allowed])[0]
        target = rng.choice(targets_of(kind, names, servers))
        duration = duration_of(kind, rng, leases)
        if target in names and kind != "kill_guard":
            if at < node_busy_until:  # another node is still out: hit a service instead
                kind, target = "kill", rng.choice(SERVICES)
                duration = duration_of(kind, rng, leases)
            else:
                node_busy_until = at + duration + leases.node_timeout_s
        faults.append(Fault(at_s=at_s, kind=kind, target=target,
                            duration_s=duration))
        at += every_s * rng.uniform(0.75, 1.25)
    return tuple(faults)


def node_out(fault: Fault) -> bool:
    """Whether the fault takes a node's work away (killed, frozen, cut off or drained)."""
    return fault.target.startswith("node-") and fault.kind != "kill_guard"
