"""Why a task waits, in words, and where a ready-pool task will most likely start (pure)."""

from __future__ import annotations

import numpy as np

from m27.common.platform import node_misses
from m27.scheduler._packing import Packer, Request
from m27.scheduler.model import MILLI_PER_GPU

#: A wait reason names at most this many nodes.
MAX_NODES_NAMED = 4


def _gib(mb: float) -> str:
    return f"{mb / 1024:.0f} GiB" if mb >= 1024 else f"{mb:.0f} MiB"


def _ask(req: Request) -> str:
    if req.gpus == 0:
        return f"needs {req.cpu_milli / 1000:.1f} CPU" + (
            f" with {_gib(req.memory_mb)} memory" if req.memory_mb else "")
    needs = req.requirements
    model = f" ({needs.text()})" if needs else ""
    if req.gpus == 1 and req.milli < MILLI_PER_GPU:
        mem = (f" with {_gib(req.gpu_memory_mb)}" if req.gpu_memory_mb
               else " with its share of GPU memory")
        return f"needs {req.milli / 1000:.2f} GPU{model}{mem}"
    return f"needs {req.gpus} whole GPU(s){model} on one node"


def wait_reason(packer: Packer, req: Request) -> str:
    """E.g. "needs 0.50 GPU with 12 GiB; largest free slice is 0.30 (GPU 1 on n2)"."""
    ask = _ask(req)
    if not packer.node_ok.any():
        return f"{ask}; no node takes new work (cordoned, draining or down)"
    unmet = _unmet(packer, req)
    if unmet:
        return f"{ask}; {unmet}"
    hot = int((packer.exists & packer.node_ok[:, None] & ~packer.usable).sum())
    note = f"; {hot} GPU(s) too hot or throttled take no new work" if hot else ""
    if req.gpus == 0:
        cpu = np.where(packer.node_ok, packer.cpu, -np.inf)
        best = int(np.argmax(cpu))
        return (f"{ask}; the most free on a node is {cpu[best] / 1000:.1f} CPU "
                f"({packer.nodes[best].node_id})")
    if req.gpus == 1 and req.milli < MILLI_PER_GPU:
        return f"{ask}; {_slice_text(packer, req)}{note}"
    full = packer.usable & (packer.free >= MILLI_PER_GPU)
    counts = full.sum(axis=1)
    best = int(np.argmax(counts))
    text = (f"{ask}; the most fully free GPUs on a node is {int(counts[best])} "
            f"({packer.nodes[best].node_id})")
    if int(counts[best]) >= req.gpus:
        text += ", but not with the CPU, memory or GPU model it needs"
    return text + note


def _unmet(packer: Packer, req: Request) -> str:
    """When no node that takes work has a GPU the requirements allow: what each misses."""
    needs = req.requirements
    if not needs or (packer.allowed(req) & packer.node_ok[:, None]).any():
        return ""
    misses = []
    for i in np.flatnonzero(packer.node_ok)[:MAX_NODES_NAMED]:
        node = packer.nodes[int(i)]
        missed = node_misses([g.model for g in node.gpus], node.platform, needs)
        misses.append(f"{node.node_id}: {missed}")
    more = int(packer.node_ok.sum()) - MAX_NODES_NAMED
    tail = f" and {more} more" if more > 0 else ""
    return f"no node meets its requirements ({' | '.join(misses)}{tail})"


def _slice_text(packer: Packer, req: Request) -> str:
    largest = packer.largest_slice()
    if largest is None:
        return "no GPU has free capacity"
    node, gpu, milli, gmem = largest
    text = (f"largest free slice is {milli / 1000:.2f} "
            f"(GPU {gpu} on {packer.nodes[node].node_id})")
    if milli >= req.milli:
        text += (f", {_gib(gmem)} GPU memory free there; a GPU with the milli lacks the "
                 "GPU memory, CPU, host memory or model it needs")
    return text


def stage_nodes(packer: Packer, req: Request, count: int) -> list[int]:
    """The `count` nodes a waiting task will most likely start on: of the nodes that could
    ever hold it, those with the most free capacity of the kind it needs (then node order),
    most likely first."""
    ok = packer.node_ok & (packer.cpu_cap >= req.cpu_milli)
    if req.gpus == 0:
        nodes = np.flatnonzero(ok)
        order = np.lexsort((packer.rank[nodes], -packer.cpu[nodes]))
    else:
        elig = packer.usable & packer.allowed(req)
        nodes = np.flatnonzero(ok & (elig.sum(axis=1) >= req.gpus))
        free = np.where(elig[nodes], np.maximum(packer.free[nodes], 0), -1)
        top = -np.sort(-free, axis=1)[:, :req.gpus].sum(axis=1)
        order = np.lexsort((packer.rank[nodes], -top))
    return [int(n) for n in nodes[order][:max(0, count)]]
