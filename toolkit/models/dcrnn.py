"""DCRNN (Li et al., ICLR 2018): an encoder-decoder of diffusion-convolution GRU cells over a road graph.

Diffusion convolution with dual random-walk supports: the forward walk D_out^-1 A and the backward walk
D_in^-1 A^T (as the reference code, transposed, so a node gathers from its neighbours), each applied K times with
the reference code's recurrence x_k = 2 S x_{k-1} - x_{k-2}; the 2K + 1 diffused copies of [input, state] feed one
linear map per gate. The encoder reads 12 steps; the decoder starts from a zero GO symbol and feeds back either
its own last prediction or, with scheduled sampling, the true value, with probability k / (k + exp(step / k))
(inverse-sigmoid decay). The coins are per (sample, decoder step) and come from the caller (keyed_uniform in the
recipe), so they depend on neither the rank nor the process count, and a resumed run draws the same ones.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


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


class DiffusionConv(nn.Module):
    """[N, B, F_in] -> [N, B, F_out] (node-major): a linear map of the K-step diffusions over every support."""

    def __init__(self, supports: torch.Tensor, in_features: int, out_features: int, steps: int, bias_start: float):
        super().__init__()
        self.register_buffer("supports", supports, persistent=False)
        self.steps = steps
        matrices = supports.shape[0] * steps + 1
        self.linear = nn.Linear(in_features * matrices, out_features)
        nn.init.xavier_normal_(self.linear.weight)
        nn.init.constant_(self.linear.bias, bias_start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes, batch, features = x.shape  # node-major: each diffusion step is ONE [N, N] x [N, B * F] product
        x0 = x.reshape(nodes, batch * features)
        diffused = [x0]
        for support in self.supports.to(x.dtype):
            previous, current = x0, support @ x0
            diffused.append(current)
            for _ in range(2, self.steps + 1):
                previous, current = current, 2 * (support @ current) - previous
                diffused.append(current)
        stacked = torch.cat([d.view(nodes, batch, features) for d in diffused], dim=-1)  # (matrix, feature) order
        return self.linear(stacked)


class DCGRUCell(nn.Module):
    """GRU whose matrix products are diffusion convolutions over the graph; node-major state [N, B, units]."""

    def __init__(self, supports: torch.Tensor, in_features: int, units: int, steps: int):
        super().__init__()
        self.units = units
        self.gates = DiffusionConv(supports, in_features + units, 2 * units, steps, bias_start=1.0)
        self.candidate = DiffusionConv(supports, in_features + units, units, steps, bias_start=0.0)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        reset, update = torch.sigmoid(self.gates(torch.cat([x, state], dim=-1))).chunk(2, dim=-1)
        candidate = torch.tanh(self.candidate(torch.cat([x, reset * state], dim=-1)))
        return update * state + (1 - update) * candidate


class DCRNN(nn.Module):
    """forward(x [B, T_in, N, input_dim], teacher [B, T_out, N] or None, use_teacher bool [B, T_out] or None)
    -> predictions [B, T_out, N] (scaled speed). teacher / use_teacher: scheduled sampling in training."""

    def __init__(
        self,
        adjacency,
        input_dim: int = 2,
        output_dim: int = 1,
        units: int = 64,
        layers: int = 2,
        diffusion_steps: int = 2,
        horizon: int = 12,
    ):
        super().__init__()
        supports = random_walk_supports(adjacency)
        self.nodes, self.units, self.horizon, self.output_dim = supports.shape[1], units, horizon, output_dim
        self.encoder = nn.ModuleList(
            DCGRUCell(supports, input_dim if i == 0 else units, units, diffusion_steps) for i in range(layers)
        )
        self.decoder = nn.ModuleList(
            DCGRUCell(supports, output_dim if i == 0 else units, units, diffusion_steps) for i in range(layers)
        )
        self.projection = nn.Linear(units, output_dim)

    def forward(
        self, x: torch.Tensor, teacher: torch.Tensor | None = None, use_teacher: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch = x.shape[0]
        x = x.permute(1, 2, 0, 3)  # [T_in, N, B, F]: node-major inside the cells
        states = [x.new_zeros(self.nodes, batch, self.units) for _ in self.encoder]
        for t in range(x.shape[0]):
            inputs = x[t]
            for i, cell in enumerate(self.encoder):
                states[i] = inputs = cell(inputs, states[i])
        if teacher is not None and use_teacher is not None:
            teacher = teacher.permute(1, 2, 0)[..., None]  # [T_out, N, B, 1]
            use_teacher = use_teacher.T[:, None, :, None]  # [T_out, 1, B, 1]
        step_input = x.new_zeros(self.nodes, batch, self.output_dim)  # GO symbol
        outputs = []
        for t in range(self.horizon):
            inputs = step_input
            for i, cell in enumerate(self.decoder):
                states[i] = inputs = cell(inputs, states[i])
            prediction = self.projection(inputs)  # [N, B, output_dim]
            outputs.append(prediction[..., 0])
            step_input = prediction
            if teacher is not None and use_teacher is not None:
                step_input = torch.where(use_teacher[t], teacher[t].to(prediction.dtype), prediction)
        return torch.stack(outputs).permute(2, 0, 1)  # [B, T_out, N]
