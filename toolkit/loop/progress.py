"""Where a run is: the loop's counters, saved in every checkpoint as progress.json; the run's length in steps; the
rest of an epoch after a resume."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.errors import TrainingStopped


@dataclass
class Progress:
    """Where the loop is; saved in every checkpoint as progress.json."""

    run_id: str = ""
    epoch: int = 0  # epochs completed
    batches_done: int = 0  # micro-batches consumed in the current epoch
    global_step: int = 0  # optimizer steps
    samples_seen: int = 0
    interval_loss_sum: float = 0.0  # training loss since the last metrics row
    interval_loss_count: int = 0
    best_value: float | None = None
    best_step: int | None = None
    best_metrics: dict = field(default_factory=dict)
    last_metrics: dict = field(default_factory=dict)
    last_eval_step: int | None = None
    stop_reason: str | None = None  # request_stop(reason): the run ended early
    train_time_sec: float = 0.0
    wall_time_sec: float = 0.0  # wall time of the work this checkpoint keeps, summed over the run's lives
    file_bytes: dict = field(default_factory=dict)  # metrics.csv / log.csv sizes when this checkpoint was saved
    first_loss: float | None = None  # the first step's training loss: --max-loss-ratio compares against it

    @classmethod
    def from_saved(cls, saved: dict) -> Progress:
        """A checkpoint's progress.json; keys this version does not know (a newer toolkit's) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})


def total_training_steps(config, batches_per_epoch: int | Callable[[int], int]) -> int:
    """Optimizer steps the run will take: --epochs x steps per epoch, capped by --max-steps (for LR schedules).
    batches_per_epoch: a number, or a function of the epoch when epochs differ (toolkit.run.sampler)."""
    if callable(batches_per_epoch):
        total = sum(math.ceil(batches_per_epoch(epoch) / config.grad_accum) for epoch in range(config.epochs))
    else:
        total = math.ceil(batches_per_epoch / config.grad_accum) * config.epochs
    return min(total, config.max_steps) if config.max_steps is not None else total


def rest_of_epoch(accelerator, loader, batches_done: int):
    """The micro-batches of the current epoch after the first `batches_done` (a resume mid-epoch): with the
    sampler's epoch set, they are exactly the ones an uninterrupted run takes next."""
    if hasattr(loader, "skip_first"):  # toolkit.run.device_data.DeviceBatches
        return loader.skip_first(batches_done)
    return accelerator.skip_first_batches(loader, batches_done) if batches_done else loader


def require_whole_epoch(batches_done: int, batches_in_epoch: int, epoch: int) -> None:
    """The loader ran out: it must have given the whole epoch. Short of it, end_epoch() would never close the epoch
    and the loop would ask for the same (empty) rest of it forever; one line instead."""
    if batches_done < batches_in_epoch:
        raise TrainingStopped(
            f"the training data of epoch {epoch + 1} ended after {batches_done} of its {batches_in_epoch} batches: "
            "the resume position or the loader's length is wrong, so the run could never reach its end; the "
            "checkpoints are kept (report this with the run's config.json)"
        )
