"""The UFS sea-ice emulator: an MLP from the local ocean/atmosphere state to sea-ice quantities (seeds 000/001).

    model = UfsEmulator(input_mean, input_std, output_mean, output_std, hidden=64, layers=3,
                        activation="gelu",          # between the layers: gelu, relu (aibalance c710abb), identity
                        output_activation="none")   # or "sigmoid": outputs bounded to (0, 1), as SOCA's IceNet
    z = model.normalise_inputs(x)        # physical -> normalised (float64 arithmetic, the network's dtype)
    model(z)                             # the network: normalised inputs -> normalised outputs (what is trained)
    model.predict(x)                     # physical units in and out
    model.jacobian(x)                    # d outputs / d inputs in physical units, [n, outputs, inputs] (autograd)
    model.predict_with_jacobian(x)       # both at once in plain tensor ops (closed form), what the export runs
    torch.export.export(ExportedEmulator(model), (x,), ...)   # forward(x) = predict_with_jacobian(x)

The export (toolkit/export/: torch.export + AOTInductor, for C++) needs the Jacobian without autograd: an MLP's is
closed form, W_L diag(f'(a_{L-1})) W_{L-1} ... diag(f'(a_1)) W_1 in normalised space (f the activation between the
layers: GELU, ReLU with f' = 1 where a > 0 and 0 elsewhere as autograd takes it, or the identity with f' = 1),
chained in the network's dtype alongside the forward pass, then scaled by output_std / input_std in float64.

SOCA's IceNet (IceNet.h: fc1 -> fc2 -> sigmoid) is this class with layers=1, activation="identity",
output_activation="sigmoid" and output statistics 0 and 1: the network's output is aice itself, and what is trained
is aice (the normalisation of the outputs is the identity). ICENET_INPUTS is the order in which SOCA fills its inputs.

With output_activation="sigmoid" the physical output is sigmoid(network) (SOCA's IceNet: aice in (0, 1)); what is
trained stays the normalised output, (sigmoid(network) - output_mean) / output_std, so the loss keeps its scale, and
predict() returns the sigmoid itself (exactly within [0, 1]). The closed-form Jacobian then carries the sigmoid's
derivative s (1 - s) in place of the output_std scaling. "none" (the default) is the network's output as before.

The normalisation statistics are float64 buffers of the model, so a saved model (safetensors, the exported
package) predicts in physical units by itself; normalising in float64 keeps the digits of large-mean fields
(temperatures in K, float32 ulp 3e-5 at 273 K) that a float32 subtraction would round away.
"""

import math

import torch
from torch import nn

STATISTICS = ("input_mean", "input_std", "output_mean", "output_std")
OUTPUT_ACTIVATIONS = ("none", "sigmoid")  # on the network's output: none, or sigmoid (outputs in (0, 1), SOCA's IceNet)
# Between the layers: GELU (the reference's), ReLU (aibalance c710abb ufsemulator/model.py), or none (SOCA's IceNet)
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "identity": nn.Identity}
# SOCA's inputs in the order MLJac.h and IceEmul.h prepData fill them (patterns[i][0..6]); Jacobian entry k is d / d
# ICENET_INPUTS[k]
ICENET_INPUTS = ("tair", "tsfc", "sst", "sss", "hs", "hi", "sice")


