"""The packer's shape bookkeeping: rare request shapes keep the nodes only they can use."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m27.scheduler._packing import SCARCE_HOSTS, Packer, Request, m27_demand, typical_demand
from m27.scheduler.tests.support import node

SMALL = Request(gpus=1, milli=1000, cpu_milli=4000)
BIG = Request(gpus=8, milli=1000, cpu_milli=120_000)  # only a 128-core node holds it
REQUESTS = [SMALL] * 400 + [BIG]  # BIG is 2 % of the GPU milli: not a typical shape


def test_rare_shapes_are_kept_unweighted() -> None:
    typical = typical_demand(REQUESTS)
    assert [shape for shape, _ in typical] == [SMALL]
    assert m27_demand(REQUESTS) == [(SMALL, 400 / 401), (BIG, 0.0)]
    assert len(m27_demand(REQUESTS, max_shapes=1)) == 1


def test_a_small_request_leaves_the_only_node_a_rare_big_one_fits_on() -> None:
    nodes = [node("big", 8, cpu=128_000), node("small", 8, cpu=16_000)]
    protected = Packer(nodes, m27_demand(REQUESTS), tie_rank=[0, 1])
    choice = protected.choose(SMALL)
    assert choice is not None
    assert nodes[choice.node].node_id == "small"
    # Knowing only the typical shapes, nothing tells the two nodes apart: node order wins.
    unaware = Packer(nodes, typical_demand(REQUESTS), tie_rank=[0, 1])
    choice = unaware.choose(SMALL)
    assert choice is not None
    assert nodes[choice.node].node_id == "big"


def test_the_scarce_rule_sees_capabilities_lost_on_other_nodes() -> None:
    """Scores cached for an untouched node must not keep an old price for its
    capabilities: placing elsewhere makes the nodes it has left scarcer."""
    wholes = SCARCE_HOSTS + 1  # so many hosts for BIG: none of them is scarce yet
    nodes = [node(f"whole{i}", 8, cpu=128_000) for i in range(wholes)] + [
        node(f"part{i}", 8, cpu=128_000) for i in range(2)]
    packer = Packer(nodes, m27_demand([SMALL] * 4000 + [BIG] * wholes),
                    tie_rank=range(len(nodes)))
    for i in range(wholes, len(nodes)):
        packer.take(i, [0], SMALL)
    first = packer.choose(SMALL)  # scored (and cached) while BIG has many hosts
    assert first is not None
    for _ in range(wholes - 1):  # BIG takes all whole nodes but the last
        assert packer.place(BIG) is not None
    choice = packer.choose(SMALL)
    assert choice is not None
    assert nodes[choice.node].node_id.startswith("part")


_SHAPES = st.sampled_from([
    Request(gpus=1, milli=300, cpu_milli=2000), Request(gpus=1, milli=500, cpu_milli=8000),
    Request(gpus=1, milli=1000, cpu_milli=4000), Request(gpus=2, milli=1000, cpu_milli=16_000),
    Request(gpus=4, milli=1000, cpu_milli=30_000), Request(gpus=0, cpu_milli=24_000),
    Request(gpus=8, milli=1000, cpu_milli=90_000)])


@settings(max_examples=60, deadline=None)
@given(st.lists(_SHAPES, min_size=1, max_size=60), st.integers(0, 2**16))
def test_a_cached_choice_is_the_choice_of_a_packer_built_afresh(
        arrivals: list[Request], seed: int) -> None:
    rng = random.Random(seed)
    nodes = [node(f"n{i}", rng.choice([2, 4, 8]), cpu=rng.choice([32_000, 96_000, 128_000]))
             for i in range(8)]
    demand = m27_demand(arrivals)
    packer = Packer(nodes, demand, tie_rank=range(len(nodes)))
    placed: list[tuple[int, list[int], Request]] = []
    for req in arrivals:
        fresh = Packer(nodes, demand, tie_rank=range(len(nodes)))
        for where, cols, held in placed:
            fresh.take(where, cols, held)
        choice, expected = packer.choose(req), fresh.choose(req)
        assert (choice is None) == (expected is None)
        if choice is None or expected is None:
            continue
        assert (choice.node, choice.gpu_ids) == (expected.node, expected.gpu_ids)
        assert choice.frag_delta == pytest.approx(expected.frag_delta, abs=1e-6)
        if choice is not None:
            cols = [packer.col_of(choice.node, g) for g in choice.gpu_ids]
            packer.take(choice.node, cols, req)
            placed.append((choice.node, cols, req))
