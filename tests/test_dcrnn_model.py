"""The DCRNN model: random-walk supports, diffusion convolution against a direct computation, the graph's
locality, scheduled sampling (decay and rank-free coins), shapes and a few training steps; the model file's cells
and its fast paths (toolkit/kernels/dcrnn.py: the diffusion's written-out backward, the fused sequence kernel)."""

import copy
import math

import numpy as np
import pytest
import torch

from toolkit import kernels
from toolkit.kernels import dcrnn as dcrnn_kernels
from toolkit.models import dcrnn
from toolkit.models.dcrnn import DCRNN, DiffusionConv, random_walk_supports, sampling_probability
from toolkit.run.randomness import keyed_uniform

# Tiny tensors: one thread (on a busy 2-core machine more threads mostly wait for each other).
torch.set_num_threads(1)
CHAIN = np.array([[1.0, 0.5, 0.0], [0.0, 1.0, 0.8], [0.2, 0.0, 1.0]])  # a directed 3-node graph


def fast(model: DCRNN) -> DCRNN:
    """The model with its fast paths swapped in (toolkit.kernels.convert, as --kernels auto does; no proof)."""
    kernels.convert(model)
    fused = model.sequence_kernel == "fused"  # (on a CPU: the fused kernel is swapped in where asked for)
    assert (type(model) is dcrnn_kernels.DCRNN) == fused and type(model.diffusion) is dcrnn_kernels.GraphDiffusion
    model.__class__ = dcrnn_kernels.DCRNN  # its methods (kernel_for, fused_forward) called by the tests below
    return model


def cells(model: DCRNN, *args) -> torch.Tensor:
    """The model file's forward, the cells (on a converted model: through its fast diffusion)."""
    return dcrnn.DCRNN.forward(model, *args)


def test_dual_random_walk_supports_against_hand_computed_matrices():
    forward, backward = random_walk_supports(CHAIN).double()
    out_degree = CHAIN.sum(axis=1, keepdims=True)
    in_degree = CHAIN.sum(axis=0, keepdims=True)
    assert np.allclose(forward.numpy(), (CHAIN / out_degree).T, atol=1e-7)  # D_out^-1 A, transposed (gather)
    assert np.allclose(backward.numpy(), (CHAIN.T / in_degree.T).T, atol=1e-7)  # D_in^-1 A^T, transposed
    assert torch.allclose(forward.sum(dim=0), torch.ones(3, dtype=torch.float64))  # each walk row sums to 1
    isolated = random_walk_supports(np.zeros((2, 2)))
    assert torch.equal(isolated, torch.zeros(2, 2, 2))  # no degree: no walk, no division by zero


def test_diffusion_convolution_matches_the_direct_sum_over_supports_and_steps():
    torch.manual_seed(0)
    supports = random_walk_supports(CHAIN)
    conv = DiffusionConv(supports, in_features=4, out_features=5, steps=2, bias_start=0.0)
    x = torch.randn(3, 7, 4)  # [N, B, F]
    # by hand: for each support S: S x, 2 S (S x) - x (the reference code's recurrence), features ordered by matrix
    diffused = [x]
    for s in supports:
        first = torch.einsum("nm,mbf->nbf", s, x)
        diffused += [first, 2 * torch.einsum("nm,mbf->nbf", s, first) - x]
    expected = torch.cat(diffused, dim=-1) @ conv.linear.weight.T + conv.linear.bias
    assert torch.allclose(conv(x), expected, atol=1e-5)
    assert conv.linear.in_features == 4 * (2 * 2 + 1)


def test_an_unconnected_sensor_is_not_affected_by_the_others():
    adjacency = np.eye(4)
    adjacency[1, 2] = adjacency[2, 3] = adjacency[3, 1] = 0.7  # sensors 1-3 connected, sensor 0 alone
    torch.manual_seed(0)
    model = DCRNN(adjacency, units=8, layers=2, diffusion_steps=2).eval()
    x = torch.randn(2, 12, 4, 2)
    changed = x.clone()
    changed[:, :, 3] += 3.0  # perturb sensor 3
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert a.shape == (2, 12, 4)
    assert torch.equal(a[:, :, 0], b[:, :, 0])  # sensor 0 cannot see it
    assert (a[:, :, 1] - b[:, :, 1]).abs().max() > 1e-4  # its neighbours do