class UfsEmulator(nn.Module):
    def __init__(
        self,
        input_mean: torch.Tensor,
        input_std: torch.Tensor,
        output_mean: torch.Tensor,
        output_std: torch.Tensor,
        hidden: int = 64,
        layers: int = 3,
        output_activation: str = "none",
        activation: str = "gelu",
    ):
        super().__init__()
        if output_activation not in OUTPUT_ACTIVATIONS:
            raise ValueError(f"output_activation {output_activation!r}: give one of {', '.join(OUTPUT_ACTIVATIONS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: give one of {', '.join(ACTIVATIONS)}")
        self.output_activation = output_activation
        self.activation = activation
        n_in, n_out = len(input_mean), len(output_mean)
        self.register_buffer("input_mean", torch.as_tensor(input_mean, dtype=torch.float64).clone())
        self.register_buffer("input_std", torch.as_tensor(input_std, dtype=torch.float64).clone())
        self.register_buffer("output_mean", torch.as_tensor(output_mean, dtype=torch.float64).clone())
        self.register_buffer("output_std", torch.as_tensor(output_std, dtype=torch.float64).clone())
        widths = [n_in, *[hidden] * layers]
        blocks: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:], strict=True):
            blocks += [nn.Linear(a, b), ACTIVATIONS[activation]()]  # nn.Identity keeps the Linear layers' indices
        blocks.append(nn.Linear(widths[-1], n_out))
        self.net = nn.Sequential(*blocks)
        for module in self.net:
            if isinstance(module, nn.Linear):  # the reference emulator's initialisation
                nn.init.xavier_normal_(module.weight)
                nn.init.zeros_(module.bias)

    def _apply(self, fn, recurse=True):
        # .float() / .half() / .to(dtype) cast the weights; the statistics stay float64 (they only move devices).
        statistics = {name: self._buffers[name] for name in STATISTICS}
        super()._apply(fn, recurse)
        for name, before in statistics.items():
            self._buffers[name] = before.to(device=self._buffers[name].device)
        return self

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised inputs [n, inputs] -> normalised outputs [n, outputs] (with the sigmoid: the sigmoid's value,
        normalised by the output statistics in float64, returned in the network's dtype)."""
        out = self.net(z)
        if self.output_activation == "sigmoid":
            return ((torch.sigmoid(out).double() - self.output_mean) / self.output_std).to(out.dtype)
        return out

    def normalise_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Physical -> normalised, computed in float64, returned in the network's dtype."""
        return ((x.double() - self.input_mean) / self.input_std).to(self.net[0].weight.dtype)

    def normalise_outputs(self, y: torch.Tensor) -> torch.Tensor:
        return ((y.double() - self.output_mean) / self.output_std).to(self.net[0].weight.dtype)

    def to_physical_outputs(self, out: torch.Tensor) -> torch.Tensor:
        return out.double() * self.output_std + self.output_mean

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Physical inputs [n, inputs] -> physical outputs [n, outputs] (float64); with the sigmoid, its value
        (no round trip through the normalisation: within [0, 1] exactly)."""
        if self.output_activation == "sigmoid":
            return torch.sigmoid(self.net(self.normalise_inputs(x))).double()
        return self.to_physical_outputs(self(self.normalise_inputs(x)))

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """d outputs / d inputs in physical units, [n, outputs, inputs] (float64): the network's Jacobian in
        normalised space scaled by output_std / input_std (the chain rule through the normalisation)."""
        z = self.normalise_inputs(x).detach()

        def one(row):
            return self(row.unsqueeze(0)).squeeze(0)

        normalised = torch.func.vmap(torch.func.jacrev(one))(z).double()  # [n, outputs, inputs]
        return normalised * self.output_std[:, None] / self.input_std[None, :]

    def predict_with_jacobian(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(predict(x), jacobian(x)) in one pass of plain tensor operations: the chain rule through the layers,
        written out (no autograd, so torch.export traces it). Predictions equal predict(x) bit for bit."""
        h = self.normalise_inputs(x)
        chain = None  # d h / d z so far: [1 or n, width, inputs] (the first layer's is the same for every point)
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                chain = layer.weight.unsqueeze(0) if chain is None else torch.matmul(layer.weight, chain)
                h = layer(h)
            elif isinstance(layer, nn.GELU):
                chain = gelu_derivative(layer, h).unsqueeze(-1) * chain
                h = layer(h)
            elif isinstance(layer, nn.ReLU):  # 1 where a > 0, else 0 (autograd's threshold_backward, a = 0 included)
                chain = (h > 0).to(h.dtype).unsqueeze(-1) * chain
                h = layer(h)
            elif not isinstance(layer, nn.Identity):  # the identity: h and its chain unchanged
                raise TypeError(f"predict_with_jacobian has no derivative for {type(layer).__name__}")
        # x.shape[0], not len(x): torch.export keeps the number of points symbolic (any n).
        chain = chain.expand(x.shape[0], -1, -1).double()
        if self.output_activation == "sigmoid":  # d sigmoid(h) / d h = s (1 - s), in float64
            s = torch.sigmoid(h)
            slope = s.double() * (1.0 - s.double())
            return s.double(), slope.unsqueeze(-1) * chain / self.input_std[None, :]
        jacobian = chain * self.output_std[:, None] / self.input_std[None, :]
        return self.to_physical_outputs(h), jacobian


def gelu_derivative(gelu: nn.GELU, a: torch.Tensor) -> torch.Tensor:
    """d gelu(a) / d a, elementwise, for both of torch's GELU forms."""
    if gelu.approximate == "tanh":  # 0.5 a (1 + tanh(u)), u = sqrt(2/pi) (a + 0.044715 a^3)
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (a + 0.044715 * a * a * a))
        return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * a * a)
    # a Phi(a): Phi(a) + a phi(a)
    return 0.5 * (1.0 + torch.erf(a * (1.0 / math.sqrt(2.0)))) + a * torch.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)


class ExportedEmulator(nn.Module):
    """The exported form: forward(x) = (predictions [n, outputs], Jacobian [n, outputs, inputs]), physical units in
    and out (float64), without autograd (torch.export traces plain tensor operations)."""

    def __init__(self, model: UfsEmulator):
        super().__init__()
        self.model = model
        for parameter in self.parameters():  # an inference module: no autograd graph in its outputs
            parameter.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.predict_with_jacobian(x)


def from_run_config(config: dict) -> UfsEmulator:
    """An untrained model shaped as a run's config.json says (statistics placeholders; load the weights next)."""
    n_in, n_out = len(config["inputs"]), len(config["outputs"])
    ones_in, ones_out = torch.ones(n_in, dtype=torch.float64), torch.ones(n_out, dtype=torch.float64)
    return UfsEmulator(ones_in * 0, ones_in, ones_out * 0, ones_out, hidden=config["hidden"], layers=config["layers"],
                       output_activation=config.get("output_activation", "none"),  # runs made before it: none
                       activation=config.get("activation", "gelu"))  # runs made before it: gelu


def is_icenet(model: UfsEmulator) -> bool:
    """Whether the model is SOCA's IceNet: fc1 -> fc2 -> sigmoid (one hidden layer, nothing between the two Linear
    layers but the identity, a sigmoid output) with no output statistics (mean 0, std 1: the output is aice)."""
    linears = [layer for layer in model.net if isinstance(layer, nn.Linear)]
    between = [layer for layer in model.net if not isinstance(layer, nn.Linear | nn.Identity)]
    return (len(linears) == 2 and not between and getattr(model, "output_activation", "none") == "sigmoid"
            and bool((model.output_mean == 0).all()) and bool((model.output_std == 1).all()))
