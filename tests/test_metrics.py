"""Ranking metrics against rankings worked out by hand, ties included."""

import math

import pytest
import torch

from toolkit.metrics import hit_rate_and_ndcg, rank_of_target


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
