"""The work a chaos schedule runs: step programs that leave their own records, and the
pipelines that run them.

Every program imports `chaosmark.py` (written next to it) and appends, to
`markers/<step>.log` in its run's working directory, one line per event:

    <event> <attempt> <pid> <node> <wall time> [<value>]

`launch` (first thing the program does), `start` (value: the progress it resumes from),
`tick` (value: the progress just made,
written after it is made), `end`. Its *effect* — what a step is for, and what must happen
exactly once per success — is one line appended to `effects/<step>.log` right before a
successful exit: `<attempt> <pid> <wall time>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import msgspec

MARK: Final = '''\
import os, time
from pathlib import Path
ATTEMPT = os.environ.get("M27_ATTEMPT", "0")
NODE = os.environ.get("M27_NODE_ID", "local")
STEP = os.environ.get("M27_TASK_ID", "local/" + os.environ.get("CHAOS_STEP", "local")
                      ).split("/", 1)[1]
def _append(folder, line):
    Path(folder).mkdir(exist_ok=True)
    with open(f"{folder}/{STEP}.log", "a") as out:
        out.write(line + "\\n")
        out.flush()
        os.fsync(out.fileno())
def mark(event, value=""):
    _append("markers", f"{event} {ATTEMPT} {os.getpid()} {NODE} {time.time():.3f} {value}")
def effect():
    _append("effects", f"{ATTEMPT} {os.getpid()} {time.time():.3f}")
mark("launch")  # at import, before anything slow (torch): the process is alive from here
'''

#: A step without a checkpoint: ticks for SECONDS, then its effect.
WORK: Final = '''\
import sys, time
from chaosmark import effect, mark
mark("start", 0)
ticks = round(float(sys.argv[1]) / 0.1)
for i in range(ticks):
    time.sleep(0.1)
    mark("tick", i + 1)
effect()
mark("end")
'''

#: Preemptible background work: saves its count in its working directory after every
#: tick (so nothing but the tick in progress is lost), and on SIGTERM exits 143 at once.
COUNTER: Final = '''\
import os, pathlib, signal, sys, time
from chaosmark import effect, mark
state = pathlib.Path("counter.state")
i = int(state.read_text()) if state.exists() else 0
mark("start", i)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
while i < int(sys.argv[1]):
    time.sleep(0.1)
    i += 1
    tmp = state.with_suffix(".tmp")
    tmp.write_text(str(i))
    os.replace(tmp, state)
    mark("tick", i)
effect()
mark("end")
'''

#: A program that manages its own checkpoint file in M27_CHECKPOINT_DIR; its agent
#: uploads the directory to the checkpoint-store every `checkpoint:` interval.
FILES: Final = '''\
import json, os, pathlib, sys, time
from chaosmark import effect, mark
state = pathlib.Path(os.environ.get("M27_CHECKPOINT_DIR", "ckpt")) / "state.json"
state.parent.mkdir(parents=True, exist_ok=True)
i = json.loads(state.read_text())["i"] if state.exists() else 0
mark("start", i)
while i < int(sys.argv[1]):
    time.sleep(0.1)
    i += 1
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps({"i": i}))
    os.replace(tmp, state)
    mark("tick", i)
effect()
mark("end")
'''

#: Deterministic training with m27.train (CPU torch): checkpoints every TRAIN_EVERY steps
#: (to the checkpoint-store its agent names), writes the sha256 of its final parameters
#: and optimizer state to final.sha256. Run alone, it gives the fault-free digest.
TRAIN_EVERY: Final = 10
TRAIN_STEPS: Final = 120
TRAIN: Final = '''\
import hashlib, pathlib, sys, time
from chaosmark import effect, mark
import torch
from m27.train import Checkpointer, Cursor

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
target = data.sum(1, keepdim=True)
ckpt = Checkpointer(model=model, optimizer=optimizer, every_steps=EVERY)
cursor = ckpt.resume() or Cursor()
mark("start", cursor.step)
while cursor.step < int(sys.argv[1]):
    batch = torch.randint(0, 64, (16,))
    optimizer.zero_grad()
    ((model(data[batch]) - target[batch]) ** 2).mean().backward()
    optimizer.step()
    cursor.advance()
    ckpt.after_step(cursor)
    mark("tick", cursor.step)
    time.sleep(0.1)
ckpt.close()
digest = hashlib.sha256()
state = [*model.state_dict().values()]
state += [v for s in optimizer.state_dict()["state"].values() for v in s.values()]
for tensor in state:
    digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
pathlib.Path("final.sha256").write_text(digest.hexdigest())
effect()
mark("end")
'''.replace("EVERY", str(TRAIN_EVERY))

PROGRAMS: Final = {"chaosmark.py": MARK, "work.py": WORK, "counter.py": COUNTER,
                   "files.py": FILES, "train.py": TRAIN}
#: Infrastructure failures a step may survive: a schedule kills many nodes.
RETRIES: Final = "retries: {infrastructure: 20}"


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One pipeline the harness submits, in a working directory of its own."""

    label: str
    pipeline: str
    #: step → its checkpoint interval in seconds (None: it has no checkpoint), for the
    #: lost-work check; steps not named here have none.
    checkpointed: dict[str, float] = msgspec.field(default_factory=dict)
    #: the steps whose final.sha256 must equal the fault-free run's
    trains: tuple[str, ...] = ()
    #: submit this many seconds after the start (0: at once)
    after_s: float = 0.0


