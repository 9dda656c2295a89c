"""Ranking metrics for leave-one-out recommendation.

Ties count against the target: an item scored equal to the target ranks above it, so a model that scores every
item the same gets the worst rank, not the best.
"""

from __future__ import annotations

import torch


def rank_of_target(target_scores: torch.Tensor, other_scores: torch.Tensor, other_valid: torch.Tensor | None = None):
    """0-based rank of each target among the other candidates: how many valid others score >= the target.

    target_scores [N]; other_scores [N, C]; other_valid bool [N, C] (False = excluded, e.g. the user's history).
    A non-finite score never helps the target (a diverged model scores NaN, and NaN >= x is False): a non-finite
    target gets the worst rank, a non-finite other beats the target.
    """
    beats = (other_scores >= target_scores.unsqueeze(1)) | ~torch.isfinite(other_scores)
    beats |= ~torch.isfinite(target_scores).unsqueeze(1)
    if other_valid is not None:
        beats &= other_valid
    return beats.sum(dim=1)


def hit_rate_and_ndcg(ranks: torch.Tensor, k: int = 10) -> tuple[float, float]:
    """HR@k and NDCG@k (one relevant item: 1 / log2(rank + 2) when rank < k) averaged over users."""
    ranks = ranks.double()
    hits = ranks < k
    ndcg = torch.where(hits, 1.0 / torch.log2(ranks + 2.0), torch.zeros_like(ranks))
    return hits.double().mean().item(), ndcg.mean().item()
