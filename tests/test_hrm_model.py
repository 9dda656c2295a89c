"""The HRM model's parts against hand-made cases and references: ACT halting on hand-set Q values (max steps, q_halt >
q_continue in training, never early in evaluation), the carry (halted rows replaced, running rows kept), the
exploration draws (hashed on the host, then per row) equal to keyed_uniform's, stablemax cross-entropy against a
float64 reference, AdamATan2 against adam-atan2 0.0.3's kernel formula (one parameter and several), the sparse
SignSGD on the batch's rows (its leaf made once and cleared by zero_grad), and that update in a real 2-process gloo
run equal to one process with the same global batch. The CPU-time paths: the target-Q segment's first
position equal to the whole segment's, a block without gradient equal bit for bit to the one with it, RMSNorm's
written-out gradient, and the oneDNN products and Functions (equal bit for bit to autograd through their parts)."""

from __future__ import annotations

import itertools
import json
import math
import textwrap

import pytest
import torch
from conftest import run_recipe

from toolkit.kernels import convert, onednn
from toolkit.kernels import hrm as hrm_kernels
from toolkit.models import hrm as hrm_module
from toolkit.models.hrm import (
    HRM,
    AdamATan2,
    PuzzleEmbedding,
    SparseSignSGD,
    act_losses,
    fold_key,
    stablemax_cross_entropy,
)
from toolkit.run import precision
from toolkit.run.randomness import keyed_hash, keyed_hash_int, keyed_uniform

VOCAB, CELLS, MAX_STEPS = 11, 9, 4


def tiny_model(kernels: bool = True, **changes) -> HRM:
    """A small HRM; with `kernels` (what a run trains under --kernels auto) its CPU kernels swapped in."""
    torch.manual_seed(0)
    settings = dict(num_puzzle_ids=3, hidden=16, heads=2, expansion=2.0, h_layers=1, l_layers=1, h_cycles=2,
                    l_cycles=2, halt_max_steps=MAX_STEPS, exploration_prob=0.0)
    model = HRM(VOCAB, CELLS, **{**settings, **changes})
    if kernels:
        convert(model)
    return model


def batch(rows: int = 4, first_id: int = 0) -> dict:
    generator = torch.Generator().manual_seed(first_id)
    labels = torch.randint(2, VOCAB, (rows, CELLS), generator=generator)
    inputs = torch.where(torch.rand(rows, CELLS, generator=generator) < 0.3, 1, labels)
    return {"inputs": inputs, "labels": labels, "puzzle_ids": torch.arange(rows) % 3,
            "ids": torch.arange(first_id, first_id + rows)}


def set_q(model: HRM, q_halt: float, q_continue: float) -> None:
    """Q head constant: every row gets these (q_halt, q_continue) logits whatever its state."""
    with torch.no_grad():
        model.q_head.weight.zero_()
        model.q_head.bias.copy_(torch.tensor([q_halt, q_continue]))


def segments_until_halted(model: HRM, explore_key=None) -> list[list[bool]]:
    """The halted flags after each of MAX_STEPS segments on one batch (the same batch offered every time)."""
    data = batch()
    carry, flags = model.initial_carry(data), []
    for _ in range(MAX_STEPS):
        with torch.no_grad():
            out = model(carry, data, explore_key=explore_key)
        carry = out["carry"]
        flags.append(out["halted"].tolist())
    return flags


def test_training_halts_at_max_steps_when_continuing_looks_better():
    model = tiny_model().train()
    set_q(model, q_halt=-3.0, q_continue=2.0)
    assert segments_until_halted(model) == [[False] * 4] * (MAX_STEPS - 1) + [[True] * 4]


def test_training_halts_as_soon_as_q_halt_exceeds_q_continue():
    model = tiny_model().train()
    set_q(model, q_halt=2.0, q_continue=-3.0)
    flags = segments_until_halted(model)
    assert flags == [[True] * 4] * MAX_STEPS  # every segment: halted rows restart, halt again after one step
    data = batch()
    out = model(model.initial_carry(data), data)
    assert out["steps"].tolist() == [1] * 4


