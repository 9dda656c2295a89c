"""SASRec / TiSASRec model: mHC equals the plain model at initialisation, causality, the gather/scatter
time-aware attention against a naive reference, training signal into mHC, argument errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from toolkit.models.sasrec import SASRec, sinkhorn

NUM_ITEMS, MAXLEN = 30, 8
SMALL = dict(hidden=8, blocks=2, heads=2, maxlen=MAXLEN, time_span=5)


def batch(seed: int = 0, batch_size: int = 3, length: int = MAXLEN):
    """Left-padded ids and per-user increasing times (0 at padding), one row without padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, NUM_ITEMS + 1, (batch_size, length), generator=g)
    times = torch.randint(0, 4, (batch_size, length), generator=g).cumsum(1) + 1
    for row, pad in enumerate([length // 2, 0, 1][:batch_size]):
        ids[row, :pad], times[row, :pad] = 0, 0
    return ids, times


@pytest.mark.parametrize("time_aware", [False, True])
@pytest.mark.parametrize("norm", ["post", "pre", "original"])
def test_fresh_mhc_equals_plain_model_with_its_weights(norm, time_aware):
    torch.manual_seed(0)
    plain = SASRec(NUM_ITEMS, norm=norm, time_aware=time_aware, **SMALL).eval()
    mhc = SASRec(NUM_ITEMS, norm=norm, time_aware=time_aware, mhc=True, mhc_streams=3, **SMALL).eval()
    result = mhc.load_state_dict(plain.state_dict(), strict=False)
    assert not result.unexpected_keys
    hyper_keys = {key for key in mhc.state_dict() if key.startswith("hyper.")}
    assert hyper_keys and set(result.missing_keys) == hyper_keys
    ids, times = batch()
    with torch.no_grad():
        expected, actual = plain(ids, times), mhc(ids, times)
    assert expected.shape == (3, MAXLEN, 8)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert expected[0, : MAXLEN // 2].abs().max() == 0  # padding positions come out as zeros


@pytest.mark.parametrize("mhc", [False, True])
@pytest.mark.parametrize("time_aware", [False, True])
def test_changing_the_last_item_leaves_earlier_positions_unchanged(time_aware, mhc):
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, norm="pre", time_aware=time_aware, mhc=mhc, **SMALL).eval()
    ids, times = batch()
    changed_ids, changed_times = ids.clone(), times.clone()
    changed_ids[:, -1] = changed_ids[:, -1] % NUM_ITEMS + 1
    changed_times[:, -1] += 3
    with torch.no_grad():
        before, after = model(ids, times), model(changed_ids, changed_times)
    torch.testing.assert_close(after[:, :-1], before[:, :-1], atol=1e-6, rtol=0)
    assert not torch.allclose(after[:, -1], before[:, -1])


def naive_time_attention(attention, query_in, kv_in, positions, intervals):
    """TiSASRec attention written literally with a [B, L, L, d] tensor of per-pair keys and values."""
    batch_size, length, hidden = query_in.shape
    heads = attention.heads
    q, k, v = attention.query(query_in), attention.key(kv_in), attention.value(kv_in)
    # keys[b, i, j] = K_j + P^K_j + R^K[r_ij], likewise values
    keys = k[:, None] + attention.position_key(positions) + attention.interval_key(intervals)
    values = v[:, None] + attention.position_value(positions) + attention.interval_value(intervals)
    q = q.view(batch_size, length, heads, -1)
    keys = keys.view(batch_size, length, length, heads, -1)
    values = values.view(batch_size, length, length, heads, -1)
    logits = torch.einsum("bihe,bijhe->bhij", q, keys) / math.sqrt(hidden // heads)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhij,bijhe->bihe", weights, values).reshape(batch_size, length, hidden)
    return attention.out(out)


def test_time_aware_attention_matches_the_naive_reference():
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, hidden=12, heads=3, maxlen=MAXLEN, time_span=4, time_aware=True, dropout=0.0)
    attention = model.blocks[0].attention
    query_in, kv_in = torch.randn(2, 6, 12), torch.randn(2, 6, 12)
    _, times = batch(batch_size=2, length=6)
    intervals = (times[:, :, None] - times[:, None, :]).abs().clamp(max=4)
    assert intervals.max() == 4 and intervals.min() == 0  # both the clamp and the zero interval are exercised
    positions = torch.arange(MAXLEN - 6, MAXLEN)
    with torch.no_grad():
        expected = naive_time_attention(attention, query_in, kv_in, positions, intervals)
        actual = attention(query_in, kv_in, positions, intervals)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_sinkhorn_is_doubly_stochastic():
    # Seeded, unit-scale logits: with widely spread ones (x3) Sinkhorn converges slowly and 50 iterations left
    # row sums 2.7e-3 off on some draws (a flaky test, not a bug); the model's logits start near identity.
    logits = torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0))
    matrix = sinkhorn(logits, iters=50)
    torch.testing.assert_close(matrix.sum(-1), torch.ones(5, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(matrix.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)


@pytest.mark.parametrize("time_aware", [False, True])
def test_training_steps_move_the_mhc_parameters(time_aware):
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, norm="original", time_aware=time_aware, mhc=True, dropout=0.1, **SMALL)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    initial = {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("hyper.")}
    ids, times = batch()
    targets, negatives = ids % NUM_ITEMS + 1, (ids + 7) % NUM_ITEMS + 1
    for step in range(3):
        hidden = model(ids, times)
        keep = ids > 0
        logits = model.score_items(hidden[keep], torch.stack([targets[keep], negatives[keep]], dim=1))
        labels = torch.zeros_like(logits)
        labels[:, 0] = 1.0
        loss = F.binary_cross_entropy_with_logits(logits, labels)
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        for name in initial:
            grad = model.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all(), name
        optimizer.step()
        if step == 0:  # W gets gradient at once; alpha only once W is non-zero (alpha's gradient is x W . dL)
            for name in initial:
                if ".w_pre" in name or ".w_post" in name:
                    assert not torch.equal(model.get_parameter(name), initial[name]), name
    # Except the last sublayer's H_res: the final mean over streams of H_res X is mean(X) for any doubly
    # stochastic H_res (columns sum to 1), so it has no effect on the output and gets no gradient.
    last_res = {f"hyper.{len(model.hyper) - 1}.{name}" for name in ("w_res", "alpha_res")}
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name in initial and (".w_" in name or ".alpha_" in name) and name not in last_res:
            assert not torch.equal(p, initial[name]), f"{name} did not move"


def test_scores():
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, **SMALL)
    hidden = torch.randn(4, 8)
    everything = model.score_all(hidden)
    assert everything.shape == (4, NUM_ITEMS + 1)
    assert everything[:, 0].abs().max() == 0  # the padding row of the item embedding is zero
    items = torch.randint(1, NUM_ITEMS + 1, (4, 5))
    torch.testing.assert_close(model.score_items(hidden, items), everything.gather(1, items))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [(dict(norm="sandwich"), "norm"), (dict(hidden=10, heads=3), "heads"), (dict(blocks=0), "blocks"),
     (dict(mhc=True, mhc_streams=0), "mhc_streams"), (dict(dropout=1.0), "dropout")],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        SASRec(NUM_ITEMS, **{**SMALL, **kwargs})


