"""Training data on the device (toolkit.run.device_data): the same batches as the DataLoader path, in the same keyed
order,
each rank its slice of the global batch, resumes mid-epoch, accumulation windows that end with the epoch, and the
same weights after training steps."""

from __future__ import annotations

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from toolkit.data.rows import TensorRows
from toolkit.loop.progress import rest_of_epoch
from toolkit.run.device_data import DeviceBatches
from toolkit.run.sampler import shuffled_batches


def dataset() -> TensorRows:
    generator = torch.Generator().manual_seed(0)
    return TensorRows({"x": torch.randn(50, 3, generator=generator), "y": torch.randn(50, 1, generator=generator)},
                      rows=torch.arange(5, 50), index_name="row")


def dataloader_path(accumulate: int = 1):
    config = DataLoaderConfiguration(split_batches=True, even_batches=True, use_seedable_sampler=True, data_seed=0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate, dataloader_config=config)
    sampler = shuffled_batches(45, 8, seed=3, epochs=2)
    return accelerator, accelerator.prepare(DataLoader(dataset(), batch_sampler=sampler))


def device_path(rank: int = 0, world_size: int = 1):
    return DeviceBatches(dataset(), shuffled_batches(45, 8, seed=3, epochs=2), "cpu", rank, world_size)


def test_the_same_batches_in_the_same_order_every_epoch_and_after_a_resume():
    accelerator, loader = dataloader_path()
    mine = device_path()
    assert len(mine) == len(loader) == 5
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        mine.set_epoch(epoch)
        theirs, ours = list(loader), list(mine)
        assert len(ours) == 5
        for a, b in zip(theirs, ours, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        loader.set_epoch(epoch)
        mine.set_epoch(epoch)
        resumed = list(rest_of_epoch(accelerator, mine, 3))
        assert all(torch.equal(a["row"], b["row"]) for a, b in zip(theirs[3:], resumed, strict=True))
        assert len(resumed) == 2


def test_each_rank_cuts_its_slice_of_the_global_batch():
    whole = list(device_path())
    halves = [list(device_path(rank, 2)) for rank in (0, 1)]
    for batch, first, second in zip(whole, *halves, strict=True):
        assert torch.equal(torch.cat([first["row"], second["row"]]), batch["row"])
        assert torch.equal(torch.cat([first["x"], second["x"]]), batch["x"])


def test_accumulation_windows_end_with_the_epoch_and_training_gives_the_same_weights():
    def train(make_loader) -> tuple[list[bool], torch.Tensor]:
        torch.manual_seed(0)
        accelerator, loader = dataloader_path(accumulate=2)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        loader = make_loader(loader)
        syncs = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            accelerator.step = 0
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = (model(batch["x"]) - batch["y"]).pow(2).mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    syncs.append(accelerator.sync_gradients)
        return syncs, model.weight.detach().clone()

    theirs, weight_theirs = train(lambda loader: loader)
    ours, weight_ours = train(lambda loader: device_path())
    assert theirs == ours == [False, True, False, True, True] * 2  # 5 batches: the last window is cut by the epoch
    assert torch.equal(weight_theirs, weight_ours)


def same_batches(theirs: list[dict], ours: list[dict]) -> None:
    assert len(theirs) == len(ours) > 0
    for a, b in zip(theirs, ours, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_traffic_windows_are_cut_on_the_device_as_the_dataloader_collates_them():
    from toolkit.data.traffic import TrafficWindows

    generator = torch.Generator().manual_seed(1)
    timesteps, sensors = 90, 4
    windows = TrafficWindows(torch.randn(timesteps, sensors, 2, generator=generator),
                             torch.rand(timesteps, sensors, generator=generator) * 70, torch.arange(3, 60))
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    for epoch in (0, 1):
        sampler = shuffled_batches(len(windows), 8, seed=5, epochs=2)
        loader = accelerator.prepare(DataLoader(windows, batch_sampler=sampler))
        loader.set_epoch(epoch)
        mine = DeviceBatches(windows, shuffled_batches(len(windows), 8, seed=5, epochs=2), "cpu")
        mine.set_epoch(epoch)
        same_batches(list(loader), list(mine))
        halves = []
        for rank in (0, 1):
            half = DeviceBatches(windows, shuffled_batches(len(windows), 8, seed=5, epochs=2), "cpu", rank, 2)
            half.set_epoch(epoch)
            halves.append(list(half))
        for whole, first, second in zip(list(mine), *halves, strict=True):
            assert torch.equal(torch.cat([first["x"], second["x"]]), whole["x"])


def test_hrm_augmentations_are_picked_on_the_device_as_the_dataset_picks_them(tmp_path):
    from recipes.hrm import HRMConfig, OneAugmentationPerPuzzle, data_recipe
    from toolkit.data.sudoku import load_sudoku, split
    from toolkit.run.sampler import CrossEpochBatchSampler

    cfg = HRMConfig(train_puzzles=24, aug=3, val_puzzles=4, test_puzzles=4, seed=2)
    stored, meta = load_sudoku(None, data_recipe(cfg), tmp_path, progress=False)
    train_set = OneAugmentationPerPuzzle(split(stored, meta, "train").select_columns(["id", "question", "answer"]),
                                         1 + meta["aug"], cfg.seed)
    assert train_set.device_bytes() == 96 * (8 + 81 + 81)  # id int64, the grids int8 as stored

    def sampler():  # batches of 10 across epochs of 24 puzzles, with the epoch each was drawn in
        return CrossEpochBatchSampler(len(train_set), 10, seed=4, epochs=3, with_epoch=True)

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    loader = accelerator.prepare(DataLoader(train_set, batch_sampler=sampler()))
    mine = DeviceBatches(train_set, sampler(), "cpu")
    picked = set()
    for epoch in range(3):
        loader.set_epoch(epoch)
        mine.set_epoch(epoch)
        theirs, ours = list(loader), list(mine)
        if theirs or ours:
            same_batches(theirs, ours)
        picked |= {int(i) for batch in ours for i in batch["id"]}
    assert len(picked) > 24  # several augmentations of the puzzles were drawn, not only the originals


def test_a_set_that_does_not_fit_goes_through_a_dataloader_with_one_line(monkeypatch):
    from types import SimpleNamespace

    from toolkit.run import device_data

    lines = []
    run = SimpleNamespace(accelerator=Accelerator(cpu=True), config=SimpleNamespace(data_on_device=True),
                          print=lines.append)
    fits = device_data.device_batches(run, dataset(), shuffled_batches(45, 8, seed=3, epochs=2))
    assert isinstance(fits, DeviceBatches) and lines == []
    monkeypatch.setattr(device_data, "free_memory", lambda device: dataset().device_bytes())  # needs half: no room
    falls_back = device_data.device_batches(run, dataset(), shuffled_batches(45, 8, seed=3, epochs=2))
    assert not isinstance(falls_back, DeviceBatches) and len(list(falls_back)) == 5
    assert len(lines) == 1 and "does not fit in half the machine's available" in lines[0], lines
    run.config.data_on_device = False  # --no-data-on-device: the DataLoader, without a line
    assert not isinstance(device_data.device_batches(run, dataset(), shuffled_batches(45, 8, seed=3, epochs=2)),
                          DeviceBatches) and len(lines) == 1
