"""Sampled negatives: never touched by the user, and a function of (seed, epoch, user, position) only."""

import pytest
import torch

from toolkit.run.randomness import keyed_hash, keyed_hash_int, keyed_uniform, sample_negatives, step_seed


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


def test_training_negatives_can_be_a_users_held_out_items(movielens_cache):
    """As the original SASRec code: training negatives avoid only the user's TRAINING items, so the validation and
    test items (which training must not know about) are drawn like any other item."""
    from toolkit.data.movielens import leave_one_out, prepare_movielens

    sequences, meta = prepare_movielens("ml-100k", None, movielens_cache)
    split = leave_one_out(sequences, meta, maxlen=50)
    users = split.eval_users
    held_out = torch.stack([split.valid_target[users], split.test_target[users]], dim=1)  # [U, 2]
    assert not split.train_touched[users[:, None], held_out].all()  # held-out items are not training items ...
    assert split.touched[users[:, None], held_out].all()  # ... though the user touched them
    negatives = torch.cat([sample_negatives(split.train_touched, users, torch.arange(50), seed=0, purpose=1, epoch=e)
                           for e in range(40)], dim=1)  # [U, 2000] draws
    assert not split.train_touched[users[:, None], negatives].any()
    drawn = (negatives[:, :, None] == held_out[:, None, :]).any(dim=1)  # [U, 2]: was each held-out item drawn?
    assert drawn.any(), "no held-out item was ever drawn as a training negative"
    assert drawn.float().mean() > 0.5  # 2000 draws from ~1650 items: most held-out items come up


def test_keyed_dropout_keys_the_samples_along_the_batch_dimension_it_is_given():
    """A sequence-first input [T, B, H] (a GRU's default): with batch_dim=1 each rank's half of the batch gets the
    mask the whole batch gives those samples, and the mask equals the batch-first one transposed. batch_dim is
    required: it was silently 0, which keyed the time steps, and 1 and 2 processes drifted apart."""
    from toolkit.run import randomness

    x = torch.ones(6, 8, 3)  # [time, batch, features]
    dropout = randomness.KeyedDropout(0.5, batch_dim=1)
    randomness.begin_micro_batch(seed=1, key=7, rank=0, world_size=1)
    whole = dropout(x)
    randomness.begin_micro_batch(seed=1, key=7, rank=0, world_size=1)
    batch_first = randomness.KeyedDropout(0.5, batch_dim=0)(x.transpose(0, 1).contiguous())
    halves = []
    for rank in range(2):
        randomness.begin_micro_batch(seed=1, key=7, rank=rank, world_size=2)
        halves.append(dropout(x[:, rank * 4:(rank + 1) * 4]))
    randomness.end_micro_batches()
    assert torch.equal(torch.cat(halves, dim=1), whole)
    assert torch.equal(batch_first.transpose(0, 1), whole)
    assert "batch_dim=1" in repr(dropout)
    with pytest.raises(TypeError):
        randomness.KeyedDropout(0.5)  # the dimension must be said


def test_keyed_dropout_masks_a_sample_the_same_on_any_rank():
    from toolkit.run import randomness

    x = torch.ones(8, 5, 3)
    randomness.begin_micro_batch(seed=1, key=7, rank=0, world_size=1)
    whole = randomness.keyed_dropout(x, 0.5)
    halves = []
    for rank in range(2):
        randomness.begin_micro_batch(seed=1, key=7, rank=rank, world_size=2)
        halves.append(randomness.keyed_dropout(x[:4], 0.5))
    randomness.end_micro_batches()
    assert torch.equal(torch.cat(halves), whole)
    assert 0.3 < (whole == 0).float().mean() < 0.7 and set(whole.unique().tolist()) == {0.0, 2.0}
    randomness.begin_micro_batch(seed=1, key=8, rank=0, world_size=1)
    assert not torch.equal(randomness.keyed_dropout(x, 0.5), whole)  # another micro-batch, another mask
    randomness.end_micro_batches()


def test_keyed_uniform_is_a_function_of_its_keys():
    from toolkit.run.randomness import keyed_uniform

    ids = torch.arange(10_000)
    coins = keyed_uniform(3, 7, 11, ids)
    assert torch.equal(coins[5000:], keyed_uniform(3, 7, 11, ids[5000:]))
    assert 0 <= coins.min() and coins.max() < 1 and abs(coins.mean().item() - 0.5) < 0.02
    assert not torch.equal(coins, keyed_uniform(3, 7, 12, ids))


