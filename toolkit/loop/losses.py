"""The training loss from the loop's side. Each micro-batch's loss stays a tensor where it was computed; the numbers
come to the host (one copy for all the steps since the last read: on a GPU, one sync) only when the loop reads them:
every --log-every optimizer steps, and whenever it needs them (an evaluation, a checkpoint, an epoch's end, the
run's end). What is read is the same Python floats a read per step would give, in the same order, so the metrics
rows, the log and the divergence guard see exactly the numbers they always saw."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from toolkit.loop.guards import loss_problem


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
    def __init__(self, read_every: int, copy: bool = False):
        self.read_every = read_every
        self.copy = copy  # --cuda-graphs: a loss the model's graph returned is overwritten by its next replay
        self._micro: list[torch.Tensor] = []  # this step's micro-batches, not yet closed
        self._closed: list[tuple[int, int, list[torch.Tensor]]] = []  # (step, epoch, micro-batches), not yet read

    def record(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self._micro.append(loss.clone() if self.copy else loss)

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

    def read(self, rider: torch.Tensor | None = None) -> tuple[list[StepLoss], list[float]]:
        """The closed steps' losses on the host, oldest first, and the values of `rider` (a recipe's own device
        values read at the same time, e.g. training sums to log), all in one device-to-host copy."""
        tensors = [t for _, _, micro in self._closed for t in micro]
        parts = [torch.stack(tensors).double()] if tensors else []  # float32 -> float64 is exact
        parts += [] if rider is None else [rider.detach().double().flatten()]
        values = torch.cat(parts).tolist() if parts else []
        carried = values[len(tensors):]
        steps, at = [], 0
        for step, epoch, micro in self._closed:
            steps.append(StepLoss(step, epoch, values[at : at + len(micro)]))
            at += len(micro)
        self._closed.clear()
        return steps, carried


def read_and_count(losses: StepLosses, progress, meter, accelerator, config, rider=None) -> str | None:
    """Read the unread steps' losses: each step guarded (the first bad one's problem is returned, and it and what
    follows are not counted), counted into the metrics row's mean, shown on the progress bar and logged. rider:
    (provide, consume), a recipe's own device values read in the same copy: consume(values) after the losses."""
    provided = rider[0]() if rider is not None else None
    reads, carried = losses.read(provided)
    for read in reads:
        step_loss = read.mean
        if progress.first_loss is None and math.isfinite(step_loss):
            progress.first_loss = step_loss
        problem = loss_problem(step_loss, progress.first_loss, config.max_loss_ratio, read.step)
        if problem is not None:
            late = progress.global_step - read.step
            return problem + (f" (read {late} step(s) later: the loss is read every --log-every {config.log_every} "
                              "steps and before every evaluation and checkpoint)" if late else "")
        progress.interval_loss_sum += sum(read.micro_batches)
        progress.interval_loss_count += len(read.micro_batches)
        meter.stepped(read.epoch, step_loss)
        if read.step % config.log_every == 0:
            accelerator.log({"train/loss": step_loss, "train/epoch": read.epoch}, step=read.step)
    if provided is not None:
        rider[1](carried)
    return None
