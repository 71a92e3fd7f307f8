"""Checkpoint cost for the training loop: m27.train's Checkpointer against torch.save +
fsync and torch.distributed.checkpoint (DCP) async_save of the same state, to the same disk.

Models of ~5M, ~50M and ~100M parameters (stacks of Linear 4d / GELU / Linear / LayerNorm
blocks) trained with AdamW on random batches, in two loops:

- `cpu`: forward, backward and optimizer step on the CPU (a CPU-bound job: the persist
  threads compete with training for the cores);
- `gpu-like`: what a GPU job leaves the host. The median forward+backward time of the model
  is measured first (a process per size, `--compute-ms` overrides it); in the timed loop
  forward/backward is a `time.sleep` of that time, and every trainable parameter's `.grad`
  is set to a preallocated random tensor, so `optimizer.step()` (on the CPU) still changes
  every tensor, as dense training does. The CPU is mostly idle, as when a GPU computes.

Each case (loop × size × mode) runs in its own process, so memory figures are its own. A
case measures `--baseline-steps` steps without checkpoints (m27: with the Checkpointer
already made, 3 steps earlier, so its buffers are allocated as in a real run where the
first save comes long after the start), then checkpoints after every step until it has
taken `--checkpoints` checkpoints: a save that comes due while the
previous one is persisting is deferred (m27 and DCP), so persistence runs back to back —
the worst case for the steps it overlaps. Then it restores the last checkpoint into a
fresh model and optimizer, in the same process (page cache warm).

Modes (`--modes`, comma-separated; by default all, less the delta_base that is the
library's default, which `default` already measures):
  default       m27 Checkpointer with the library's defaults (its delta_base is named
                in the row)
  memory        m27, XOR deltas against the base held in host memory
                (delta_base="memory": two host buffer slots per changing tensor)
  off           m27, no deltas (delta_base="off": one slot)
  store         m27, XOR deltas against the base read back from the store
                (delta_base="store": one slot; the lowest-memory mode with deltas)
  frozen        m27 with the library's defaults, all but the last block frozen
  torch         torch.save of model+optimizer state_dicts, then fsync (blocks the loop)
  torch-frozen  the same, mostly frozen
  dcp           torch.distributed.checkpoint.async_save into a FileSystemWriter
                (sync_files=True: DCP fsyncs each data file and the metadata file) with a
                caller-owned DefaultStager, so its staging copies are allocated once and
                reused; staging runs inside the call
  dcp-staged    the same with background staging (StagingOptions use_async_staging): the
                call returns at once and the next optimizer.step() waits until the
                staging copy is done

Figures per case:
  stall         what the training loop lost per checkpoint. m27: time in after_step plus
                the time the next optimizer.step() waited for the snapshot copy. torch:
                the whole save + fsync. DCP: the time async_save blocked the loop plus
                (dcp-staged) the time the next optimizer.step() waited for staging.
  durable       from the start of the save until the checkpoint is durable. m27: from
                after_step until the manifest is committed (chunks and manifest fsynced,
                renamed, directory fsynced). torch: = stall. DCP: from the call until its
                future completed (data and .metadata fsynced, .metadata renamed) plus an
                fsync of the checkpoint directory, which DCP does not do itself.
  vs torch      durable median / torch.save+fsync median of the same loop, size and
                frozen-ness (the "torch" or "torch-frozen" row of this run).
  step while persisting
                median step time while a checkpoint was persisting (the step right after
                a save less the time it waited for the snapshot or staging copy, which
                is in the stall) against the baseline steps without checkpoints.
  bytes/ckpt    bytes each checkpoint added to the disk: first checkpoint → median of
                the later ones (m27 stores only changed chunks; torch and DCP write all).
  host memory   persistent host buffers the method keeps (m27: snapshot buffers; DCP:
                its cached staging copies), in MiB and % of the state (model state_dict
                + optimizer state tensors); "peak +" is the growth of peak RSS
                (VmHWM, reset before the timed loop) over RSS before it.
  restore       m27: Checkpointer.resume() (every chunk's sha256 verified, deltas
                decoded, state loaded); torch: torch.load(weights_only=True) +
                load_state_dict; DCP: dcp.load into get_state_dict() + set_state_dict (no
                integrity check). Warm page cache. "vs torch" = restore / torch.load of
                the matching torch row.

`--ckpt-kwargs '{"persist_threads": 2}'` (a JSON object) is merged into the keyword
arguments of every m27 Checkpointer (the saving and the restoring one); a name the
Checkpointer does not take fails before any case runs. With few checkpoints "p95" is
close to the maximum: use --checkpoints 20 or more for a meaningful p95.

    python bench/checkpoint_stall.py [--loop cpu|gpu-like|both] [--sizes 5M,50M,100M]
        [--modes default,off,store,frozen,torch,torch-frozen,dcp,dcp-staged]
        [--checkpoints 6] [--baseline-steps 8] [--compute-ms MS]
        [--ckpt-kwargs JSON] [--json]

M27_BENCH_DIR names the directory the cases write under (default: the system temp dir).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SIZES = {"5M": (256, 9), "50M": (768, 10), "100M": (1024, 12)}  # width, blocks
BATCH = 64
LOOPS = ("cpu", "gpu-like")
Method = Literal["m27", "torch", "dcp"]


@dataclass(frozen=True)
class Mode:
    label: str
    method: Method
    frozen: bool = False
    delta_base: str | None = None  # m27 only; None: the library's default
    compress: str | None = None  # m27 only; None: the library's default ("auto")
    background_staging: bool = False  # DCP only


MODES = {
    "default": Mode("m27, defaults", "m27"),
    "memory": Mode("m27, deltas vs memory (2 slots), always compressed", "m27",
                   delta_base="memory", compress="always"),
    "off": Mode("m27, no deltas", "m27", delta_base="off"),
    "store": Mode("m27, deltas vs store (1 slot), always compressed", "m27",
                  delta_base="store", compress="always"),
    "frozen": Mode("m27, mostly frozen", "m27", frozen=True),
    "torch": Mode("torch.save + fsync", "torch"),
    "torch-frozen": Mode("torch.save + fsync, mostly frozen", "torch", frozen=True),
    "dcp": Mode("DCP async_save", "dcp"),
    "dcp-staged": Mode("DCP async_save, background staging", "dcp", background_staging=True),
}
DELTA_MODES = ("memory", "off", "store")
#: Checkpointer arguments each mode sets itself: --ckpt-kwargs may not change them.
RESERVED_KWARGS = frozenset({"model", "optimizer", "store", "delta_base", "environ"})

Step = Callable[[], float]


# ---------------------------------------------------------------------------- the model


def model_for(size: str) -> Any:
    import torch

    width, blocks = SIZES[size]
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers)


def setup(size: str, frozen: bool, loop: str, compute_s: float) -> tuple[Any, Any, Step]:
    """Model, AdamW and a step function returning the step's seconds; optimizer state
    exists (warm-up steps taken)."""
    import torch

    torch.manual_seed(0)
    model = model_for(size)
    if frozen:  # everything but the last block
        for parameter in list(model.parameters())[:-6]:
            parameter.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    width = SIZES[size][0]
    batch = (torch.randn(BATCH, width), torch.randn(BATCH, width))
    grads = [torch.randn_like(p) * 1e-3 for p in trainable]

    def cpu_step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return time.perf_counter() - started

    def gpu_like_step() -> float:
        started = time.perf_counter()
        for parameter, grad in zip(trainable, grads, strict=True):
            parameter.grad = grad
        time.sleep(compute_s)  # forward + backward on the GPU
        optimizer.step()
        return time.perf_counter() - started

    step = cpu_step if loop == "cpu" else gpu_like_step
    for _ in range(3):  # warm-up; creates the optimizer state
        step()
    return model, optimizer, step


def fresh_state(size: str, frozen: bool) -> tuple[Any, Any]:
    """A model and optimizer as a new process would build them before restoring, with the
    optimizer state allocated (one step on random gradients) so DCP can load in place."""
    import torch

    torch.manual_seed(1)
    model = model_for(size)
    if frozen:
        for parameter in list(model.parameters())[:-6]:
            parameter.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    for parameter in trainable:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def measure_compute(size: str, steps: int = 10) -> float:
    """Median forward+backward seconds of the dense model on this machine's CPUs."""
    import torch

    torch.manual_seed(0)
    model = model_for(size)
    width = SIZES[size][0]
    batch = (torch.randn(BATCH, width), torch.randn(BATCH, width))
    times = []
    for number in range(steps + 3):  # three warm-up passes
        model.zero_grad()
        started = time.perf_counter()
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()  # type: ignore[no-untyped-call]
        if number >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def state_bytes(model: Any, optimizer: Any) -> int:
    import torch

    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor))
    return int(total)