def test_scheduled_sampling_feeds_the_truth_only_where_the_coin_says():
    torch.manual_seed(1)
    model = DCRNN(CHAIN, units=8, layers=1).eval()
    x = torch.randn(3, 12, 3, 2)
    truth = torch.randn(3, 12, 3)
    never = torch.zeros(3, 12, dtype=torch.bool)
    with torch.no_grad():
        free = model(x)
        assert torch.equal(model(x, truth, never), free)  # no coin: the decoder feeds back its own predictions
        coins = never.clone()
        coins[1, 4] = True  # sample 1 gets the truth after decoder step 4
        forced = model(x, truth, coins)
    assert torch.equal(forced[[0, 2]], free[[0, 2]])
    assert torch.equal(forced[1, :5], free[1, :5]) and not torch.equal(forced[1, 5], free[1, 5])


def test_inverse_sigmoid_decay():
    k = 2000
    assert sampling_probability(0, k) == pytest.approx(k / (k + 1))
    assert sampling_probability(10 * k, k) == pytest.approx(k / (k + math.exp(10)))
    values = [sampling_probability(s, k) for s in range(0, 40000, 1000)]
    assert all(a > b for a, b in zip(values, values[1:], strict=False)) and values[-1] < 1e-3
    assert sampling_probability(5, 0) == 0.0  # no scheduled sampling: never the truth
    assert sampling_probability(10**9, 1.0) < 1e-300  # no overflow


def test_coins_of_a_window_do_not_depend_on_which_rank_holds_it():
    windows = torch.arange(100, 164)
    horizon = torch.arange(12)[None, :]
    whole = keyed_uniform(0, 3, 17, windows[:, None], horizon)
    halves = [keyed_uniform(0, 3, 17, part[:, None], horizon) for part in windows.chunk(2)]
    assert torch.equal(torch.cat(halves), whole)
    assert not torch.equal(whole, keyed_uniform(0, 3, 18, windows[:, None], horizon))  # new coins every step


