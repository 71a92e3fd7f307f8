"""Free capacity of a cluster as a policy sees it, and the fit checks every policy (and the
engine's validation of their decisions) share. Pure: built from a `ClusterState`.
"""

from __future__ import annotations

from collections.abc import Iterator

from m27.common.platform import any_model_matches
from m27.scheduler.model import MILLI_PER_GPU, ClusterState, Gpu, Job, Node


def gpus_needed(job: Job) -> int:
    """Whole GPUs a gang needs; 1 for a share of one GPU; 0 for CPU-only work."""
    if job.gpu_milli <= 0:
        return 0
    return max(1, job.gpu_milli // MILLI_PER_GPU)


def demand_milli(job: Job) -> int:
    """What the job uses of each of its GPUs while busy."""
    return min(job.gpu_milli, MILLI_PER_GPU) if job.gpu_milli > 0 else 0


def memory_need(job: Job, gpu: Gpu, milli: int) -> int:
    """GPU memory a placement holds: asked for, else the share's proportion."""
    if job.gpu_memory_mb:
        return job.gpu_memory_mb
    return gpu.memory_mb * milli // MILLI_PER_GPU


def model_ok(job: Job, gpu: Gpu) -> bool:
    """`gpu_model` may list several models, `|`-separated (the openb `gpu_spec`), matched
    by words as the scheduler does (m27.common.platform)."""
    return not job.gpu_model or any_model_matches(gpu.model, job.gpu_model.split("|"))


class FreeMap:
    """Free milli-GPU, GPU memory and CPU per node; `take` as decisions are made."""

    def __init__(self, state: ClusterState, *, memory_overprovision: float = 1.0) -> None:
        self.nodes: dict[str, Node] = {n.node_id: n for n in state.nodes if n.schedulable}
        self.milli: dict[tuple[str, int], int] = {}
        self.memory: dict[tuple[str, int], float] = {}
        self.cpu: dict[str, int] = {}
        self.gpus: dict[tuple[str, int], Gpu] = {}
        self._max_free: int | None = None
        for node in self.nodes.values():
            self.cpu[node.node_id] = node.cpu_milli
            for gpu in node.gpus:
                self.gpus[node.node_id, gpu.index] = gpu
                self.milli[node.node_id, gpu.index] = MILLI_PER_GPU
                self.memory[node.node_id, gpu.index] = gpu.memory_mb * memory_overprovision
        for run in state.running:
            self.take(run.job, run.node_id, run.gpu_ids, run.gpu_milli, borrowed=bool(run.lender))

    def gpu(self, node_id: str, index: int) -> Gpu:
        return self.gpus[node_id, index]

    def max_free(self) -> int:
        """The largest free share on any GPU: a quick "nothing fits" for busy clusters."""
        if self._max_free is None:
            self._max_free = max(self.milli.values(), default=0)
        return self._max_free

    def take(self, job: Job, node_id: str, gpu_ids: tuple[int, ...], milli: int, *,
             borrowed: bool = False) -> None:
        if node_id not in self.nodes:
            return
        self.cpu[node_id] -= job.cpu_milli
        self._max_free = None
        for index in gpu_ids:
            key = (node_id, index)
            if not borrowed:  # a backfill uses its lender's share, not free capacity
                self.milli[key] -= milli
            self.memory[key] -= memory_need(job, self.gpu(node_id, index), milli)

    def gpu_fits(self, job: Job, node_id: str, index: int, milli: int) -> bool:
        gpu = self.gpu(node_id, index)
        key = (node_id, index)
        return (model_ok(job, gpu) and self.milli[key] >= milli
                and self.memory[key] >= memory_need(job, gpu, milli))

    def free_gpus(self, job: Job, node_id: str, milli: int) -> Iterator[int]:
        if milli > self.max_free():
            return
        for gpu in self.nodes[node_id].gpus:
            if self.gpu_fits(job, node_id, gpu.index, milli):
                yield gpu.index

    def cpu_fits(self, job: Job, node_id: str) -> bool:
        return self.cpu[node_id] >= job.cpu_milli