# ---------------------------------------------------------------------------- memory


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    return _status("VmRSS")


def reset_peak_rss() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    return _status("VmHWM")


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------- m27


def checkpointer_kwargs(extra: dict[str, Any], root: Path) -> dict[str, Any]:
    return {"signal": False, "stop_signal": False,
            "environ": {"M27_CONFIG": str(root / "none")}, **extra}


def case_m27(size: str, mode: Mode, loop: str, compute_s: float, checkpoints: int,
             root: Path, baseline_steps: int, extra: dict[str, Any]) -> dict[str, Any]:
    from m27.train import Checkpointer, Cursor

    model, optimizer, step = setup(size, mode.frozen, loop, compute_s)
    rss_before = rss_bytes()
    peak_reset = reset_peak_rss()
    store = root / "m27"
    kwargs = {"every_steps": 1, **checkpointer_kwargs(extra, root)}
    if mode.delta_base is not None:
        kwargs["delta_base"] = mode.delta_base
    if mode.compress is not None:
        kwargs["compress"] = mode.compress
    ckpt = Checkpointer(model=model, optimizer=optimizer, store=str(store), **kwargs)
    # Made at the start, as a training program does: it allocates its buffers in the
    # background after the first optimizer step (no after_step yet, so no saves).
    for _ in range(3):
        step()
    baseline = [step() for _ in range(baseline_steps)]
    cursor, during, just_saved = Cursor(), [], False
    while ckpt.counters.started < checkpoints:
        persisting = ckpt.counters.started > ckpt.counters.committed + ckpt.counters.failed
        seconds = step()
        if just_saved:  # this step holds the save's wait for the copy: not counted twice
            seconds -= ckpt.reports[-1].blocked_s
        if persisting:
            during.append(seconds)
        cursor.advance()
        just_saved = ckpt.after_step(cursor)
    step()  # the last snapshot's copy is waited for here
    ckpt.flush()
    peak = peak_rss_bytes()
    reports = list(ckpt.reports)
    buffers = ckpt.host_buffer_bytes
    counters = ckpt.counters
    ckpt.close()
    restore = restore_m27(size, mode.frozen, store, root, extra)
    return {
        "stall_s": [r.stall_s for r in reports], "capture_s": [r.capture_s for r in reports],
        "blocked_s": [r.blocked_s for r in reports],
        "durable_s": [r.durable_s for r in reports], "new_bytes": [r.new_bytes for r in reports],
        "size_bytes": reports[-1].size_bytes, "deferred": counters.deferred,
        "failed": counters.failed, "helped": sum(r.helped for r in reports),
        "baseline_step_s": statistics.median(baseline),
        "persist_step_s": statistics.median(during) if during else None,
        "persist_steps": len(during), "host_buffer_bytes": buffers,
        "peak_rss_growth_bytes": peak - rss_before if peak_reset else None,
        "rss_before_bytes": rss_before, "state_bytes": state_bytes(model, optimizer),
        "restore_s": restore, "stored_bytes": tree_bytes(store),
        "delta_base": kwargs.get("delta_base", library_default("delta_base")),
    }


