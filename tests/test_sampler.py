"""toolkit.run.sampler: batches across epoch boundaries. The reference HRM's step count at Sudoku-1k, every item of an
epoch drawn once (only the incomplete batch at a cycle's end left out), the epoch's batches the same on every call
(a resume), and what a loader over it yields."""

import pytest
import torch

from toolkit.run.sampler import CrossEpochBatchSampler, EpochPermutation


def test_sudoku_1k_takes_the_reference_steps():
    # 20,000 epochs of 1,000 puzzles in batches of 768, streams of 2,000 epochs (epochs_per_iter = eval_interval):
    # 10 x floor(2,000,000 / 768) = 26,040 steps; one stream for the whole run would be floor(20,000,000 / 768).
    cycles = CrossEpochBatchSampler(1000, 768, seed=0, epochs=20000, epochs_per_cycle=2000)
    assert cycles.total_batches() == 26040 == sum(cycles.batches_in_epoch(e) for e in range(20000))
    assert CrossEpochBatchSampler(1000, 768, seed=0, epochs=20000).total_batches() == 26041
    assert [cycles.batches_in_epoch(e) for e in range(4)] == [2, 1, 1, 2]  # 768-item batches start in epochs unevenly
    plain = CrossEpochBatchSampler(48, 16, seed=0, epochs=5)  # batches that fit: 3 an epoch, as drop_last gives
    assert [plain.batches_in_epoch(e) for e in range(5)] == [3] * 5


@pytest.mark.parametrize("items, size, epochs, cycle", [(10, 4, 6, 3), (7, 3, 5, None), (5, 8, 4, 2)])
def test_every_item_of_every_epoch_once_except_the_tail_of_a_cycle(items, size, epochs, cycle):
    sampler = CrossEpochBatchSampler(items, size, seed=4, epochs=epochs, epochs_per_cycle=cycle, with_epoch=True)
    drawn = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == sampler.batches_in_epoch(epoch)
        assert all(len(batch) == size for batch in batches)
        assert all(batch[0][0] == epoch for batch in batches)  # a batch belongs to the epoch it starts in
        assert list(sampler) == batches  # the same again (a resume asks again)
        drawn += [pair for batch in batches for pair in batch]
    assert len(drawn) == len(set(drawn)) == sampler.total_batches() * size
    cycle = cycle or epochs
    for first in range(0, epochs, cycle):  # each cycle: its epochs' permutations in a row, cut to full batches
        length = min(cycle, epochs - first)
        stream = [(e, int(i)) for e in range(first, first + length) for i in sampler.sampler.order(e)]
        kept = length * items // size * size
        assert [pair for pair in drawn if first <= pair[0] < first + length] == stream[:kept]


def test_orders_are_keyed_by_seed_and_epoch():
    order = EpochPermutation(50, seed=1)
    assert sorted(order.order(3).tolist()) == list(range(50))
    assert torch.equal(order.order(3), EpochPermutation(50, seed=1).order(3))
    assert not torch.equal(order.order(3), order.order(4))
    assert not torch.equal(order.order(3), EpochPermutation(50, seed=2).order(3))


def test_a_data_loader_yields_the_epochs_batches_and_plain_items_without_with_epoch():
    sampler = CrossEpochBatchSampler(10, 4, seed=0, epochs=3)
    loader = torch.utils.data.DataLoader(list(range(100, 110)), batch_sampler=sampler)
    seen = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert len(loader) == sampler.batches_in_epoch(epoch)
        seen += [value for batch in loader for value in batch.tolist()]
    assert len(seen) == 28 and sorted(set(seen)) == list(range(100, 110))  # 30 drawn, the last 2 left out


def test_shuffled_batches_are_shuffle_and_drop_last_in_a_keyed_order():
    from toolkit.run.sampler import shuffled_batches

    sampler = shuffled_batches(10, 3, seed=2, epochs=3)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        raw = list(sampler)
        assert all(b.dtype == torch.int64 for b in raw)  # index tensors: __getitems__ takes them as they are
        batches = [b.tolist() for b in raw]
        assert len(sampler) == len(batches) == 3 and all(len(b) == 3 for b in batches)  # the tail item dropped
        items = [i for b in batches for i in b]
        assert len(set(items)) == 9 and set(items) <= set(range(10))
        orders.append(items)
        again = shuffled_batches(10, 3, seed=2, epochs=3)
        again.set_epoch(epoch)
        assert [b.tolist() for b in again] == batches  # a pure function of (seed, epoch): a resume draws the same
    assert orders[0] != orders[1] != orders[2]
    other = shuffled_batches(10, 3, seed=3, epochs=3)
    assert [i for b in other for i in b.tolist()] != orders[0]
