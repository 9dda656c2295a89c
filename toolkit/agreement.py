"""What every rank must decide together, in one all-reduce: has ANY rank been pre-empted, seen a non-finite (or
exploded) loss, or been asked to stop? Each rank sees some of these alone (its own SIGUSR1, its own loss, its own
early-stopping decision); acting on them apart would leave the others waiting in a collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    preempted: bool = False
    diverged: bool = False
    stop: bool = False
    terminated: bool = False  # the pre-emption was (on some rank) a SIGTERM: no requeue


def agree(accelerator, *, preempted: bool = False, diverged: bool = False, stop: bool = False,
          terminated: bool = False) -> Agreement:
    """Each flag true when it is true on any rank. One process: the flags themselves (no tensor, no collective)."""
    if accelerator.num_processes == 1:
        return Agreement(preempted, diverged, stop, terminated)
    flags = torch.tensor([preempted, diverged, stop, terminated], dtype=torch.float32, device=accelerator.device)
    flags = accelerator.reduce(flags, reduction="sum")
    return Agreement(*(bool(v > 0) for v in flags.tolist()))