def restore_m27(size: str, frozen: bool, store: Path, root: Path,
                extra: dict[str, Any]) -> float:
    from m27.train import Checkpointer

    model, optimizer = fresh_state(size, frozen)
    ckpt = Checkpointer(model=model, optimizer=optimizer, store=str(store),
                        **checkpointer_kwargs(extra, root))
    started = time.perf_counter()
    cursor = ckpt.resume()
    elapsed = time.perf_counter() - started
    ckpt.close()
    if cursor is None:
        raise RuntimeError("resume() found no checkpoint")
    return elapsed


# ---------------------------------------------------------------------------- torch.save


def case_torch(size: str, mode: Mode, loop: str, compute_s: float, checkpoints: int,
               root: Path) -> dict[str, Any]:
    import torch

    model, optimizer, step = setup(size, mode.frozen, loop, compute_s)
    rss_before = rss_bytes()
    peak_reset = reset_peak_rss()
    path, stalls, sizes = root / "torch.pt", [], []
    for _ in range(checkpoints):
        step()
        started = time.perf_counter()
        with path.open("wb") as file:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, file)
            file.flush()
            os.fsync(file.fileno())
        stalls.append(time.perf_counter() - started)
        sizes.append(path.stat().st_size)
    peak = peak_rss_bytes()
    fresh, fresh_opt = fresh_state(size, mode.frozen)
    started = time.perf_counter()
    state = torch.load(path, weights_only=True)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    return {"stall_s": stalls, "durable_s": stalls, "new_bytes": sizes,
            "state_bytes": state_bytes(model, optimizer),
            "peak_rss_growth_bytes": peak - rss_before if peak_reset else None,
            "restore_s": time.perf_counter() - started}


