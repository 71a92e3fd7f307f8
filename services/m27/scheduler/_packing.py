"""Fragmentation-aware packing (pure, numpy-vectorised over nodes and GPUs).

FGD ("Beware of Fragmentation", ATC'23) places a task where it increases the *expected
fragmentation* of idle GPU capacity the least. A node's fragmentation with respect to one
typical request shape s is the idle GPU milli that s could not use there: all of it when s
cannot start on the node at all (too little CPU / memory, too few GPUs with enough free
milli, or the wrong GPU model), otherwise the idle milli on the GPUs that are too small for
s (or of the wrong model). The expectation weighs the shapes by how common they are.

m27 keeps FGD's objective and decides what FGD leaves to chance (docs/scheduling.md):
- places within a tolerance of the least fragmentation growth are equally good (100 milli
  for a share or a CPU task, 40 for one whole GPU, none for a gang: `Tolerance`);
- among them it keeps scarce capabilities: it avoids taking from a node the last room for
  a typical shape that few nodes can still host (a big-CPU 8-GPU node), then takes the GPU
  the request fills most tightly (a gang or CPU task: the node it leaves least idle), then
  the cooler, less loaded GPU, then a fixed node order;
- its typical shapes cover 95 % of the requested GPU *milli* (FGD: of the request count),
  so rare but large requests are among them; the rarer shapes still count for the
  scarce-capability rule (weight 0: they do not move the expected fragmentation).

The packer keeps per-node fragmentation rows and recomputes only the row of the node a
placement changed; per-node best scores are cached per request and only nodes changed
since are scored again. One placement costs a few vector operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from m27.common.platform import Requirements, any_model_matches, platform_fits
from m27.common.windows import blocks
from m27.scheduler.model import MILLI_PER_GPU, Job, Node

Strategy = Literal["m27", "fgd", "bestfit"]
#: A typical shape that fewer nodes than this can still host is a scarce capability: m27
#: avoids taking it away when an equally good place would not.
SCARCE_HOSTS = 20
#: At most this many request shapes are tracked (each costs a column per node).
MAX_SHAPES = 256
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B = npt.NDArray[np.bool_]


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """What one task needs: `gpus` GPUs with `milli` free each, on one node."""

    gpus: int = 0  # 0: CPU only; 1: one GPU (a share when milli < 1000); k: a gang
    milli: int = 0  # per GPU
    cpu_milli: int = 0
    memory_mb: int = 0
    gpu_memory_mb: int = 0  # per GPU; 0: `milli`'s proportion of the GPU's memory
    models: tuple[str, ...] = ()  # allowed GPU models (m27.common.platform words); () any
    driver: str = ""  # a driver version requirement, e.g. ">=535"; "" none
    cuda: str = ""  # a CUDA version requirement, e.g. ">=12.1"; "" none
    #: For nodes whose maintenance window is near: it checkpoints (stops losing little), or
    #: its time limit (None: none) — it may go there only if one of them ends it in time.
    checkpoints: bool = False
    runs_for_s: float | None = None

    @property
    def requirements(self) -> Requirements:
        return Requirements(gpu_model="|".join(self.models), driver=self.driver,
                            cuda=self.cuda)


def request_of(job: Job) -> Request:
    """A job's request: below 1000 milli a share of one GPU, k × 1000 a gang of k GPUs."""
    if job.gpu_milli <= 0:
        gpus, milli = 0, 0
    elif job.gpu_milli < MILLI_PER_GPU:
        gpus, milli = 1, job.gpu_milli
    else:
        gpus, milli = -(-job.gpu_milli // MILLI_PER_GPU), MILLI_PER_GPU
    models = tuple(m for m in job.gpu_model.split("|") if m) if job.gpu_model else ()
    return Request(gpus=gpus, milli=milli, cpu_milli=job.cpu_milli, memory_mb=job.memory_mb,
                   gpu_memory_mb=job.gpu_memory_mb, models=models, driver=job.driver,
                   cuda=job.cuda, checkpoints=job.checkpoints, runs_for_s=job.timeout_s)


def typical_demand(requests: Sequence[Request], coverage: float = 0.95,
                   with_cpu: bool = True, by_milli: bool = True,
                   ) -> list[tuple[Request, float]]:
    """The most frequent GPU request shapes (GPUs, milli, CPU, models), with their
    frequencies, until they cover `coverage` of the requested GPU milli (`by_milli`, m27)
    or of the GPU requests (FGD's target workload). CPU-only requests are left out: they
    cannot use idle GPU capacity, so it is no fragment for them."""
    counts: dict[tuple[int, int, int, tuple[str, ...], str, str], int] = {}
    for r in requests:
        if r.gpus > 0:
            key = (r.gpus, r.milli, r.cpu_milli if with_cpu else 0, r.models, r.driver, r.cuda)
            counts[key] = counts.get(key, 0) + 1
    total = sum(counts.values())
    milli_total = sum(k[0] * k[1] * n for k, n in counts.items())
    shapes: list[tuple[Request, float]] = []
    covered = 0.0
    for (gpus, milli, cpu, models, driver, cuda), n in sorted(
            counts.items(), key=lambda kv: (-kv[1], kv[0])):
        shapes.append((Request(gpus=gpus, milli=milli, cpu_milli=cpu, models=models,
                               driver=driver, cuda=cuda),
                       n / total))
        covered += gpus * milli * n / milli_total if by_milli else n / total
        if covered >= coverage:
            break
    return shapes


def m27_demand(requests: Sequence[Request], coverage: float = 0.95,
               max_shapes: int = MAX_SHAPES) -> list[tuple[Request, float]]:
    """m27's shapes: the typical ones weighted as FGD weighs them, then every rarer shape
    with weight 0 (up to `max_shapes` in all). A weightless shape does not move the
    expected fragmentation, but the scarce-capability rule keeps room for it: the rare
    8-GPU, 120-core requests only a few nodes can host are not left without one."""
    typical = typical_demand(requests, coverage)
    known = {shape for shape, _ in typical}
    rare = [(shape, 0.0) for shape, _ in typical_demand(requests, 1.0) if shape not in known]
    return (typical + rare)[:max(max_shapes, len(typical))]


class Tolerance(msgspec.Struct, frozen=True, kw_only=True):
    """How far (milli) above the least fragmentation growth a place still counts as a tie,
    by kind of request. Measured on the FGD protocol (docs/benchmarks.md): a share's
    growth differs between places by what its leftover slice might still host, where
    100 milli is about FGD's own quantisation; a whole GPU's or a gang's growth differs by
    whole GPUs a typical shape can no longer use, which is real, so it is compared more
    closely (a whole GPU) or exactly (a gang)."""

    share: float = 100.0  # and CPU-only tasks
    whole: float = 40.0  # one whole GPU
    gang: float = 0.0  # several whole GPUs on one node

    def of(self, req: Request) -> float:
        if req.gpus > 1:
            return self.gang
        return self.whole if req.gpus == 1 and req.milli >= MILLI_PER_GPU else self.share


TOLERANCE = Tolerance()


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    node: int  # index into the packer's nodes
    gpu_ids: tuple[int, ...]  # GPU indexes (Gpu.index) on that node
    frag_delta: float  # growth of expected fragmentation, milli


class _Entry:
    """Cached per-node scores of one request, valid for nodes whose version matches.

    `lost` holds which typical shapes each node could no longer host, not how much that
    costs: the cost depends on how many nodes can still host each shape, which changes
    with every placement anywhere, so it is priced when a choice is made."""

    def __init__(self, version: I64, keys: F64, cols: I64, frag: F64, lost: B) -> None:
        self.version, self.keys, self.cols, self.frag = version, keys, cols, frag
        self.lost = lost


class Packer:
    """Free capacity of a cluster and the fragmentation bookkeeping, updated per placement.

    Build it once per scheduling cycle (or per benchmark run); `choose` is pure given the
    state, `take` applies a placement.
    """

    def __init__(self, nodes: Sequence[Node], demand: Sequence[tuple[Request, float]],
                 *, overprovision: float = 1.0, max_temperature_c: float = 80.0,
                 strategy: Strategy = "m27", tie_rank: Sequence[int] | None = None,
                 tolerance: Tolerance = TOLERANCE) -> None:
        self.nodes = tuple(nodes)
        self.index = {x.node_id: i for i, x in enumerate(self.nodes)}
        self.strategy: Strategy = strategy
        #: m27: places within `tolerance.of(request)` milli of the least fragmentation
        #: growth are equally good; the other keys decide among them.
        self.tolerance = tolerance
        self.protect_scarce = strategy == "m27"
        n, g = len(self.nodes), max([len(x.gpus) for x in self.nodes] + [1])
        self.gpu_index = np.full((n, g), -1, np.int64)
        self.usable = np.zeros((n, g), np.bool_)
        self.exists = np.zeros((n, g), np.bool_)
        self.free = np.zeros((n, g), np.int64)
        self.gmem_total = np.zeros((n, g), np.float64)
        self.gmem_free = np.zeros((n, g), np.float64)
        self.temp = np.zeros((n, g), np.float64)
        self.util = np.zeros((n, g), np.float64)
        self.cpu = np.array([x.cpu_milli for x in self.nodes], np.float64)
        self.cpu_cap = np.maximum(self.cpu, 1.0)
        self.mem = np.array([x.memory_mb if x.memory_mb > 0 else np.inf for x in self.nodes],
                            np.float64)
        self.node_ok = np.array([x.schedulable and not x.draining for x in self.nodes],
                                np.bool_)
        self.gpu_cap = np.maximum(np.array([len(x.gpus) for x in self.nodes], np.float64)
                                  * MILLI_PER_GPU, 1.0)
        models: dict[str, int] = {}
        self.model = np.full((n, g), -1, np.int64)
        for i, node in enumerate(self.nodes):
            for j, gpu in enumerate(node.gpus):
                self.gpu_index[i, j] = gpu.index
                self.exists[i, j] = True
                hot = (gpu.temperature_c is not None
                       and gpu.temperature_c > max_temperature_c) or bool(gpu.throttled)
                self.usable[i, j] = not hot
                self.free[i, j] = MILLI_PER_GPU
                self.gmem_total[i, j] = gpu.memory_mb
                self.gmem_free[i, j] = gpu.memory_mb * overprovision
                self.temp[i, j] = gpu.temperature_c or 0.0
                self.util[i, j] = gpu.utilization_pct or 0.0
                self.model[i, j] = models.setdefault(gpu.model, len(models))
        self.usable &= self.node_ok[:, None]
        #: GPUs differ in temperature or load: every GPU is scored on its own.
        self.varied = bool(self.temp.any() or self.util.any())
        self.models = models
        self.rank = np.asarray(tie_rank if tie_rank is not None else range(n), np.int64)
        self.version = np.zeros(n, np.int64)  # bumped on every change of a node
        self._cache: dict[Request, _Entry] = {}
        self._allowed: dict[tuple[tuple[str, ...], str, str, bool, float | None], B] = {}
        self._node_allows: dict[tuple[str, str, bool, float | None], B] = {}
        self._set_demand(demand)

    # -- fragmentation bookkeeping ------------------------------------------------------

    def _set_demand(self, demand: Sequence[tuple[Request, float]]) -> None:
        shapes = [(r, w) for r, w in demand if r.gpus > 0 and w >= 0]
        if not any(w > 0 for _, w in shapes):
            shapes = [(Request(gpus=1, milli=MILLI_PER_GPU), 1.0)]
        weight = np.array([w for _, w in shapes], np.float64)
        self.s_w = weight / weight.sum()
        self.s_k = np.array([r.gpus for r, _ in shapes], np.int64)
        self.s_m = np.array([r.milli for r, _ in shapes], np.int64)
        self.s_cpu = np.array([r.cpu_milli for r, _ in shapes], np.float64)
        self.s_mem = np.array([r.memory_mb for r, _ in shapes], np.float64)
        self.s_elig = np.stack([self.allowed(r) for r, _ in shapes], axis=2)
        self.s_elig &= self.usable[:, :, None]
        fr = self._fr()
        self.cnt, self.part = self._rows(fr, self.s_elig)
        self.tot = fr.sum(axis=1).astype(np.float64)
        self.frag = self._frag(self.cpu, self.mem, self.cnt, self.part, self.tot)
        #: per node and shape: could host one now; per shape: on how many nodes
        self.hosts_now = self._fits(self.cpu, self.mem, self.cnt) & self.node_ok[:, None]
        self.hosts = self.hosts_now.sum(axis=0)

    def model_mask(self, allowed: Sequence[str]) -> B:
        """GPUs (node × column) whose model is one of `allowed` (() any), by words."""
        if not allowed:
            return self.exists.copy()
        codes = [code for name, code in self.models.items()
                 if any_model_matches(name, allowed)]
        return np.isin(self.model, codes) & self.exists

    def allowed(self, req: Request) -> B:
        """GPUs (node × column) `req` may use: of a model it allows, on a node that allows
        it (`node_allows`). Nodes, their platforms and windows do not change within a
        packer: computed once per kind of ask."""
        key = (req.models, req.driver, req.cuda, req.checkpoints, req.runs_for_s)
        mask = self._allowed.get(key)
        if mask is None:
            mask = self.model_mask(req.models) & self.node_allows(req)[:, None]
            self._allowed[key] = mask
        return mask

    def node_allows(self, req: Request) -> B:
        """Nodes that allow `req` beyond capacity: their driver and CUDA meet its
        requirements (all, with none), and their maintenance window is not so near that
        it would be cut short (unless it checkpoints or its time limit ends it before)."""
        key = (req.driver, req.cuda, req.checkpoints, req.runs_for_s)
        mask = self._node_allows.get(key)
        if mask is None:
            needs = Requirements(driver=req.driver, cuda=req.cuda)
            mask = np.array([platform_fits(n.platform, needs)
                             and not blocks(n.window_in_s, checkpoints=req.checkpoints,
                                            runs_for_s=req.runs_for_s)
                             for n in self.nodes], np.bool_).reshape(len(self.nodes))
            self._node_allows[key] = mask
        return mask

    def _fr(self) -> I64:
        """Free milli that new work may use (0 on hot, throttled or missing GPUs)."""
        return np.where(self.usable, np.maximum(self.free, 0), 0)

    def _rows(self, fr: I64, elig: B) -> tuple[I64, F64]:
        """Per node and shape: GPUs big enough for it, idle milli too small for it."""
        big = elig & (fr[:, :, None] >= self.s_m)
        cnt = big.sum(axis=1)
        part = (fr[:, :, None] * ~big).sum(axis=1).astype(np.float64)
        return cnt, part

    def _fits(self, cpu: F64, mem: F64, cnt: I64) -> B:
        """Per row and typical shape: could one such request start there?"""
        fits: B = ((cpu[:, None] >= self.s_cpu) & (mem[:, None] >= self.s_mem)
                   & (cnt >= self.s_k))
        return fits

    def _frag(self, cpu: F64, mem: F64, cnt: I64, part: F64, tot: F64) -> F64:
        """Expected fragmentation of each row (node or candidate), in milli."""
        result: F64 = np.where(self._fits(cpu, mem, cnt), part, tot[:, None]) @ self.s_w
        return result

    def _lost_shapes(self, nodes: I64, cpu: F64, mem: F64, cnt: I64) -> B:
        """Per candidate node and typical shape: it could host the shape before, not after."""
        if not self.protect_scarce:
            return np.zeros((nodes.size, self.s_k.size), np.bool_)
        lost: B = self.hosts_now[nodes] & ~self._fits(cpu, mem, cnt)
        return lost

    def _lost_cost(self, lost: B) -> F64:
        """What losing those shapes costs: each shape counts `SCARCE_HOSTS` / (nodes that
        can still host it), summed and rounded down, so only capabilities that few nodes
        still have count. m27 keeps them (a big-CPU 8-GPU node) for the shapes needing
        them, even when their weight is too small to move the expected fragmentation."""
        rarity = SCARCE_HOSTS / np.maximum(self.hosts, 1)
        cost: F64 = np.floor(lost @ rarity + 1e-9)
        return cost

    def _refresh(self, i: int) -> None:
        fr = self._fr()[i:i + 1]
        cnt, part = self._rows(fr, self.s_elig[i:i + 1])
        self.cnt[i], self.part[i] = cnt[0], part[0]
        self.tot[i] = float(fr.sum())
        self.frag[i] = self._frag(self.cpu[i:i + 1], self.mem[i:i + 1], cnt, part,
                                  self.tot[i:i + 1])[0]
        hosts = self._fits(self.cpu[i:i + 1], self.mem[i:i + 1], cnt)[0] & self.node_ok[i]
        self.hosts += hosts.astype(np.int64) - self.hosts_now[i]
        self.hosts_now[i] = hosts

    # -- placing ------------------------------------------------------------------------

    def take(self, node: int, gpu_cols: Sequence[int], req: Request) -> None:
        """Hold `req` on `node` (GPU columns into the packer's arrays, not Gpu.index)."""
        self.hold(node, {c: (req.milli, self.gpu_memory(req, node, c)) for c in gpu_cols},
                  req.cpu_milli, req.memory_mb)

    def hold(self, node: int, gpus: dict[int, tuple[int, float]], cpu_milli: int,
             memory_mb: int) -> None:
        """Hold capacity on `node`: per GPU column (milli, GPU MiB), plus CPU and memory."""
        self.version[node] += 1
        self.cpu[node] -= cpu_milli
        self.mem[node] -= memory_mb
        for col, (milli, gmem) in gpus.items():
            self.free[node, col] -= milli
            self.gmem_free[node, col] -= gmem
        self._refresh(node)

    def gpu_memory(self, req: Request, node: int, col: int) -> float:
        """GPU memory a request holds on one GPU: its ask, or its share's proportion."""
        if req.gpu_memory_mb > 0:
            return float(req.gpu_memory_mb)
        return float(self.gmem_total[node, col]) * req.milli / MILLI_PER_GPU

    def col_of(self, node: int, gpu_index: int) -> int:
        cols = np.flatnonzero(self.gpu_index[node] == gpu_index)
        return int(cols[0]) if cols.size else -1

    def node_fits(self, req: Request, rows: I64 | None = None) -> B:
        """Nodes (all, or `rows`) that take new work, have the CPU and memory for `req` and
        allow it (`node_allows`: driver, CUDA, maintenance window)."""
        r = slice(None) if rows is None else rows
        fits: B = (self.node_ok[r] & (self.cpu[r] >= req.cpu_milli)
                   & (self.mem[r] >= req.memory_mb) & self.node_allows(req)[r])
        return fits

    def gpu_fits(self, req: Request, rows: I64 | None = None) -> B:
        """GPUs (node × column) with the milli, memory and model `req` needs on each."""
        r = slice(None) if rows is None else rows
        total = self.gmem_total[r]
        need = (float(req.gpu_memory_mb) if req.gpu_memory_mb > 0
                else total * req.milli / MILLI_PER_GPU)
        fits: B = (self.usable[r] & (self.free[r] >= req.milli)
                   & (self.gmem_free[r] >= need - 1e-6) & self.allowed(req)[r]
                   & self.node_fits(req, rows)[:, None])
        return fits

    def choose(self, req: Request, only: int | None = None) -> Choice | None:
        """Where `req` fragments the cluster least (None: it fits nowhere now); with
        `only`, on that node or nowhere. Per-node scores are cached per request and only
        the nodes changed since are scored again."""
        if only is not None:
            rows = np.array([only], np.int64)
            return self._choice(req, rows, *self._scores(req, rows))
        entry = self._cache.get(req)
        if entry is None:
            if len(self._cache) >= 256:
                self._cache.clear()
            rows = np.arange(len(self.nodes), dtype=np.int64)
            entry = _Entry(self.version.copy(), *self._scores(req, rows))
            self._cache[req] = entry
        else:
            rows = np.flatnonzero(entry.version != self.version)
            if rows.size:
                keys, cols, frag, lost = self._scores(req, rows)
                entry.keys[:, rows], entry.cols[rows], entry.frag[rows] = keys, cols, frag
                entry.lost[rows] = lost
                entry.version[rows] = self.version[rows]
        return self._choice(req, np.arange(len(self.nodes), dtype=np.int64), entry.keys,
                            entry.cols, entry.frag, entry.lost)

    def _choice(self, req: Request, rows: I64, keys: F64, cols: I64, frag: F64,
                lost: B) -> Choice | None:
        ok = np.flatnonzero(np.isfinite(keys[0]))
        if ok.size == 0:
            return None
        sort_keys = list(keys[:, ok])
        best0 = sort_keys[0].min()
        near = sort_keys[0] <= best0 + self._near(req) + 1e-6  # float noise: exact ties
        sort_keys[0] = np.where(near, best0, sort_keys[0])
        if self.protect_scarce:
            # Priced now, with the current host counts (only the ties need it).
            sort_keys[1] = np.zeros(ok.size)
            sort_keys[1][near] = self._lost_cost(lost[ok[near]])
        order = np.lexsort((self.rank[rows[ok]], *reversed(sort_keys)))
        best = int(ok[order[0]])
        node = int(rows[best])
        gpu_ids = tuple(sorted(int(self.gpu_index[node, c]) for c in cols[best, :req.gpus]))
        return Choice(node=node, gpu_ids=gpu_ids, frag_delta=float(frag[best]))

    def _near(self, req: Request) -> float:
        """How much more growth than the best still ties (m27; exact for the others)."""
        return self.tolerance.of(req) if self.strategy == "m27" else 0.0

    def place(self, req: Request) -> Choice | None:
        """choose, then take."""
        choice = self.choose(req)
        if choice is not None:
            cols = [self.col_of(choice.node, gi) for gi in choice.gpu_ids]
            self.take(choice.node, cols, req)
        return choice

    def _key(self, delta: F64) -> F64:
        """FGD as published scores `int(100 * sigmoid(-delta / 1000))`, so deltas a few
        milli apart tie (and go to the node order); m27 keeps the exact growth and
        treats growths within `tolerance` of the best as ties (`_choice`)."""
        if self.strategy == "fgd":
            key: F64 = -np.floor(100.0 / (1.0 + np.exp(delta / 1000.0)))
            return key
        return delta

    def _scores(self, req: Request, rows: I64) -> tuple[F64, I64, F64, B]:
        """Per node in `rows`: its sort keys (first key inf: does not fit; m27's second,
        the scarce capabilities lost, is priced in `_choice`), the GPU columns it would
        use, its fragmentation growth and the typical shapes it could no longer host."""
        if req.gpus == 0:
            return self._scores_cpu(req, rows)
        if req.gpus == 1:
            return self._scores_one(req, rows)
        return self._scores_gang(req, rows)

    def _node_left(self, req: Request, rows: I64) -> F64:
        """Best-fit's node score: CPU and GPU left after placing, as shares of capacity."""
        left: F64 = ((self.cpu[rows] - req.cpu_milli) / self.cpu_cap[rows]
                     + (self.tot[rows] - req.gpus * req.milli) / self.gpu_cap[rows])
        return left

    def _scores_cpu(self, req: Request, rows: I64) -> tuple[F64, I64, F64, B]:
        fits = self.node_fits(req, rows)
        frag = np.zeros(rows.size)
        lost = np.zeros((rows.size, self.s_k.size), np.bool_)
        if self.strategy == "bestfit":
            keys = np.stack([self._node_left(req, rows)])
        else:
            cpu, mem = self.cpu[rows] - req.cpu_milli, self.mem[rows] - req.memory_mb
            frag = self._frag(cpu, mem, self.cnt[rows], self.part[rows],
                              self.tot[rows]) - self.frag[rows]
            lost = self._lost_shapes(rows, cpu, mem, self.cnt[rows])
            # m27: CPU work goes where it costs no capability (priced in `_choice`) and
            # idle GPU capacity is scarcest: it strands the least.
            keys = np.stack([self._key(frag)] + (
                [np.zeros(rows.size), self.tot[rows]] if self.strategy == "m27" else []))
        keys[0, ~fits] = np.inf
        return keys, np.zeros((rows.size, 1), np.int64), frag, lost

    def _scores_one(self, req: Request, rows: I64) -> tuple[F64, I64, F64, B]:
        ok = self.gpu_fits(req, rows)
        if ok.shape[1] > 1 and not self.varied:
            ok &= ~self._repeats(ok, rows)
        r, c = np.nonzero(ok)
        nodes = rows[r]
        left = np.maximum(self.free[nodes, c], 0) - req.milli
        frag, lost_shapes = (
            (np.zeros(r.size), np.zeros((r.size, self.s_k.size), np.bool_))
            if self.strategy == "bestfit" else self._delta(nodes, [c], req))
        lost = self._lost_cost(lost_shapes)
        if self.strategy == "bestfit":
            cand = [self._node_left(req, nodes), left.astype(np.float64)]
        elif self.strategy == "fgd":
            cand = [self._key(frag)]
        else:
            # Then the GPU it fills most tightly, on the node left least idle (keeping
            # empty nodes whole for gangs), then the coolest, least loaded GPU.
            cand = [self._key(frag), lost, left.astype(np.float64),
                    self.temp[nodes, c], self.util[nodes, c]]
        keys = np.full((len(cand), rows.size), np.inf)
        cols = np.zeros((rows.size, 1), np.int64)
        best_frag = np.zeros(rows.size)
        best_lost = np.zeros((rows.size, self.s_k.size), np.bool_)
        if r.size and self._near(req) > 0:
            # GPUs within the tolerance of the node's least growth are equally good.
            by_frag = np.lexsort((frag, r))
            rs = r[by_frag]
            row_min = np.full(rows.size, np.inf)
            row_min[rs[np.r_[True, rs[1:] != rs[:-1]]]] = frag[
                by_frag[np.r_[True, rs[1:] != rs[:-1]]]]
            near = frag <= row_min[r] + self._near(req) + 1e-6
            cand[0] = np.where(near, row_min[r], frag)
        if r.size:
            order = np.lexsort((c, *reversed(cand), r))
            rs = r[order]
            first = order[np.r_[True, rs[1:] != rs[:-1]]]
            for k, key in enumerate(cand):
                keys[k, r[first]] = key[first]
            cols[r[first], 0] = c[first]
            best_frag[r[first]] = frag[first]
            best_lost[r[first]] = lost_shapes[first]
        return keys, cols, best_frag, best_lost

    def _repeats(self, ok: B, rows: I64) -> B:
        """GPUs equal to an earlier candidate GPU of their node (same free milli and model):
        they would score the same, so only the first is scored."""
        vals = np.where(ok, self.free[rows] * 4096 + self.model[rows], -1)
        repeats = np.zeros_like(ok)
        for col in range(1, ok.shape[1]):
            repeats[:, col] = ok[:, col] & (vals[:, :col] == vals[:, col:col + 1]).any(axis=1)
        return repeats

    def _scores_gang(self, req: Request, rows: I64) -> tuple[F64, I64, F64, B]:
        ok = self.gpu_fits(req, rows)
        g = ok.shape[1]
        keys_n = 1 if self.strategy != "m27" else 4
        keys = np.full((keys_n, rows.size), np.inf)
        cols = np.zeros((rows.size, max(req.gpus, 1)), np.int64)
        frag = np.zeros(rows.size)
        lost_shapes = np.zeros((rows.size, self.s_k.size), np.bool_)
        sel = np.flatnonzero(ok.sum(axis=1) >= req.gpus)
        if sel.size == 0 or req.gpus > g:
            return keys, cols, frag, lost_shapes
        nodes = rows[sel]
        # Within a node, the GPUs it fills most tightly, then the coolest, then by index.
        left = np.where(ok[sel], self.free[nodes] - req.milli, np.iinfo(np.int64).max)
        order = np.lexsort((np.arange(g)[None, :].repeat(sel.size, 0), self.temp[nodes],
                            left), axis=1)
        chosen = order[:, :req.gpus]
        cols[sel] = chosen
        if self.strategy == "bestfit":
            keys[0, sel] = self._node_left(req, nodes)
            return keys, cols, frag, lost_shapes
        delta, lost = self._delta(nodes, [chosen[:, j] for j in range(req.gpus)], req)
        frag[sel] = delta
        lost_shapes[sel] = lost
        keys[0, sel] = self._key(delta)
        if self.strategy == "m27":
            # Then the fewest capabilities lost (priced in `_choice`), the node the gang
            # fills most tightly, then the coolest GPUs.
            keys[1, sel] = 0.0
            keys[2, sel] = self.tot[nodes]
            keys[3, sel] = self.temp[nodes[:, None], chosen].mean(axis=1)
        return keys, cols, frag, lost_shapes

    def _delta(self, nodes: I64, cols: list[I64], req: Request) -> tuple[F64, B]:
        """Growth of each candidate node's expected fragmentation if `req` took `cols`,
        and (m27) the typical shapes the node could no longer host."""
        cnt = self.cnt[nodes].copy()
        part = self.part[nodes].copy()
        for col in cols:
            f = np.maximum(self.free[nodes, col], 0)[:, None]
            f2 = f - req.milli
            el = self.s_elig[nodes, col]
            was, now = el & (f >= self.s_m), el & (f2 >= self.s_m)
            cnt += now.astype(np.int64) - was
            part += np.where(now, 0, f2) - np.where(was, 0, f)
        tot = self.tot[nodes] - req.milli * len(cols)
        cpu, mem = self.cpu[nodes] - req.cpu_milli, self.mem[nodes] - req.memory_mb
        delta: F64 = self._frag(cpu, mem, cnt, part, tot) - self.frag[nodes]
        return delta, self._lost_shapes(nodes, cpu, mem, cnt)

    # -- what `--explain` says ----------------------------------------------------------

    def largest_slice(self) -> tuple[int, int, int, float] | None:
        """(node, Gpu.index, free milli, free GPU MiB) of the largest usable free slice."""
        fr = np.where(self.usable & self.node_ok[:, None], np.maximum(self.free, 0), -1)
        if fr.size == 0 or fr.max() < 0:
            return None
        flat = int(np.lexsort((self.rank[:, None].repeat(fr.shape[1], 1).ravel(),
                               -fr.ravel()))[0])
        node, col = divmod(flat, fr.shape[1])
        return (node, int(self.gpu_index[node, col]), int(fr[node, col]),
                float(self.gmem_free[node, col]))
