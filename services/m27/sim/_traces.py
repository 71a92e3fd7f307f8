"""Trace readers: m27's own JSONL, the Alibaba openb GPU-sharing trace, the Philly job table.

Each returns a `Trace`; a malformed row raises `TraceError` naming `file:line` and what is
wrong. Formats (docs/simulator.md has them in full):

- JSONL: one JSON object per line, `#` comments and blank lines allowed. An optional
  `{"type": "cluster", "nodes": [...], "clock0_s": 0}` line describes the cluster; each
  `{"type": "job", "id": ..., "submit_s": ..., "duration_s": ..., ...}` line is a job.
- openb (`openb_pod_list_*.csv` + `openb_node_list_*.csv`): pods carry no run time, so a
  pod runs for `deletion_time - scheduled_time` (or `- creation_time` when it was never
  scheduled); pods without a deletion time are skipped (the `multigpu*` lists have no times
  at all, so they cannot be replayed for JCT). Still-running pods were deleted when the
  observation ended: their duration is a lower bound.
- Philly (`timestamp,duration,num_gpus,gpu_time,cluster`): submit time and duration as
  given, `num_gpus` whole GPUs gang-placed on one node; a job larger than the largest node
  is skipped.
"""

from __future__ import annotations

import csv
import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Final

import msgspec

from m27.common.model import Urgency
from m27.scheduler.model import MILLI_PER_GPU, Gpu, Job, Node, Tier
from m27.sim._errors import TraceError
from m27.sim._workload import DAY_S, SimJob, Trace, make_nodes

NonNeg = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]
PHILLY_HEADER: Final = ("timestamp", "duration", "num_gpus")
OPENB_HEADER: Final = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
OPENB_NODES: Final = "openb_node_list_gpu_node.csv"
#: openb names GPU models but not their memory; FGD ignores GPU memory, we assume these.
MODEL_MEMORY_MB: Final = {"V100M32": 32_768, "A10": 24_576}
DEFAULT_GPU_MEMORY_MB: Final = 16_384
QOS: Final[dict[str, tuple[Urgency, Tier, bool]]] = {
    "LS": ("normal", "immediate", False), "Burstable": ("normal", "immediate", False),
    "Guaranteed": ("high", "immediate", False), "BE": ("low", "background", True)}


class NodeLine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    gpus: Count
    gpu_memory_mb: Count = DEFAULT_GPU_MEMORY_MB
    cpu_milli: Count = 32_000
    memory_mb: Count = 0
    model: str = ""
    count: Annotated[int, msgspec.Meta(ge=1)] = 1  # this many nodes alike: id-0, id-1, ...


class ClusterLine(msgspec.Struct, frozen=True, tag="cluster", tag_field="type",
                  forbid_unknown_fields=True):
    nodes: Annotated[list[NodeLine], msgspec.Meta(min_length=1)]
    clock0_s: Annotated[float, msgspec.Meta(ge=0, lt=DAY_S)] = 0.0


class JobLine(msgspec.Struct, frozen=True, tag="job", tag_field="type",
              forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(min_length=1)]
    submit_s: NonNeg
    duration_s: Positive
    gpu_milli: Count = 0
    gpu_memory_mb: Count = 0
    cpu_milli: Count = 1000
    memory_mb: Count = 0
    user: str = ""
    urgency: Urgency = "normal"
    tier: Tier = "immediate"
    preemptible: bool = False
    gpu_model: str = ""
    checkpoint_s: NonNeg = 0.0
    io_every_s: NonNeg = 0.0
    io_s: NonNeg = 0.0
    stage_s: NonNeg = 0.0
    by_script: bool = False
    kind: str = ""


Line = ClusterLine | JobLine
_decoder = msgspec.json.Decoder(Line)


def read_trace(path: Path, *, nodes: int | None = None, gpus_per_node: int | None = None,
               node_list: Path | None = None) -> Trace:
    """Read any supported trace; `nodes`×`gpus_per_node` replaces (or supplies) its cluster."""
    override = make_nodes(nodes, gpus_per_node) if nodes and gpus_per_node else None
    if path.suffix in (".jsonl", ".ndjson", ".json"):
        trace = read_jsonl(path)
    else:
        header = tuple(_header(path))
        if header[:3] == PHILLY_HEADER:
            return read_philly(path, nodes=override or make_nodes(2, 8))
        if header[:5] == OPENB_HEADER:
            trace = read_openb(path, node_list)
        else:
            raise TraceError(f"{path}:1: unknown trace format (header {','.join(header)!r}); "
                             "expected .jsonl, an openb pod list or the Philly job table")
    if override is not None:
        trace = msgspec.structs.replace(trace, nodes=override)
    return trace


def is_philly(path: Path) -> bool:
    """Whether `path` is the Philly job table (a CSV with its header)."""
    return path.suffix == ".csv" and tuple(_header(path))[:3] == PHILLY_HEADER


def _header(path: Path) -> list[str]:
    try:
        with path.open(newline="") as f:
            return next(csv.reader(f), [])
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open(encoding="utf-8") as f:
            yield from enumerate(f, start=1)
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None


