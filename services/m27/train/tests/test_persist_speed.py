"""How the persister spends its time: which chunks it compresses, how it shares the CPU,
how deep a restore's delta chains go (the design behind docs/benchmarks.md's figures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.common.checkpoint_format import chain_depth
from m27.common.checkpoint_storage import LocalStore
from m27.train import Checkpointer, CheckpointError, Cursor
from m27.train._crew import Crew, WorkList, paced_workers, rest_before_next
from m27.train._policy import compression_pays


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"M27_CONFIG": str(tmp_path / "no-config")}


class Loop:
    def __init__(self, store: LocalStore, env: dict[str, str], *, zeros: bool = False,
                 **options: Any) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.Linear(8192, 8))
        if zeros:  # compressible state: every parameter stays zero (lr 0)
            for p in self.model.parameters():
                torch.nn.init.zeros_(p)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0 if zeros else 1e-3,
                                         momentum=0.9)
        self.ckpt = Checkpointer(model=self.model, optimizer=self.optimizer, store=store,
                                 signal=False, stop_signal=False, environ=env,
                                 every_steps=1, **options)
        self.cursor = Cursor()

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.optimizer.zero_grad()
            self.model(torch.randn(4, 64)).pow(2).mean().backward()
            self.optimizer.step()
            self.cursor.advance()
            self.ckpt.after_step(self.cursor)
            self.ckpt.flush()


@pytest.fixture
def loops() -> Iterator[list[Loop]]:
    made: list[Loop] = []
    yield made
    for loop in made:
        loop.ckpt.close()


def codecs(store: LocalStore) -> set[str]:
    return {c.codec for m in store.list("local") for e in m.entries if e.kind == "tensor"
            for c in e.chunks}


def test_dense_float_state_is_written_raw_to_a_local_disk(
        tmp_path: Path, env: dict[str, str], loops: list[Loop]) -> None:
    store = LocalStore(tmp_path / "store")
    loops.append(loop := Loop(store, env))
    loop.steps(3)
    assert codecs(store) == {"raw"}  # random-looking floats: compressing costs more time
    rates = loop.ckpt._persister.rates
    assert rates.write is not None
    assert rates.encode is not None


def test_compressible_state_is_compressed_and_never_or_always_are_obeyed(
        tmp_path: Path, env: dict[str, str], loops: list[Loop]) -> None:
    zeros = LocalStore(tmp_path / "zeros")
    loops.append(loop := Loop(zeros, env, zeros=True))
    loop.steps(2)
    assert codecs(zeros) == {"zstd"}
    never = LocalStore(tmp_path / "never")
    loops.append(loop := Loop(never, env, zeros=True, compress="never"))
    loop.steps(2)
    assert codecs(never) == {"raw"}
    always = LocalStore(tmp_path / "always")
    loops.append(loop := Loop(always, env, compress="always"))
    loop.steps(2)
    assert "raw" not in codecs(always)


@settings(max_examples=5, deadline=None)
@given(keep_full_every=st.integers(2, 12), checkpoints=st.integers(2, 14),
       delta_base=st.sampled_from(["memory", "store"]))
def test_a_restore_never_decodes_more_than_one_delta_over_a_full_chunk(
        tmp_path_factory: pytest.TempPathFactory, keep_full_every: int, checkpoints: int,
        delta_base: str) -> None:
    root = tmp_path_factory.mktemp("chain")
    store = LocalStore(root / "store")
    env = {"M27_CONFIG": str(root / "no-config")}
    loop = Loop(store, env, compress="always", delta_base=delta_base,
                keep_full_every=keep_full_every)
    try:
        loop.steps(checkpoints)
    finally:
        loop.ckpt.close()
    manifests = store.list("local")
    assert len(manifests) == checkpoints
    assert max(chain_depth(c) for m in manifests for e in m.entries for c in e.chunks) <= 1
    fresh = Loop(store, env)
    try:
        fresh.ckpt.resume()
        for mine, theirs in zip(fresh.model.parameters(), loop.model.parameters(),
                                strict=True):
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))  # bitwise
    finally:
        fresh.ckpt.close()


@pytest.mark.parametrize("setting", [{"persist_cpu_share": 1.5}, {"compress": "fast"},
                                     {"delta_base": "disk"}, {"persist_threads": 0}])
def test_a_bad_setting_is_a_clear_error(tmp_path: Path, env: dict[str, str],
                                        setting: dict[str, Any]) -> None:
    (name,) = setting
    with pytest.raises(CheckpointError, match=name):
        Loop(LocalStore(tmp_path / "store"), env, **setting)


@given(saving=st.floats(0, 1), encode=st.floats(1e6, 1e10), write=st.floats(1e6, 1e10))
def test_compression_pays_exactly_when_it_makes_the_chunk_durable_sooner(
        saving: float, encode: float, write: float) -> None:
    raw_s = 1 / write
    compressed_s = 1 / encode + (1 - saving) / write
    if abs(raw_s - compressed_s) > 1e-9 * raw_s:
        assert compression_pays(saving, encode, write) == (compressed_s < raw_s)


@given(share=st.floats(0.01, 1.0), cores=st.integers(1, 256))
def test_paced_workers_can_use_the_share_they_are_given(share: float, cores: int) -> None:
    threads, share_cores = paced_workers(share, cores)
    assert share_cores == pytest.approx(share * cores)
    assert threads >= max(1.0, share_cores) - 1e-9  # enough threads to use it
    assert threads < share_cores + 1
    assert paced_workers(0.0, cores) == (0, 0.0)


@given(share_cores=st.floats(0.05, 8.0),
       chunks=st.lists(st.tuples(st.floats(1e-4, 0.05), st.floats(0.0, 0.2)), max_size=60))
def test_paced_cpu_time_stays_within_the_share(share_cores: float,
                                               chunks: list[tuple[float, float]]) -> None:
    """One paced worker, simulated: chunks of given CPU time, each perhaps also waiting for
    the disk. Whenever it may start a chunk, the CPU time spent so far is within the share
    of the time elapsed; so it never exceeds the share by more than one chunk."""
    clock = cpu = 0.0
    for chunk_cpu, chunk_wait in chunks:
        rest = rest_before_next(share_cores, clock, cpu)
        assert rest >= 0
        clock += rest
        assert cpu <= share_cores * clock + 1e-9
        assert rest == 0 or rest_before_next(share_cores, clock, cpu) < 1e-9  # not longer
        clock += chunk_cpu + chunk_wait
        cpu += chunk_cpu
    assert cpu <= share_cores * clock + max((c for c, _ in chunks), default=0) + 1e-9


def burn(seconds: float) -> None:
    """Use `seconds` of this thread's CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_paced_thread_uses_at_most_its_share_of_a_core() -> None:
    busy = 0.02
    work = WorkList(list(range(5)), lambda _: burn(busy))
    started = time.perf_counter()
    thread = threading.Thread(target=work.work, kwargs={"share_cores": 0.25})
    thread.start()
    thread.join()
    elapsed = time.perf_counter() - started
    assert work.paced_items == 5
    assert elapsed >= 4 * busy / 0.25 * 0.9  # resting three times as long as it worked