def test_evaluation_never_halts_early():
    model = tiny_model().eval()
    set_q(model, q_halt=5.0, q_continue=-5.0)
    assert segments_until_halted(model) == [[False] * 4] * (MAX_STEPS - 1) + [[True] * 4]


def test_exploration_forces_a_minimum_of_segments_keyed_by_sample():
    model = tiny_model(exploration_prob=1.0).train()  # every row explores: a minimum of 2..MAX_STEPS segments
    set_q(model, q_halt=2.0, q_continue=-3.0)
    flags = segments_until_halted(model, explore_key=(0, 11, 1))
    halted_at = [next(i + 1 for i, step in enumerate(flags) if step[row]) for row in range(4)]
    assert all(2 <= when <= MAX_STEPS for when in halted_at), halted_at
    again = segments_until_halted(model, explore_key=(0, 11, 1))
    assert again == flags  # keyed: the same coins every time


def test_fold_key_is_keyed_hash_bit_for_bit():
    # The integer keys hashed on the host (keyed_hash_int), the tensor ones folded on: keyed_hash's values exactly,
    # for any int64 key (negative ones and those past 2**32 included).
    generator = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randint(-2**63, 2**63 - 1, (20000,), generator=generator),
                      torch.randint(0, 2**33, (20000,), generator=generator),
                      torch.tensor([0, 1, -1, 2**32 - 1, 2**32, -2**32, 2**63 - 1, -2**63])])
    for prefix in [(0, 11, 5), (3, 12), (2**40, -7, 1)]:
        assert torch.equal(fold_key(keyed_hash_int(*prefix), keys), keyed_hash(*prefix, keys))
        assert torch.equal(fold_key(keyed_hash(*prefix), keys), keyed_hash(*prefix, keys))
        epochs, puzzles = keys[:100].abs() % 1000, keys[100:200]
        assert torch.equal(fold_key(fold_key(keyed_hash_int(*prefix), epochs), puzzles),
                           keyed_hash(*prefix, epochs, puzzles))


@pytest.mark.parametrize("probability", [0.0, 0.1, 1 / 3, 0.5, 1.0])
def test_exploration_draws_are_keyed_uniforms_compared_as_integers(probability):
    # forward's coin (hash < ceil(p 2**32)) and minimum (2 + (hash (max - 1) >> 32)) decide as keyed_uniform does.
    model = tiny_model(exploration_prob=probability)
    ids, key = torch.arange(-5, 50000), (7, 11, 3)
    coin, draw = fold_key(model.exploration_key(key, "cpu"), ids).unbind()
    assert torch.equal(coin < model.coin_threshold, keyed_uniform(*key, 0, ids) < probability)
    assert torch.equal(2 + (draw * (MAX_STEPS - 1) >> 32),
                       2 + (keyed_uniform(*key, 1, ids) * (MAX_STEPS - 1)).long())


def test_a_training_forward_reuses_its_embedding_leaf_and_zero_grad_clears_it():
    model = tiny_model().train()
    data = batch()
    optimizer = SparseSignSGD(model.puzzle_emb, lr=0.5, weight_decay=0.0)
    leaves = []
    for _ in range(2):
        act_losses(model(model.initial_carry(data), data))[0].backward()
        leaves.append(model.puzzle_emb.batch_rows)
        assert leaves[-1].grad is not None and torch.equal(model.puzzle_emb.batch_ids, data["puzzle_ids"])
        optimizer.step()
        optimizer.zero_grad()
        assert leaves[-1].grad is None and model.puzzle_emb.batch_ids is None
    assert leaves[0] is leaves[1]  # made once for the batch size (before a compiled forward, in HRM.__call__)
    table = model.puzzle_emb.table.clone()
    optimizer.step()  # no training forward since zero_grad: nothing to update
    assert torch.equal(model.puzzle_emb.table, table)
    with torch.no_grad():  # evaluation and no-grad calls read the table, no leaf
        model.eval()(model.initial_carry(data), data)
    assert model.puzzle_emb.batch_ids is None