def read_jsonl(path: Path) -> Trace:
    nodes: tuple[Node, ...] = ()
    clock0 = 0.0
    jobs: list[SimJob] = []
    seen: dict[str, int] = {}
    for number, text in _lines(path):
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        try:
            line = _decoder.decode(text)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{path}:{number}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise TraceError(f"{path}:{number}: not valid JSON ({exc})") from None
        if isinstance(line, ClusterLine):
            if nodes:
                raise TraceError(f"{path}:{number}: a second cluster line")
            nodes, clock0 = _cluster(line), line.clock0_s
            continue
        if line.id in seen:
            raise TraceError(f"{path}:{number}: job id {line.id!r} already used on line "
                             f"{seen[line.id]}")
        seen[line.id] = number
        jobs.append(_job(line, path, number))
    if not nodes:
        nodes = make_nodes(2, 8)
    jobs.sort(key=lambda j: (j.submit_s, j.job.task_id))
    return Trace(name=path.name, nodes=nodes, jobs=tuple(jobs), clock0_s=clock0)


def _cluster(line: ClusterLine) -> tuple[Node, ...]:
    out: list[Node] = []
    for spec in line.nodes:
        for i in range(spec.count):
            gpus = tuple(Gpu(index=g, memory_mb=spec.gpu_memory_mb, model=spec.model,
                             simulated=True) for g in range(spec.gpus))
            out.append(Node(node_id=spec.id if spec.count == 1 else f"{spec.id}-{i}",
                            gpus=gpus, cpu_milli=spec.cpu_milli, memory_mb=spec.memory_mb))
    return tuple(out)


def _job(line: JobLine, path: Path, number: int) -> SimJob:
    if line.gpu_milli > MILLI_PER_GPU and line.gpu_milli % MILLI_PER_GPU:
        raise TraceError(f"{path}:{number}: gpu_milli {line.gpu_milli} is neither a share "
                         "(< 1000) nor whole GPUs (a multiple of 1000)")
    if line.io_s > 0 and line.io_every_s <= 0:
        raise TraceError(f"{path}:{number}: io_s needs io_every_s > 0")
    job = Job(task_id=line.id, gpu_milli=line.gpu_milli, gpu_memory_mb=line.gpu_memory_mb,
              cpu_milli=line.cpu_milli, memory_mb=line.memory_mb, urgency=line.urgency,
              user=line.user, preemptible=line.preemptible, tier=line.tier,
              gpu_model=line.gpu_model, checkpoints=line.checkpoint_s > 0)
    return SimJob(job=job, submit_s=line.submit_s, duration_s=line.duration_s,
                  io_every_s=line.io_every_s, io_s=line.io_s, checkpoint_s=line.checkpoint_s,
                  stage_s=line.stage_s, by_script=line.by_script, kind=line.kind)


def write_jsonl(trace: Trace, path: Path) -> None:
    """The inverse of `read_jsonl` (one node line per node)."""
    enc = msgspec.json.Encoder()
    nodes = [NodeLine(id=n.node_id, gpus=len(n.gpus), cpu_milli=n.cpu_milli,
                      memory_mb=n.memory_mb,
                      gpu_memory_mb=n.gpus[0].memory_mb if n.gpus else DEFAULT_GPU_MEMORY_MB,
                      model=n.gpus[0].model if n.gpus else "") for n in trace.nodes]
    lines = [enc.encode(ClusterLine(nodes=nodes, clock0_s=trace.clock0_s))]
    for s in trace.jobs:
        j = s.job
        lines.append(enc.encode(JobLine(
            id=j.task_id, submit_s=s.submit_s, duration_s=s.duration_s, gpu_milli=j.gpu_milli,
            gpu_memory_mb=j.gpu_memory_mb, cpu_milli=j.cpu_milli, memory_mb=j.memory_mb,
            user=j.user, urgency=j.urgency, tier=j.tier, preemptible=j.preemptible,
            gpu_model=j.gpu_model, checkpoint_s=s.checkpoint_s, io_every_s=s.io_every_s,
            io_s=s.io_s, stage_s=s.stage_s, by_script=s.by_script, kind=s.kind)))
    path.write_bytes(b"\n".join(lines) + b"\n")


