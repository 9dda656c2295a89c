"""DCRNN (Li et al., ICLR 2018): an encoder-decoder of diffusion-convolution GRU cells over a road graph.

Diffusion convolution with dual random-walk supports: the forward walk D_out^-1 A and the backward walk
D_in^-1 A^T (as the reference code, transposed, so a node gathers from its neighbours), each applied K times with
the reference code's recurrence x_k = 2 S x_{k-1} - x_{k-2}; the 2K + 1 diffused copies of [input, state] feed one
linear map per gate. The encoder reads 12 steps; the decoder starts from a zero GO symbol and feeds back either
its own last prediction or, with scheduled sampling, the true value, with probability k / (k + exp(step / k))
(inverse-sigmoid decay). The coins are per (sample, decoder step) and come from the caller (keyed_uniform in the
recipe), so they depend on neither the rank nor the process count, and a resumed run draws the same ones.

How it is computed (the same function as the recurrence, up to rounding): the recurrence started from x_0 = x gives
x_k = T_k(S) x with the matrix polynomials T_0 = I, T_1 = S, T_k = 2 S T_{k-1} - T_{k-2}. They are computed once
(GraphDiffusion) and stacked with I into one [(2K + 1) N, N] matrix, so x and all its diffused copies are ONE
product, instead of 2K dependent products, the 2 a - b passes and a concatenation. Road graphs are sparse (a sensor
has a few neighbours), and so are the low powers of the walks: on CPU the stacked matrix is a sparse COO tensor
when few enough entries are non-zero (SPARSE_DENSITY), which cuts the diffusion's work several-fold. And the
diffusion acts on each feature apart while the linear map sums over features, so each gate's map splits into x's
part and the state's part (DCGRUCell): x's diffusions serve the reset/update gates and the candidate, and a layer's
new state is diffused once, as the layer above's input now and as its own state at the next step. Per cell step
only the new state and reset * state are diffused (the reference diffuses [x, state] and [x, r * state]).

Two sequence kernels compute this (DCRNN(sequence_kernel=...); the recipe's --sequence-kernel): the cells above
(DCRNN.cells_forward, autograd's backward), and the fused kernel (DCRNN.fused_forward). On a GPU the kernel launches of
a step are what limit this model: the cells launch ~3,000 per optimizer step of the recipe, most of them autograd's
for 48 small cell steps. The fused kernel is one autograd Function over the whole sequence with a hand-written
backward (_FusedDCRNN), ~930:

- the rows are batch-major (sample, node), and the stacking puts the matrix index inside the node's, so the
  diffusion [(sample, node, m), feature] of a [(sample, node), feature] block IS the linear maps' input
  [(sample, node), (m, feature)]: one sparse (or batched dense) product, no layout copy;
- every state lives in one buffer R [rows, B * N, width], a row holding [input | h^0 | h^1 | ...] blocks each with a
  trailing column of ones (the biases are weight rows, at m = 0 where T_0 = I keeps ones ones), skewed so that the
  cell of layer l at time t reads ONE window, row t + l, blocks l and l + 1 = [h^{l-1}_t | h^l_{t-1}], and writes
  h^l_t where its two readers look for it: no concatenation and no copy per step;
- a cell step is 9 kernels forward (the window's diffusion, one product for the reset/update gates and the
  candidate's input part, sigmoid, reset * state, its diffusion, the candidate's product, tanh, the state update in
  two) and 11 backward (the derivatives written side by side into one buffer, the same products transposed, the
  gradients accumulated in place into a gradient buffer laid out as R); the weight gradients of all the steps are a
  few products at the end, not one per step per weight;
- the encoder has no feedback, so its layers run as a wavefront: at step s layer l computes time s - l, all layers
  in the same kernels (one window, block-banded weights), 12 + L - 1 steps instead of 12 L. The cells before a
  layer's first step and after its last are computed and harmless: the first get an update gate of exactly 1 (their
  state stays exactly 0, and every gradient they pass on is exactly 0), the last touch only rows no real cell reads;
- the decoder (its prediction fed back: no wavefront) runs cell by cell, 12 L steps; the fed-back value is one
  batched product a step (the true value where the coin came up, else the projection), the predictions one product;
- all the parameters are packed into the fused layout by one gather a forward (index maps built once) and their
  gradients unpacked by one gather; the run's buffers come from a pool on the model (new pages every step cost
  more than the products on CPU).
The price: the wavefront's banded weights and the candidate's zero block are products with zeros, and each window is
diffused whole (each state twice): on CPU, where launches cost nothing, a step of the cpu preset's model is ~1.2x the
cells' (benchmarks/README.md), so sequence_kernel="auto" takes the fused kernel on CUDA only. On CPU in float32 /
float64 its diffusion operators are sparse CSR tensors (block-diagonal over the samples) when few enough entries are
non-zero (FUSED_SPARSE_DENSITY); otherwise dense, expanded over the samples for bmm. Under autocast its products run
in the autocast dtype, the states and their gradients in the parameters' dtype. torch.compile traces the cells.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from typing import Literal

import numpy as np
import torch
from torch import nn

# Below this fraction of non-zeros in the stacked [I; T_k(S)] the diffusion is a sparse product on CPU. Measured
# (one thread, forward + backward of GraphDiffusion, K=2): the generated 50-sensor network (6.7% non-zeros, B*F =
# 64*32) sparse 1.8 ms, dense 3.1 ms; 207 sensors, B*F = 64*128: 2.5% non-zeros sparse 117 ms, dense 256 ms; 25%:
# sparse 377 ms, dense 262 ms; 43%: 586 ms, 253 ms. The sparse time grows with the non-zeros, the dense one does
# not: they cross near 15%.
SPARSE_DENSITY = 0.15
# The same for the fused sequence kernel's operators (CSR, block-diagonal over the samples; dense ones are batched
# products). Measured (one thread, batch 64, a 36-column window's diffusion; the sparse time grows with the non-zeros,
# the dense one does not): 50 nodes, 5% non-zeros CSR 0.16 ms, dense 0.72 ms; 24%: 0.49, 0.73; 37%: 0.74, 0.69; 207
# nodes, 1%: 0.8, 12.6; 19%: 7.3, 12.6; 34%: 12.9, 12.5. They cross near 35%.
FUSED_SPARSE_DENSITY = 0.3
_CACHED_OPERATORS = 16  # fused operators kept, (device, dtype, kind, blocks): train, eval and the backward's counts
SEQUENCE_KERNELS = ("auto", "fused", "cells")


def random_walk_supports(adjacency: np.ndarray | torch.Tensor) -> torch.Tensor:
    """[2, N, N] float32: (D_out^-1 A)^T and (D_in^-1 A^T)^T, rows of zero degree left zero."""
    a = torch.as_tensor(np.asarray(adjacency), dtype=torch.float64)

    def walk(matrix):
        degree = matrix.sum(dim=1, keepdim=True)
        return torch.where(degree > 0, matrix / degree.clamp_min(1e-12), torch.zeros_like(matrix))

    return torch.stack([walk(a).T, walk(a.T).T]).float()


def sampling_probability(step: int, decay_steps: float) -> float:
    """Probability of feeding the true value to the decoder at optimizer step `step`: k / (k + exp(step / k))."""
    if decay_steps <= 0:
        return 0.0
    return decay_steps / (decay_steps + math.exp(min(step / decay_steps, 700.0)))


def diffusion_polynomials(supports: torch.Tensor, steps: int) -> torch.Tensor:
    """[S * K, N, N] float64: T_1(S), ..., T_K(S) for each support S (T_0 = I, T_1 = S, T_k = 2 S T_{k-1} - T_{k-2}),
    so that the recurrence x_k = 2 S x_{k-1} - x_{k-2} from x_0 = x is x_k = T_k(S) x. Computed in float64 from the
    supports as given (float32 in the model), so the only difference to the recurrence is rounding."""
    supports = supports.double()
    eye = torch.eye(supports.shape[-1], dtype=torch.float64)
    polynomials = []
    for support in supports:
        previous, current = eye, support
        for _ in range(steps):
            polynomials.append(current)
            previous, current = current, 2 * (support @ current) - previous
    if not polynomials:
        return supports.new_zeros(0, *supports.shape[1:])
    return torch.stack(polynomials)


def _product(matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(matrix, x) if matrix.is_sparse else matrix @ x


class _DiffuseFlat(torch.autograd.Function):
    """x [N, B, F] -> [N * B, M * F]: the stacked [I; T_k(S)] times x, laid out as a linear map's input (features
    ordered (matrix, feature)). One autograd node for the product and its layout copy, in both directions: each
    cell step diffuses twice, and the Python and autograd cost of the separate views, permutes and copies was a
    visible share of the step. The matrices are constants (no gradient); the transposed one is kept, as a coalesced
    sparse tensor where sparse, so the backward pass does not transpose on every call."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, matrix: torch.Tensor, transposed: torch.Tensor) -> torch.Tensor:
        nodes, batch, features = x.shape
        matrices = matrix.shape[0] // nodes
        ctx.transposed, ctx.shape = transposed, (matrices, nodes, batch, features)
        product = _product(matrix, x.reshape(nodes, batch * features))
        return product.view(matrices, nodes, batch, features).permute(1, 2, 0, 3).reshape(nodes * batch, -1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        matrices, nodes, batch, features = ctx.shape
        grad = grad.view(nodes, batch, matrices, features).permute(2, 0, 1, 3).reshape(matrices * nodes, -1)
        grad = grad.to(ctx.transposed.dtype)  # under autocast the product's output, so its grad, may be half
        return _product(ctx.transposed, grad).view(nodes, batch, features), None, None


def _block_diagonal_csr(matrix: torch.Tensor, blocks: int) -> torch.Tensor:
    """`blocks` copies of `matrix` down the diagonal, as a sparse CSR tensor (the batch-major products' operator)."""
    rows, cols = matrix.shape
    row, col = matrix.nonzero(as_tuple=True)  # row-major, so the block-major repetition below is CSR order
    values = matrix[row, col]
    shift = torch.arange(blocks, device=matrix.device)[:, None]
    row, col = (row + shift * rows).reshape(-1), (col + shift * cols).reshape(-1)
    crow = torch.zeros(blocks * rows + 1, dtype=torch.int64, device=matrix.device)
    crow[1:] = torch.bincount(row, minlength=blocks * rows).cumsum(0)
    if max(blocks * rows, blocks * cols, len(col)) < 2**31:  # MKL's (LP64) index type: no conversion per product
        crow, col = crow.int(), col.int()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta state")
        return torch.sparse_csr_tensor(crow, col, values.repeat(blocks), (blocks * rows, blocks * cols),
                                       check_invariants=False)



class GraphDiffusion(nn.Module):
    """x [N, B, F] (node-major) -> [N * B, M * F], M = S * K + 1: x itself, then T_k(S) x for every support S and
    step k = 1..K (support-major), as ONE product of the stacked [I; polynomials] with x viewed as [N, B * F]. The
    identity block costs a copy that the linear maps' input needs anyway (the cells kernel).

    fused_operator(): the same matrices T_m, m = 0..M-1 (T_0 = I, then T_k(S) for every support S and step k = 1..K,
    support-major) in the layouts of the fused sequence kernel, with T[m, n, n'] the entry of T_m by which node n
    gathers from node n':
    - "spread" [(n, m), n']: with the matrix index inside the node's, on the fused kernel's batch-major rows
      (sample, node) its output [(b, n, m), F] IS the linear maps' input [(b, n), (m, F)], no copy;
    - "collect" [n', (n, m)], its transpose: the backward of "spread".
    Sparse (CPU, float32/64, density < FUSED_SPARSE_DENSITY): CSR tensors of `blocks` copies down the diagonal (one
    per sample); dense: the matrix itself, which the caller expands over the samples for bmm."""

    def __init__(self, supports: torch.Tensor, steps: int):
        super().__init__()
        polynomials = diffusion_polynomials(supports, steps)
        self.nodes = nodes = supports.shape[-1]
        self.matrices = polynomials.shape[0] + 1
        # float64 (not a parameter, not saved): a float64 model gets the exact polynomials of its supports; other
        # dtypes get them rounded once, in operator().
        stacked = torch.cat([torch.eye(nodes, dtype=torch.float64), polynomials.reshape(-1, nodes)])
        self.register_buffer("stacked", stacked, persistent=False)
        # (device, dtype, ...) -> (matrix, transposed). One entry per dtype in use: under bf16 autocast a forward
        # diffuses float32 inputs and bf16 states in turn, and a single-entry cache was rebuilt 22 times a forward
        # (a conversion, a host sync for the density, on CPU a sparse copy each time).
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.density = float((stacked != 0).double().mean())  # the fused kernel's choice; read here, never per step
        # fused_operator(): (device, dtype, kind, blocks, buffer) -> operator, least recently used first out. Each is
        # built once (a conversion and, sparse, an index construction): a training step uses 4 (per-step products
        # forward and backward, the weight gradients' of the encoder and of the decoder), evaluation 1.
        self._fused_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def operator(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked matrix, its transpose) for `like`'s device and dtype: sparse COO tensors or dense ones."""
        if torch.compiler.is_compiling():
            # Traced by --compile: dense, converted inside the graph. The cache below cannot be traced (its key reads
            # a data pointer, the density a host value): each diffusion broke the graph, 28 graphs a forward.
            matrix = self.stacked.to(dtype=like.dtype)
            return matrix, matrix.T
        key = (like.device, like.dtype, self.stacked.data_ptr(), self.stacked.device)
        pair = self._cache.get(key)
        if pair is None:
            if len(self._cache) >= 4:  # the model moved or its buffers were replaced: the old entries are stale
                self._cache.clear()
            matrix = self.stacked.to(device=like.device, dtype=like.dtype)
            density = float((matrix != 0).float().mean())
            # sparse only on CPU in float32 / float64: CUDA's dense products are fast at these sizes, and half
            # precision has no CPU sparse kernel
            if like.device.type == "cpu" and like.dtype in (torch.float32, torch.float64) and density < SPARSE_DENSITY:
                pair = (matrix.to_sparse().coalesce(), matrix.T.to_sparse().coalesce())
            else:
                pair = (matrix, matrix.T)
            self._cache[key] = pair
        return pair

    def fused_sparse(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether fused_operator() is sparse there: on CPU in float32 / float64 on a sparse enough graph (CUDA's
        dense products are fast at these sizes, and half precision has no CPU sparse kernel)."""
        return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
                and self.density < FUSED_SPARSE_DENSITY)

    def _fused_matrix(self, kind: str) -> torch.Tensor:
        m, n = self.matrices, self.nodes
        t = self.stacked.view(m, n, n)
        if kind == "spread":
            return t.permute(1, 0, 2).reshape(n * m, n)
        if kind == "collect":
            return t.permute(2, 1, 0).reshape(n, n * m)
        raise ValueError(f"unknown diffusion operator kind {kind!r}")

    def fused_operator(self, kind: str, device: torch.device, dtype: torch.dtype, blocks: int = 1) -> torch.Tensor:
        """The fused kernel's "spread" or "collect" operator for `blocks` samples (see the class docstring)."""
        sparse = self.fused_sparse(device, dtype)
        key = (torch.device(device), dtype, kind, blocks if sparse else 1, self.stacked.data_ptr(),
               self.stacked.device)
        operator = self._fused_cache.get(key)
        if operator is not None and operator.is_inference() and not torch.is_inference_mode_enabled():
            operator = None  # made under inference_mode: not usable outside it
        if operator is None:
            matrix = self._fused_matrix(kind).to(device=device, dtype=dtype)
            operator = _block_diagonal_csr(matrix, blocks) if sparse else matrix.contiguous()
            self._fused_cache[key] = operator
            while len(self._fused_cache) > _CACHED_OPERATORS:  # other batch sizes, or the model moved: oldest out
                self._fused_cache.popitem(last=False)
        else:
            self._fused_cache.move_to_end(key)
        return operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, B, F] -> [N * B, M * F]: x and its diffusions laid out as a linear map's input, features ordered
        (matrix, feature), as the weights of DiffusionConv's linear map are."""
        return _DiffuseFlat.apply(x, *self.operator(x))


def _diffuse(operator: torch.Tensor, rhs: torch.Tensor, *, add: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """operator (one block) times rhs [blocks * the operator's columns, F] -> [blocks * its rows, F]: one sparse
    product with the block-diagonal CSR operator, or one bmm with the dense one expanded over the blocks (no copy).
    out: the result's buffer; add: a [blocks * rows, F] tensor (any strides) the product is added to, in place."""
    rows, cols = operator.shape
    if operator.layout == torch.sparse_csr:
        if add is not None:
            if add.dtype == rhs.dtype:
                return add.addmm_(operator, rhs)
            return add.add_(torch.mm(operator, rhs))
        if out is None:
            return torch.mm(operator, rhs)
        return out.addmm_(operator, rhs, beta=0)  # not mm(out=): that zero-fills a new tensor of out's size first
    blocks, features = rhs.shape[0] // cols, rhs.shape[1]
    expanded, rhs = operator.expand(blocks, rows, cols), rhs.view(blocks, cols, features)
    if add is not None:
        if add.dtype == rhs.dtype:
            return add.view(blocks, rows, features).baddbmm_(expanded, rhs)
        return add.add_(torch.bmm(expanded, rhs).view(-1, features))
    if out is None:
        return torch.bmm(expanded, rhs).view(-1, features)
    torch.bmm(expanded, rhs, out=out.view(blocks, rows, features))
    return out


class DiffusionConv(nn.Module):
    """[N, B, F_in] -> [N, B, F_out] (node-major): a linear map of the K-step diffusions over every support.
    Holds the linear map (weight columns ordered (matrix, feature)); the diffusion is given (the cells of a model
    share one) or made from `supports`."""

    def __init__(
        self,
        supports: torch.Tensor,
        in_features: int,
        out_features: int,
        steps: int,
        bias_start: float,
        diffusion: GraphDiffusion | None = None,
    ):
        super().__init__()
        self.diffusion = GraphDiffusion(supports, steps) if diffusion is None else diffusion
        self.matrices = supports.shape[0] * steps + 1
        self.linear = nn.Linear(in_features * self.matrices, out_features)
        nn.init.xavier_normal_(self.linear.weight)
        nn.init.constant_(self.linear.bias, bias_start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes, batch, _ = x.shape
        return self.linear(self.diffusion(x)).view(nodes, batch, -1)

    def split(self, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's columns of the first `first` features of every matrix, and of the rest: [out, M * first],
        [out, M * (F_in - first)], each ordered (matrix, feature) as GraphDiffusion lays out a part."""
        weight = self.linear.weight.view(self.linear.out_features, self.matrices, -1)
        return weight[..., :first].flatten(1), weight[..., first:].flatten(1)


class DCGRUCell(nn.Module):
    """GRU whose matrix products are diffusion convolutions over the graph; node-major state [N, B, units].

    The gates' input [x, state] and the candidate's [x, reset * state] are diffused by parts: since the diffusion acts
    on each feature apart and the linear map is a sum over features, each map is x's diffusions times its x columns
    plus the state part's diffusions times its state columns. So x's diffusions serve both maps, and a layer's new
    state is diffused once (DCRNN.forward): it is the layer above's x now and this layer's state at the next step.
    Only reset * state is diffused inside the step."""

    def __init__(self, supports: torch.Tensor, in_features: int, units: int, steps: int, diffusion: GraphDiffusion):
        super().__init__()
        self.units, self.in_features = units, in_features
        self.gates = DiffusionConv(supports, in_features + units, 2 * units, steps, 1.0, diffusion)
        self.candidate = DiffusionConv(supports, in_features + units, units, steps, 0.0, diffusion)

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The weights split by part, once per sequence (the same for every step): gates x, gates state, gates bias,
        candidate x, candidate state, candidate bias."""
        gates_x, gates_state = self.gates.split(self.in_features)
        candidate_x, candidate_state = self.candidate.split(self.in_features)
        gates_bias, candidate_bias = self.gates.linear.bias, self.candidate.linear.bias
        return gates_x, gates_state.T, gates_bias, candidate_x, candidate_state.T, candidate_bias

    def step(self, x_part: torch.Tensor, state: torch.Tensor, state_part: torch.Tensor, weights) -> torch.Tensor:
        """x_part [N * B, M * F_in], state_part [N * B, M * units]: GraphDiffusion(x) and (state);
        state [N, B, units] -> the new state [N, B, units]."""
        gates_x, gates_state, gates_bias, candidate_x, candidate_state, candidate_bias = weights
        flat_state = state.reshape(-1, self.units)
        gates = torch.sigmoid(torch.addmm(nn.functional.linear(x_part, gates_x, gates_bias), state_part, gates_state))
        reset, update = gates.chunk(2, dim=-1)
        reset_state = (reset * flat_state).view_as(state)
        reset_part = self.gates.diffusion(reset_state)
        candidate_pre = nn.functional.linear(x_part, candidate_x, candidate_bias)
        candidate = torch.tanh(torch.addmm(candidate_pre, reset_part, candidate_state))
        # update * state + (1 - update) * candidate in one pass; lerp wants one dtype (under autocast the products
        # are half precision, the state as it came: the sum promotes, as the separate products did)
        dtype = torch.promote_types(candidate.dtype, flat_state.dtype)
        return torch.lerp(candidate.to(dtype), flat_state.to(dtype), update.to(dtype)).view_as(state)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """x [N, B, F_in], state [N, B, units] -> the new state; one step on its own (DCRNN.forward shares the work)."""
        diffuse = self.gates.diffusion
        return self.step(diffuse(x), state, diffuse(state), self.weights())


class _Layout:
    """Where the fused forward keeps things (see the module docstring).

    R's row: block 0 (width first = max(input_dim, output_dim) + 1: the encoder's input or the decoder's fed-back
    value, then a column of ones) and blocks 1..L (width block = units + 1: h^{j-1}, then ones); block j starts at
    offsets[j]. A band of k layers lo..lo+k-1 reads the window offsets[lo]:offsets[lo + k] + units (blocks lo..lo+k,
    the last one's state only); the diffusion of the window, [(sample, node), (matrix m, window column)], times the
    band's weights gives, for the k layers, the gates (2 units: reset, then update) of all k layers, then the
    candidate's input part (units) of all k layers.

    The packed weights, per segment (enc: one band of all L layers; dec0, dec1, ...: one band per layer; proj):
    - band [M window, 3 k units]: the gates' input, state and bias rows, the candidate's input and bias rows; a bias
      sits on its block's ones row at m = 0 (T_0 = I: the only matrix under which a column of ones stays ones);
    - state [M k units, k units], block-diagonal: the candidate's rows for the diffused reset * state;
    - proj [units + 1, output_dim]: the projection and its bias.
    The weight gradients come out in the same layouts, except the encoder's: per layer (the band's blocks between
    layers are zeros, ~40% of its products), a k = 1 band split into the gates' and the candidate's columns."""

    def __init__(self, units: int, layers: int, matrices: int, in_dim: int, out_dim: int, horizon: int):
        self.units, self.layers, self.matrices, self.in_dim, self.out_dim = units, layers, matrices, in_dim, out_dim
        self.horizon = horizon
        self.first, self.block = max(in_dim, out_dim) + 1, units + 1
        self.offsets = [0] + [self.first + j * self.block for j in range(layers + 1)]
        self.width = self.offsets[-1]
        self.segments: dict[str, tuple[int, tuple[int, int]]] = {}  # name -> (offset, shape), packed weights
        self.grad_segments: dict[str, tuple[int, tuple[int, int]]] = {}  # the same, their gradients
        self.size = self.grad_size = 0

    def window(self, lo: int, k: int) -> tuple[int, int]:
        return self.offsets[lo], self.offsets[lo + k] + self.units

    def build_indices(self, parameter_shapes: list[torch.Size]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pack, unpack): packed = flat[pack] with flat = the parameters flattened and concatenated, then a zero;
        flat_grad = packed_grad[unpack]. Parameters: per cell (encoder layers, then decoder layers) the gates' weight
        and bias and the candidate's, then the projection's weight and bias."""
        u, m, layers = self.units, self.matrices, self.layers
        sizes = [math.prod(shape) for shape in parameter_shapes]
        total = sum(sizes)
        ids = [part.view(shape) for part, shape in zip(torch.arange(total).split(sizes), parameter_shapes,
                                                        strict=True)]
        cells = [ids[4 * i: 4 * i + 4] for i in range(2 * layers)]
        packed, grads = [], []

        def add(name, segment, grad=False):
            segments, size, parts = (self.grad_segments, self.grad_size, grads) if grad else (self.segments,
                                                                                            self.size, packed)
            segments[name] = (size, (segment.shape[0], segment[0].numel()))
            parts.append(segment.reshape(-1))
            if grad:
                self.grad_size += segment.numel()
            else:
                self.size += segment.numel()

        def band(lo, cell_ids, features):
            k = len(cell_ids)
            start, end = self.window(lo, k)
            weights = torch.full((m, end - start, 3 * k * u), total)  # `total`: flat's zero
            state = torch.full((m, k * u, k * u), total)
            for j, ((gates_w, gates_b, cand_w, cand_b), f) in enumerate(zip(cell_ids, features, strict=True)):
                layer = lo + j
                x_rows, h_rows = self.offsets[layer] - start, self.offsets[layer + 1] - start
                ones = h_rows - 1
                gates_w, cand_w = gates_w.view(2 * u, m, f + u), cand_w.view(u, m, f + u)  # columns (m, feature)
                g, c = slice(2 * u * j, 2 * u * (j + 1)), slice(2 * u * k + u * j, 2 * u * k + u * (j + 1))
                weights[:, x_rows:x_rows + f, g] = gates_w[:, :, :f].permute(1, 2, 0)
                weights[:, h_rows:h_rows + u, g] = gates_w[:, :, f:].permute(1, 2, 0)
                weights[0, ones, g] = gates_b
                weights[:, x_rows:x_rows + f, c] = cand_w[:, :, :f].permute(1, 2, 0)
                weights[0, ones, c] = cand_b
                state[:, u * j:u * (j + 1), u * j:u * (j + 1)] = cand_w[:, :, f:].permute(1, 2, 0)
            return weights.reshape(-1, 3 * k * u), state.reshape(m * k * u, k * u)

        features = [self.in_dim] + [u] * (layers - 1)
        weights, state = band(0, cells[:layers], features)
        add("enc_band", weights)
        add("enc_state", state)
        for layer in range(layers):
            weights, state = band(layer, [cells[layer]], [features[layer]])
            add(f"enc{layer}_gates", weights[:, :2 * u], grad=True)
            add(f"enc{layer}_candidate", weights[:, 2 * u:], grad=True)
            add(f"enc{layer}_state", state, grad=True)
        for layer in range(layers):
            weights, state = band(layer, [cells[layers + layer]], [self.out_dim if layer == 0 else u])
            for grad in (False, True):
                add(f"dec{layer}_band", weights, grad)
                add(f"dec{layer}_state", state, grad)
        proj_w, proj_b = ids[-2], ids[-1]
        for grad in (False, True):
            add("proj", torch.cat([proj_w.T, proj_b[None]]), grad)
        pack, grad_ids = torch.cat(packed), torch.cat(grads)
        real = grad_ids < total
        unpack = torch.empty(total, dtype=torch.int64)
        unpack[grad_ids[real]] = torch.arange(len(grad_ids))[real]
        for entries in (pack, grad_ids):
            assert torch.equal(entries[entries < total].sort().values, torch.arange(total)), "each entry once"
        return pack, unpack

    def view(self, buffer: torch.Tensor, name: str, grad: bool = False) -> torch.Tensor:
        offset, shape = (self.grad_segments if grad else self.segments)[name]
        return buffer[offset:offset + shape[0] * shape[1]].view(shape)


class _Run:
    """One fused forward (and its backward): the buffers and the saved tensors of one sequence."""

    def __init__(self, model: DCRNN, x, teacher, use_teacher, params, compute_dtype):
        self.model, self.layout, self.params = model, model._layout, params
        self.x, self.dtype, self.compute = x, params[0].dtype, compute_dtype
        self.batch, self.steps, self.nodes = x.shape[0], x.shape[1], x.shape[2]
        self.rows = self.batch * self.nodes
        self.forcing = teacher is not None and use_teacher is not None
        self.coins, self.teacher = use_teacher, teacher  # without both: no coin comes up (forward())
        self.teacher_dtype = teacher.dtype if teacher is not None else None
        self.held: list[tuple[tuple, torch.Tensor]] = []

    def acquire(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised buffer this run keeps until release(): taken from the model's pool of released ones when
        one fits. The buffers of a run are tens of MB; new ones each step are new pages to fault in on CPU (a few ms
        a step on this 2-core VM), and allocator churn elsewhere."""
        dtype = self.compute if dtype is None else dtype
        key = (shape, dtype, self.x.device)
        try:
            buffer = self.model._pool[key].pop()
        except (KeyError, IndexError):
            buffer = torch.empty(shape, dtype=dtype, device=self.x.device)
        self.held.append((key, buffer))
        return buffer

    def release(self) -> None:
        """Back to the pool: a few per shape (the forwards of an accumulation window), the shapes of a few batch
        sizes (training's, evaluation's and their last batches'), least recently released first out."""
        pool = self.model._pool
        for key, buffer in self.held:
            free = pool.setdefault(key, [])
            pool.move_to_end(key)
            if len(free) < 4 and not buffer.is_inference():  # (made under inference_mode: read-only outside it)
                free.append(buffer)
        while len(pool) > 32:
            pool.popitem(last=False)
        self.held = []

    def operator(self, kind: str, blocks: int) -> torch.Tensor:
        return self.model.diffusion.fused_operator(kind, self.x.device, self.compute, blocks)

    def scratch(self, name: str, rows: int, columns: int) -> torch.Tensor | None:
        """A [rows, columns] output buffer for a product nothing keeps, reused from step to step on CPU: a fresh
        allocation of a few MB there is fresh pages, and their faults cost more than the product (measured: a 6 MB
        sparse product 0.9 ms into a reused buffer, 5-6 ms into a new one). None elsewhere (caching allocators)."""
        if self.x.device.type != "cpu":
            return None
        key, size = (name, threading.get_ident()), rows * columns  # (threads: DataParallel's replicas share it)
        buffer = self.model._scratch.get(key)
        if (buffer is None or buffer.numel() < size or buffer.dtype != self.compute
                or buffer.is_inference() and not torch.is_inference_mode_enabled()):
            buffer = self.model._scratch[key] = torch.empty(size, dtype=self.compute)
        return buffer[:size].view(rows, columns)

    def states(self, buffer: torch.Tensor, row: int, lo: int, k: int) -> torch.Tensor:
        """[B N, k, units]: the slots of h^{lo}..h^{lo+k-1} in `row` of R (or of its gradient)."""
        lay = self.layout
        return buffer[row, :, lay.first:].view(self.rows, lay.layers, lay.block)[:, lo:lo + k, :lay.units]

    def diagonal(self, buffer: torch.Tensor, first_row: int) -> torch.Tensor:
        """[L, B N, units]: h^l's slot of row first_row + l, for every l (the encoder-decoder handoff)."""
        lay, row = self.layout, buffer.stride(0)
        return buffer.as_strided((lay.layers, self.rows, lay.units), (row + lay.block, lay.width, 1),
                                 buffer.storage_offset() + first_row * row + lay.offsets[1])

    # ---- forward --------------------------------------------------------------------------------------------------
    def cell(self, buffer, row, lo, k, band, state, spread, reset_state, idle_from=None):
        """Layers lo..lo+k-1 at once, reading `row`'s window and writing their new states into row + 1: 9 kernels.
        idle_from: the layers from it on are before their first step (the encoder's wavefront): update gate 1."""
        lay, u, n, m = self.layout, self.layout.units, self.rows, self.layout.matrices
        start, end = lay.window(lo, k)
        window = buffer[row, :, start:end].to(self.compute)
        diffused = _diffuse(spread, window, out=self.scratch("diffused", n * m, end - start))
        pre = torch.mm(diffused.view(n, -1), band)  # [B N, 3 k u]: the gates, then the candidate's input part
        if idle_from is not None:
            pre[:, :2 * k * u].view(n, k, 2 * u)[:, idle_from:, u:].fill_(math.inf)
        gates = torch.sigmoid(pre[:, :2 * k * u])
        reset, update = gates.view(n, k, 2 * u).split(u, dim=-1)
        h_compute = window.as_strided((n, k, u), (window.stride(0), lay.block, 1),
                                      window.storage_offset() + lay.offsets[lo + 1] - start)
        torch.mul(reset, h_compute, out=reset_state.view(n, k, u))
        diffused = _diffuse(spread, reset_state, out=self.scratch("diffused reset", n * m, k * u))
        candidate = torch.tanh(torch.addmm(pre[:, 2 * k * u:], diffused.view(n, -1), state))
        h = self.states(buffer, row, lo, k)
        difference = h - candidate.view(n, k, u)
        torch.addcmul(candidate.view(n, k, u), update, difference, out=self.states(buffer, row + 1, lo, k))
        return gates, candidate, difference

    def forward(self) -> torch.Tensor:
        lay, model = self.layout, self.model
        u, layers, horizon, out_dim = lay.units, lay.layers, lay.horizon, lay.out_dim
        b, n, rows, steps = self.batch, self.nodes, self.rows, self.steps
        device, dtype, compute = self.x.device, self.dtype, self.compute
        self.span = span = steps + layers - 1  # wavefront steps of the encoder
        self.encoder_rows = steps + layers
        buffer = self.acquire(self.encoder_rows + horizon + layers, rows, lay.width, dtype=dtype).zero_()
        buffer[:, :, lay.first - 1::lay.block].fill_(1)  # the ones columns: the biases
        buffer[:steps, :, :lay.in_dim].view(steps, b, n, lay.in_dim).copy_(self.x.permute(1, 0, 2, 3))
        self.buffer = buffer
        encoder, decoder = buffer[:self.encoder_rows], buffer[self.encoder_rows:]
        flat = torch.cat([p.reshape(-1) for p in self.params] + [model._zero])
        self.packed = packed = flat[model._pack].to(compute)
        spread = self.operator("spread", b)

        self.reset_enc = self.acquire(span, rows, layers * u)
        band, state = lay.view(packed, "enc_band"), lay.view(packed, "enc_state")
        self.saved_enc = [
            self.cell(encoder, s, 0, layers, band, state, spread, self.reset_enc[s],
                      idle_from=s + 1 if s + 1 < layers else None)
            for s in range(span)
        ]
        self.diagonal(decoder, 0).copy_(self.diagonal(encoder, steps))  # the final states start the decoder

        # The value fed to the next decoder step, per sample: the true value where its coin came up, else the
        # prediction: teacher_fed + top @ proj_fed with teacher_fed = coin ? true value : 0 and proj_fed = coin ? 0 :
        # the projection (its bias row included), one batched product a step into R (no product, then a selection).
        if not self.forcing:  # the same computation with no coin up: evaluation gives what a run of zero coins does
            self.coins = torch.zeros(b, horizon, dtype=torch.bool, device=device)
            self.teacher = torch.zeros((), dtype=dtype, device=device).expand(b, horizon, n)
        proj = lay.view(packed, "proj")
        coins, zero = self.coins.T[:, :, None, None], torch.zeros((), dtype=compute, device=device)  # [T_out, B, 1, 1]
        self.proj_fed = proj_fed = torch.where(coins, zero, proj)  # [T_out, B, units + 1, output_dim]
        teacher_fed = torch.where(coins, self.teacher.permute(1, 0, 2)[..., None].to(compute), zero)  # [T_out, B, N, 1]
        self.reset_dec = self.acquire(layers, horizon, rows, u)
        self.saved_dec = [[None] * horizon for _ in range(layers)]
        bands = [(lay.view(packed, f"dec{i}_band"), lay.view(packed, f"dec{i}_state")) for i in range(layers)]
        top = slice(lay.offsets[layers], lay.offsets[layers + 1])
        for t in range(horizon):
            for i in range(layers):
                self.saved_dec[i][t] = self.cell(decoder, t + i, i, 1, *bands[i], spread, self.reset_dec[i, t])
            if t + 1 < horizon:
                fed = decoder[t + 1, :, :out_dim].view(b, n, out_dim)
                top_state = decoder[t + layers, :, top].to(compute).view(b, n, lay.block)
                if compute == dtype:
                    torch.baddbmm(teacher_fed[t], top_state, proj_fed[t], out=fed)
                else:
                    fed.copy_(torch.baddbmm(teacher_fed[t], top_state, proj_fed[t]))
        tops = decoder[layers:layers + horizon, :, top].view(horizon * rows, lay.block).to(compute)
        outputs = torch.mm(tops, proj)  # the predictions of all the steps at once
        return outputs.view(horizon, b, n, out_dim)[..., 0].permute(1, 0, 2)

    # ---- backward -------------------------------------------------------------------------------------------------
    def cell_backward(self, buffer, grads, row, lo, k, saved, band, state, collect, slot):
        """The gradients of cell(): 11 kernels. slot [B N, 3 k u]: the gates' and the candidate's pre-activation
        gradients, side by side (kept for the weight gradients); grads: R's gradient, accumulated in place."""
        lay, u, n = self.layout, self.layout.units, self.rows
        gates, candidate, difference = saved
        reset, update = gates.view(n, k, 2 * u).split(u, dim=-1)
        slot_gates = slot[:, :2 * k * u]
        slot_reset, slot_update = slot_gates.view(n, k, 2 * u).split(u, dim=-1)
        slot_candidate = slot[:, 2 * k * u:]
        grad_h = self.states(grads, row + 1, lo, k)
        grad_previous = self.states(grads, row, lo, k)
        # h' = candidate + update * (h - candidate)
        torch.ops.aten.tanh_backward.grad_input(torch.addcmul(grad_h, grad_h, update, value=-1),
                                                candidate.view(n, k, u), grad_input=slot_candidate.view(n, k, u))
        torch.mul(grad_h, difference, out=slot_update)
        grad_previous.addcmul_(grad_h, update)
        # candidate = tanh(input part + D(reset * h) state)
        grad_diffused = torch.mm(slot_candidate, state.T, out=self.scratch("grad diffused reset", n, state.shape[0]))
        grad_reset_state = _diffuse(collect, grad_diffused.view(-1, k * u)).view(n, k, u)
        torch.mul(grad_reset_state, self.states(buffer, row, lo, k), out=slot_reset)
        grad_previous.addcmul_(grad_reset_state, reset)
        torch.ops.aten.sigmoid_backward.grad_input(slot_gates, gates, grad_input=slot_gates)
        # pre = D(window) band: the window's inputs and states of every layer of the band
        start, end = lay.window(lo, k)
        grad_diffused = torch.mm(slot, band.T, out=self.scratch("grad diffused", n, band.shape[0]))
        _diffuse(collect, grad_diffused.view(-1, end - start), add=grads[row, :, start:end])

    def weight_grads(self, name, windows, slots, candidate_slots, reset_states, blocks):
        """One layer's weight gradients over all the steps at once: D(window)^T slots and D(reset * h)^T
        candidate_slots, with D ("spread") over every step's samples in one product each. slots: the band's
        columns, or (the encoder) a (gates, candidate) pair of column ranges: one product each."""
        lay, rows, m = self.layout, windows.shape[0], self.layout.matrices
        spread, grads = self.operator("spread", blocks), self.packed_grad
        diffused = _diffuse(spread, windows.to(self.compute), out=self.scratch("spread", rows * m, windows.shape[1]))
        if isinstance(slots, tuple):
            torch.mm(diffused.view(rows, -1).T, slots[0], out=lay.view(grads, f"{name}_gates", grad=True))
            torch.mm(diffused.view(rows, -1).T, slots[1], out=lay.view(grads, f"{name}_candidate", grad=True))
        else:
            torch.mm(diffused.view(rows, -1).T, slots, out=lay.view(grads, f"{name}_band", grad=True))
        diffused = _diffuse(spread, reset_states, out=self.scratch("spread", rows * m, reset_states.shape[1]))
        torch.mm(diffused.view(rows, -1).T, candidate_slots, out=lay.view(grads, f"{name}_state", grad=True))

    def backward(self, grad_output, need_x: bool, need_teacher: bool):
        lay, model = self.layout, self.model
        u, layers, horizon, out_dim = lay.units, lay.layers, lay.horizon, lay.out_dim
        b, n, rows, steps, span = self.batch, self.nodes, self.rows, self.steps, self.span
        device, compute, packed, buffer = self.x.device, self.compute, self.packed, self.buffer
        grads = self.acquire(*buffer.shape, dtype=buffer.dtype).zero_()
        encoder, decoder = buffer[:self.encoder_rows], buffer[self.encoder_rows:]
        grad_enc, grad_dec = grads[:self.encoder_rows], grads[self.encoder_rows:]
        collect = self.operator("collect", b)

        # the decoder, last step first: the projection's gradient (its output's and, through the fed-back value,
        # the next step's input's), then the cells top down
        if out_dim == 1:
            grad_pred = grad_output.permute(1, 0, 2).to(compute).clone(memory_format=torch.contiguous_format)
        else:
            grad_pred = grad_output.new_zeros(horizon, b, n, out_dim, dtype=compute)
            grad_pred[..., 0] = grad_output.permute(1, 0, 2)
        grad_pred = grad_pred.view(horizon * rows, out_dim)
        slots_dec = self.acquire(layers, horizon, rows, 3 * u)
        bands = [(lay.view(packed, f"dec{i}_band"), lay.view(packed, f"dec{i}_state")) for i in range(layers)]
        proj, proj_fed = lay.view(packed, "proj"), self.proj_fed.transpose(2, 3)  # [T_out, B, output_dim, units + 1]
        top = slice(lay.offsets[layers], lay.offsets[layers + 1])
        grad_tops = grad_dec[layers:layers + horizon, :, top].view(horizon * rows, lay.block)
        if compute == self.dtype:  # the predictions' gradient, all the steps at once
            grad_tops.addmm_(grad_pred, proj.T)
        else:
            grad_tops.add_(torch.mm(grad_pred, proj.T))
        for t in reversed(range(horizon)):
            if t + 1 < horizon:  # the fed value's: per sample through proj_fed (0 where the true value was fed)
                grad_fed = grad_dec[t + 1, :, :out_dim].view(b, n, out_dim)
                grad_top = grad_dec[t + layers, :, top].view(b, n, lay.block)
                if compute == self.dtype:
                    grad_top.baddbmm_(grad_fed, proj_fed[t])
                else:
                    grad_top.add_(torch.bmm(grad_fed.to(compute), proj_fed[t]))
            for i in reversed(range(layers)):
                self.cell_backward(decoder, grad_dec, t + i, i, 1, self.saved_dec[i][t], *bands[i], collect,
                                   slots_dec[i, t])
        self.diagonal(grad_enc, steps).add_(self.diagonal(grad_dec, 0))

        # the encoder's wavefront, last step first
        slots_enc = self.acquire(span, rows, 3 * layers * u)
        band, state = lay.view(packed, "enc_band"), lay.view(packed, "enc_state")
        for s in reversed(range(span)):
            self.cell_backward(encoder, grad_enc, s, 0, layers, self.saved_enc[s], band, state, collect, slots_enc[s])

        # the weight gradients, all steps at once, into the gradients' layout; then unpacked by one gather
        self.packed_grad = packed_grad = self.acquire(lay.grad_size)
        slots, resets = slots_enc.view(span * rows, -1), self.reset_enc.view(span * rows, -1)
        for i in range(layers):
            start, end = lay.window(i, 1)
            gates = slots[:, 2 * u * i:2 * u * (i + 1)]
            candidate = slots[:, 2 * u * layers + u * i:2 * u * layers + u * (i + 1)]
            self.weight_grads(f"enc{i}", encoder[:span, :, start:end].view(span * rows, end - start),
                              (gates, candidate), candidate, resets[:, u * i:u * (i + 1)], span * b)
        for i in range(layers):
            start, end = lay.window(i, 1)
            slots = slots_dec[i].view(horizon * rows, -1)
            self.weight_grads(f"dec{i}", decoder[i:i + horizon, :, start:end].view(horizon * rows, end - start),
                              slots, slots[:, 2 * u:], self.reset_dec[i].view(horizon * rows, u), horizon * b)
        # the projection's gradient: its outputs' and, where the prediction was fed back, the fed values'
        grad_fed = grad_dec[1:horizon, :, :out_dim].view(horizon - 1, b, n, out_dim)
        fed_back = ~self.coins.T[:horizon - 1, :, None, None]  # [T_out - 1, B, 1, 1]: the prediction was fed back
        grad_pred.view(horizon, b, n, out_dim)[:horizon - 1].addcmul_(grad_fed, fed_back)
        tops = decoder[layers:layers + horizon, :, top].view(horizon * rows, lay.block).to(compute)
        torch.mm(tops.T, grad_pred, out=lay.view(packed_grad, "proj", grad=True))
        flat = packed_grad[model._unpack].to(self.dtype)
        param_grads = [part.view(p.shape) for part, p in zip(flat.split([p.numel() for p in self.params]),
                                                             self.params, strict=True)]

        grad_x = grad_teacher = None
        if need_x:
            grad_x = grad_enc[:steps, :, :lay.in_dim].view(steps, b, n, lay.in_dim).permute(1, 0, 2, 3)
            grad_x = grad_x.to(self.x.dtype, copy=True)  # grads goes back to the pool
        if need_teacher:
            fed_true = grad_dec[1:horizon, :, :out_dim].view(horizon - 1, b, n, out_dim).sum(-1)
            grad_teacher = torch.zeros(b, horizon, n, dtype=self.teacher_dtype, device=device)
            grad_teacher[:, :horizon - 1] = (fed_true * self.coins.T[:horizon - 1, :, None]).permute(1, 0, 2)
        self.release()
        return grad_x, grad_teacher, param_grads


class _FusedDCRNN(torch.autograd.Function):
    """DCRNN's forward over a whole sequence with its hand-written backward (_Run): a few kernels per cell step."""

    @staticmethod
    def forward(ctx, model, compute_dtype, x, teacher, use_teacher, *params):
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are explicit: products in compute_dtype
            run = _Run(model, x, teacher, use_teacher, params, compute_dtype)
            output = run.forward()
        if any(ctx.needs_input_grad):
            ctx.run = run
        else:  # no backward to come (evaluation, no_grad): the buffers can serve the next forward
            run.release()
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        run, ctx.run = ctx.run, None
        if run is None:
            raise RuntimeError("DCRNN's fused backward runs once per forward (its buffers are reused): "
                               "a second backward through the same graph (retain_graph) is not supported")
        with torch.autocast(grad_output.device.type, enabled=False):
            grad_x, grad_teacher, param_grads = run.backward(grad_output, ctx.needs_input_grad[2],
                                                             ctx.needs_input_grad[3] and run.forcing)
        return None, None, grad_x, grad_teacher, None, *param_grads



class DCRNN(nn.Module):
    """forward(x [B, T_in, N, input_dim], teacher [B, T_out, N] or None, use_teacher bool [B, T_out] or None)
    -> predictions [B, T_out, N] (scaled speed). teacher / use_teacher: scheduled sampling in training.

    sequence_kernel: how a forward is computed (the same function; they differ in rounding only): "cells", a
    DCGRUCell step at a time under autograd; "fused", one autograd Function over the whole sequence with a
    hand-written backward (_FusedDCRNN: ~930 kernels an optimizer step of the recipe where the cells launch ~3,000);
    "auto", fused on CUDA, where launches limit this model, and cells on CPU, where the cells are faster. Traced by
    torch.compile, the forward is always the cells (the fused kernel's buffers and hand-written backward do not
    trace)."""

    def __init__(
        self,
        adjacency,
        input_dim: int = 2,
        output_dim: int = 1,
        units: int = 64,
        layers: int = 2,
        diffusion_steps: int = 2,
        horizon: int = 12,
        sequence_kernel: Literal["auto", "fused", "cells"] = "auto",
    ):
        super().__init__()
        if sequence_kernel not in SEQUENCE_KERNELS:
            raise ValueError(f"sequence_kernel {sequence_kernel!r}: give one of {', '.join(SEQUENCE_KERNELS)}")
        self.sequence_kernel = sequence_kernel
        supports = random_walk_supports(adjacency)
        self.nodes, self.units, self.horizon, self.output_dim = supports.shape[1], units, horizon, output_dim
        # one for every cell (its sparse form is made once); not a child of the cells' convs only, for forward()
        self.diffusion = diffusion = GraphDiffusion(supports, diffusion_steps)
        self.encoder = nn.ModuleList(
            DCGRUCell(supports, input_dim if i == 0 else units, units, diffusion_steps, diffusion)
            for i in range(layers)
        )
        self.decoder = nn.ModuleList(
            DCGRUCell(supports, output_dim if i == 0 else units, units, diffusion_steps, diffusion)
            for i in range(layers)
        )
        self.projection = nn.Linear(units, output_dim)
        # the fused kernel's layout and its index maps (derived: not saved; they follow the model's device)
        self._layout = _Layout(units, layers, diffusion.matrices, input_dim, output_dim, horizon)
        pack, unpack = self._layout.build_indices([p.shape for p in self._fused_parameters()])
        self.register_buffer("_pack", pack, persistent=False)
        self.register_buffer("_unpack", unpack, persistent=False)
        self.register_buffer("_zero", torch.zeros(1), persistent=False)  # the packed weights' zero entries
        self._scratch: dict[tuple, torch.Tensor] = {}  # _Run.scratch: CPU output buffers reused between steps
        self._pool: OrderedDict[tuple, list[torch.Tensor]] = OrderedDict()  # _Run.acquire: buffers for later runs

    def kernel_for(self, device: torch.device | str) -> str:
        """"fused" or "cells": the sequence kernel a forward on `device` takes (outside torch.compile)."""
        if self.sequence_kernel != "auto":
            return self.sequence_kernel
        return "fused" if torch.device(device).type == "cuda" else "cells"

    def _fused_parameters(self) -> list[torch.Tensor]:
        params = []
        for cell in [*self.encoder, *self.decoder]:
            params += [cell.gates.linear.weight, cell.gates.linear.bias]
            params += [cell.candidate.linear.weight, cell.candidate.linear.bias]
        return [*params, self.projection.weight, self.projection.bias]

    def forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.kernel_for(x.device) == "cells":
            return self.cells_forward(x, teacher, use_teacher)
        return self.fused_forward(x, teacher, use_teacher)

    def fused_forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The whole sequence as one autograd Function (_FusedDCRNN); under autocast its products run in the
        autocast dtype, its states and their gradients in the parameters' dtype."""
        params = self._fused_parameters()
        dtype = compute = params[0].dtype
        if dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
            compute = torch.get_autocast_dtype(x.device.type)
        return _FusedDCRNN.apply(self, compute, x, teacher, use_teacher, *params)

    def cells_forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A DCGRUCell step at a time under autograd (what torch.compile traces and fuses)."""
        batch, steps = x.shape[:2]
        nodes, units, diffuse = self.nodes, self.units, self.diffusion
        # the input's diffusions for every step in one product: [N, T * B, F] -> [T, N * B, M * F]
        flat_x = x.permute(2, 1, 0, 3).reshape(nodes, steps * batch, -1)
        x_parts = diffuse(flat_x).view(nodes, steps, batch, -1).transpose(0, 1).reshape(steps, nodes * batch, -1)
        # range(layers), not the ModuleList, in comprehensions: dynamo (torch 2.13) cannot iterate a ModuleList in a
        # comprehension's frame and fell back to eager for this whole forward under --compile
        layers = len(self.encoder)
        states = [x.new_zeros(nodes, batch, units) for _ in range(layers)]
        state_parts = [x.new_zeros(nodes * batch, diffuse.matrices * units) for _ in range(layers)]  # diffused zeros
        weights = [self.encoder[i].weights() for i in range(layers)]
        for t in range(steps):
            inputs = x_parts[t]
            for i, cell in enumerate(self.encoder):
                states[i] = cell.step(inputs, states[i], state_parts[i], weights[i])
                state_parts[i] = inputs = diffuse(states[i])
        if teacher is not None and use_teacher is not None:
            teacher = teacher.permute(1, 2, 0)[..., None]  # [T_out, N, B, 1]
            use_teacher = use_teacher.T[:, None, :, None]  # [T_out, 1, B, 1]
        step_input = x.new_zeros(nodes, batch, self.output_dim)  # GO symbol
        weights = [self.decoder[i].weights() for i in range(layers)]
        outputs = []
        for t in range(self.horizon):
            inputs = diffuse(step_input)
            for i, cell in enumerate(self.decoder):
                states[i] = cell.step(inputs, states[i], state_parts[i], weights[i])
                if i + 1 < len(self.decoder) or t + 1 < self.horizon:  # the top state's last diffusion is unused
                    state_parts[i] = inputs = diffuse(states[i])
            prediction = self.projection(states[-1])  # [N, B, output_dim]
            outputs.append(prediction[..., 0])
            step_input = prediction
            if teacher is not None and use_teacher is not None:
                step_input = torch.where(use_teacher[t], teacher[t].to(prediction.dtype), prediction)
        return torch.stack(outputs).permute(2, 0, 1)  # [B, T_out, N]
