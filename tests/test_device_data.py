"""Training data on the device (toolkit.device_data): the same batches as the DataLoader path, in the same keyed order,
each rank its slice of the global batch, resumes mid-epoch, accumulation windows that end with the epoch, and the
same weights after training steps."""

from __future__ import annotations

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from toolkit.data.rows import TensorRows
from toolkit.device_data import DeviceBatches
from toolkit.progress import rest_of_epoch
from toolkit.sampler import shuffled_batches


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
