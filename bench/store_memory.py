"""The checkpoint-store's memory under the soak's kind of traffic, alone and fast.

The one-hour soak (bench/load.py) saw the checkpoint-store's RSS grow ~20 MiB/h at ~4
checkpoint uploads a second. This reproduces that traffic without the rest of m27, faster:
nats-server, the four services (no node-agent) and `--workers` threads that upload a
step's checkpoint files the way a node-agent does (`_checkpoint_files.upload`: GetManifest,
MissingChunks, PutChunks, Commit, retention retiring the previous one), each task getting
a few uploads before the next task (a new run) takes its place. It samples the store's RSS
and where it lives (`/proc/PID/smaps`: the brk heap, anonymous mappings, the rest).

Variants, to tell the causes apart:
  --channel per-upload   a new gRPC channel for every upload, closed after it, as the
                         agent does (the default); `shared`: one channel per worker
  --gc-interval S        the store's garbage collection every S seconds (0: never)
  --quiet-after S        uploads stop after S seconds, GC rounds go on
  --finished-runs        each task's run is recorded as ended after its uploads (a record
                         in m27_runs, as the orchestrator writes it), so that
                         `[checkpoint] keep_finished` (--env M27_CHECKPOINT_KEEP_FINISHED=…)
                         removes its checkpoints; without it the store keeps everything
  --env NAME=VALUE       extra environment for the services (MALLOC_ARENA_MAX=2, ...)

    python bench/store_memory.py --duration 600 --workers 4 [--channel shared] [--out m.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from load import memory_mib, say, trend_per_hour

from m27.client.checkpoints import RemoteStore
from m27.common import subjects
from m27.common.api_auth import ApiAccess
from m27.common.bus import NatsBus
from m27.common.model import RunRecord
from m27.node_agent import _checkpoint_files
from m27.orchestrator.runs import StoredRun

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import Cluster  # the same helper the tests use

T = TypeVar("T")


def smaps_mib(pid: int) -> dict[str, float]:
    """Resident MiB by kind of mapping: `heap` (brk), `anon` (anonymous mmaps: allocator
    arenas, Python's obmalloc arenas, thread stacks), `file` (libraries, mapped files)."""
    resident: dict[str, float] = {"heap": 0.0, "anon": 0.0, "file": 0.0}
    kind = "file"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and len(head) >= 5:  # a mapping's first line
            name = head[5] if len(head) > 5 else ""
            kind = "heap" if name == "[heap]" else "anon" if not name or name.startswith(
                "[anon") else "file"
        elif head[0] == "Rss:":
            resident[kind] += int(head[1]) / 1024
    return resident


class Uploads:
    """Worker threads uploading checkpoint files as a node-agent does."""

    def __init__(self, address: str, access: ApiAccess, root: Path, *, workers: int,
                 per_task: int, file_bytes: int, shared_channel: bool,
                 ended: Callable[[str], None] | None) -> None:
        self.address, self.access, self.root = address, access, root
        self.workers, self.per_task, self.file_bytes = workers, per_task, file_bytes
        self.shared_channel = shared_channel
        self.ended = ended
        self.count = 0
        self.failed = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def run(self, worker: int) -> None:
        task = 0
        shared = RemoteStore(self.address, task_id="", access=self.access) \
            if self.shared_channel else None
        directory = self.root / f"w{worker}"
        directory.mkdir(parents=True)
        while not self.stop.is_set():
            task += 1
            run_id = f"r-20261207-{worker:06d}-{task % 0xffffff:06x}"
            task_id = f"{run_id}/train"
            for n in range(self.per_task):
                (directory / "state").write_bytes(os.urandom(self.file_bytes // 2) +
                                                  bytes(self.file_bytes // 2) + bytes([n]))
                sink = shared or RemoteStore(self.address, task_id=task_id, access=self.access)
                sink.task_id, sink.attempt = task_id, 0
                try:
                    _checkpoint_files.upload(sink, task_id, 0, directory, level=3,
                                             max_bytes=1 << 30, now=time.time())
                except Exception as exc:
                    with self._lock:
                        self.failed += 1
                    say(f"worker {worker}: upload failed: {exc}")
                finally:
                    if sink is not shared:
                        sink.close()
                with self._lock:
                    self.count += 1
            if self.ended is not None:
                self.ended(run_id)
        if shared is not None:
            shared.close()


class RunRecorder:
    """Writes a finished run's record into m27_runs, as the orchestrator stores it, from
    any thread (its own event loop and NATS connection)."""

    def __init__(self, nats_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus = self._wait(NatsBus.open(nats_url, name="bench-store-memory"))

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)

    def ended(self, run_id: str) -> None:
        now = time.time()
        record = RunRecord(run_id=run_id, name="bench", user="bench", urgency="normal",
                           state="succeeded", created_at=now, steps=(), ended_at=now)
        self._wait(self.bus.kv_put(subjects.RUNS_BUCKET, run_id, StoredRun(run=record)))

    def close(self) -> None:
        self._wait(self.bus.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    env = {"M27_CHECKPOINT_GC_INTERVAL": f"{args.gc_interval}s",
           **dict(pair.split("=", 1) for pair in args.env)}
    cluster = Cluster(root, nodes=0, env=env)
    cluster.start()
    recorder = RunRecorder(cluster.nats_url) if args.finished_runs else None
    try:
        store = cluster.processes["checkpoint-store"]
        uploads = Uploads(store.grpc_address, cluster.access, root / "files",
                          workers=args.workers, per_task=args.per_task,
                          file_bytes=args.file_kib * 1024,
                          shared_channel=args.channel == "shared",
                          ended=recorder.ended if recorder else None)
        threads = [threading.Thread(target=uploads.run, args=(i,), daemon=True)
                   for i in range(args.workers)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        samples: list[dict[str, Any]] = []
        while True:
            now = time.monotonic() - began
            rss, _, _ = memory_mib(store.pid)
            samples.append({"t": now, "uploads": uploads.count, "rss_mib": rss,
                            **smaps_mib(store.pid)})
            say(f"t={now:5.0f}s uploads {uploads.count:6d} rss {rss:6.1f} MiB "
                + " ".join(f"{k} {samples[-1][k]:.1f}" for k in ("heap", "anon", "file")))
            if now >= args.duration:
                break
            if args.quiet_after is not None and now >= args.quiet_after:
                uploads.stop.set()  # GC rounds go on over a fixed set of keys and files
            time.sleep(min(args.sample_every, args.duration - now + 0.01))
        uploads.stop.set()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        if recorder is not None:
            recorder.close()
        cluster.stop()
    return summary(args, samples, uploads.failed)


def summary(args: argparse.Namespace, samples: Sequence[Mapping[str, Any]],
            failed: int) -> dict[str, Any]:
    kept = [s for s in samples if s["t"] >= args.warmup]
    per_upload = {}
    if len(kept) >= 2 and kept[-1]["uploads"] > kept[0]["uploads"]:
        done = kept[-1]["uploads"] - kept[0]["uploads"]
        per_upload = {k: (kept[-1][k] - kept[0][k]) * 1024 / done
                      for k in ("rss_mib", "heap", "anon", "file")}
    elapsed = samples[-1]["t"] - samples[0]["t"] if len(samples) > 1 else 0.0
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": platform.platform(), "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "uploads": samples[-1]["uploads"], "failed": failed,
            "uploads_per_s": samples[-1]["uploads"] / elapsed if elapsed else 0.0,
            "trend_mib_per_h": {k: trend_per_hour([(s["t"], s[k]) for s in kept])
                                for k in ("rss_mib", "heap", "anon", "file")},
            "kib_per_upload_after_warmup": per_upload, "samples": list(samples)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds (600)")
    parser.add_argument("--workers", type=int, default=4, help="upload threads (4)")
    parser.add_argument("--per-task", type=int, default=3,
                        help="uploads of one task before a new one (3, as the soak's steps)")
    parser.add_argument("--file-kib", type=int, default=4, help="the file's size (4 KiB)")
    parser.add_argument("--channel", choices=("per-upload", "shared"), default="per-upload")
    parser.add_argument("--gc-interval", type=float, default=600.0,
                        help="the store's GC interval in seconds (600, the default; 0: none)")
    parser.add_argument("--quiet-after", type=float, metavar="S",
                        help="stop uploading after S seconds; GC rounds go on over what is "
                        "stored (a leak per round grows; a high-water mark does not)")
    parser.add_argument("--finished-runs", action="store_true",
                        help="record each task's run as ended after its uploads")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the services")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="samples before this are left out of the trend (s)")
    parser.add_argument("--out", type=Path, help="write the result as JSON")
    args = parser.parse_args(argv)
    if bad := [pair for pair in args.env if "=" not in pair]:
        parser.error(f"--env takes NAME=VALUE, got {bad[0]!r}")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="m27-store-memory-") as tmp:
        result = run(args, Path(tmp))
    shown = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(shown, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
