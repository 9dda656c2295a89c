"""Where a resumed epoch starts, checked in-process in well under a second.

A wrong resume position used to be found only by an end-to-end run that never ended (600 s). These tests compare
batches directly: the first life's k batches followed by the resumed life's batches are one uninterrupted epoch, for
every k, with the loaders the recipes use (a keyed permutation, a cross-epoch batch sampler), on one process and as
the rank split of two. And a loader that runs out before its epoch is complete is one line, not an endless loop.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from toolkit.loop.training import TrainingStopped, require_whole_epoch, rest_of_epoch
from toolkit.run.sampler import CrossEpochBatchSampler, EpochPermutation

ITEMS = 23


def plain_loader(seed: int = 7) -> DataLoader:
    return DataLoader(range(ITEMS), batch_size=4, sampler=EpochPermutation(ITEMS, seed), drop_last=True)


def cross_epoch_loader(seed: int = 7) -> DataLoader:
    sampler = CrossEpochBatchSampler(ITEMS, 5, seed=seed, epochs=4)
    return DataLoader(range(ITEMS), batch_sampler=sampler)


def batches_of(iterable) -> list[list[int]]:
    return [batch.tolist() for batch in iterable]


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.mark.parametrize("make_loader", [plain_loader, cross_epoch_loader], ids=["permutation", "cross-epoch"])
@pytest.mark.parametrize("epoch", [0, 2])
def test_a_resumed_epoch_continues_exactly_where_the_first_life_stopped(accelerator, make_loader, epoch):
    loader = accelerator.prepare_data_loader(make_loader())
    loader.set_epoch(epoch)
    whole = batches_of(loader)
    assert whole and all(len(set(b)) == len(b) for b in whole)
    for k in range(len(whole) + 1):
        resumed = accelerator.prepare_data_loader(make_loader())  # a new life builds its loader again
        resumed.set_epoch(epoch)
        rest = batches_of(rest_of_epoch(accelerator, resumed, k))
        assert whole[:k] + rest == whole, f"resumed after {k} batches of epoch {epoch}"
        assert len(rest) == len(whole) - k


def test_each_rank_of_two_resumes_at_its_own_share_of_the_global_batch(accelerator):
    """Accelerate splits each global batch between the ranks (split_batches): after k global batches, each rank's
    rest of the epoch is its share of global batches k, k+1, ..."""
    global_batches = batches_of(plain_loader())
    for rank in range(2):
        shard = prepare_data_loader(plain_loader(), num_processes=2, process_index=rank, split_batches=True,
                                    put_on_device=False)
        shard.set_epoch(0)
        mine = batches_of(shard)
        assert mine == [b[rank * 2:(rank + 1) * 2] for b in global_batches]
        for k in range(len(mine) + 1):
            shard = prepare_data_loader(plain_loader(), num_processes=2, process_index=rank, split_batches=True,
                                        put_on_device=False)
            shard.set_epoch(0)
            assert batches_of(rest_of_epoch(accelerator, shard, k)) == mine[k:], (rank, k)


def test_a_loader_short_of_its_epoch_stops_the_run_in_one_line():
    require_whole_epoch(6, 6, epoch=0)  # the whole epoch: nothing to say
    require_whole_epoch(7, 6, epoch=0)  # a step past the end (a pre-emption saved at the epoch's last batch)
    with pytest.raises(TrainingStopped) as caught:
        require_whole_epoch(5, 6, epoch=2)
    message = str(caught.value)
    assert "\n" not in message
    assert "epoch 3 ended after 5 of its 6 batches" in message


def test_the_generator_is_the_same_object_when_nothing_is_skipped(accelerator):
    loader = accelerator.prepare_data_loader(plain_loader())
    assert rest_of_epoch(accelerator, loader, 0) is loader
    assert isinstance(next(iter(rest_of_epoch(accelerator, loader, 1))), torch.Tensor)
