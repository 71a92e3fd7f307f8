"""The packer's shape bookkeeping: rare request shapes keep the nodes only they can use."""

from __future__ import annotations

from m27.scheduler._packing import Packer, Request, m27_demand, typical_demand
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
