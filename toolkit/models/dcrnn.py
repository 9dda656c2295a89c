"""DCRNN (Li et al., ICLR 2018): an encoder-decoder of diffusion-convolution GRU cells over a road graph.

This file is the model as plain PyTorch: what trains under `--kernels plain`, and what the fast paths are proven
equal to at every start under `--kernels auto`. The fast paths are toolkit/kernels/dcrnn.py's (FAST_PATHS): the
fused sequence kernel (the whole sequence as one autograd Function with a hand-written backward, a third of the
cells' kernel launches, taken where `sequence_kernel` says), and the diffusion's product with its backward written
out. An edit here that they do not know stops a `--kernels auto` run at its start, naming the fast path.

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
DCRNN.forward runs this a DCGRUCell step at a time under autograd (the "cells"; what torch.compile traces).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from torch import nn

FAST_PATHS = "toolkit.kernels.dcrnn"  # the fused sequence kernel, the diffusion's written-out backward

# Below this fraction of non-zeros in the stacked [I; T_k(S)] the diffusion is a sparse product on CPU. Measured
# (one thread, forward + backward of GraphDiffusion, K=2): the generated 50-sensor network (6.7% non-zeros, B*F =
# 64*32) sparse 1.8 ms, dense 3.1 ms; 207 sensors, B*F = 64*128: 2.5% non-zeros sparse 117 ms, dense 256 ms; 25%:
# sparse 377 ms, dense 262 ms; 43%: 586 ms, 253 ms. The sparse time grows with the non-zeros, the dense one does
# not: they cross near 15%.
SPARSE_DENSITY = 0.15
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


def operator_product(matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.sparse.mm(matrix, x) if matrix.is_sparse else matrix @ x


class GraphDiffusion(nn.Module):
    """x [N, B, F] (node-major) -> [N * B, M * F], M = S * K + 1: x itself, then T_k(S) x for every support S and
    step k = 1..K (support-major), as ONE product of the stacked [I; polynomials] with x viewed as [N, B * F]. The
    identity block costs a copy that the linear maps' input needs anyway."""

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

    def operator(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked matrix, its transpose) for `like`'s device and dtype: sparse COO tensors or dense ones (the
        transpose serves the backward of toolkit/kernels/dcrnn.py's diffusion)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, B, F] -> [N * B, M * F]: x and its diffusions laid out as a linear map's input, features ordered
        (matrix, feature), as the weights of DiffusionConv's linear map are."""
        nodes, batch, features = x.shape
        matrix, _ = self.operator(x)
        if matrix.is_sparse:  # in x's dtype: under autocast a bf16 product's backward meets the float32 operator
            with torch.autocast(x.device.type, enabled=False):
                product = torch.sparse.mm(matrix, x.reshape(nodes, batch * features))  # [(m, n), (b, f)]
        else:
            product = matrix @ x.reshape(nodes, batch * features)
        return product.view(self.matrices, nodes, batch, features).permute(1, 2, 0, 3).reshape(nodes * batch, -1)


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


class DCRNN(nn.Module):
    """forward(x [B, T_in, N, input_dim], teacher [B, T_out, N] or None, use_teacher bool [B, T_out] or None)
    -> predictions [B, T_out, N] (scaled speed). teacher / use_teacher: scheduled sampling in training.

    sequence_kernel: the sequence kernel the fast path (toolkit/kernels/dcrnn.py, under `--kernels auto`) takes, the
    same function up to rounding: "fused", its fused kernel (one autograd Function over the whole sequence with a
    hand-written backward, ~930 kernels an optimizer step of the recipe where the cells launch ~3,000); "cells", this
    file's forward; "auto", fused on CUDA, where launches limit this model, and the cells on CPU, where they are
    faster. This file's forward is always the cells: with --kernels plain a model told "fused" runs them."""

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

    def forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The cells: a DCGRUCell step at a time under autograd (what torch.compile traces and fuses)."""
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