def test_a_few_adam_steps_lower_the_error():
    torch.manual_seed(0)
    model = DCRNN(CHAIN, units=8, layers=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    t = torch.arange(24.0)
    series = torch.sin(t / 4)[None, :, None].expand(8, 24, 3) + 0.1 * torch.arange(8.0)[:, None, None]
    x = torch.stack([series[:, :12], torch.zeros(8, 12, 3)], dim=-1)
    y = series[:, 12:]
    losses = []
    for _ in range(30):
        loss = (model(x) - y).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def assert_low_precision_close_to_float64(model, adjacency, x, teacher, coins, out, weights, eps):
    """A forward under autocast (out) and its float32 gradients are within the low dtype's rounding (eps) of the
    float64 recurrence's: the output within 2 eps (and above eps/32: it did compute in low precision), the gradients
    within 4 eps in all and 16 eps per parameter."""
    grads = torch.autograd.grad((out.float() * weights).sum(), list(model.parameters()))
    model64 = copy.deepcopy(model).double()
    reference = _recurrence_dcrnn(model64, adjacency, x.double(), teacher.double(), coins)
    expected = torch.autograd.grad((reference * weights.double()).sum(), list(model64.parameters()))
    error = (out.double() - reference).abs().max().item()
    assert eps / 32 < error < 2 * eps, (error, eps)
    flat = torch.cat([g.double().flatten() for g in grads]), torch.cat([g.flatten() for g in expected])
    assert (flat[0] - flat[1]).norm() < 4 * eps * flat[1].norm(), ((flat[0] - flat[1]).norm() / flat[1].norm(), eps)
    for (name, _), got, want in zip(model.named_parameters(), grads, expected, strict=True):
        assert got.dtype == torch.float32 and (got.double() - want).norm() < 16 * eps * want.norm(), name


def _recurrence_dcrnn(model, adjacency, x, teacher=None, use_teacher=None):
    """The straightforward formulation, with `model`'s parameters: per conv, the recurrence x_k = 2 S x_{k-1} - x_{k-2}
    over each support, the 2K + 1 copies of [input, state] concatenated (matrix-major) into one linear map per gate."""
    supports = random_walk_supports(adjacency).to(x.dtype)

    def conv(linear, inputs):  # inputs [B, N, F]
        diffused = [inputs]
        for s in supports:
            previous, current = inputs, torch.einsum("nm,bmf->bnf", s, inputs)
            diffused.append(current)
            for _ in range(2, model.encoder[0].gates.matrices // 2 + 1):
                previous, current = current, 2 * torch.einsum("nm,bmf->bnf", s, current) - previous
                diffused.append(current)
        return torch.cat(diffused, dim=-1) @ linear.weight.T + linear.bias

    def cell(c, inputs, state):
        reset, update = torch.sigmoid(conv(c.gates.linear, torch.cat([inputs, state], -1))).chunk(2, -1)
        candidate = torch.tanh(conv(c.candidate.linear, torch.cat([inputs, reset * state], -1)))
        return update * state + (1 - update) * candidate

    batch = x.shape[0]
    states = [x.new_zeros(batch, model.nodes, model.units) for _ in model.encoder]
    for t in range(x.shape[1]):
        inputs = x[:, t]
        for i, c in enumerate(model.encoder):
            states[i] = inputs = cell(c, inputs, states[i])
    step_input, outputs = x.new_zeros(batch, model.nodes, model.output_dim), []
    for t in range(model.horizon):
        inputs = step_input
        for i, c in enumerate(model.decoder):
            states[i] = inputs = cell(c, inputs, states[i])
        prediction = model.projection(inputs)
        outputs.append(prediction[..., 0])
        step_input = prediction
        if use_teacher is not None:
            step_input = torch.where(use_teacher[:, t, None, None], teacher[:, t, :, None], prediction)
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("converted", [False, True], ids=["plain", "converted"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_model_equals_the_recurrence_formulation_in_float64_values_and_gradients(steps, sparse, converted,
                                                                                   monkeypatch):
    # The model file's cells (autograd through the diffusion's product), and converted (the diffusion's backward
    # written out, toolkit/kernels/dcrnn.py's _DiffuseFlat)
    monkeypatch.setattr(dcrnn, "SPARSE_DENSITY", 2.0 if sparse else 0.0)  # force the product's path
    rng = np.random.default_rng(steps)
    adjacency = (rng.random((6, 6)) < 0.4) * rng.random((6, 6)) + np.eye(6)
    adjacency[5] = adjacency[:, 5] = 0  # a sensor without degree: rows of zeros in both walks
    torch.manual_seed(steps)
    model = DCRNN(adjacency, units=5, layers=2, diffusion_steps=steps, horizon=4).double()
    if converted:
        fast(model)
    x = torch.randn(3, 12, 6, 2, dtype=torch.float64)
    teacher = torch.randn(3, 4, 6, dtype=torch.float64)
    coins = torch.rand(3, 4) < 0.5
    ours = model(x, teacher, coins)
    assert model.diffusion.operator(x)[0].is_sparse == sparse
    reference = _recurrence_dcrnn(model, adjacency, x, teacher, coins)
    assert ours.shape == reference.shape == (3, 4, 6)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-10)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), list(model.parameters()))
    expected = torch.autograd.grad((reference * weights).sum(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-10), name


def test_the_diffusion_is_sparse_on_a_sparse_graph_and_dense_on_a_dense_one():
    ring = np.eye(40) + np.roll(np.eye(40), 1, axis=1)  # each sensor feeds the next: T_1, T_2 are 2-3 diagonals
    x = torch.zeros(40, 1, 1)
    assert DCRNN(ring, units=4).diffusion.operator(x)[0].is_sparse
    assert not DCRNN(CHAIN, units=4).diffusion.operator(x)[0].is_sparse  # 3 nodes: the powers fill in


def _train(model, dtype, steps=6):
    """Adam steps on a smooth series (every sensor alike), under CPU autocast to `dtype` (None: fp32): the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.03, eps=1e-3)
    series = torch.sin(torch.arange(24.0) / 4)[None, :, None] + 0.1 * torch.arange(4.0)[:, None, None]
    series = series.expand(4, 24, model.nodes)
    x, y = torch.stack([series[:, :12], torch.zeros(4, 12, model.nodes)], dim=-1), series[:, 12:]
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = (model(x) - y).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


RING = np.eye(40) + np.roll(np.eye(40), 1, axis=1)  # each sensor feeds the next: a sparse diffusion


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sparse, adjacency", [(True, RING), (False, CHAIN)], ids=["sparse", "dense"])
def test_trains_under_autocast_on_either_path(sparse, adjacency, dtype):
    # Against the float64 recurrence (_recurrence_dcrnn: no stacked operator, no sparse or dense path of its own) with
    # the same weights: the forward in low precision is within 2 eps of the dtype (eps: 2**-7 bf16, 2**-10 fp16;
    # measured 0.36-0.5 eps, outputs ~0.5) and does show its rounding (> eps / 32; fp32 is ~1e-7 off); the gradients
    # are within 4 eps of the reference in norm over all parameters and 16 eps for each parameter (measured, seeds
    # 0-5: <= 1.7 and <= 5.6 eps). Then 6 Adam steps under autocast against an fp32 run from the same weights: the
    # first loss within 2 eps (measured <= 0.16), the last under half the first, and within 5% of the fp32 run's
    # (seed 0: <= 0.1%; rounding compounds over steps, up to 10% for some seeds, so no tighter per-step match).
    eps = torch.finfo(dtype).eps
    nodes = adjacency.shape[0]
    torch.manual_seed(0)
    model = DCRNN(adjacency, units=4)
    x, teacher, coins = torch.randn(2, 12, nodes, 2), torch.randn(2, 12, nodes), torch.rand(2, 12) < 0.5
    weights = torch.randn(2, 12, nodes)
    assert model.diffusion.operator(x)[0].is_sparse == sparse  # the fp32 diffusions take this path
    with torch.autocast("cpu", dtype=dtype):
        out = model(x, teacher, coins)
    assert out.dtype == dtype
    assert {key[1] for key in model.diffusion._cache} == {torch.float32, dtype}  # fp32 and low-precision diffusions
    assert_low_precision_close_to_float64(model, adjacency, x, teacher, coins, out, weights, eps)

    torch.manual_seed(0)
    low = _train(DCRNN(adjacency, units=4), dtype)
    torch.manual_seed(0)
    full = _train(DCRNN(adjacency, units=4), None)
    assert abs(low[0] - full[0]) < 2 * eps * full[0], (low, full)
    assert low[-1] < 0.5 * low[0] and abs(low[-1] - full[-1]) < 0.05 * full[-1], (low, full)  # fp32: 0.93 -> 0.23


def test_under_autocast_the_operator_is_built_once_per_dtype():
    # bf16 autocast diffuses float32 inputs and bf16 states in turn; a one-entry cache rebuilt the operator 22 times a
    # forward (a conversion and a host sync for its density each time: a GPU stall in every diffusion).
    ring = np.eye(40) + np.roll(np.eye(40), 1, axis=1)
    model = DCRNN(ring, units=4)
    built = []
    real_to = torch.Tensor.to

    def forward_once():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 12, 40, 2), torch.randn(2, 12, 40), torch.rand(2, 12) < 0.5).float().sum().backward()

    def counting_to(tensor, *args, **kwargs):
        if tensor is model.diffusion.stacked:
            built.append(kwargs.get("dtype"))
        return real_to(tensor, *args, **kwargs)

    forward_once()
    first = dict(model.diffusion._cache)
    assert sorted(str(key[1]) for key in first) == ["torch.bfloat16", "torch.float32"]
    torch.Tensor.to = counting_to
    try:
        forward_once()
    finally:
        torch.Tensor.to = real_to
    assert built == []  # the second forward built nothing
    assert all(model.diffusion._cache[key][0] is first[key][0] for key in first)


@pytest.mark.parametrize("layers, converted", [(1, True), (2, True), (1, False)],
                         ids=["1-layer-converted", "2-layers-converted", "1-layer-plain"])
def test_compile_traces_the_whole_forward_as_one_graph(layers, converted):
    # --compile: the diffusion's cached operator (a data pointer in its key, a host value for its density) broke the
    # graph at every diffusion, 28 graphs a forward, and iterating the ModuleList in a comprehension made dynamo fall
    # back to eager for the whole forward. Dynamo's own tracing (the eager backend: no inductor, seconds) must see
    # one graph, and the compiled forward computes what the eager one does.
    ring = np.eye(20) + np.roll(np.eye(20), 1, axis=1)  # sparse: the eager model uses its sparse path
    torch.manual_seed(0)
    model = DCRNN(ring, units=4, layers=layers)
    if converted:  # what --kernels auto compiles: the cells, through the diffusion's written-out backward
        fast(model)
    args = (torch.randn(2, 12, 20, 2), torch.randn(2, 12, 20), torch.rand(2, 12) < 0.5)
    explained = torch._dynamo.explain(model)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-6)  # dense in the graph, sparse eager


# ---- the fused sequence kernel (toolkit/kernels/dcrnn.py): the same function as the cells, in far fewer kernels -----


def test_the_sequence_kernel_is_fused_on_cuda_and_the_cells_on_cpu_unless_named(monkeypatch):
    model = fast(DCRNN(CHAIN, units=4))
    assert (model.kernel_for("cpu"), model.kernel_for(torch.device("cuda", 0))) == ("cells", "fused")
    for named in ("fused", "cells"):
        assert {fast(DCRNN(CHAIN, units=4, sequence_kernel=named)).kernel_for(d) for d in ("cpu", "cuda")} == {named}
    with pytest.raises(ValueError, match="sequence_kernel 'fast'"):
        DCRNN(CHAIN, units=4, sequence_kernel="fast")
    x = torch.randn(2, 12, 3, 2)
    # the model file's forward is the cells, whatever the model is told (--kernels plain); converted, "fused" is
    # the fused kernel
    torch.manual_seed(0)
    plain = DCRNN(CHAIN, units=4, sequence_kernel="fused")
    assert torch.equal(plain(x), cells(plain, x))
    converted, taken = fast(copy.deepcopy(plain)), []
    fused_forward = dcrnn_kernels.DCRNN.fused_forward
    monkeypatch.setattr(dcrnn_kernels.DCRNN, "fused_forward", lambda *args: taken.append(1) or fused_forward(*args))
    assert torch.allclose(converted(x), plain(x), atol=1e-6) and taken == [1]
    # traced by torch.compile, even a model told "fused" runs the cells (the fused kernel does not trace)
    monkeypatch.setattr(dcrnn_kernels.DCRNN, "fused_forward", lambda *args: pytest.fail("the fused kernel traced"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert converted(x).shape == (2, 12, 3)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@pytest.mark.parametrize(
    "layers, input_dim, output_dim, forcing",
    [(1, 2, 1, True), (2, 2, 1, True), (2, 7, 1, False), (3, 3, 2, True)],  # 7 inputs > 5 units: the widest block
    ids=["1-layer", "2-layers", "2-layers-wide-input-no-teacher", "3-layers-2-outputs"],
)
def test_fused_kernel_equals_the_cells_in_float64_values_and_gradients(layers, input_dim, output_dim, forcing,
                                                                         sparse, monkeypatch):
    # The fused kernel (one autograd Function: the encoder's layers as a wavefront, a hand-written backward) against
    # the cells (a DCGRUCell step at a time, autograd): values and the gradients of the parameters, of the input and
    # of the teacher values, to float64 rounding.
    monkeypatch.setattr(dcrnn_kernels, "FUSED_SPARSE_DENSITY", 2.0 if sparse else 0.0)  # force the products' path
    rng = np.random.default_rng(layers)
    adjacency = (rng.random((6, 6)) < 0.4) * rng.random((6, 6)) + np.eye(6)
    torch.manual_seed(layers)
    model = DCRNN(adjacency, input_dim=input_dim, output_dim=output_dim, units=5, layers=layers, horizon=5).double()
    fast(model)
    x = torch.randn(3, 4, 6, input_dim, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True) if forcing else None
    coins = torch.rand(3, 5) < 0.5 if forcing else None
    inputs = [x, teacher] if forcing else [x]
    ours, reference = model.fused_forward(x, teacher, coins), cells(model, x, teacher, coins)
    assert dcrnn_kernels.fused_sparse(model.diffusion, x.device, x.dtype) == sparse
    assert {operator.layout for operator in dcrnn_kernels.fused_operators(model.diffusion).cache.values()} == {
        torch.sparse_csr if sparse else torch.strided}
    assert ours.shape == reference.shape == (3, 5, 6)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-12)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), [*inputs, *model.parameters()])
    expected = torch.autograd.grad((reference * weights).sum(), [*inputs, *model.parameters()])
    names = ["x", "teacher"][:len(inputs)] + [name for name, _ in model.named_parameters()]
    for name, got, want in zip(names, grads, expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), name


def test_fused_kernel_in_its_cuda_form_equals_the_cells_in_float64(monkeypatch):
    # What differs on CUDA, taken on CPU: dense operators (batched products) and no reused scratch buffers (the
    # products allocate their outputs, as CUDA's caching allocator makes cheap). No GPU run has checked it.
    monkeypatch.setattr(dcrnn_kernels, "FUSED_SPARSE_DENSITY", 0.0)
    monkeypatch.setattr(dcrnn_kernels._Run, "scratch", lambda self, name, rows, columns: None)
    torch.manual_seed(0)
    model = fast(DCRNN(RING[:8, :8], units=5, layers=2, horizon=4).double())
    x = torch.randn(3, 5, 8, 2, dtype=torch.float64)
    teacher, coins = torch.randn(3, 4, 8, dtype=torch.float64), torch.rand(3, 4) < 0.5
    ours, reference = model.fused_forward(x, teacher, coins), cells(model, x, teacher, coins)
    assert dcrnn_kernels._state(model).scratch == {} and torch.allclose(ours, reference, rtol=0, atol=1e-12)
    weights = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * weights).sum(), list(model.parameters()))
    expected = torch.autograd.grad((reference * weights).sum(), list(model.parameters()))
    for (name, _), got, want in zip(model.named_parameters(), grads, expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("adjacency", [RING, CHAIN], ids=["sparse", "dense"])
def test_fused_kernel_under_autocast_is_within_the_dtypes_rounding(adjacency, dtype):
    # As test_trains_under_autocast_on_either_path for the cells: against the float64 recurrence, the forward within
    # 2 eps (measured 0.17-0.42 eps), the gradients within 4 eps in norm and 16 eps per parameter (measured <= 1.11,
    # 5.6); the products run in the autocast dtype (its operators only), the parameters' gradients in float32.
    eps, nodes = torch.finfo(dtype).eps, adjacency.shape[0]
    torch.manual_seed(0)
    model = fast(DCRNN(adjacency, units=4, sequence_kernel="fused"))
    x, teacher, coins = torch.randn(2, 12, nodes, 2), torch.randn(2, 12, nodes), torch.rand(2, 12) < 0.5
    weights = torch.randn(2, 12, nodes)
    with torch.autocast("cpu", dtype=dtype):
        out = model(x, teacher, coins)
    assert out.dtype == dtype and model.diffusion._cache == {}  # the cells' operators unused
    assert {key[1] for key in dcrnn_kernels.fused_operators(model.diffusion).cache} == {dtype}
    assert_low_precision_close_to_float64(model, adjacency, x, teacher, coins, out, weights, eps)


def test_under_autocast_the_fused_kernels_operators_are_built_once(monkeypatch):
    # A forward and its backward use the diffusion matrices as "spread" and its transpose "collect" (dense in bf16);
    # each is built once for its device and dtype, then reused: a rebuild is a conversion every diffusion.
    model = fast(DCRNN(RING, units=4, sequence_kernel="fused"))
    operators = dcrnn_kernels.fused_operators(model.diffusion).cache

    def forward_once():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 12, 40, 2), torch.randn(2, 12, 40), torch.rand(2, 12) < 0.5).float().sum().backward()

    forward_once()
    first = dict(operators)
    assert sorted((key[1], key[2]) for key in first) == [(torch.bfloat16, "collect"), (torch.bfloat16, "spread")]
    built = []
    monkeypatch.setattr(dcrnn_kernels, "fused_matrix", lambda diffusion, kind: built.append(kind))
    forward_once()
    assert built == []  # the second forward built nothing
    assert all(operators[key] is first[key] for key in first)


def test_the_fused_kernels_reused_buffers_never_serve_two_live_forwards():
    # The fused kernel takes its buffers from a pool on the model and gives them back after its backward (or at once
    # when no backward can come). Predictions kept from an earlier forward, and two forwards backpropagated in either
    # order (gradient accumulation), must not see each other's buffers.
    ring = np.eye(20) + np.roll(np.eye(20), 1, axis=1)
    torch.manual_seed(0)
    model = fast(DCRNN(ring, units=4, sequence_kernel="fused"))
    x1, x2 = torch.randn(2, 12, 20, 2), torch.randn(2, 12, 20, 2)
    with torch.no_grad():
        kept = model(x1)
        copy_of_kept = kept.clone()
        model(x2)
    assert torch.equal(kept, copy_of_kept)

    def grads(loss):
        return torch.autograd.grad(loss, list(model.parameters()))

    alone = [a + b for a, b in zip(grads(model(x1).sum()), grads((model(x2) ** 2).sum()), strict=True)]
    first, second = model(x1).sum(), (model(x2) ** 2).sum()
    together = [a + b for a, b in zip(grads(second), grads(first), strict=True)]  # the later forward first
    for got, want in zip(together, alone, strict=True):
        assert torch.equal(got, want)
    out = model(x1)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once per forward"):
        out.sum().backward()
    fresh = fast(DCRNN(ring, units=4, sequence_kernel="fused"))
    with torch.inference_mode():  # buffers made there cannot be written outside it: not kept for training
        fresh(x1)
    fresh(x1).sum().backward()


def test_a_training_step_of_the_cpu_preset_model_fused_dispatches_a_third_of_the_cells_kernels():
    # The kernels of a forward and backward depend on the steps and layers, not on the sizes. Fused:
    # 9 a cell step forward, 11 backward, the encoder's 2 layers as one wavefront (13 steps), the decoder's 24 cells,
    # the fed-back value 1 + 1 a decoder step, and a few dozen for the whole sequence: 799 (with the loss's sum and
    # its gradient, 801). The cells: 2,882.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.kernels += not func.is_view
            return func(*args, **(kwargs or {}))

    ring = np.eye(20) + np.roll(np.eye(20), 1, axis=1)
    x, teacher, coins = torch.randn(4, 12, 20, 2), torch.randn(4, 12, 20), torch.rand(4, 12) < 0.5
    counts = {}
    for kernel in ("fused", "cells"):
        model = fast(DCRNN(ring, units=16, layers=2, diffusion_steps=2, sequence_kernel=kernel))
        model(x, teacher, coins).sum().backward()  # operators built, buffers pooled
        model.zero_grad(set_to_none=True)
        with Count() as count:
            model(x, teacher, coins).sum().backward()
        counts[kernel] = count.kernels
    assert counts["fused"] <= 820 and counts["cells"] > 2500, counts  # measured 801 and 2,882
