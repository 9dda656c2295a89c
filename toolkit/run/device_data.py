"""Training data kept on the device: each batch cut there, with no DataLoader, no workers and no copy per step.

    train_loader = device_batches(run, train_set, batch_sampler)   # a dataset that can cut batches on a device
    # not given to accelerator.prepare(): it is on the device and cut per rank (or, not fitting, a prepared loader)

The batches are those the DataLoader path gives (Accelerate's split_batches: rank r takes the r-th equal slice of
each global batch), in the same keyed order: the sampler's order for an epoch is cut into index batches on the host
once per epoch and copied to the device in one piece. Accumulation windows end with the epoch as they do under
Accelerate's loaders (its DataLoaderStateMixin: the last batch marks the end of the data). A set that does not fit in
the device's free memory (with room to spare for the model's own work) falls back to the DataLoader in one line.

A dataset takes part by two methods (TensorRows, TrafficWindows and HRM's OneAugmentationPerPuzzle have them):

    device_bytes() -> int                       what it puts on the device
    on_device(device) -> cut                    its tensors moved there once; cut(index) -> the collated batch, for
                                                one batch's row of the sampler's index_batches() (on the device)
    device_index(order) -> order                (optional) the epoch's index batches turned into what cut() takes,
                                                on the host once an epoch (HRM: (epoch, puzzle) pairs -> table rows)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import psutil
import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from torch.utils.data import DataLoader

FREE_MEMORY_SHARE = 0.5  # a set may take at most this share of the device's free memory


class CutOnDevice(Protocol):
    def device_bytes(self) -> int: ...

    def on_device(self, device: torch.device) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]: ...


def index_batches(batch_sampler) -> torch.Tensor:
    """The batch sampler's current epoch as one index tensor [batches, batch, ...]."""
    if hasattr(batch_sampler, "index_batches"):  # toolkit.run.sampler's samplers: no per-item Python
        return batch_sampler.index_batches()
    return torch.as_tensor([list(batch) for batch in batch_sampler], dtype=torch.long)


class DeviceBatches(DataLoaderStateMixin):
    def __init__(self, dataset: CutOnDevice, batch_sampler, device: torch.device | str, rank: int = 0,
                 world_size: int = 1):
        self.gradient_state = GradientState()
        self._drop_last = True  # every batch is a whole global batch (the keyed samplers cut no short one)
        self.dataset, self.batch_sampler, self.device = dataset, batch_sampler, torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.cut = dataset.on_device(self.device)

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        return self.skip_first(0)

    def epoch_order(self) -> torch.Tensor:
        """This rank's indices of the epoch's batches [batches, batch / world size, ...], on the host (the sampler's
        work): split_batches, rank r takes the r-th equal slice of each global batch."""
        order = index_batches(self.batch_sampler)
        if hasattr(self.dataset, "device_index"):
            order = self.dataset.device_index(order)
        share = order.shape[1] // self.world_size
        return order[:, self.rank * share:(self.rank + 1) * share]

    def skip_first(self, skip: int):
        """This epoch's batches after the first `skip` (a resume mid-epoch)."""
        self.begin()
        try:
            mine = self.epoch_order().to(self.device)  # one copy an epoch
            for i in range(skip, len(mine)):
                self.end_of_dataloader = i == len(mine) - 1  # before the yield: accumulate() reads it
                yield self.cut(mine[i])
        finally:
            self.end()


def free_memory(device: torch.device) -> int:
    """Bytes free on the device: the GPU's (CUDA), else the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def device_batches(run, dataset: CutOnDevice, batch_sampler, **loader_args):
    """DeviceBatches on the run's device when the set fits in half its free memory, else the DataLoader path,
    prepared, with one line saying why (or without one: --no-data-on-device). Either way, do not pass it to
    accelerator.prepare()."""
    accelerator = run.accelerator
    device = accelerator.device
    if run.config.data_on_device:
        needed, free = dataset.device_bytes(), free_memory(device)
        if needed <= FREE_MEMORY_SHARE * free:
            return DeviceBatches(dataset, batch_sampler, device, accelerator.process_index, accelerator.num_processes)
        where = "the GPU's free" if device.type == "cuda" else "the machine's available"
        run.print(f"training data: {needed / 2**30:.2f} GiB does not fit in half {where} {free / 2**30:.2f} GiB; "
                  "loading it through a DataLoader instead")
    return accelerator.prepare(DataLoader(dataset, batch_sampler=batch_sampler, **loader_args))