def _rows(path: Path, header: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    for number, text in _lines(path):
        if number == 1 or not text.strip():
            continue
        cells = next(csv.reader([text]))
        if len(cells) < len(header):
            raise TraceError(f"{path}:{number}: {len(cells)} columns, expected "
                             f"{len(header)} ({','.join(header)})")
        yield number, dict(zip(header, cells, strict=False))


def _num(path: Path, number: int, row: dict[str, str], column: str) -> float:
    try:
        value = float(row[column])
    except (KeyError, ValueError):
        raise TraceError(f"{path}:{number}: {column} is {row.get(column, '')!r}, "
                         "not a number") from None
    if value < 0:
        raise TraceError(f"{path}:{number}: {column} is negative ({value:g})")
    return value


def read_philly(path: Path, *, nodes: tuple[Node, ...], start: str = "",
                days: float | None = None, checkpoint_s: float = 0.0) -> Trace:
    """Philly jobs submitted from `start` (ISO date; default the first) for `days`."""
    header = tuple(_header(path))
    rows: list[tuple[dt.datetime, float, int, str]] = []
    for number, row in _rows(path, header):
        try:
            when = dt.datetime.fromisoformat(row["timestamp"])
        except ValueError:
            raise TraceError(f"{path}:{number}: timestamp {row['timestamp']!r} is not "
                             "YYYY-MM-DD HH:MM:SS") from None
        duration = _num(path, number, row, "duration")
        gpus = _num(path, number, row, "num_gpus")
        if gpus != int(gpus) or gpus < 1:
            raise TraceError(f"{path}:{number}: num_gpus {row['num_gpus']!r} is not a "
                             "whole number ≥ 1")
        rows.append((when, duration, int(gpus), row.get("cluster", "")))
    if not rows:
        raise TraceError(f"{path}: no jobs")
    t0 = dt.datetime.fromisoformat(start) if start else min(r[0] for r in rows)
    t1 = t0 + dt.timedelta(days=days) if days is not None else None
    biggest = max(len(n.gpus) for n in nodes)
    jobs: list[SimJob] = []
    skipped: list[str] = []
    for i, (when, duration, gpus, vc) in enumerate(sorted(rows)):
        if when < t0 or (t1 is not None and when >= t1):
            continue
        if gpus > biggest or duration <= 0:
            skipped.append(f"philly-{i}: {gpus} GPUs / {duration:g} s does not fit a node")
            continue
        job = Job(task_id=f"philly-{i}", gpu_milli=gpus * MILLI_PER_GPU, user=vc,
                  preemptible=True, checkpoints=checkpoint_s > 0)
        jobs.append(SimJob(job=job, submit_s=(when - t0).total_seconds(), duration_s=duration,
                           checkpoint_s=checkpoint_s, kind="trace"))
    midnight = t0.replace(hour=0, minute=0, second=0, microsecond=0)
    return Trace(name=path.name, nodes=nodes, jobs=tuple(jobs),
                 clock0_s=(t0 - midnight).total_seconds(), skipped=tuple(skipped))


def read_openb_nodes(path: Path) -> tuple[Node, ...]:
    header = tuple(_header(path))
    out: list[Node] = []
    for number, row in _rows(path, header):
        gpus = int(_num(path, number, row, "gpu"))
        model = row.get("model", "")
        memory = MODEL_MEMORY_MB.get(model, DEFAULT_GPU_MEMORY_MB)
        out.append(Node(node_id=row["sn"], cpu_milli=int(_num(path, number, row, "cpu_milli")),
                        memory_mb=int(_num(path, number, row, "memory_mib")),
                        gpus=tuple(Gpu(index=g, memory_mb=memory, model=model, simulated=True)
                                   for g in range(gpus))))
    if not out:
        raise TraceError(f"{path}: no nodes")
    return tuple(out)


def read_openb(path: Path, node_list: Path | None = None) -> Trace:
    """Pods of an openb pod list on the nodes of its node list (default: the GPU nodes'
    list next to it)."""
    nodes = read_openb_nodes(node_list or path.with_name(OPENB_NODES))
    header = tuple(_header(path))
    jobs: list[SimJob] = []
    skipped: list[str] = []
    for number, row in _rows(path, header):
        sim = _pod(path, number, row)
        if isinstance(sim, str):
            skipped.append(sim)
        else:
            jobs.append(sim)
    if not jobs:
        raise TraceError(f"{path}: no pod has both a creation and a deletion time, so "
                         "nothing can be replayed for job completion times")
    jobs.sort(key=lambda j: (j.submit_s, j.job.task_id))
    return Trace(name=path.name, nodes=nodes, jobs=tuple(jobs), skipped=tuple(skipped))


def _pod(path: Path, number: int, row: dict[str, str]) -> SimJob | str:
    name = row["name"]
    if not row.get("creation_time") or not row.get("deletion_time"):
        return f"{name}: no creation/deletion time"
    created = _num(path, number, row, "creation_time")
    began = _num(path, number, row, "scheduled_time") if row.get("scheduled_time") else created
    duration = _num(path, number, row, "deletion_time") - began
    if duration <= 0:
        return f"{name}: deleted before it ran"
    count = int(_num(path, number, row, "num_gpu"))
    milli = int(_num(path, number, row, "gpu_milli")) if row.get("gpu_milli") else 1000
    milli = min(max(milli, 1), MILLI_PER_GPU) if count == 1 else count * MILLI_PER_GPU
    qos = row.get("qos", "") or "LS"
    if qos not in QOS:
        raise TraceError(f"{path}:{number}: qos {qos!r} is not one of {', '.join(QOS)}")
    urgency, tier, preemptible = QOS[qos]
    job = Job(task_id=name, gpu_milli=milli, cpu_milli=int(_num(path, number, row, "cpu_milli")),
              memory_mb=int(_num(path, number, row, "memory_mib")), urgency=urgency, tier=tier,
              preemptible=preemptible, gpu_model=row.get("gpu_spec", ""))
    return SimJob(job=job, submit_s=created, duration_s=duration, kind="trace")
