"""Ranking metrics for leave-one-out recommendation, and masked regression metrics (MAE, RMSE, MAPE) as global sums.

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


# ----------------------------------------------------------------------------------------------------
# Regression metrics (DCRNN traffic speeds, the UFS emulator) as global sums: N processes give what 1 gives
# ----------------------------------------------------------------------------------------------------

ERROR_SUMS = ("abs_err_sum", "sq_err_sum", "abs_pct_err_sum", "count", "pct_count")


def masked_error_sums(
    pred: torch.Tensor, target: torch.Tensor, null_value: float | None = 0.0, keep_dims: int | tuple[int, ...] = ()
) -> torch.Tensor:
    """Sums for masked MAE/RMSE/MAPE, in float64, to be added over batches and ranks and divided once at the end.

    Returns [..., 5] = ERROR_SUMS: sum |pred - target|, sum (pred - target)^2, sum |pred - target| / |target|,
    count, pct_count. A reading counts where the target is finite and != null_value (DCRNN: 0.0 = a missing
    reading; None masks only non-finite targets); MAPE's terms and pct_count also need a nonzero target.
    Predictions are never masked: a NaN prediction on a valid reading makes the sums (and metrics) NaN.
    Give pred and target in physical units (mph, K), i.e. after undoing the normalisation.
    keep_dims: dimensions NOT summed over (e.g. 1 for per-horizon sums of [batch, horizon, sensors] -> [horizon, 5]);
    they lead the result in ascending order. In a recipe: sums += masked_error_sums(...) per batch, then
    error_metrics(accelerator.reduce(sums, "sum")) once.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred and target shapes differ: {tuple(pred.shape)} vs {tuple(target.shape)}")
    pred, target = pred.detach().double(), target.detach().double()
    keep = (keep_dims,) if isinstance(keep_dims, int) else tuple(keep_dims)
    keep = tuple(d % target.dim() for d in keep) if target.dim() else ()
    valid = torch.isfinite(target)
    if null_value is not None:
        valid &= target != null_value
    pct_valid = valid & (target != 0)
    # where(), not multiplication by the mask: a NaN/inf at a masked reading must not leak in (NaN * 0 = NaN).
    zero = torch.zeros((), dtype=torch.float64, device=target.device)
    error = torch.where(valid, pred - target, zero)
    pct = torch.where(pct_valid, error.abs() / torch.where(pct_valid, target.abs(), torch.ones_like(target)), zero)
    terms = torch.stack([error.abs(), error.square(), pct, valid.double(), pct_valid.double()], dim=-1)
    summed = [d for d in range(target.dim()) if d not in keep]
    return terms.sum(dim=summed) if summed else terms


def error_metrics(sums: torch.Tensor) -> dict[str, float]:
    """{"mae", "rmse", "mape", "count"} from (summed) masked_error_sums of shape [5]; mape is a FRACTION
    (0.073 = 7.3%). A metric over no valid readings is NaN (not 0: nothing was measured)."""
    sums = torch.as_tensor(sums).detach().double().cpu()
    if sums.shape != (len(ERROR_SUMS),):
        names = ", ".join(ERROR_SUMS)
        raise ValueError(f"expected sums of shape [{len(ERROR_SUMS)}] ({names}), got {tuple(sums.shape)}")
    abs_sum, sq_sum, pct_sum, count, pct_count = sums.tolist()
    nan = float("nan")
    return {
        "mae": abs_sum / count if count else nan,
        "rmse": (sq_sum / count) ** 0.5 if count else nan,
        "mape": pct_sum / pct_count if pct_count else nan,
        "count": int(count),
    }
