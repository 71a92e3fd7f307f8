"""Checkpoint cost for the training loop: m27.train's Checkpointer against torch.save +
fsync of the same state to the same disk.

Models of ~5M, ~50M and ~100M parameters (stacks of Linear 4d / GELU / Linear / LayerNorm
blocks) trained with AdamW on random batches. Each case runs in its own process (so
memory figures are its own), checkpointing after every step for --checkpoints
checkpoints: with m27 a save that comes due while the previous one is persisting waits
for it, so persistence runs back to back — the worst case for the steps that overlap it.

Per case: training-loop stall per checkpoint (m27: time in after_step + time the next
optimizer step waited for the snapshot copy; torch.save: the whole save + fsync), time
until durable, step time while a checkpoint persists against steps without checkpoints,
extra host memory (snapshot buffers; RSS growth), bytes stored per checkpoint (dense
training, and a model with all but its last block frozen), restore time (warm page cache).

    python bench/checkpoint_stall.py [--sizes 5M,50M,100M] [--checkpoints 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {"5M": (256, 9), "50M": (768, 10), "100M": (1024, 12)}  # width, blocks
BATCH = 64


def model_for(size: str) -> Any:
    import torch

    width, blocks = SIZES[size]
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def setup(size: str, frozen: bool) -> tuple[Any, Any, Any]:
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

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return time.perf_counter() - started

    for _ in range(3):  # warm-up; creates the optimizer state
        step()
    return model, optimizer, step


def state_bytes(model: Any, optimizer: Any) -> int:
    import torch

    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor))
    return int(total)


def case_m27(size: str, frozen: bool, delta_base: str, checkpoints: int, root: Path,
             baseline_steps: int) -> dict[str, Any]:
    from m27.common.checkpoint_storage import LocalStore
    from m27.train import Checkpointer, Cursor

    model, optimizer, step = setup(size, frozen)
    baseline = [step() for _ in range(baseline_steps)]
    rss_before = rss_bytes()
    store = LocalStore(root / "m27")
    ckpt = Checkpointer(model=model, optimizer=optimizer, store=store, every_steps=1,
                        delta_base=delta_base, signal=False,  # type: ignore[arg-type]
                        environ={"M27_CONFIG": str(root / "none")})
    cursor, during, just_saved = Cursor(), [], False
    while ckpt.counters.started < checkpoints:
        persisting = ckpt.counters.started > ckpt.counters.committed + ckpt.counters.failed
        seconds = step()
        if persisting and not just_saved:  # the step after a save holds its stall
            during.append(seconds)
        cursor.advance()
        just_saved = ckpt.after_step(cursor)
    step()  # the last snapshot's copy is waited for here
    ckpt.flush()
    rss_after = rss_bytes()
    reports = list(ckpt.reports)
    buffers = ckpt.host_buffer_bytes
    ckpt.close()
    restore = restore_m27(size, frozen, store, root)
    return {
        "stall_s": [r.stall_s for r in reports], "capture_s": [r.capture_s for r in reports],
        "blocked_s": [r.blocked_s for r in reports],
        "durable_s": [r.durable_s for r in reports], "new_bytes": [r.new_bytes for r in reports],
        "size_bytes": reports[-1].size_bytes, "deferred": ckpt.counters.deferred,
        "baseline_step_s": statistics.median(baseline),
        "persist_step_s": statistics.median(during) if during else None,
        "persist_steps": len(during), "host_buffer_bytes": buffers,
        "rss_growth_bytes": rss_after - rss_before, "rss_before_bytes": rss_before,
        "state_bytes": state_bytes(model, optimizer), "restore_s": restore,
        "stored_bytes": sum(f.stat().st_size for f in (root / "m27").rglob("*") if f.is_file()),
    }


def restore_m27(size: str, frozen: bool, store: Any, root: Path) -> float:
    from m27.train import Checkpointer

    model, optimizer, _ = setup(size, frozen)
    ckpt = Checkpointer(model=model, optimizer=optimizer, store=store, signal=False,
                        environ={"M27_CONFIG": str(root / "none")})
    started = time.perf_counter()
    ckpt.resume()
    elapsed = time.perf_counter() - started
    ckpt.close()
    return elapsed


def case_torch(size: str, frozen: bool, checkpoints: int, root: Path) -> dict[str, Any]:
    import torch

    model, optimizer, step = setup(size, frozen)
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
    fresh, fresh_opt, _ = setup(size, frozen)
    started = time.perf_counter()
    state = torch.load(path, weights_only=True)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    return {"stall_s": stalls, "durable_s": stalls, "new_bytes": sizes,
            "restore_s": time.perf_counter() - started}


def run_case(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    root = Path(args.root)
    if args.case == "torch":
        result = case_torch(args.size, args.frozen, args.checkpoints, root)
    else:
        result = case_m27(args.size, args.frozen, args.case, args.checkpoints, root,
                          args.baseline_steps)
    print(json.dumps(result))


def spawn(size: str, case: str, frozen: bool, checkpoints: int, baseline: int) -> Any:
    with tempfile.TemporaryDirectory(prefix="m27-bench-ckpt-", dir=os.environ.get(
            "M27_BENCH_DIR")) as tmp:
        argv = [sys.executable, __file__, "--one", "--size", size, "--case", case,
                "--checkpoints", str(checkpoints), "--root", tmp,
                "--baseline-steps", str(baseline)]
        if frozen:
            argv.append("--frozen")
        out = subprocess.run(argv, check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(results: dict[str, Any]) -> None:
    print("| model | method | stall median | stall p95 | durable median | "
          "step while persisting | bytes/ckpt (first → later) | host memory | restore |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        later = r["new_bytes"][1:] or r["new_bytes"]
        slowdown = "—"
        if r.get("persist_step_s"):
            slowdown = (f"{r['persist_step_s'] * 1e3:.0f} ms vs {r['baseline_step_s'] * 1e3:.0f}"
                        f" ms ({r['persist_step_s'] / r['baseline_step_s'] - 1:+.0%})")
        memory = "—"
        if "host_buffer_bytes" in r:
            memory = (f"{r['host_buffer_bytes'] / 2**20:.0f} MiB "
                      f"({r['host_buffer_bytes'] / r['state_bytes']:.0%} of state)")
        print(f"| {key} | {statistics.median(r['stall_s']) * 1e3:.2f} ms | "
              f"{p(r['stall_s'], 0.95) * 1e3:.2f} ms | "
              f"{statistics.median(r['durable_s']):.2f} s | {slowdown} | "
              f"{r['new_bytes'][0] / 2**20:.1f} → {statistics.median(later) / 2**20:.1f} MiB | "
              f"{memory} | {r['restore_s']:.2f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="5M,50M,100M")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--baseline-steps", type=int, default=8)
    parser.add_argument("--cases", default="memory,off,frozen,torch,torch-frozen")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--frozen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_case(args)
        return
    results: dict[str, Any] = {}
    for size in args.sizes.split(","):
        for case in args.cases.split(","):
            method = {"memory": ("memory", False), "off": ("off", False),
                      "frozen": ("memory", True), "torch": ("torch", False),
                      "torch-frozen": ("torch", True)}[case]
            label = f"{size} | " + {
                "memory": "m27 (XOR deltas, default)", "off": "m27 (no deltas)",
                "frozen": "m27, mostly frozen", "torch": "torch.save + fsync",
                "torch-frozen": "torch.save + fsync, mostly frozen"}[case]
            results[label] = spawn(size, method[0], method[1], args.checkpoints,
                                   args.baseline_steps)
            print(f"done: {label}", file=sys.stderr, flush=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0]}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(meta)
    summary(results)


if __name__ == "__main__":
    main()