def test_the_int_hash_is_the_tensor_hash_bit_for_bit():
    # step_seed runs once per micro-batch on Python ints (~1 us, not ~90 us): checkpoints written before keep resuming
    # exactly only if every value is the same, negative and 63-bit keys included.
    import random

    from toolkit.run.randomness import keyed_hash, keyed_hash_int

    rng = random.Random(0)
    keys = [(rng.randrange(2**32), 0x5EED, rng.randrange(-(2**40), 2**40), rng.randrange(64)) for _ in range(5000)]
    keys += [(0, 0, 0, 0), (2**32 - 1, 0x5EED, 2**62, 7), (5, 0x5EED, -1, 0), (-(2**62), 3, 2**63 - 1, 1)]
    assert [keyed_hash_int(*k) for k in keys] == [int(keyed_hash(*map(torch.tensor, k))) for k in keys]
    assert [keyed_hash_int(*k) for k in keys[:50]] == [int(keyed_hash(*k)) for k in keys[:50]]  # ints folded on host


def test_reseeding_the_global_rng_draws_what_torch_manual_seed_draws():
    from toolkit.run.randomness import reseed_global_rng

    torch.manual_seed(1234)
    expected = (torch.rand(5), torch.randn(3), torch.randint(0, 100, (4,)))
    torch.rand(7)  # move the generator on
    reseed_global_rng(1234)
    drawn = (torch.rand(5), torch.randn(3), torch.randint(0, 100, (4,)))
    assert all(a.equal(b) for a, b in zip(expected, drawn, strict=True))


def test_keyed_hash_stays_on_the_tensor_keys_device():
    # Found on the first GPU run: SASRec's negatives hashed (seed, ..., users on cuda, positions, attempt) and the
    # Python int `attempt`, last, brought the hash back to the CPU. The meta device stands in for CUDA here.
    users = torch.arange(4, device="meta").view(-1, 1)
    positions = torch.arange(3).view(1, -1)  # a CPU tensor key, as the recipe passes it
    for keys in [(7, 1, 0, users, positions, 5), (users, 3), (positions, users), (7, users)]:
        assert keyed_hash(*keys).device.type == "meta", keys
        assert keyed_uniform(*keys).device.type == "meta", keys
    assert keyed_hash(7, 1, 0, positions, 5).device.type == "cpu"
    assert keyed_hash(7, 1).device.type == "cpu"
    # the values do not depend on where the keys were: CPU tensors and ints give the int version's bits
    assert keyed_hash(7, 1, torch.tensor(2), 5).item() == keyed_hash_int(7, 1, 2, 5)


def test_keyed_keep_masks_a_sample_the_same_on_any_rank():
    from toolkit.run import randomness

    randomness.begin_micro_batch(seed=1, key=7, rank=0, world_size=1)
    whole = randomness.keyed_keep(6, 11, 0.3, scale=2.0)
    second = randomness.keyed_keep(6, 11, 0.3, scale=2.0)  # the next call in the micro-batch: a new mask
    halves = []
    for rank in range(3):
        randomness.begin_micro_batch(seed=1, key=7, rank=rank, world_size=3)
        halves.append(randomness.keyed_keep(2, 11, 0.3, scale=2.0))
    randomness.end_micro_batches()
    assert whole.shape == (6, 11) and set(whole.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(torch.cat(halves), whole) and not torch.equal(second, whole)
    assert randomness.keyed_keep(6, 11, 0.3) is None  # outside a micro-batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_keep_from_lanes_is_the_comparison_with_the_threshold(dtype):
    """The CPU's float arithmetic (float32, float64) and the comparison (other dtypes, GPUs) give the same mask:
    lanes at or above round(p * 65536) - 32768 kept, every int16 value and both sides of the threshold tried."""
    from toolkit.run.randomness import keep_from_lanes

    lanes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(256, 256)
    for p in (0.0, 0.2, 0.3, 0.5, 0.99):
        expected = (lanes.int() >= round(p * 65536) - 32768).to(dtype)
        assert torch.equal(keep_from_lanes(lanes, p, dtype), expected)
        assert torch.equal(keep_from_lanes(lanes[:, 3:7], p, dtype), expected[:, 3:7])  # a strided view
        assert torch.equal(keep_from_lanes(lanes, p, dtype, scale=2.0), expected * 2)
