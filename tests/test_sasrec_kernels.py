"""SASRec's fast paths (toolkit/kernels/sasrec.py): the chunked attention with dropout against the model's formula,
forward and backward, with the same keyed mask; oneDNN's linear layers against F.linear; the proof at a run's start
passes for the model as written and refuses an edit to its SelfAttention, naming it."""

import pytest
import torch
import torch.nn.functional as F
from test_sasrec_model import NUM_ITEMS, batch, chunked_attention_mask

from toolkit import kernels
from toolkit.errors import UsageError
from toolkit.kernels import sasrec as fast
from toolkit.models import sasrec
from toolkit.models.sasrec import SASRec
from toolkit.run import randomness

ATTENTIONS = {"plain": sasrec.causal_attention_with_dropout, "kernel": fast.causal_attention_with_dropout}


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 13])
def test_attention_in_query_chunks_is_the_models_formula_with_its_mask(length, count, heads, monkeypatch):
    """The chunks skip the all-future blocks: any length, odd or 1, any chunk count (the CPU's 2 to 4, a GPU's 2)
    and one head or more give the model's formula (the literal one, with the keyed mask in its documented layout),
    forward and backward (CausalAttention's written-out gradients)."""
    monkeypatch.setattr(sasrec, "query_chunks", lambda n, device: sasrec.even_chunks(n, count))
    chunks = sasrec.query_chunks(length, torch.device("cpu"))
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(3, heads, length, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    keep = chunked_attention_mask(3, heads, length, 0.25, chunks).double()
    results = {}
    for name, attention in ATTENTIONS.items():
        randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
        results[name] = attention(q, k, v, 0.25)
        randomness.end_micro_batches()
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = (q @ k.transpose(-1, -2) / 2).masked_fill(future, float("-inf")).softmax(-1)
    expected = (weights * keep / 0.75) @ v
    upstream = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    for name, actual in results.items():
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0, msg=name)
        grads = torch.autograd.grad(actual, (q, k, v), upstream)
        for part, got, want in zip("qkv", grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=f"{name} {part}")


@pytest.mark.parametrize("implementation", ATTENTIONS)
def test_attention_masks_a_sample_the_same_on_any_rank(implementation):
    """The keyed mask: two ranks holding half the micro-batch each compute the rows of one."""
    attention = ATTENTIONS[implementation]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 1, 10, 4, generator=g) for _ in range(3))
    randomness.begin_micro_batch(seed=3, key=5, rank=0, world_size=1)
    whole = attention(q, k, v, 0.2)
    halves = []
    for rank in range(2):
        randomness.begin_micro_batch(seed=3, key=5, rank=rank, world_size=2)
        rows = slice(2 * rank, 2 * rank + 2)
        halves.append(attention(q[rows], k[rows], v[rows], 0.2))
    randomness.end_micro_batches()
    torch.testing.assert_close(torch.cat(halves), whole, atol=0, rtol=0)


