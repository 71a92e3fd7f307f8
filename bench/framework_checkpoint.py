"""Checkpoint cost inside PyTorch Lightning and the Hugging Face Trainer: m27's callbacks
(`m27.train.lightning.M27Checkpoint`, `m27.train.huggingface.M27Callback`) against each
framework's own checkpointing at the same cadence, in the same run, to the same disk.

A stack of Linear/GELU/Linear/LayerNorm blocks (bench/checkpoint_stall.py's sizes) is
trained with AdamW on random batches for `--warmup` steps and then `--checkpoints` ×
`--every` steps, checkpointing every `--every` optimizer steps. Two loops (as in
bench/checkpoint_stall.py): `gpu-like` — forward+backward is a sleep of the time it was
measured to take and every gradient is a preallocated random tensor, so the host is idle
as while a GPU computes and the AdamW step still changes every tensor; `cpu` — real
forward, backward and step on the CPU. No GPU is used (none was available).

Methods per framework: `none` (no checkpoints: the baseline), `m27` (the callback, its
defaults), `native` (Lightning's ModelCheckpoint(every_n_train_steps) / the Trainer's
save_strategy="steps", each keeping the latest only, as is common), `native+fsync` (the
same, with the files fsynced after each save: neither framework fsyncs, so `native` is not
durable when it returns). Each case runs in a process of its own.

Figures: stall — what the loop lost per checkpoint (m27: the Checkpointer's stall, its
capture including the framework's own checkpoint dict, plus the next optimizer step's
wait for the snapshot copy; native: the whole save call); durable — m27: until the
manifest is committed; native+fsync: the save; added per checkpoint — (the run's time −
the same run without checkpoints) ÷ checkpoints, which includes persistence competing
with training.

    .venv/bin/python bench/framework_checkpoint.py --frameworks lightning,huggingface \\
        --sizes 5M,50M --loop gpu-like --checkpoints 6 --every 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint_stall import BATCH, SIZES, measure_compute, model_for

FRAMEWORKS = ("lightning", "huggingface")
METHODS = ("none", "m27", "native", "native+fsync")


def fsync_tree(path: Path) -> None:
    """fsync every file under `path` (or `path` itself) and the folders holding them."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for folder in {f.parent for f in files}:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Loop:
    """What one step does: real forward+backward, or a sleep and preset gradients."""

    def __init__(self, model: Any, kind: str, compute_s: float) -> None:
        import torch

        self.model, self.kind, self.compute_s = model, kind, compute_s
        self.grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()] \
            if kind == "gpu-like" else []

    def loss(self, x: Any) -> Any:
        import torch

        if self.kind == "cpu":
            return self.model(x).pow(2).mean()
        time.sleep(self.compute_s)
        self.set_grads()
        return torch.zeros((), requires_grad=True)  # backward of it leaves the grads as set

    def set_grads(self) -> None:
        """(Lightning zeroes the gradients between training_step and backward: it calls
        this again just before the optimizer step.)"""
        for parameter, grad in zip(self.model.parameters(), self.grads, strict=True):
            parameter.grad = grad


def batches(size: str, count: int) -> Any:
    import torch

    width, _ = SIZES[size]
    return torch.utils.data.TensorDataset(torch.randn(count * BATCH, width))


def timed(record: list[float], call: Callable[..., Any], after: Callable[[], None] | None
          ) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = call(*args, **kwargs)
        if after is not None:
            after()
        record.append(time.perf_counter() - started)
        return result
    return wrapper


def case_lightning(size: str, method: str, loop_kind: str, compute_s: float, steps: int,
                   every: int, root: Path) -> dict[str, Any]:
    import pytorch_lightning as pl
    import torch

    from m27.train.lightning import M27Checkpoint

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_for(size)
            self.loop = Loop(self.net, loop_kind, compute_s)

        def training_step(self, batch: Any, index: int) -> Any:
            return self.loop.loss(batch[0])

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if self.loop.grads:
                self.loop.set_grads()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    saves: list[float] = []
    callbacks: list[Any] = []
    m27 = M27Checkpoint(every_steps=every, store=root / "store", signal=False) \
        if method == "m27" else None
    if m27 is not None:
        callbacks.append(m27)
    if method.startswith("native"):
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt",
                                                      every_n_train_steps=every))

    kept: list[Any] = []

    class Timer(pl.Callback):
        def setup(self, trainer: Any, module: Any, stage: str) -> None:
            fsync = (lambda: fsync_tree(root / "ckpt")) if method == "native+fsync" else None
            trainer.save_checkpoint = timed(saves, trainer.save_checkpoint, fsync)

        def on_train_end(self, trainer: Any, module: Any) -> None:  # before m27 closes
            if m27 is not None and m27.checkpointer is not None:
                m27.checkpointer.flush()
                kept.extend(m27.checkpointer.reports)

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=method.startswith("native"),
                         callbacks=[Timer(), *callbacks], default_root_dir=root)
    loader = torch.utils.data.DataLoader(batches(size, steps), batch_size=BATCH)
    started = time.perf_counter()
    trainer.fit(Module(), loader)
    total = time.perf_counter() - started
    return _result(total, saves, kept, method)