def test_bad_inputs_raise_value_error_naming_them():
    ids, times = batch()
    with pytest.raises(ValueError, match="times"):
        SASRec(NUM_ITEMS, time_aware=True, **SMALL)(ids)
    with pytest.raises(ValueError, match="times"):
        SASRec(NUM_ITEMS, time_aware=True, **SMALL)(ids, times[:, 1:])
    with pytest.raises(ValueError, match="maxlen"):
        SASRec(NUM_ITEMS, **SMALL)(torch.ones(2, MAXLEN + 1, dtype=torch.long))


def test_deterministic_interval_values_by_gather_match_scatter_add():
    """--deterministic on CUDA takes the gather path for TiSASRec's interval values (scatter_add_ is atomic there);
    it computes what the scatter_add_ path computes."""
    from toolkit.models.sasrec import interval_value_sum_by_gather

    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(3, 2, 6, 6, generator=generator)
    index = torch.randint(0, 9, (3, 2, 6, 6), generator=generator)
    values = torch.randn(2, 9, 4, generator=generator)
    bins = weights.new_zeros(3, 2, 6, 9).scatter_add_(-1, index, weights)
    assert torch.allclose(interval_value_sum_by_gather(weights, index, values), bins @ values, atol=1e-6)


def keyed_masks(count, shape, p):
    """The keep masks (0/1) that keyed dropout draws for its first `count` calls in micro-batch (seed 3, key 5)."""
    from toolkit.run import randomness

    randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
    masks = [randomness.keyed_keep_mask(shape, p) for _ in range(count)]
    randomness.end_micro_batches()
    return masks


def chunked_attention_mask(batch_size, heads, length, p, chunks):
    """The [B, h, L, L] 0/1 mask that causal_attention_with_dropout applies at its first call in micro-batch (seed 3,
    key 5), written out from its documented layout: keyed_keep for (head, chunk, row, key) of the computed blocks,
    chunk after chunk, each block [rows, stop] row by row; zero right of the chunks (the future, masked anyway)."""
    from toolkit.run import randomness

    per_head = sum((stop - start) * stop for start, stop in chunks)
    randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
    kept = randomness.keyed_keep(batch_size, heads * per_head, p).view(batch_size, heads, per_head)
    randomness.end_micro_batches()
    mask, offset = torch.zeros(batch_size, heads, length, length), 0
    for start, stop in chunks:
        block = kept[:, :, offset:offset + (stop - start) * stop]
        mask[:, :, start:stop, :stop] = block.reshape(batch_size, heads, stop - start, stop)
        offset += (stop - start) * stop
    return mask


