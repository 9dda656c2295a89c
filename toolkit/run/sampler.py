"""Batches that run across epoch boundaries, so that no item is left out at an epoch's end.

A plain DataLoader with drop_last loses the tail of every epoch (HRM's Sudoku-1k: 1,000 puzzles in batches of 768
is one step an epoch and 232 puzzles never seen); without drop_last it makes a short batch. The reference HRM
(puzzle_dataset.py) instead concatenates the permutations of `epochs_per_iter` epochs into one stream and cuts it
into full batches, dropping only the incomplete batch at the end of that stream: 20,000 epochs x 1,000 puzzles in
cycles of 2,000 epochs are 10 x floor(2,000,000 / 768) = 26,040 steps of 768.

`CrossEpochBatchSampler` does the same for any map-style dataset, in the training loop's terms: loop epoch e yields
the batches that START in data epoch e (a batch may end in the next epoch), so the number of batches per epoch varies
(0, 1 or 2 for 1,000 items in batches of 768) and their sum over the run is the stream's. Give the loop
`batches_per_epoch=sampler.batches_in_epoch` so its step count is right. The order of epoch e is a permutation keyed
by (seed, e): the same on every rank, after a resume and for any process count (Accelerate splits each global batch
between the processes; skip_first_batches resumes mid-epoch).

    sampler = CrossEpochBatchSampler(len(train_set), cfg.batch_size, seed=cfg.seed, epochs=cfg.epochs,
                                     epochs_per_cycle=cfg.eval_every)
    train_loader = DataLoader(train_set, batch_sampler=sampler, ...)
    loop = TrainingLoop(run, model, train_loader, ..., batches_per_epoch=sampler.batches_in_epoch)

with_epoch=True yields (epoch, item) pairs instead of items, for datasets whose item depends on the epoch it is
drawn in (HRM picks one augmentation of each puzzle per epoch).
"""

from __future__ import annotations

import torch

from toolkit.run.randomness import keyed_hash_int

EPOCH_ORDER = 13  # purpose of keyed randomness: the order of an epoch


class EpochPermutation(torch.utils.data.Sampler):
    """The items of one epoch in a keyed random order; set_epoch chooses the epoch (Accelerate's prepared loader
    forwards set_epoch to a batch sampler's `sampler`, also when it splits batches between processes)."""

    def __init__(self, num_items: int, seed: int):
        self.num_items, self.seed, self.epoch = num_items, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        # A pure function of (seed, epoch): a generator seeded by their hash, no state carried between epochs (randperm
        # of 24,000 items takes ~0.1 ms, a stable argsort of their hashes ~1.5 ms).
        generator = torch.Generator().manual_seed(keyed_hash_int(self.seed, EPOCH_ORDER, epoch))
        return torch.randperm(self.num_items, generator=generator)

    def __len__(self) -> int:
        return self.num_items

    def __iter__(self):
        return iter(self.order(self.epoch).tolist())


class CrossEpochBatchSampler(torch.utils.data.Sampler):
    """Full batches of `batch_size` cut from the stream of epochs, each a fresh permutation of the items; the stream
    restarts every `epochs_per_cycle` epochs (default: one stream for the whole run), and the incomplete batch at the
    end of a cycle is dropped. Iterating yields the batches that start in the current epoch (set_epoch)."""

    def __init__(self, num_items: int, batch_size: int, *, seed: int, epochs: int, epochs_per_cycle: int | None = None,
                 with_epoch: bool = False):
        if num_items < 1 or batch_size < 1 or epochs < 0 or (epochs_per_cycle is not None and epochs_per_cycle < 1):
            raise ValueError(f"CrossEpochBatchSampler needs num_items >= 1 ({num_items}), batch_size >= 1 "
                             f"({batch_size}), epochs >= 0 ({epochs}) and epochs_per_cycle >= 1 ({epochs_per_cycle})")
        self.sampler = EpochPermutation(num_items, seed)
        self.num_items, self.batch_size, self.epochs = num_items, batch_size, epochs
        self.epochs_per_cycle = epochs_per_cycle or max(epochs, 1)
        self.with_epoch = with_epoch
        self.drop_last = True  # Accelerate's BatchSamplerShard: never pad a batch with items from the start

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _cycle(self, epoch: int) -> tuple[int, int]:
        """(first epoch, epochs) of the cycle holding `epoch`; the last cycle may be shorter."""
        first = epoch // self.epochs_per_cycle * self.epochs_per_cycle
        return first, min(self.epochs_per_cycle, self.epochs - first)

    def batch_range(self, epoch: int) -> range:
        """The batches (numbered within the cycle) that start in `epoch` and are complete."""
        if not 0 <= epoch < self.epochs:
            return range(0)
        first, length = self._cycle(epoch)
        items, size, local = self.num_items, self.batch_size, epoch - first
        complete = length * items // size
        start = -(-local * items // size)  # the first batch whose first position is in this epoch
        stop = min(-(-(local + 1) * items // size), complete)
        return range(start, max(start, stop))

    def batches_in_epoch(self, epoch: int) -> int:
        return len(self.batch_range(epoch))

    def total_batches(self) -> int:
        return sum(self._cycle(first)[1] * self.num_items // self.batch_size
                   for first in range(0, self.epochs, self.epochs_per_cycle))

    def __len__(self) -> int:
        return self.batches_in_epoch(self.sampler.epoch)

    def index_batches(self) -> torch.Tensor:
        """The current epoch's batches as one tensor: [batches, batch_size] item numbers, or with_epoch
        [batches, batch_size, 2] (epoch, item) pairs. What iterating yields, at once (toolkit.run.device_data cuts
        batches on the device from it)."""
        epoch, batches = self.sampler.epoch, self.batch_range(self.sampler.epoch)
        first, _ = self._cycle(epoch) if batches else (0, 0)
        positions = torch.arange(batches.start * self.batch_size, batches.stop * self.batch_size)
        epochs = first + positions // self.num_items
        items = torch.empty_like(positions)
        for e in epochs.unique().tolist():
            here = epochs == e
            items[here] = self.sampler.order(e)[positions[here] % self.num_items]
        rows = items.view(len(batches), self.batch_size)
        if not self.with_epoch:
            return rows
        return torch.stack([epochs.view(len(batches), self.batch_size), rows], dim=-1)

    def __iter__(self):
        # The epoch's batches at once, as index tensors: no per-item Python (Accelerate's seedable sampler yields item
        # by item, ~0.15 ms a step for the UFS MLP's batches of 1,000 against a 1.3 ms step), and a dataset's
        # __getitems__ takes them without converting 1,000 Python ints (torch.as_tensor of a list: ~40 us a step).
        batches = self.index_batches()
        if not self.with_epoch:
            yield from batches
            return
        for pairs in batches.tolist():
            yield [tuple(pair) for pair in pairs]


def shuffled_batches(num_items: int, batch_size: int, *, seed: int, epochs: int) -> CrossEpochBatchSampler:
    """The usual training order, as a batch sampler: each epoch a keyed permutation of the items cut into full
    batches, the incomplete last one dropped (a DataLoader's shuffle=True, drop_last=True), the same on every rank,
    after a resume and for any process count. For small steps with large batches, where Accelerate's seedable
    sampler costs a visible share of the step:

        train_loader = DataLoader(train_set, batch_sampler=shuffled_batches(len(train_set), cfg.batch_size,
                                                                            seed=cfg.seed, epochs=cfg.epochs))
    """
    return CrossEpochBatchSampler(num_items, batch_size, seed=seed, epochs=epochs, epochs_per_cycle=1)