# ---------------------------------------------------------------------------- DCP


class DcpSaver:
    """dcp.async_save with a caller-owned stager, one directory per checkpoint; records
    for each save the time the call blocked and the time until durable."""

    def __init__(self, root: Path, background_staging: bool) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root = root
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=False,
            use_async_staging=background_staging, use_non_blocking_copy=False))
        self.process_group = "none (single process, no_dist)"
        self.call_s: list[float] = []
        self.blocked_s: list[float] = []
        self.durable_s: list[float | None] = []
        self.new_bytes: list[int] = []
        self.errors: list[str] = []
        self.upload: Future[Any] | None = None
        self.staging: Future[Any] | None = None
        self._done = threading.Event()
        self._done.set()

    @property
    def busy(self) -> bool:
        return not self._done.is_set()

    def save(self, model: Any, optimizer: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        index = len(self.call_s)
        path = self.root / f"ckpt-{index}"
        started = time.perf_counter()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            response = self._call(dcp, state, path)
        self.call_s.append(time.perf_counter() - started)
        self.blocked_s.append(0.0)
        self.durable_s.append(None)
        self.new_bytes.append(0)
        if isinstance(response, Future):
            self.upload, self.staging = response, None
        else:  # AsyncSaveResponse (background staging)
            self.upload, self.staging = response.upload_completion, response.staging_completion
        self._done.clear()
        self.upload.add_done_callback(lambda f: self._durable(f, index, path, started))

    def _call(self, dcp: Any, state: dict[str, Any], path: Path) -> Any:
        def call() -> Any:
            return dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path),
                                  async_stager=self.stager)
        try:
            return call()
        except Exception as exc:
            if self.call_s:  # it worked before: a real failure
                raise
            self.process_group = init_gloo(f"{type(exc).__name__}: {exc}")
            return call()

    def _durable(self, future: Future[Any], index: int, path: Path, started: float) -> None:
        """On DCP's upload thread, once the save completed."""
        from m27.common.checkpoint_storage import fsync_dir

        try:
            future.result()
            fsync_dir(path)
            fsync_dir(self.root)
            self.durable_s[index] = time.perf_counter() - started
            self.new_bytes[index] = tree_bytes(path)
            if index >= 2:  # keep the last two checkpoints (disk space)
                shutil.rmtree(self.root / f"ckpt-{index - 2}", ignore_errors=True)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self._done.set()

    def before_step(self, *_: Any) -> None:
        """Optimizer pre-hook: the next step waits until the staging copy is done."""
        staging, self.staging = self.staging, None
        if staging is not None:
            started = time.perf_counter()
            staging.result()
            self.blocked_s[-1] += time.perf_counter() - started

    def wait(self) -> None:
        self._done.wait()

    def cached_bytes(self) -> int | None:
        """Bytes of the stager's reused staging copies (a private attribute: None if
        this torch has none)."""
        stager = getattr(self.stager, "_state_dict_stager", None)
        mapping = getattr(stager, "_cached_storage_mapping", None)
        if mapping is None:
            return None
        return int(sum(storage.nbytes() for storage in mapping.values()))

    def close(self) -> None:
        self.stager.close()


