"""Randomness keyed by what it belongs to, so results do not depend on the process count or on resuming.

Sample-level randomness (sampled negatives) is a counter-based hash of (seed, purpose, epoch, sample, position),
computed for a whole batch at once in torch. Step-level randomness (dropout) comes from the global torch RNG,
reseeded from (seed, step, rank) before every micro-batch, so a resumed run draws the same masks as an
uninterrupted one without depending on how many RNG draws happened before the checkpoint.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A well-tested 32-bit integer finaliser; products stay below 2**59, so int64 never overflows.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def keyed_hash(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash integer keys (tensors broadcast together) to uniform 32-bit values, as int64."""
    hashed = torch.tensor(0x9E3779B9, dtype=torch.int64)
    for key in keys:
        key = torch.as_tensor(key, dtype=torch.int64)
        hashed = _mix32(hashed.to(key.device) ^ (key & _MASK32) ^ ((key >> 32) & _MASK32) * 0x27D4EB2F & _MASK32)
    return hashed


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for the global RNG before a micro-batch: dropout masks depend on (seed, step, rank) only."""
    return int(keyed_hash(seed, 0x5EED, step, rank))


def sample_negatives(
    touched: torch.Tensor,
    users: torch.Tensor,
    positions: torch.Tensor,
    *,
    seed: int,
    purpose: int,
    epoch: int,
    max_tries: int = 64,
) -> torch.Tensor:
    """One item per (user, position) that the user never touched, drawn uniformly from 1..num_items.

    touched: bool [num_users, num_items + 1] on the batch's device; users: [B]; positions: [P].
    Returns int64 [B, P]; a pure function of (seed, purpose, epoch, user, position), vectorised over the batch.
    """
    num_items = touched.shape[1] - 1
    users = users.view(-1, 1)
    positions = positions.view(1, -1).to(users.device)
    items = torch.zeros(users.shape[0], positions.shape[1], dtype=torch.int64, device=users.device)
    pending = torch.ones_like(items, dtype=torch.bool)
    for attempt in range(max_tries):
        draw = 1 + keyed_hash(seed, purpose, epoch, users, positions, attempt) % num_items
        items = torch.where(pending, draw, items)
        pending = touched[users, items]
        if not bool(pending.any()):
            return items
    raise RuntimeError(f"could not sample untouched items in {max_tries} tries: a user touched almost every item")