@pytest.mark.parametrize("implementation", ATTENTIONS)
def test_attention_dropout_outside_a_micro_batch_is_plain_dropout(implementation):
    """No key announced (a model trained outside the loop): torch's generator, still 0 or 1 / (1 - p) per weight,
    drawn in the same layout by the model's code and the kernel (the same numbers from the same seed)."""
    def first_call(attention):
        torch.manual_seed(0)
        q, k, v = torch.randn(2, 1, 6, 4), torch.randn(2, 1, 6, 4), torch.ones(2, 1, 6, 4)
        return (q, k, v), attention(q, k, v, 0.5)  # v all ones: each output is the sum of the kept weights * 2

    attention = ATTENTIONS[implementation]
    inputs, out = first_call(attention)
    assert out.shape == (2, 1, 6, 4) and torch.isfinite(out).all()
    assert not torch.equal(out, attention(*inputs, 0.5))  # a new mask each call
    other = ATTENTIONS["kernel" if implementation == "plain" else "plain"]
    torch.testing.assert_close(first_call(other)[1], out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("library", ["onednn", "mkl"])
def test_onednn_linear_is_f_linear_forward_and_backward(library, monkeypatch):
    """The CPU's float32 linear layers (oneDNN's inner product; MKL's GEMM where that runs AVX-512 kernels) compute
    F.linear and its gradients, up to rounding; under autocast and in other dtypes F.linear itself runs."""
    from toolkit.kernels import onednn
    from toolkit.kernels.sasrec import linear

    monkeypatch.setattr(onednn, "products_by", lambda: library)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=g, requires_grad=True)
    weight, bias = torch.randn(6, 5, generator=g, requires_grad=True), torch.randn(6, generator=g, requires_grad=True)
    upstream = torch.randn(3, 7, 6, generator=g)
    actual = linear(x, weight, bias)
    assert type(actual.grad_fn).__name__ == "OneDNNLinearBackward"  # oneDNN's, not F.linear's
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(actual, (x, weight, bias), upstream)
    for got, want in zip(grads, torch.autograd.grad(expected, (x, weight, bias), upstream), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    (grad_x,) = torch.autograd.grad(linear(x, weight, None), x, upstream)  # without a bias
    torch.testing.assert_close(grad_x, upstream @ weight, atol=1e-5, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, weight, bias).dtype == torch.bfloat16
    assert linear(x.double(), weight.double(), bias.double()).dtype == torch.float64


def sasrec_and_example(heads: int = 1, **settings):
    """A SASRec in training mode (dropout on) and the recipe's kind of example: hidden states and two items' scores."""
    torch.manual_seed(0)
    model = SASRec(NUM_ITEMS, **{**dict(hidden=8, blocks=2, heads=heads, maxlen=8, time_span=5, dropout=0.3),
                                 **settings})
    ids, times = batch(batch_size=2)
    targets = ids % NUM_ITEMS + 1

    def example(m):
        hidden = m(ids, times if m.time_aware else None)
        return hidden, m.score_items(hidden, torch.stack([targets, ids], dim=-1))

    return model, example


@pytest.mark.parametrize("settings", [dict(), dict(norm="original"), dict(time_aware=True, mhc=True),
                                      dict(mhc=True, norm="pre")], ids=["sasrec", "original-ln", "tisasrec-mhc",
                                                                        "sasrec-mhc-pre-ln"])
@pytest.mark.parametrize("heads", [1, 2])
def test_the_proof_passes_for_the_model_as_written(heads, settings):
    model, example = sasrec_and_example(heads, **settings)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    swapped = kernels.with_kernels(model, "auto", example)
    assert set(swapped) == {f"blocks.{i}.{part}" for i in range(2) for part in ("attention", "ffn")}
    assert type(model.blocks[0].attention) is fast.SelfAttention and type(model.blocks[1].ffn) is fast.FeedForward
    assert model.training and all(torch.equal(value, state[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("time_aware", [False, True])
def test_an_edit_to_the_models_attention_is_refused_under_auto_and_trained_under_plain(time_aware, monkeypatch):
    """The model's SelfAttention edited (its output halved) and its fast path not: --kernels auto refuses, in one
    line naming SelfAttention; --kernels plain takes the model as written."""
    written = sasrec.SelfAttention.forward
    monkeypatch.setattr(sasrec.SelfAttention, "forward", lambda self, *args: 0.5 * written(self, *args))
    model, example = sasrec_and_example(time_aware=time_aware)
    with pytest.raises(UsageError) as refused:
        kernels.with_kernels(model, "auto", example)
    message = str(refused.value)
    assert "\n" not in message and "SelfAttention" in message and "blocks.0.attention" in message
    model, example = sasrec_and_example(time_aware=time_aware)
    assert kernels.with_kernels(model, "plain", example) == []
    assert type(model.blocks[0].attention) is sasrec.SelfAttention