def init_gloo(why: str) -> str:
    """A single-process gloo group on loopback, for a DCP that insists on one."""
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    return f"gloo, 1 process (without one: {why})"


def case_dcp(size: str, mode: Mode, loop: str, compute_s: float, checkpoints: int,
             root: Path, baseline_steps: int) -> dict[str, Any]:
    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    except ImportError as exc:
        return {"unavailable": f"torch.distributed.checkpoint: {exc}"}
    model, optimizer, step = setup(size, mode.frozen, loop, compute_s)
    baseline = [step() for _ in range(baseline_steps)]
    rss_before = rss_bytes()
    peak_reset = reset_peak_rss()
    saver = DcpSaver(root / "dcp", mode.background_staging)
    hook = optimizer.register_step_pre_hook(saver.before_step)
    during: list[float] = []
    just_saved, deferred = False, 0
    try:
        while len(saver.call_s) < checkpoints:
            persisting = saver.busy
            seconds = step()
            if just_saved:  # this step holds the wait for the staging copy
                seconds -= saver.blocked_s[-1]
            if persisting:
                during.append(seconds)
            just_saved = False
            if saver.busy:
                deferred += 1
                continue
            if saver.errors:
                raise RuntimeError(saver.errors[0])
            saver.save(model, optimizer)
            just_saved = True
        step()  # (background staging) the last copy is waited for here
        saver.wait()
    except Exception as exc:
        return {"unavailable": f"DCP async_save failed: {type(exc).__name__}: {exc}",
                "process_group": saver.process_group}
    finally:
        hook.remove()
    peak = peak_rss_bytes()
    cached = saver.cached_bytes()
    saver.close()
    if saver.errors:
        return {"unavailable": f"DCP save failed: {saver.errors[0]}",
                "process_group": saver.process_group}
    latest = root / "dcp" / f"ckpt-{len(saver.call_s) - 1}"
    restore = restore_dcp(size, mode.frozen, latest)
    stalls = [c + b for c, b in zip(saver.call_s, saver.blocked_s, strict=True)]
    return {"stall_s": stalls, "call_s": saver.call_s, "blocked_s": saver.blocked_s,
            "durable_s": saver.durable_s, "new_bytes": saver.new_bytes,
            "deferred": deferred, "baseline_step_s": statistics.median(baseline),
            "persist_step_s": statistics.median(during) if during else None,
            "persist_steps": len(during), "host_buffer_bytes": cached,
            "peak_rss_growth_bytes": peak - rss_before if peak_reset else None,
            "state_bytes": state_bytes(model, optimizer), "restore_s": restore,
            "process_group": saver.process_group}


def restore_dcp(size: str, frozen: bool, path: Path) -> float:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model, optimizer = fresh_state(size, frozen)
    started = time.perf_counter()
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return time.perf_counter() - started


# ---------------------------------------------------------------------------- processes


