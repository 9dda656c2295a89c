"""Ranking metrics against rankings worked out by hand, ties and non-finite scores included; masked regression
metrics (MAE, RMSE, MAPE) against hand-computed values, and their sums over parts against the whole."""

import math

import pytest
import torch

from toolkit.run.metrics import ERROR_SUMS, error_metrics, hit_rate_and_ndcg, masked_error_sums, rank_of_target


def test_rank_counts_ties_against_the_target():
    target = torch.tensor([0.5, 0.5, 0.9])
    others = torch.tensor([[0.1, 0.5, 0.7],  # one above, one tie -> rank 2
                           [0.5, 0.5, 0.5],  # all tie -> worst rank 3
                           [0.1, 0.2, 0.3]])  # best -> rank 0
    assert rank_of_target(target, others).tolist() == [2, 3, 0]


def test_excluded_candidates_do_not_count():
    target = torch.tensor([0.5])
    others = torch.tensor([[0.9, 0.8, 0.1, 0.5]])
    valid = torch.tensor([[False, True, True, False]])  # history excluded: only 0.8 beats the target
    assert rank_of_target(target, others, valid).tolist() == [1]


def test_hit_rate_and_ndcg_by_hand():
    ranks = torch.tensor([0, 1, 9, 10, 50])
    hr, ndcg = hit_rate_and_ndcg(ranks, k=10)
    assert hr == pytest.approx(3 / 5)
    assert ndcg == pytest.approx((1 / math.log2(2) + 1 / math.log2(3) + 1 / math.log2(11)) / 5)


def test_constant_scores_give_zero_not_perfect_metrics():
    # A model that scores everything equal must not look perfect: 100 tied negatives put the target last.
    ranks = rank_of_target(torch.zeros(4), torch.zeros(4, 100))
    assert hit_rate_and_ndcg(ranks, k=10) == (0.0, 0.0)


def test_non_finite_scores_never_help_the_target():
    nan, inf = float("nan"), float("inf")
    target = torch.tensor([nan, inf, 1.0, 1.0])
    others = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [nan, 0.0, 0.0], [-inf, 0.0, 0.0]])
    assert rank_of_target(target, others).tolist() == [3, 3, 1, 1]
    diverged = rank_of_target(torch.full((5,), nan), torch.full((5, 100), nan))
    assert hit_rate_and_ndcg(diverged, k=10) == (0.0, 0.0)  # not 1.0 and 1.0
    valid = torch.tensor([[True, False, False]])
    assert rank_of_target(torch.tensor([nan]), torch.zeros(1, 3), valid).tolist() == [1]


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "target, others, valid, rank",
    [
        (NAN, [0.0, 1.0, -5.0], None, 3),  # a NaN target is worst: every valid other beats it
        (INF, [0.0, 1.0, -5.0], None, 3),  # so is +inf (not a real score either)
        (-INF, [0.0, 1.0, -5.0], None, 3),
        (NAN, [0.0, 1.0, -5.0], [True, False, True], 2),  # ... but excluded candidates still do not count
        (1.0, [NAN, 0.0, 0.5], None, 1),  # a NaN other beats the target
        (1.0, [INF, -INF, 0.5], None, 2),  # +inf and -inf others both beat it
        (1.0, [NAN, 0.0, 0.5], [False, True, True], 0),  # an excluded NaN other does not
    ],
    ids=["nan-target", "inf-target", "-inf-target", "nan-target-excluded", "nan-other", "inf-others",
         "nan-other-excluded"],
)
def test_non_finite_scores_rank_against_the_target(target, others, valid, rank):
    valid = None if valid is None else torch.tensor([valid])
    assert rank_of_target(torch.tensor([target]), torch.tensor([others]), valid).tolist() == [rank]


# ---- masked regression metrics ---------------------------------------------------------------------------


