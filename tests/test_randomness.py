"""Sampled negatives: never touched by the user, and a function of (seed, epoch, user, position) only."""

import torch

from toolkit.randomness import sample_negatives, step_seed


def _touched(num_users=6, num_items=30):
    generator = torch.Generator().manual_seed(0)
    touched = torch.rand(num_users, num_items + 1, generator=generator) < 0.5
    touched[:, 0] = True  # padding is never a valid negative
    return touched


def test_negatives_are_untouched_items():
    touched = _touched()
    negatives = sample_negatives(touched, torch.arange(6), torch.arange(50), seed=3, purpose=1, epoch=2)
    assert negatives.shape == (6, 50)
    assert negatives.min() >= 1 and negatives.max() <= 30
    assert not touched[torch.arange(6)[:, None], negatives].any()


def test_negatives_do_not_depend_on_batch_composition():
    # The same user gets the same negatives whether it sits in a batch of 6 or alone (= any process count).
    touched = _touched()
    whole = sample_negatives(touched, torch.arange(6), torch.arange(20), seed=3, purpose=1, epoch=0)
    for user in range(6):
        alone = sample_negatives(touched, torch.tensor([user]), torch.arange(20), seed=3, purpose=1, epoch=0)
        assert torch.equal(alone[0], whole[user])


def test_negatives_change_with_epoch_and_seed_and_cover_the_items():
    touched = torch.zeros(1, 11, dtype=torch.bool)
    touched[0, 0] = True
    base = sample_negatives(touched, torch.tensor([0]), torch.arange(1000), seed=1, purpose=1, epoch=0)
    assert not torch.equal(base, sample_negatives(touched, torch.tensor([0]), torch.arange(1000), seed=1, purpose=1,
                                                  epoch=1))
    assert not torch.equal(base, sample_negatives(touched, torch.tensor([0]), torch.arange(1000), seed=2, purpose=1,
                                                  epoch=0))
    counts = torch.bincount(base.flatten(), minlength=11)[1:]
    assert counts.min() > 60  # roughly uniform over the 10 items (100 expected each)


def test_step_seed_differs_by_step_and_rank():
    assert len({step_seed(0, s, r) for s in range(50) for r in range(4)}) == 200
