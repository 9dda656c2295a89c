"""Training data kept on the device: each batch cut there, with no DataLoader, no workers and no copy per step.

    train_loader = device_batches(run, train_set, batch_sampler)   # a TensorRows dataset, a keyed batch sampler
    # not given to accelerator.prepare(): it is on the device and cut per rank (or, not fitting, a prepared loader)

The batches are those the DataLoader path gives (Accelerate's split_batches: rank r takes the r-th equal slice of
each global batch), in the same keyed order: the sampler's order for an epoch is cut into index batches on the host
once per epoch and copied to the device in one piece. Accumulation windows end with the epoch as they do under
Accelerate's loaders (its DataLoaderStateMixin: the last batch marks the end of the data). A set that does not fit in
the device's free memory (with room to spare for the model's own work) falls back to the DataLoader in one line."""

from __future__ import annotations

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState
from torch.utils.data import DataLoader

from toolkit.data.rows import TensorRows

FREE_MEMORY_SHARE = 0.5  # a set may take at most this share of the device's free memory


class DeviceBatches(DataLoaderStateMixin):
    def __init__(self, dataset: TensorRows, batch_sampler, device: torch.device | str, rank: int = 0,
                 world_size: int = 1):
        self.gradient_state = GradientState()
        self._drop_last = True  # every batch is a whole global batch (the keyed samplers cut no short one)
        self.dataset, self.batch_sampler, self.device = dataset, batch_sampler, torch.device(device)
        self.rank, self.world_size = rank, world_size
        rows = dataset.rows
        self.columns = {dataset.index_name: rows.to(self.device),
                        **{name: field[rows].to(self.device) for name, field in dataset.fields.items()}}

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        return self.skip_first(0)

    def epoch_order(self) -> torch.Tensor:
        """This rank's row indices of the epoch's batches [batches, batch / world size], on the host (the sampler's
        work): split_batches, rank r takes the r-th equal slice of each global batch."""
        order = torch.as_tensor([list(batch) for batch in self.batch_sampler], dtype=torch.long)
        share = order.shape[1] // self.world_size
        return order[:, self.rank * share:(self.rank + 1) * share]

    def skip_first(self, skip: int):
        """This epoch's batches after the first `skip` (a resume mid-epoch)."""
        self.begin()
        try:
            mine = self.epoch_order().to(self.device)  # one copy an epoch
            for i in range(skip, len(mine)):
                self.end_of_dataloader = i == len(mine) - 1  # before the yield: accumulate() reads it
                index = mine[i]
                yield {name: column[index] for name, column in self.columns.items()}
        finally:
            self.end()


def set_bytes(dataset: TensorRows) -> int:
    """The bytes DeviceBatches puts on the device: every field's rows, gathered."""
    return sum(field[0].numel() * field.element_size() * len(dataset.rows) for field in dataset.fields.values())


def device_batches(run, dataset: TensorRows, batch_sampler, **loader_args):
    """DeviceBatches on the run's device when the set fits (on a CPU run it is already in memory), else the
    DataLoader path, prepared, with one line saying why. Either way, do not pass it to accelerator.prepare()."""
    accelerator = run.accelerator
    device = accelerator.device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        needed = set_bytes(dataset)
        if needed > FREE_MEMORY_SHARE * free:
            run.print(f"training data: {needed / 2**30:.2f} GiB does not fit in half the GPU's free "
                      f"{free / 2**30:.2f} GiB; loading it through a DataLoader instead")
            return accelerator.prepare(DataLoader(dataset, batch_sampler=batch_sampler, **loader_args))
    return DeviceBatches(dataset, batch_sampler, device, accelerator.process_index, accelerator.num_processes)
