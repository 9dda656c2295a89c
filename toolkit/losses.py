"""The training loss from the loop's side. Each micro-batch's loss stays a tensor where it was computed; the numbers
come to the host (one copy for all the steps since the last read: on a GPU, one sync) only when the loop reads them:
every READ_EVERY optimizer steps, and whenever it needs them (an evaluation, a checkpoint, an epoch's end, the
run's end). What is read is the same Python floats a read per step would give, in the same order, so the metrics
rows, the log and the divergence guard see exactly the numbers they always saw."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolkit.guards import loss_problem

READ_EVERY = 1  # optimizer steps between reads of the loss on the host


@dataclass
class StepLoss:
    """One optimizer step's training loss: its micro-batches' losses, read."""

    step: int
    epoch: int
    micro_batches: list[float]

    @property
    def mean(self) -> float:
        return sum(self.micro_batches) / len(self.micro_batches) if self.micro_batches else float("nan")


class StepLosses:
    def __init__(self, read_every: int = READ_EVERY):
        self.read_every = read_every
        self._micro: list[torch.Tensor] = []  # this step's micro-batches, not yet closed
        self._closed: list[tuple[int, int, list[torch.Tensor]]] = []  # (step, epoch, micro-batches), not yet read

    def record(self, loss: torch.Tensor) -> None:
        self._micro.append(loss.detach().float())

    def close_step(self, step: int, epoch: int) -> None:
        """The optimizer step `step` is taken: its micro-batches' losses belong to it."""
        self._closed.append((step, epoch, self._micro))
        self._micro = []

    def read_due(self, step: int) -> bool:
        """The cadence: every read_every steps (a function of the step alone, so every rank reads at the same step)."""
        return step % self.read_every == 0

    @property
    def unread(self) -> int:
        return len(self._closed)

    def read(self) -> list[StepLoss]:
        """The closed steps' losses on the host, oldest first (one device-to-host copy)."""
        tensors = [t for _, _, micro in self._closed for t in micro]
        values = torch.stack(tensors).tolist() if tensors else []
        steps, at = [], 0
        for step, epoch, micro in self._closed:
            steps.append(StepLoss(step, epoch, values[at : at + len(micro)]))
            at += len(micro)
        self._closed.clear()
        return steps


def read_and_count(losses: StepLosses, progress, meter, accelerator, config) -> str | None:
    """Read the unread steps' losses: each step guarded (the first bad one's problem is returned, and it and what
    follows are not counted), counted into the metrics row's mean, shown on the progress bar and logged."""
    for read in losses.read():
        step_loss = read.mean
        if progress.first_loss is None and math.isfinite(step_loss):
            progress.first_loss = step_loss
        problem = loss_problem(step_loss, progress.first_loss, config.max_loss_ratio, read.step)
        if problem is not None:
            return problem
        progress.interval_loss_sum += sum(read.micro_batches)
        progress.interval_loss_count += len(read.micro_batches)
        meter.stepped(read.epoch, step_loss)
        if read.step % config.log_every == 0:
            accelerator.log({"train/loss": step_loss, "train/epoch": read.epoch}, step=read.step)
    return None
