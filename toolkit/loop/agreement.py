"""What every rank must decide together, in one all-reduce: has ANY rank been pre-empted, seen a non-finite (or
exploded) loss, or been asked to stop? Each rank sees some of these alone (its own SIGUSR1, its own loss, its own
early-stopping decision); acting on them apart would leave the others waiting in a collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


_host_groups: dict[int, object] = {}  # id(default group) -> the gloo group that agrees on host flags


def any_rank_on_host(accelerator, *flags: bool) -> tuple[bool, ...]:
    """Each host flag true when it is true on any rank, agreed on the host: a gloo all-reduce of a CPU tensor, so a
    GPU run does not wait for its queued work (an all-reduce on the device and its .item() would, every time).
    Collective: every rank calls it at the same point. One process: the flags themselves."""
    if accelerator.num_processes == 1:
        return tuple(flags)
    default = dist.group.WORLD
    if dist.get_backend() == "gloo":
        group = default  # a CPU run's own group
    else:  # NCCL takes device tensors only: a gloo group beside it, made once (every rank makes it together)
        group = _host_groups.get(id(default))
        if group is None:
            group = _host_groups[id(default)] = dist.new_group(backend="gloo")
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(values, group=group)
    return tuple(bool(v > 0) for v in values.tolist())