@pytest.mark.parametrize("converted", [False, True])
@pytest.mark.parametrize("time_aware", [False, True])
def test_attention_dropout_is_the_literal_formula_with_the_keyed_mask(time_aware, converted):
    """softmax(q k^T / sqrt(d_h) + causal mask), its weights times the keyed 0/1 mask / (1 - p), @ v: the model's
    code and its fast paths (converted: the chunked attention, CausalAttention) compute exactly that, with dropout,
    SASRec's and TiSASRec's."""
    from toolkit import kernels
    from toolkit.models.sasrec import query_chunks
    from toolkit.run import randomness

    torch.manual_seed(0)
    p = 0.3
    model = SASRec(NUM_ITEMS, hidden=12, heads=3, maxlen=MAXLEN, time_span=4, time_aware=time_aware, dropout=p)
    if converted:
        assert set(kernels.convert(model)) == {f"blocks.{i}.{part}" for i in range(2) for part in ("attention", "ffn")}
    attention = model.blocks[0].attention.train()
    x = torch.randn(2, 6, 12)
    _, times = batch(batch_size=2, length=6)
    intervals = (times[:, :, None] - times[:, None, :]).abs().clamp(max=4)
    positions = torch.arange(MAXLEN - 6, MAXLEN)
    if time_aware:  # TiSASRec's mask: keyed_keep_mask of the whole [B, h, L, L]
        (keep,) = keyed_masks(1, (2, 3, 6, 6), p)
    else:
        keep = chunked_attention_mask(2, 3, 6, p, query_chunks(6, x.device))
    with torch.no_grad():
        randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
        actual = attention(x, x, positions, intervals)
        randomness.end_micro_batches()
        q, k, v = (attention._split(layer(x)) for layer in (attention.query, attention.key, attention.value))
        if time_aware:
            keys = k.unsqueeze(-2) + attention._split(attention.position_key(positions)).unsqueeze(-2)
            k_pairs = keys.transpose(-2, -3) + attention._split(attention.interval_key(intervals)).transpose(1, 2)
            logits = (q.unsqueeze(-2) * k_pairs).sum(-1)  # [B, h, i, j]
            values = v + attention._split(attention.position_value(positions))
            v_pairs = values.unsqueeze(-3) + attention._split(attention.interval_value(intervals)).transpose(1, 2)
        else:
            logits = q @ k.transpose(-1, -2)
        future = torch.ones(6, 6, dtype=torch.bool).triu(1)
        weights = (logits / math.sqrt(4)).masked_fill(future, float("-inf")).softmax(-1) * keep / (1 - p)
        out = (weights.unsqueeze(-1) * v_pairs).sum(-2) if time_aware else weights @ v
        expected = attention.out(out.transpose(1, 2).flatten(-2))
    assert 0.1 < (keep[..., ~future] == 0).float().mean() < 0.5
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 13])
def test_plain_attention_with_dropout_is_the_formula_with_the_mask_laid_out_by_query_chunks(length, count, heads,
                                                                                          monkeypatch):
    """The model's causal_attention_with_dropout places the keyed draw where its documented layout says (the
    chunks' blocks, row by row), for any length and chunk count: the mask the chunked kernel applies."""
    from toolkit.models import sasrec
    from toolkit.run import randomness

    monkeypatch.setattr(sasrec, "query_chunks", lambda n, device: sasrec.even_chunks(n, count))
    chunks = sasrec.query_chunks(length, torch.device("cpu"))
    assert len(chunks) == min(length, count) and chunks[0][0] == 0 and chunks[-1][1] == length
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(3, heads, length, 4, generator=g, dtype=torch.float64) for _ in range(3))
    keep = chunked_attention_mask(3, heads, length, 0.25, chunks).double()
    randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
    actual = sasrec.causal_attention_with_dropout(q, k, v, 0.25)
    randomness.end_micro_batches()
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = (q @ k.transpose(-1, -2) / 2).masked_fill(future, float("-inf")).softmax(-1)
    torch.testing.assert_close(actual, (weights * keep / 0.75) @ v, atol=1e-12, rtol=0)


def test_query_chunks_by_device_and_length():
    from toolkit.models.sasrec import query_chunks

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert query_chunks(200, cpu) == [(0, 50), (50, 100), (100, 150), (150, 200)]
    assert query_chunks(150, cpu) == [(0, 50), (50, 100), (100, 150)]
    assert query_chunks(50, cpu) == [(0, 25), (25, 50)]  # the ml-100k preset's maxlen
    assert query_chunks(200, cuda) == [(0, 100), (100, 200)] and query_chunks(1, cpu) == [(0, 1)]
