"""The data cursor and the resumable sampler."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from m27.train import Cursor, ResumableSampler, epoch_order


def test_the_order_of_an_epoch_depends_only_on_seed_and_epoch() -> None:
    torch.manual_seed(0)
    first = epoch_order(100, seed=3, epoch=2)
    torch.manual_seed(99)  # the global generator plays no part
    assert torch.equal(first, epoch_order(100, seed=3, epoch=2))
    assert not torch.equal(first, epoch_order(100, seed=3, epoch=3))
    assert not torch.equal(first, epoch_order(100, seed=4, epoch=2))
    assert sorted(first.tolist()) == list(range(100))
    assert epoch_order(5, 0, 0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_a_sampler_started_mid_epoch_yields_the_rest_of_the_same_order() -> None:
    sampler = ResumableSampler(20, batch_size=4, seed=1)
    sampler.set_epoch(1)
    whole = list(sampler)
    sampler.start(Cursor(epoch=1, batch=3, step=8))
    assert list(sampler) == whole[12:]
    assert len(sampler) == 8
    loader: DataLoader[int] = DataLoader(list(range(20)),  # type: ignore[arg-type]
                                         batch_size=4, sampler=sampler)
    assert [b.tolist() for b in loader] == [whole[12:16], whole[16:20]]


def test_an_action_runs_once_when_the_next_iteration_begins() -> None:
    sampler = ResumableSampler(4, batch_size=2)
    calls: list[int] = []
    sampler.call_before_next_iteration(lambda: calls.append(1))
    iterator = iter(sampler)
    assert calls == []  # not when the iterator is made: when it is first advanced
    next(iterator)
    list(sampler)
    assert calls == [1]


def test_a_sampler_refuses_a_state_for_other_data() -> None:
    saved = ResumableSampler(10, batch_size=2, seed=5).state_dict()
    other = ResumableSampler(12, batch_size=2)
    with pytest.raises(ValueError, match="10 samples"):
        other.load_state_dict(saved)
    same = ResumableSampler(10, batch_size=2)
    same.load_state_dict(saved)
    assert same.seed == 5


def test_the_cursor_advances_and_rolls_over_epochs() -> None:
    cursor = Cursor()
    cursor.advance()
    cursor.advance(2)
    assert cursor.state_dict() == {"epoch": 0, "batch": 3, "step": 3}
    cursor.next_epoch()
    assert Cursor.from_state(cursor.state_dict()) == Cursor(epoch=1, batch=0, step=3)