def case_huggingface(size: str, method: str, loop_kind: str, compute_s: float, steps: int,
                     every: int, root: Path) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    from m27.train.huggingface import M27Callback

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_for(size)
            self.loop = Loop(self.net, loop_kind, compute_s)

        def forward(self, x: Any) -> dict[str, Any]:
            return {"loss": self.loop.loss(x)}

    data = [{"x": row[0]} for row in batches(size, steps)]
    args = TrainingArguments(
        output_dir=str(root / "ckpt"), per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=1e-4, save_strategy="steps" if method.startswith("native") else "no",
        save_steps=every, save_total_limit=1, logging_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False, optim="adamw_torch")
    m27 = M27Callback(every_steps=every, store=root / "store", signal=False) \
        if method == "m27" else None
    kept: list[Any] = []

    class Keep(transformers.TrainerCallback):
        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            if m27 is not None and m27.checkpointer is not None:
                m27.checkpointer.flush()
                kept.extend(m27.checkpointer.reports)

    trainer = Trainer(model=Module(), args=args, train_dataset=data,
                      callbacks=[Keep(), *([m27] if m27 else [])])
    saves: list[float] = []
    fsync = (lambda: fsync_tree(root / "ckpt")) if method == "native+fsync" else None
    trainer._save_checkpoint = timed(saves, trainer._save_checkpoint, fsync)  # type: ignore[method-assign]
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    return _result(total, saves, kept, method)


def _result(total: float, saves: list[float], reports: list[Any], method: str
            ) -> dict[str, Any]:
    if method == "m27":
        stalls = [r.stall_s for r in reports]
        durable = [r.durable_s for r in reports if r.durable_s is not None]
    else:
        stalls, durable = saves, saves if method == "native+fsync" else []
    return {"total_s": total, "stalls": stalls, "durable": durable, "count": len(stalls)}


def one(args: argparse.Namespace) -> None:
    steps = args.warmup + args.checkpoints * args.every
    case = case_lightning if args.framework == "lightning" else case_huggingface
    result = case(args.size, args.method, args.loop, args.compute_s, steps, args.every,
                  Path(args.root))
    print(json.dumps(result))


def spawn(argv: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="m27-bench-fw-",
                                     dir=os.environ.get("M27_BENCH_DIR")) as tmp:
        out = subprocess.run([sys.executable, __file__, "--one", "--root", tmp, *argv],
                             check=False, capture_output=True, text=True)
        if out.returncode != 0:
            tail = out.stderr.strip().splitlines()[-6:]
            print("\n".join(tail), file=sys.stderr, flush=True)
            return {"error": f"exit {out.returncode}"}
        result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return result


def ms(values: list[float], q: float) -> str:
    """The median (q = 0.5) or the nearest-rank q-quantile, readable."""
    if not values:
        return "—"
    ordered = sorted(values)
    value = statistics.median(ordered) if q == 0.5 else \
        ordered[min(len(ordered) - 1, max(0, -(-int(q * 100) * len(ordered) // 100) - 1))]
    return f"{value * 1000:.2f} ms" if value < 1 else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", default="lightning,huggingface")
    parser.add_argument("--sizes", default="5M,50M")
    parser.add_argument("--loop", choices=("gpu-like", "cpu"), default="gpu-like")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--framework", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--compute-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one(args)
        return
    frameworks = [f for f in args.frameworks.split(",") if f]
    methods = [m for m in args.methods.split(",") if m]
    for name, values, known in (("--frameworks", frameworks, FRAMEWORKS),
                                ("--methods", methods, METHODS),
                                ("--sizes", args.sizes.split(","), tuple(SIZES))):
        unknown = sorted(set(values) - set(known))
        if unknown:
            parser.error(f"{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    print("no GPU: both loops run on the CPU (gpu-like: forward+backward is a sleep)",
          flush=True)
    print("| framework | loop | model | method | stall median | stall p95 | durable median "
          "| added per checkpoint |\n|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for size in args.sizes.split(","):
        compute = measure_compute(size) if args.loop == "gpu-like" else 0.0
        for framework in frameworks:
            baseline: float | None = None
            for method in methods:
                result = spawn(["--framework", framework, "--size", size, "--method", method,
                                "--loop", args.loop, "--compute-s", str(compute),
                                "--checkpoints", str(args.checkpoints),
                                "--every", str(args.every), "--warmup", str(args.warmup)])
                rows.append({"framework": framework, "size": size, "method": method,
                             "loop": args.loop, "compute_s": compute, **result})
                if "error" in result:
                    print(f"| {framework} | {args.loop} | {size} | {method} | "
                          f"{result['error']} | | | |", flush=True)
                    continue
                if method == "none":
                    baseline = result["total_s"]
                added = "—" if baseline is None or method == "none" or not result["count"] \
                    else f"{(result['total_s'] - baseline) / result['count'] * 1000:.0f} ms"
                print(f"| {framework} | {args.loop} | {size} | {method} "
                      f"| {ms(result['stalls'], 0.5)} | {ms(result['stalls'], 0.95)} "
                      f"| {ms(result['durable'], 0.5)} | {added} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
