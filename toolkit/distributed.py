"""Collectives a recipe needs beyond what Accelerate's prepare() does for it."""

from __future__ import annotations

import torch
from accelerate import Accelerator


def global_mean(accelerator: Accelerator, local_sum: torch.Tensor, local_count: torch.Tensor | int):
    """Mean over the whole GLOBAL batch of a loss summed over a varying number of items per rank (e.g. non-padding
    positions). Returns (loss to backpropagate, the global mean as a detached value).

    Each rank's mean would weight ranks equally whatever their item counts, so N processes would not match one
    process. Dividing the local sum by the global count and scaling by the world size makes DDP's gradient
    average equal the gradient of the global mean.
    """
    count = torch.as_tensor(local_count, dtype=torch.float32, device=local_sum.device)
    totals = torch.stack([local_sum.detach().float(), count])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    global_count = totals[1].clamp_min(1.0)
    loss = local_sum * (accelerator.num_processes / global_count)
    return loss, totals[0] / global_count