def py(program: str, *args: object) -> str:
    return "'\"$M27_PYTHON\" " + " ".join([program, *map(str, args)]) + "'"


def jobs(wave: int = 0, after_s: float = 0.0) -> list[Job]:
    """One wave of work: shell steps with a sweep, a training step, a program-managed
    checkpoint file, preemptible background work, and (6 s later) an urgent step, which
    preempts the background work when every GPU is taken."""
    shell = ("pipeline:\n"
             f"  - {{name: a, command: {py('work.py', 1)}, {RETRIES}}}\n"
             "  - name: sweep\n    depends_on: [a]\n    matrix: {i: [1, 2, 3, 4]}\n"
             f"    max_parallel: 2\n    {RETRIES}\n"
             f"    command: {py('work.py', 1.5)}\n"
             f"  - {{name: b, depends_on: [sweep], command: {py('work.py', 1)}, {RETRIES}}}\n")
    train = ("priority: high\npreemptible: true\npipeline:\n"
             f"  - {{name: train, type: gpu, command: {py('train.py', TRAIN_STEPS)}, "
             f"{RETRIES}}}\n")
    files = ("pipeline:\n  - {name: files, type: gpu, checkpoint: 1s, checkpoint_signal: none,"
             f" command: {py('files.py', 100)}, {RETRIES}}}\n")
    background = ("priority: low\npreemptible: true\npipeline:\n"
                  f"  - {{name: bg, type: gpu, command: {py('counter.py', 120)}, "
                  f"{RETRIES}}}\n")
    urgent = ("priority: urgent\npipeline:\n"
              f"  - {{name: urgent, type: gpu, command: {py('work.py', 2)}, {RETRIES}}}\n")
    w = f"w{wave}-"
    return [Job(label=w + "shell", pipeline=shell, after_s=after_s),
            Job(label=w + "train", pipeline=train, trains=("train",), after_s=after_s,
                checkpointed={"train": TRAIN_EVERY * 0.1}),
            Job(label=w + "files", pipeline=files, checkpointed={"files": 1.0},
                after_s=after_s),
            Job(label=w + "bg", pipeline=background, checkpointed={"bg": 0.1},
                after_s=after_s),
            Job(label=w + "urgent", pipeline=urgent, after_s=after_s + 6.0)]


def write_programs(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for name, text in PROGRAMS.items():
        (workdir / name).write_text(text)