def test_masked_errors_by_hand():
    # Readings 1, 4, 10 count; 0 (missing) and NaN are masked, whatever was predicted there (100, NaN).
    target = torch.tensor([1.0, 0.0, NAN, 4.0, 10.0])
    pred = torch.tensor([2.0, 100.0, NAN, 3.0, 7.0])
    sums = masked_error_sums(pred, target, null_value=0.0)
    assert sums.dtype == torch.float64 and sums.shape == (len(ERROR_SUMS),)
    # errors 1, -1, -3: |.| sums to 5, squares to 11, relative errors 1/1 + 1/4 + 3/10 = 1.55 over 3 readings
    assert sums.tolist() == pytest.approx([5.0, 11.0, 1.55, 3.0, 3.0], rel=1e-15)
    metrics = error_metrics(sums)
    assert metrics["mae"] == pytest.approx(5 / 3, rel=1e-15)
    assert metrics["rmse"] == pytest.approx(math.sqrt(11 / 3), rel=1e-15)
    assert metrics["mape"] == pytest.approx(1.55 / 3, rel=1e-15)  # a fraction: 0.5167 = 51.67%
    assert metrics["count"] == 3


def test_without_a_null_value_zeros_count_but_not_in_mape():
    target = torch.tensor([0.0, 2.0, NAN])
    pred = torch.tensor([0.5, 1.0, 3.0])
    sums = masked_error_sums(pred, target, null_value=None)
    assert sums.tolist() == pytest.approx([1.5, 1.25, 0.5, 2.0, 1.0], rel=1e-15)
    assert error_metrics(sums) == pytest.approx({"mae": 0.75, "rmse": math.sqrt(0.625), "mape": 0.5, "count": 2})


def test_a_diverged_prediction_is_not_hidden_and_nothing_measured_is_nan():
    target = torch.tensor([1.0, 2.0, 0.0])
    metrics = error_metrics(masked_error_sums(torch.tensor([1.0, NAN, 5.0]), target))
    assert all(math.isnan(metrics[name]) for name in ["mae", "rmse", "mape"])
    assert error_metrics(masked_error_sums(torch.tensor([NAN, NAN, NAN]), target, null_value=0.0))["count"] == 2
    empty = error_metrics(masked_error_sums(torch.ones(3), torch.zeros(3)))  # every reading missing
    assert empty["count"] == 0 and all(math.isnan(empty[name]) for name in ["mae", "rmse", "mape"])


def test_per_horizon_sums_keep_that_dimension():
    generator = torch.Generator().manual_seed(0)
    target = torch.rand(4, 12, 5, generator=generator) * 70
    target[target < 10] = 0.0  # missing readings
    pred = target + torch.randn(4, 12, 5, generator=generator)
    per_horizon = masked_error_sums(pred, target, keep_dims=1)
    assert per_horizon.shape == (12, len(ERROR_SUMS))
    for h in [2, 5, 11]:  # DCRNN's horizons 3, 6, 12
        assert torch.allclose(per_horizon[h], masked_error_sums(pred[:, h], target[:, h]), rtol=1e-14, atol=0)
    assert torch.allclose(per_horizon.sum(0), masked_error_sums(pred, target), rtol=1e-14, atol=0)


def test_sums_over_parts_equal_the_whole():
    # What N processes do: each sums its shard, one all-reduce adds the sums. Uneven parts, masked zeros, NaNs.
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(1001, 7, generator=generator, dtype=torch.float64) * 70
    target[target < 5] = 0.0
    target[3, 2] = NAN
    pred = (target + torch.randn(1001, 7, generator=generator, dtype=torch.float64)).float()
    whole = masked_error_sums(pred, target)
    assert 0 < whole[3] < target.numel() - 1  # some readings were masked
    halves = masked_error_sums(pred[:400], target[:400]) + masked_error_sums(pred[400:], target[400:])
    assert torch.allclose(halves, whole, rtol=1e-13, atol=0)
    split, joined = error_metrics(halves), error_metrics(whole)
    assert split["count"] == joined["count"]
    for name in ["mae", "rmse", "mape"]:
        assert split[name] == pytest.approx(joined[name], rel=1e-13)
    # The mean of per-part MAEs (what averaging each process's metric gives) is NOT the MAE of the whole.
    part_mae = [error_metrics(masked_error_sums(pred[a:b], target[a:b]))["mae"] for a, b in [(0, 10), (10, 1001)]]
    assert abs(sum(part_mae) / 2 - joined["mae"]) > 1e-3


def test_shapes_must_match():
    with pytest.raises(ValueError, match="shapes differ"):
        masked_error_sums(torch.zeros(3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="expected sums of shape"):
        error_metrics(torch.zeros(4))