def test_carry_replaces_halted_rows_and_keeps_running_ones():
    model = tiny_model().train()
    set_q(model, q_halt=-3.0, q_continue=2.0)
    first, second = batch(first_id=0), batch(first_id=100)
    out = model(model.initial_carry(first), first)
    carry = out["carry"]
    carry["halted"] = torch.tensor([True, False, True, False])  # rows 0 and 2 done: they take the new batch's rows
    out = model(carry, second)
    assert out["carry"]["data_ids"].tolist() == [100, 1, 102, 3]
    assert out["steps"].tolist() == [1, 2, 1, 2]
    assert torch.equal(out["labels"][1], first["labels"][1]) and torch.equal(out["labels"][0], second["labels"][0])
    # A replaced row starts from the initial state: the same output as that row run alone from a fresh carry.
    fresh = model(model.initial_carry(second), second)
    assert torch.allclose(out["logits"][0], fresh["logits"][0], atol=1e-6)
    assert not torch.allclose(out["logits"][1], fresh["logits"][1], atol=1e-3)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_the_target_q_segment_computes_the_first_position_as_the_whole_segment_does(positions):
    """segment(..., logits=False), the target-Q pass, runs H's last block at the first position only (its query
    against every position's key and value): the same z_L, and the same first position and Q values as the whole
    segment, in float64."""
    model = tiny_model(h_layers=2, l_layers=2, positions=positions).double()
    with torch.no_grad():
        model.q_head.weight.normal_(0, 0.3)
        data = batch()
        x = model.embed(data["inputs"], data["puzzle_ids"])
        z_h, z_l = torch.randn(2, *x.shape, dtype=torch.float64)
        whole_h, whole_l, _, whole_q = model.segment(z_h, z_l, x)
        first_h, first_l, logits, first_q = model.segment(z_h, z_l, x, logits=False)
    assert logits is None and first_h.shape == (len(x), 1, x.shape[-1])
    assert torch.equal(first_l, whole_l)
    torch.testing.assert_close(first_h[:, 0], whole_h[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(first_q, whole_q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("positions", ["rope", "learned"])
@pytest.mark.parametrize("sizes", ["tiny", "onednn", "mkl"])
def test_a_block_without_gradient_computes_what_it_does_with_gradient_and_leaves_its_input(positions, sizes,
                                                                                          monkeypatch):
    """Without gradient a block writes its sums, norms, rotation and SwiGLU product over its own temporaries (at
    toolkit.kernels.onednn's sizes, gate and up as two products, silu and the product over gate): the same values, bit
    for bit, as the autograd path (there, the OneDNN Functions), by either library, and the state it was given
    unchanged."""
    hidden = 16 if sizes == "tiny" else 64  # 64: 16 x 82 rows by 64 by 512, 43M multiply-adds
    if sizes != "tiny":
        if not onednn.available():
            pytest.skip("this torch has no oneDNN")
        monkeypatch.setattr(onednn, "products_by", lambda: sizes)
    model = tiny_model(h_layers=2, positions=positions, **({} if sizes == "tiny" else {"hidden": 64, "heads": 4}))
    x = torch.randn(4 if sizes == "tiny" else 16, CELLS + 1, hidden)
    kept = x.clone()
    with torch.no_grad():
        without = model.h_level(x, x.flip(0), model.rotary)
    with_gradient = model.h_level(x, x.flip(0), model.rotary)
    assert with_gradient.requires_grad and torch.equal(x, kept)
    assert torch.equal(without, with_gradient.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotary_rotates_q_and_k_side_by_side_as_the_reference_rotates_each(dtype):
    """Rotary rotates q's and k's heads as they lie in qkv's rows (tables repeated over the heads, halves swapped by a
    cat): bit for bit the reference's q cos + rotate_half(q) sin per head (float32 tables; bfloat16 cast back), with
    and without gradient, rows strided as in qkv."""
    batch, length, heads, head_dim = 3, CELLS + 1, 2, 8
    rotary = hrm_module.Rotary(head_dim, length, heads)
    qkv = torch.randn(batch, length, 3 * heads * head_dim).to(dtype)
    qk = qkv[..., :2 * heads * head_dim]
    kept, kept_v = qk.clone(), qkv[..., 2 * heads * head_dim:].clone()
    angles = torch.outer(torch.arange(length, dtype=torch.float32),
                         1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x = qk.unflatten(-1, (2 * heads, head_dim)).float()
    halves = (x[..., head_dim // 2:], x[..., :head_dim // 2])
    want = (x * cos.unsqueeze(-2) + torch.cat([-halves[0], halves[1]], -1) * sin.unsqueeze(-2)).to(dtype)
    with torch.no_grad():
        without = rotary(qk)
    with_gradient = rotary(qk.clone().requires_grad_())
    assert without.dtype == dtype and torch.equal(qk, kept)
    assert torch.equal(without, want.flatten(-2)) and torch.equal(with_gradient.detach(), want.flatten(-2))
    # k's heads alone and q's at the first position alone (the target-Q segment's last block): those parts
    k_alone, q_first = qk[..., heads * head_dim:].clone(), qk[:, :1, :heads * head_dim].clone()
    assert torch.equal(rotary(k_alone), want.flatten(-2)[..., heads * head_dim:])
    assert torch.equal(rotary(q_first), want.flatten(-2)[:, :1, :heads * head_dim])
    with torch.no_grad():  # over a temporary of the caller's (as Attention's qkv), in place in the tables' dtype
        rotated = rotary.rotate_temporary(qk)
    assert (rotated is qk) == (dtype == rotary.cos.dtype) and torch.equal(rotated, want.flatten(-2))
    assert torch.equal(qkv[..., 2 * heads * head_dim:], kept_v)


def test_rms_norm_gradient_is_autograd_s_of_its_formula():
    """The kernel's written-out RMSNorm gradient, r (g - y mean(g y)), against autograd through the model's formula,
    in float64; and bfloat16 in, bfloat16 out (normalised in float32), with a gradient."""
    torch.manual_seed(3)
    rms_norm, plain = hrm_kernels.RMSNorm(), hrm_module.RMSNorm()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 8, dtype=torch.float64)
    (ours,) = torch.autograd.grad(rms_norm(x), x, g)
    (formula,) = torch.autograd.grad(plain(x), x, g)
    torch.testing.assert_close(ours, formula, rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(rms_norm, (x,))
    half = x.detach().to(torch.bfloat16).requires_grad_()
    out = rms_norm(half)
    out.float().sum().backward()
    assert out.dtype == half.grad.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(rms_norm(half), out) and torch.equal(plain(half), out)


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("library", ["onednn", "mkl"])
@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_onednn_attention_and_swiglu_compute_what_autograd_through_their_parts_does(positions, library, monkeypatch):
    """In float32 on the CPU, Attention and SwiGLU with gradient are one autograd Function each (oneDNN's or MKL's
    products, whichever the machine runs faster; the backward written over the forward's temporaries): the same
    outputs and gradients, bit for bit, as autograd through the same modules' parts (their path where oneDNN is not
    taken); a second backward through them is refused; float64 takes the parts."""
    monkeypatch.setattr(onednn, "products_by", lambda: library)
    model = tiny_model(hidden=64, heads=4, positions=positions)  # 160 rows: products of 2M and 5M multiply-adds
    block = model.h_level.blocks[0]
    for part, inputs in [(block.attention, (model.rotary,)), (block.mlp, ())]:
        results = []
        for by_parts in (False, True):
            with monkeypatch.context() as patch:
                if by_parts:
                    patch.setattr(hrm_kernels, "by_onednn", lambda *_: False)
                x = torch.randn(16, CELLS + 1, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
                out = part(x, *inputs)
            fused = type(out.grad_fn.next_functions[0][0]).__name__.startswith(("OneDNNAttention", "OneDNNSwiGLU"))
            assert fused != by_parts
            out.backward(torch.ones_like(out) / 7)
            results.append([out.detach(), x.grad, *[p.grad for p in part.parameters()]])
            part.zero_grad(set_to_none=True)
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want)
        again = part(torch.randn(16, CELLS + 1, 64, requires_grad=True), *inputs).sum()
        again.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="runs once per forward"):
            again.backward()
    double = tiny_model(hidden=64, heads=4, positions=positions).double()
    out = double.h_level.blocks[0].attention(torch.randn(16, CELLS + 1, 64, dtype=torch.float64, requires_grad=True),
                                             double.rotary)
    assert not type(out.grad_fn.next_functions[0][0]).__name__.startswith(("OneDNNAttention", "OneDNNSwiGLU"))


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("library", ["onednn", "mkl"])
def test_linear_multiplies_by_onednn_in_float32_on_the_cpu_and_by_f_linear_otherwise(library, monkeypatch):
    """Linear's oneDNN products (forward, and both gradients; MKL's where that is the faster) equal F.linear's to
    float32 rounding; a product under ~1M multiply-adds, float64 and autocast take F.linear itself."""
    monkeypatch.setattr(onednn, "products_by", lambda: library)
    torch.manual_seed(4)
    layer = hrm_kernels.Linear(64, 192)
    x = torch.randn(2, 80, 64, requires_grad=True)  # 160 x 64 x 192 = 2M multiply-adds
    g = torch.randn(2, 80, 192)
    got = layer(x)
    assert type(got.grad_fn.next_functions[0][0]).__name__ == "OneDNNLinearBackward"
    grads = torch.autograd.grad(got, (x, layer.weight), g)
    want = torch.nn.functional.linear(x, layer.weight)
    for a, b in zip((got, *grads), (want, *torch.autograd.grad(want, (x, layer.weight), g)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    threads = torch.get_num_threads()
    try:  # at 1 thread and at 2: the kernels split the work differently (MKL's x.T g differs by g's layout at 1)
        for count, (rows, inputs, outputs) in itertools.product(
                (1, 2), [(5248, 64, 512), (5248, 256, 64), (5248, 64, 192)]):  # HRM's, either side wider
            torch.set_num_threads(count)
            xs, gs = torch.randn(rows, inputs), torch.randn(rows, outputs)
            weight_gradient = onednn.weight_gradient(xs, gs)
            assert weight_gradient.shape == (outputs, inputs) and weight_gradient.is_contiguous()
            torch.testing.assert_close(weight_gradient, gs.t() @ xs, rtol=1e-4, atol=1e-3)
            # the same values whether g's transpose is at hand (SwiGLU's transposed Function) or g itself
            assert torch.equal(onednn.weight_gradient(xs, gs.t().contiguous().t()), weight_gradient)
    finally:
        torch.set_num_threads(threads)
    small = x[:, :4]  # 8 rows: 98k multiply-adds
    assert torch.equal(layer(small), torch.nn.functional.linear(small, layer.weight))
    assert torch.equal(layer.double()(x.double()), torch.nn.functional.linear(x.double(), layer.weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.float()(x).dtype == torch.bfloat16


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
def test_products_go_to_mkl_where_it_runs_avx512_kernels_and_to_onednn_elsewhere(tmp_path, monkeypatch):
    """MKL's GEMM takes AVX-512 kernels on Intel's CPUs alone: there the products are MKL's, on AMD's (MKL's AVX2
    kernels) oneDNN's, and MKL_ENABLE_INSTRUCTIONS below AVX-512 (an AVX2 machine emulated) makes them oneDNN's."""
    assert onednn.mkl_runs_avx512("GenuineIntel", "AVX512", "")
    assert onednn.mkl_runs_avx512("GenuineIntel", "AVX512", "AVX512_E4")
    assert not onednn.mkl_runs_avx512("GenuineIntel", "AVX512", "AVX2")
    assert not onednn.mkl_runs_avx512("GenuineIntel", "AVX2", "")
    assert not onednn.mkl_runs_avx512("AuthenticAMD", "AVX512", "")
    assert not onednn.mkl_runs_avx512("", "DEFAULT", "")  # Arm: no vendor_id line
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    try:
        for vendor, cap, library in [("GenuineIntel", "", "mkl"), ("AuthenticAMD", "", "onednn"),
                                     ("GenuineIntel", "AVX2", "onednn")]:
            (tmp_path / vendor).write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2 avx512f\n")
            monkeypatch.setenv("TOOLKIT_CPUINFO", str(tmp_path / vendor))
            monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", cap)
            onednn.products_by.cache_clear()
            assert (precision.cpu_vendor(), onednn.products_by()) == (vendor, library)
    finally:
        monkeypatch.undo()
        onednn.products_by.cache_clear()  # this machine's own again
    monkeypatch.setattr(onednn, "products_by", lambda: "mkl")
    x, w = torch.randn(300, 64), torch.randn(192, 64)
    assert torch.equal(onednn.product(x, w), torch.mm(x, w.t()))
    monkeypatch.setattr(onednn, "products_by", lambda: "onednn")
    assert torch.equal(onednn.product(x, w), torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))


def test_stablemax_cross_entropy_matches_a_float64_reference():
    torch.manual_seed(1)
    logits = (torch.randn(3, 5, VOCAB) * 4).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (3, 5))
    labels[0, 0] = -100  # ignored
    got = stablemax_cross_entropy(logits, labels)
    assert got.dtype == torch.float64
    for b in range(3):
        for t in range(5):
            if labels[b, t] == -100:
                assert got[b, t].item() == 0.0
                continue
            row = [float(v) for v in logits[b, t].float()]
            s = [1.0 / (1.0 - v) if v < 0 else v + 1.0 for v in row]
            expected = -math.log(s[labels[b, t]] / sum(s))
            assert got[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_act_losses_count_only_halted_rows_in_the_metrics():
    model = tiny_model().train()
    set_q(model, q_halt=-3.0, q_continue=2.0)
    data = batch()
    out = model(model.initial_carry(data), data)
    out["halted"] = torch.tensor([True, False, False, True])
    loss, sums = act_losses(out)
    assert sums["rows"].item() == 4 and sums["count"].item() == 2
    blanks = (data["inputs"] == 1)[[0, 3]].sum().item()
    assert sums["blank_cells"].item() == blanks
    assert loss.item() == pytest.approx(sums["lm_loss"].item() + 0.5 * (sums["q_halt_loss"].item()
                                                                     + sums["q_continue_loss"].item()), rel=1e-5)


def adam_atan2_0_0_3(p, m, v, grad, t, lr, b1, b2, wd):
    """adam-atan2 0.0.3's kernel (csrc/adam_atan2.cu, adam_math) transcribed in float64 lists: step_size = lr / bc1,
    denom = sqrt(v) / sqrt(bc2), p -= step_size * atan2(m, denom); the moments by lerp, decay before the update."""
    bc1, bc2_sqrt = 1 - b1**t, math.sqrt(1 - b2**t)
    for i, g in enumerate(grad):
        p[i] *= 1 - lr * wd
        m[i] = m[i] + (1 - b1) * (g - m[i])
        v[i] = v[i] + (1 - b2) * (g * g - v[i])
        p[i] -= (lr / bc1) * math.atan2(m[i], math.sqrt(v[i]) / bc2_sqrt)


def test_adam_atan2_is_adam_atan2_0_0_3():
    torch.manual_seed(2)
    start = torch.randn(2, 5, dtype=torch.float64)
    param = torch.nn.Parameter(start.clone())
    lr, (b1, b2), wd = 0.01, (0.9, 0.95), 0.1
    optimizer = AdamATan2([param], lr=lr, betas=(b1, b2), weight_decay=wd)
    p, m, v = start.flatten().tolist(), [0.0] * 10, [0.0] * 10
    for t in range(1, 7):
        grad = torch.randn(2, 5, dtype=torch.float64) * (10.0 ** (t - 3))  # scales from 1e-2 to 1e3
        param.grad = grad.clone()
        optimizer.step()
        adam_atan2_0_0_3(p, m, v, grad.flatten().tolist(), t, lr, b1, b2, wd)
        assert param.detach().flatten().tolist() == pytest.approx(p, rel=1e-12, abs=1e-15), t
    # The bias correction outside atan2 matters: putting 1/(1 - b1) inside it (m_hat) gives another first step.
    first = torch.nn.Parameter(start.clone())
    grad = torch.randn(2, 5, dtype=torch.float64)
    first.grad = grad.clone()
    AdamATan2([first], lr=lr, betas=(b1, b2)).step()
    inside = start - lr * torch.atan2(grad, grad.abs())  # atan2(m_hat, sqrt(v_hat)) = atan2(g, |g|) at t = 1
    assert (first.detach() - inside).abs().max() > 1e-4
    scaled = torch.nn.Parameter(start.clone())  # scale invariant: gradients x 1000 give the same steps (wd 0)
    plain = torch.nn.Parameter(start.clone())
    for grads, prm in [(1000.0, scaled), (1.0, plain)]:
        opt = AdamATan2([prm], lr=lr)
        for t in range(3):
            prm.grad = grads * torch.linspace(-1, 1, 10, dtype=torch.float64).view(2, 5) * (t + 1)
            opt.step()
    assert torch.allclose(scaled, plain, rtol=0, atol=1e-12)


def test_adam_atan2_steps_several_parameters_as_each_alone():
    # The foreach ops and the one atan2 over the concatenated moments: each parameter as the formula has it, sizes
    # that are no multiple of a vector's width included, with a parameter that has no gradient left untouched.
    torch.manual_seed(3)
    shapes = [(3, 7), (5,), (2, 3, 4), (1,), (33,)]
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in shapes]
    idle = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    lr, (b1, b2), wd = 0.01, (0.9, 0.95), 0.1
    optimizer = AdamATan2([*params, idle], lr=lr, betas=(b1, b2), weight_decay=wd)
    state = [(p.detach().flatten().tolist(), [0.0] * p.numel(), [0.0] * p.numel()) for p in params]
    start_idle = idle.detach().clone()
    for t in range(1, 5):
        grads = [torch.randn(p.shape, dtype=torch.float64) * 10.0 ** (t - 2) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for p, g, (flat, m, v) in zip(params, grads, state, strict=True):
            adam_atan2_0_0_3(flat, m, v, g.flatten().tolist(), t, lr, b1, b2, wd)
            assert p.detach().flatten().tolist() == pytest.approx(flat, rel=1e-12, abs=1e-15), (t, p.shape)
    assert torch.equal(idle.detach(), start_idle) and idle not in optimizer.state


def test_sparse_sign_sgd_updates_only_the_batch_rows_with_summed_duplicates():
    embedding = PuzzleEmbedding(5, 3).train()
    with torch.no_grad():
        embedding.table.copy_(torch.arange(15, dtype=torch.float32).view(5, 3))
    before = embedding.table.clone()
    ids = torch.tensor([1, 3, 1])
    rows = embedding(ids)
    # Row 1 appears twice: gradients (+2, -1, 0) and (-3, +1, 0) sum to (-1, 0, 0); row 3 gets (0, 5, -5).
    (rows * torch.tensor([[2.0, -1, 0], [0, 5, -5], [-3, 1, 0]])).sum().backward()
    lr, wd = 0.5, 0.1
    SparseSignSGD(embedding, lr, wd).step()
    expected = before.clone()
    expected[1] = before[1] * (1 - lr * wd) - lr * torch.tensor([-1.0, 0, 0])
    expected[3] = before[3] * (1 - lr * wd) - lr * torch.tensor([0.0, 1, -1])
    assert torch.equal(embedding.table, expected)


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from toolkit.process import begin_process
    begin_process()  # first: it ends the process group at exit (toolkit.process.shutdown)
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from toolkit.models.hrm import PuzzleEmbedding, SparseSignSGD

    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    ids = torch.tensor(json.loads(sys.argv[2]))
    grads = torch.tensor(json.loads(sys.argv[3]))
    embedding = PuzzleEmbedding(6, 4).train()
    embedding.table.copy_(torch.linspace(-1, 1, 24).view(6, 4))
    optimizer = SparseSignSGD(embedding, lr=0.25, weight_decay=0.5, gather=accelerator.gather)
    share = len(ids) // world
    mine = slice(rank * share, (rank + 1) * share)
    for step in range(3):
        rows = embedding(ids[mine])
        (rows * grads[mine] * (step + 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    json.dump({"world_size": dist.get_world_size() if dist.is_initialized() else 1, "rank": rank,
               "table": embedding.table.tolist()}, open(f"{sys.argv[1]}/rank{rank}.json", "w"))
    """
)


@pytest.mark.slow
def test_two_gloo_processes_update_the_table_as_one_process(tmp_path):
    # Id 2 is in both ranks' halves with opposite-signed gradients (it only sums right when gathered); id 4 twice.
    ids = [2, 4, 0, 4, 2, 5]
    grads = [[1, -2, 3, 0], [1, 1, 1, 1], [0, 0, -1, 2], [-3, 1, -1, 1], [-4, 1, -3, 0], [5, -5, 0, 1]]
    outputs = {}
    for config in (None, "cpu_2proc.yaml"):
        out = tmp_path / str(config)
        out.mkdir()
        script = out / "sparse.py"
        script.write_text(SCRIPT)
        run_recipe([str(out), json.dumps(ids), json.dumps(grads)], config=config, recipe=str(script), timeout=300)
        outputs[config] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    one, two = outputs[None], outputs["cpu_2proc.yaml"]
    assert [(r["rank"], r["world_size"]) for r in one] == [(0, 1)]
    assert [(r["rank"], r["world_size"]) for r in two] == [(0, 2), (1, 2)]
    assert one[0]["table"] == two[0]["table"] == two[1]["table"]  # bit for bit, on every rank
    table = torch.tensor(one[0]["table"])
    start = torch.linspace(-1, 1, 24).view(6, 4)
    assert torch.equal(table[[1, 3]], start[[1, 3]])  # rows never in a batch are untouched (no decay either)
    # Id 2: summed gradient (-3, -1, 0, 0) -> sign (-1, -1, 0, 0); three steps of decay 1 - 0.25 * 0.5.
    expected = start[2].clone()
    for _ in range(3):
        expected = expected * (1 - 0.125) - 0.25 * torch.tensor([-1.0, -1, 0, 0])
    assert torch.allclose(table[2], expected, atol=1e-6)


def test_a_temporary_injection_takes_the_sum_only_where_it_has_the_sum_s_dtype():
    """ReasoningModule(injection_is_temporary=True) writes state + injection over the injection (the segment's own
    z_h + x), the same values as without; a bfloat16 injection to a float32 state is not narrowed to bfloat16."""
    module = hrm_module.ReasoningModule(1, 16, 2, 2.0)
    state = torch.randn(2, CELLS + 1, 16)
    for dtype in (torch.float32, torch.bfloat16):
        injection = torch.randn(2, CELLS + 1, 16).to(dtype)
        with torch.no_grad():
            want = module(state, injection.clone(), None)
            got = module(state, temporary := injection.clone(), None, injection_is_temporary=True)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
        assert torch.equal(temporary, injection) == (dtype == torch.bfloat16)  # float32: written over