def test_a_paced_thread_stands_back_while_the_idle_threads_keep_up() -> None:
    """On a GPU job idle-priority workers get the CPU they need: their CPU time counts
    against the budget, so the normal-priority workers (which could delay training)
    take next to nothing."""
    work = WorkList(list(range(40)), lambda _: burn(0.005))
    paced = threading.Thread(target=work.work, kwargs={"share_cores": 0.25})
    unpaced = threading.Thread(target=work.work)  # as an idle worker that gets its CPU
    unpaced.start()
    paced.start()
    unpaced.join()
    paced.join()
    assert work.paced_items <= 2
    assert work.cpu_s >= 40 * 0.005 * 0.9


def test_waiting_for_the_disk_is_not_paced() -> None:
    """Pacing counts CPU time: a chunk that waits (an fsync, a slow store) costs training
    nothing, so the thread does not rest for it."""
    work = WorkList(list(range(5)), lambda _: time.sleep(0.05))
    started = time.perf_counter()
    thread = threading.Thread(target=work.work, kwargs={"share_cores": 0.05})
    thread.start()
    thread.join()
    assert time.perf_counter() - started < 5 * 0.05 / 0.05 / 4  # far less than wall pacing


def test_unpacing_wakes_a_resting_thread_at_once() -> None:
    work = WorkList(list(range(3)), lambda _: burn(0.05))
    thread = threading.Thread(target=work.work, kwargs={"share_cores": 0.001})  # rests ~50 s
    thread.start()
    time.sleep(0.1)
    started = time.perf_counter()
    work.unpaced.set()
    thread.join(10)
    assert not thread.is_alive()
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("unpace_after", [None, 0.0])
def test_the_calling_thread_takes_chunks_only_when_pacing_is_off(
        unpace_after: float | None) -> None:
    """The persister's own thread runs at normal priority: were it to take chunks while
    the crew is paced, the share would not hold."""
    crew = Crew(idle_workers=0, cpu_share=0.5, cores=1, lower_priority=lambda: None)
    try:
        def chunk(_: int) -> str:
            burn(0.01)
            return threading.current_thread().name

        work = WorkList(list(range(30)), chunk)
        names = crew.run(work, unpace_after)
    finally:
        crew.close()
    assert len(names) == 30
    callers = [n for n in names if n == threading.current_thread().name]
    if unpace_after is None:
        assert callers == []
        assert all(n.startswith("m27-ckpt-paced-") for n in names)
    else:  # urgent: every thread helps, this one included
        assert callers
