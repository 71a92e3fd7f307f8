"""Demo step 2 (GPU): train a small torch MLP on the spirals; checkpoint every epoch.

Runs on CUDA when the node has a real GPU; on a node with simulated GPUs it says so and
trains on the CPU. An interrupted run resumes from its last checkpoint in M27_CHECKPOINT_DIR.
It logs every batch's loss (`batch_loss`, which the pipeline's `monitor:` watches) and each
epoch's loss and accuracy; on its checkpoint signal (SIGUSR1, sent by the agent on request
or on a training anomaly) it saves after the current batch. `--spike-epoch N` makes the
first batch of epoch N take a step 300 times too large: a real loss spike.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rich.progress import track

import m27.train
from m27.demo._data import load

try:
    import torch
    from torch import nn
except ImportError:  # pragma: no cover - depends on the installation
    print("the demo's training step needs torch: pip install torch==2.13.0 (or 'm27[torch]')",
          file=sys.stderr)
    raise SystemExit(2) from None


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 2))


def pick_device() -> torch.device:
    backend = os.environ.get("M27_GPU_BACKEND", "")
    if torch.cuda.is_available():
        print(f"device: cuda ({torch.cuda.get_device_name(0)})")
        return torch.device("cuda")
    why = "the node's GPUs are simulated" if backend == "simulated" else "no CUDA device"
    print(f"device: cpu ({why}; M27_GPU_BACKEND={backend or 'unset'})")
    return torch.device("cpu")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temp file, fsync, rename: a crash never leaves half a checkpoint."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--out", type=Path, default=Path("model.pt"))
    parser.add_argument("--spike-epoch", type=int, default=0,
                        help="a learning-rate blunder at the start of this epoch (0: none)")
    args = parser.parse_args()
    asked = threading.Event()

    def on_checkpoint_signal(*_: object) -> None:
        asked.set()  # os.write: a print here could re-enter one the loop is in
        os.write(sys.stdout.fileno(), b"checkpoint asked for (SIGUSR1)\n")

    signal.signal(signal.SIGUSR1, on_checkpoint_signal)
    # Python puts back the default action (death) while it shuts down: ignore it by then
    atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)
    torch.manual_seed(args.seed)
    device = pick_device()
    features, labels = load(args.data, "train")
    x = torch.tensor(features, device=device)
    y = torch.tensor(labels, device=device)
    net = model().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    checkpoint = Path(os.environ.get("M27_CHECKPOINT_DIR", ".")) / "demo-train.pt"
    start, history = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["epoch"], state["history"]
        print(f"resumed from {checkpoint} after epoch {start}")
    # A bar on a terminal (run by hand); under m27 stdout is the step's log: plain lines.
    for epoch in track(range(start, args.epochs), description="training",
                       total=args.epochs - start, disable=not sys.stdout.isatty()):
        began = time.monotonic()
        loss_sum, correct = 0.0, 0
        batches = torch.randperm(len(y), device=device).split(64)
        for index, batch in enumerate(batches):
            blunder = epoch + 1 == args.spike_epoch and index == 0
            for group in optimizer.param_groups:
                group["lr"] = 3.0 if blunder else 0.01
            optimizer.zero_grad()
            logits = net(x[batch])
            loss = nn.functional.cross_entropy(logits, y[batch])
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(batch)
            correct += int((logits.argmax(1) == y[batch]).sum())
            m27.train.log(epoch * len(batches) + index, batch_loss=loss.item())
            if asked.is_set():  # the checkpoint signal: save now, not at the epoch's end
                asked.clear()
                save_checkpoint(checkpoint, {"model": net.state_dict(),
                                             "optimizer": optimizer.state_dict(),
                                             "epoch": epoch, "history": history})
                print(f"saved a checkpoint after batch {index + 1} of epoch {epoch + 1} "
                      f"(a resume repeats this epoch)", flush=True)
        record = {"epoch": epoch + 1, "loss": loss_sum / len(y), "accuracy": correct / len(y),
                  "seconds": time.monotonic() - began}
        history.append(record)
        print(f"epoch {epoch + 1}/{args.epochs}: loss {record['loss']:.4f} "
              f"accuracy {record['accuracy']:.3f}", flush=True)
        m27.train.log(epoch + 1, loss=record["loss"], accuracy=record["accuracy"])
        save_checkpoint(checkpoint, {"model": net.state_dict(),
                                     "optimizer": optimizer.state_dict(),
                                     "epoch": epoch + 1, "history": history})
    torch.save(net.state_dict(), args.out)
    Path("metrics.json").write_text(json.dumps({"history": history}, indent=2))
    print(f"saved {args.out} and metrics.json")


if __name__ == "__main__":
    main()