def run_case(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    if args.measure:
        print(json.dumps({"compute_s": measure_compute(args.size)}))
        return
    root, mode = Path(args.root), MODES[args.mode]
    extra = json.loads(args.ckpt_kwargs)
    started = time.perf_counter()
    if mode.method == "torch":
        result = case_torch(args.size, mode, args.loop, args.compute_s, args.checkpoints, root)
    elif mode.method == "dcp":
        result = case_dcp(args.size, mode, args.loop, args.compute_s, args.checkpoints, root,
                          args.baseline_steps)
    else:
        result = case_m27(args.size, mode, args.loop, args.compute_s, args.checkpoints, root,
                          args.baseline_steps, extra)
    result["case_wall_s"] = time.perf_counter() - started
    print(json.dumps(result))


def spawn(extra_argv: list[str]) -> dict[str, Any]:
    """Run one case in a process of its own; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="m27-bench-ckpt-", dir=os.environ.get(
            "M27_BENCH_DIR")) as tmp:
        argv = [sys.executable, __file__, "--one", "--root", tmp, *extra_argv]
        out = subprocess.run(argv, check=False, capture_output=True, text=True)
        if out.returncode != 0:
            tail = out.stderr.strip().splitlines()[-8:]
            print("\n".join(tail), file=sys.stderr, flush=True)
            return {"error": f"exit {out.returncode}: {tail[-1] if tail else ''}"}
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result


def parse_ckpt_kwargs(raw: str) -> dict[str, Any]:
    """--ckpt-kwargs as a dict, checked against Checkpointer's signature."""
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--ckpt-kwargs is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise SystemExit("--ckpt-kwargs must be a JSON object, e.g. '{\"persist_threads\": 2}'")
    reserved = sorted(RESERVED_KWARGS & extra.keys())
    if reserved:
        raise SystemExit(f"--ckpt-kwargs: {', '.join(reserved)} is set by the modes "
                         "(use --modes memory,off,store)")
    from m27.train import Checkpointer

    parameters = inspect.signature(Checkpointer).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = sorted(set(extra) - set(parameters))
    if unknown and not takes_any:
        raise SystemExit(f"--ckpt-kwargs: Checkpointer takes no {', '.join(unknown)}; it takes "
                         f"{', '.join(n for n in parameters if n not in RESERVED_KWARGS)}")
    return extra


def library_default(name: str) -> Any:
    """The default of one of Checkpointer's arguments (imports torch)."""
    from m27.train import Checkpointer

    return inspect.signature(Checkpointer).parameters[name].default


def parse_modes(raw: str) -> list[str]:
    if raw == "all":
        default = library_default("delta_base")
        return [m for m in MODES if m not in DELTA_MODES or m != default]
    modes = [m.strip() for m in raw.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(MODES)}")
    return modes


# ---------------------------------------------------------------------------- output


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def reference(results: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """The torch.save row this row is compared with: same loop and size, same frozen-ness."""
    wanted = "torch-frozen" if MODES[row["mode"]].frozen else "torch"
    for other in results:
        if (other["loop"], other["size"], other["mode"]) == (row["loop"], row["size"], wanted):
            return other if "stall_s" in other else None
    return None


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"


def table_row(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
    label = MODES[row["mode"]].label
    if MODES[row["mode"]].method == "m27" and MODES[row["mode"]].delta_base is None:
        label += f" (delta_base={row.get('delta_base', '?')})"
    head = f"| {row['loop']} | {row['size']} | {label} |"
    if "error" in row or "unavailable" in row:
        why = row.get("error") or row.get("unavailable")
        return head + f" {why} |" + " |" * 10
    durable = [d for d in row["durable_s"] if d is not None]
    durable_median = statistics.median(durable) if durable else float("nan")
    failed = f" ({row['failed']} failed)" if row.get("failed") else ""
    vs_save = vs_load = "—"
    if ref is not None and ref is not row:
        vs_save = f"{durable_median / statistics.median(ref['durable_s']):.1f}×"
        vs_load = f"{row['restore_s'] / ref['restore_s']:.1f}×"
    slowdown = "—"
    if row.get("persist_step_s"):
        slowdown = (f"{row['persist_step_s'] * 1e3:.0f} vs {row['baseline_step_s'] * 1e3:.0f}"
                    f" ms ({row['persist_step_s'] / row['baseline_step_s'] - 1:+.0%})")
    later = row["new_bytes"][1:] or row["new_bytes"]
    memory = []
    if row.get("host_buffer_bytes") is not None:
        memory.append(f"{mib(row['host_buffer_bytes'])} "
                      f"({row['host_buffer_bytes'] / row['state_bytes']:.0%})")
    if row.get("peak_rss_growth_bytes") is not None:
        memory.append(f"peak +{mib(max(0, row['peak_rss_growth_bytes']))}")
    return (head + f" {ms(statistics.median(row['stall_s']))} | {ms(p(row['stall_s'], 0.95))} |"
            f" {durable_median:.2f} s{failed} | {vs_save} | {slowdown} |"
            f" {row['new_bytes'][0] / 2**20:.1f} → {statistics.median(later) / 2**20:.1f} MiB |"
            f" {'; '.join(memory) or '—'} | {row['restore_s']:.2f} s | {vs_load} |")


def summary(meta: dict[str, Any], compute: dict[str, float], results: list[dict[str, Any]]
            ) -> None:
    print(f"machine: {meta['machine']}, {meta['cpus']} cores, Python {meta['python']}, "
          f"torch {meta['torch']}; load average at start {meta['load_start']}, at end "
          f"{meta['load_end']}; {meta['wall_s']:.0f} s in all")
    if meta["ckpt_kwargs"]:
        print(f"m27 Checkpointer kwargs: {json.dumps(meta['ckpt_kwargs'])}")
    if compute:
        measured = ", ".join(f"{size} {seconds * 1e3:.0f} ms" for size, seconds in compute.items())
        print(f"gpu-like loop: forward+backward replaced by a sleep of {measured} "
              f"({meta['compute_source']})")
    groups = {r["process_group"] for r in results if r.get("process_group")}
    if groups:
        print(f"DCP process group: {'; '.join(sorted(groups))}")
    print("restore: warm page cache, in the process that saved")
    print()
    print("| loop | model | method | stall median | stall p95 | durable median | "
          "durable / torch.save+fsync | step while persisting vs without | "
          "bytes/ckpt (first → later) | host memory (% of state) | restore | "
          "restore / torch.load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results:
        print(table_row(row, reference(results, row)))


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", choices=[*LOOPS, "both"], default="both")
    parser.add_argument("--sizes", default="5M,50M,100M")
    parser.add_argument("--modes", "--cases", dest="modes", default="all",
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--baseline-steps", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="gpu-like loop: sleep this long instead of the measured "
                             "forward+backward time")
    parser.add_argument("--ckpt-kwargs", default="{}",
                        help="JSON object merged into every m27 Checkpointer's kwargs")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--compute-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_case(args)
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"--sizes: unknown {', '.join(unknown)}; known: {', '.join(SIZES)}")
    modes = parse_modes(args.modes)
    extra = parse_ckpt_kwargs(args.ckpt_kwargs)
    loops = list(LOOPS) if args.loop == "both" else [args.loop]
    began, load_start = time.monotonic(), load_average()

    compute: dict[str, float] = {}
    if "gpu-like" in loops:
        for size in sizes:
            if args.compute_ms is not None:
                compute[size] = args.compute_ms / 1e3
                continue
            measured = spawn(["--measure", "--size", size])
            if "error" in measured:
                raise SystemExit(f"measuring {size}'s forward+backward failed: "
                                 f"{measured['error']}")
            compute[size] = measured["compute_s"]
            print(f"gpu-like {size}: forward+backward {compute[size] * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)

    results: list[dict[str, Any]] = []
    for loop in loops:
        for size in sizes:
            for mode in modes:
                argv = ["--loop", loop, "--size", size, "--mode", mode,
                        "--checkpoints", str(args.checkpoints),
                        "--baseline-steps", str(args.baseline_steps),
                        "--compute-s", repr(compute.get(size, 0.0)),
                        "--ckpt-kwargs", json.dumps(extra)]
                result = {"loop": loop, "size": size, "mode": mode, **spawn(argv)}
                results.append(result)
                print(f"done: {loop} {size} {mode} ({result.get('case_wall_s', 0):.0f} s)",
                      file=sys.stderr, flush=True)

    import torch

    meta = {"machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "torch": torch.__version__,
            "load_start": load_start, "load_end": load_average(),
            "wall_s": time.monotonic() - began, "ckpt_kwargs": extra,
            "compute_source": "--compute-ms" if args.compute_ms is not None else
            "measured median of 10 steps, batch 64, on this machine's CPUs"}
    if args.json:
        print(json.dumps({"meta": meta, "compute_s": compute, "results": results}, indent=2))
        return
    summary(meta, compute, results)


if __name__ == "__main__":
    main()
