"""The cluster view a client gets from `m27.v1.ClusterService`, as domain structs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, cast

import grpc
import msgspec

from m27.common.logfiles import STREAMS, LogChunk, Stream
from m27.v1 import cluster_pb2 as pb

#: The trailing metadata the ClusterService puts on an UNAVAILABLE it sends itself.
ERROR_ORIGIN: Final = ("m27-error-origin", "cluster-service")


class TaskShare(msgspec.Struct, frozen=True, kw_only=True):
    """A task holding a share of one GPU."""

    task_id: str
    attempt: int
    share: float
    paused: bool = False


class GpuStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU and its latest reading. `simulated`: a model, not hardware. Readings that
    the node did not report are None."""

    index: int
    name: str
    uuid: str
    simulated: bool
    memory_total_mb: int
    memory_used_mb: int
    utilization_pct: float
    temperature_c: float
    power_w: float | None = None
    power_limit_w: float | None = None
    throttle: tuple[str, ...] = ()
    holdings: tuple[TaskShare, ...] = ()


class NodeStatus(msgspec.Struct, frozen=True, kw_only=True):
    """A node as `m27 nodes` shows it. `state`: up, stopped or lost."""

    node_id: str
    hostname: str
    backend: str
    state: str
    heartbeat_age_s: float
    cpu_slots: int
    cpu_used: int
    gpus: tuple[GpuStatus, ...] = ()
    cgroups: bool = False
    mps: bool = False
    incarnation: str = ""
    driver_version: str = ""  # "" unknown (no NVML, a simulated GPU given none)
    cuda_version: str = ""
    nvml_version: str = ""
    #: How its driver or CUDA differs from most live nodes'; () when it agrees.
    platform_differences: tuple[str, ...] = ()


def _gpu_from_proto(message: pb.Gpu) -> GpuStatus:
    return GpuStatus(
        index=message.index, name=message.name, uuid=message.uuid,
        simulated=message.simulated, memory_total_mb=message.memory_total_mb,
        memory_used_mb=message.memory_used_mb, utilization_pct=message.utilization_pct,
        temperature_c=message.temperature_c, power_w=message.power_w or None,
        power_limit_w=message.power_limit_w or None, throttle=tuple(message.throttle),
        holdings=tuple(TaskShare(task_id=h.task_id, attempt=h.attempt, share=h.share,
                                 paused=h.paused) for h in message.holdings))


def node_from_proto(message: pb.Node) -> NodeStatus:
    return NodeStatus(
        node_id=message.node_id, hostname=message.hostname, backend=message.backend,
        state=message.state, heartbeat_age_s=message.heartbeat_age_s,
        cpu_slots=message.cpu_slots, cpu_used=message.cpu_used,
        gpus=tuple(_gpu_from_proto(g) for g in message.gpus), cgroups=message.cgroups,
        mps=message.mps, incarnation=message.incarnation,
        driver_version=message.driver_version, cuda_version=message.cuda_version,
        nvml_version=message.nvml_version,
        platform_differences=tuple(message.platform_differences))


def chunk_from_proto(message: pb.LogChunk) -> LogChunk:
    stream: Stream = next((s for s in STREAMS if s == message.stream), "stdout")
    return LogChunk(stream=stream, data=message.data, offset=message.offset)


def from_cluster_service(exc: grpc.aio.AioRpcError) -> bool:
    """An error the ClusterService raised itself (e.g. a node it cannot reach), not one of
    reaching the API."""
    # The stubs say a tuple of _Metadatum; grpc.aio gives Metadata, which iterates pairs.
    pairs = cast(Iterable[tuple[str, str]], exc.trailing_metadata() or ())
    return any(tuple(pair) == ERROR_ORIGIN for pair in pairs)
