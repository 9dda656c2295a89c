"""The UFS emulator model: statistics as buffers, predictions and the Jacobian in physical units (against finite
differences), the closed-form Jacobian the export runs (against autograd) and its torch.export trace. The export
CLI, the C++ consumer and netCDF inference: tests/test_ufs_export.py."""

from __future__ import annotations

import pytest
import torch

from toolkit.models.ufs_emulator import ExportedEmulator, UfsEmulator, from_run_config, is_icenet

# Statistics like the real fields': temperatures in K, a humidity in kg/kg, winds in m/s.
MEAN = torch.tensor([273.4, 263.0, 2.2e-3, -0.1], dtype=torch.float64)
STD = torch.tensor([2.5, 9.0, 1.6e-3, 6.5], dtype=torch.float64)


def model_with_stats(dtype=torch.float32) -> UfsEmulator:
    torch.manual_seed(0)
    model = UfsEmulator(
        MEAN,
        STD,
        torch.tensor([0.3, 1.2], dtype=torch.float64),
        torch.tensor([0.4, 0.9], dtype=torch.float64),
        hidden=32,
        layers=3,
    )
    return model.to(dtype)


def physical_inputs(n: int = 16) -> torch.Tensor:
    return MEAN + STD * torch.randn(n, len(MEAN), dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_statistics_are_float64_buffers_that_travel_with_the_weights():
    model = model_with_stats()
    state = model.state_dict()
    for name in ["input_mean", "input_std", "output_mean", "output_std"]:
        assert name in dict(model.named_buffers()) and state[name].dtype == torch.float64
    assert not any(p.dtype == torch.float64 for p in model.parameters())  # the network itself is float32
    rebuilt = from_run_config({"inputs": ["a", "b", "c", "d"], "outputs": ["y", "z"], "hidden": 32, "layers": 3})
    rebuilt.load_state_dict(state)
    x = physical_inputs()
    assert torch.equal(rebuilt.predict(x), model.predict(x))


def test_predict_is_the_network_between_the_normalisations():
    model = model_with_stats()
    x = physical_inputs()
    z = ((x - MEAN) / STD).float()
    assert torch.equal(model.normalise_inputs(x), z)
    expected = model(z).double() * model.output_std + model.output_mean
    assert torch.equal(model.predict(x), expected)
    layers = [m for m in model.net if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in layers] == [(32, 4), (32, 32), (32, 32), (2, 32)]
    assert sum(isinstance(m, torch.nn.GELU) for m in model.net) == 3
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in layers)
    # Xavier-normal: std sqrt(2 / (fan_in + fan_out)); the 32 x 32 layer has 1024 draws
    assert abs(layers[1].weight.std().item() / (2 / 64) ** 0.5 - 1) < 0.1


def test_jacobian_in_physical_units_matches_finite_differences():
    model = model_with_stats(torch.float64)  # float64 so central differences are accurate to ~1e-10
    x = physical_inputs(5)
    jacobian = model.jacobian(x)
    assert jacobian.shape == (5, 2, 4)
    numeric = torch.empty_like(jacobian)
    for i in range(4):
        step = 1e-5 * STD[i]  # a step in each input's own units (K, kg/kg, m/s)
        plus, minus = x.clone(), x.clone()
        plus[:, i] += step
        minus[:, i] -= step
        numeric[:, :, i] = (model.predict(plus) - model.predict(minus)) / (2 * step)
    scale = jacobian.abs().amax(dim=(0, 1), keepdim=True)  # per input: its entries span its units' range
    assert ((jacobian - numeric).abs() / scale).max() < 1e-6
    # the humidity column is in 1/(kg/kg): ~1/1.6e-3 times the normalised sensitivity, which the chain rule gives
    assert jacobian[:, :, 2].abs().max() > 50 * jacobian[:, :, 0].abs().max()
    # the float32 model's Jacobian is the same to float32 accuracy
    single = model_with_stats(torch.float32)
    assert torch.allclose(single.jacobian(x), jacobian, rtol=1e-4, atol=1e-4 * scale.max().item())


def test_closed_form_jacobian_is_autograds():
    """predict_with_jacobian (plain tensor ops, what the export traces) against jacobian (autograd): equal to 1e-10
    in float64, for both GELU forms and a single point; its predictions are predict()'s bit for bit."""
    for approximate in ("none", "tanh"):
        model = model_with_stats(torch.float64)
        for layer in model.net:
            if isinstance(layer, torch.nn.GELU):
                layer.approximate = approximate
        for x in (physical_inputs(7), physical_inputs(1)):
            predictions, jacobian = model.predict_with_jacobian(x)
            autograd = model.jacobian(x).detach()
            assert torch.equal(predictions, model.predict(x)) and jacobian.shape == (len(x), 2, 4)
            scale = autograd.abs().amax(dim=(0, 1), keepdim=True)  # per input: its units' range
            assert ((jacobian - autograd).abs() / scale).max() < 1e-10, approximate
    # the float32 network: the same chain in float32, equal to autograd's to float32 accuracy
    single = model_with_stats(torch.float32)
    x = physical_inputs()
    predictions, jacobian = single.predict_with_jacobian(x)
    autograd = single.jacobian(x).detach()
    assert torch.equal(predictions, single.predict(x))
    assert ((jacobian - autograd).abs() / autograd.abs().amax(dim=(0, 1), keepdim=True)).max() < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "relu", "identity"])
def test_exported_emulator_traces_with_any_number_of_points(activation):
    """torch.export of ExportedEmulator (no AOTInductor compile here: that is tests/test_ufs_export.py): the
    program's outputs are the closed form's for 1 and for 9 points, without a DeprecationWarning, for each
    activation."""
    import warnings

    model = model_with_stats()
    if activation != "gelu":
        torch.manual_seed(0)
        model = UfsEmulator(MEAN, STD, model.output_mean, model.output_std, hidden=32, layers=3, activation=activation)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        program = torch.export.export(
            ExportedEmulator(model), (physical_inputs(2),), dynamic_shapes={"x": {0: torch.export.Dim("points", min=1)}}
        )
    for n in (1, 9):
        x = physical_inputs(n)
        predictions, jacobian = program.module()(x)
        expected_predictions, expected_jacobian = model.predict_with_jacobian(x)
        assert torch.equal(predictions, expected_predictions) and torch.equal(jacobian, expected_jacobian)


def test_closed_form_jacobian_of_relu_and_identity_is_autograds():
    """ReLU (aibalance c710abb's) and no activation (SOCA's IceNet, with the sigmoid output): the closed form equals
    autograd's to 1e-10 in float64, ReLU's kink (a = 0, derivative 0 as autograd takes it) included."""
    for activation, output_activation in (("relu", "none"), ("identity", "sigmoid"), ("relu", "sigmoid")):
        torch.manual_seed(0)
        model = UfsEmulator(MEAN, STD, torch.tensor([0.3, 1.2], dtype=torch.float64),
                            torch.tensor([0.4, 0.9], dtype=torch.float64), hidden=32, layers=2, activation=activation,
                            output_activation=output_activation).double()
        kind = {"relu": torch.nn.ReLU, "identity": torch.nn.Identity}[activation]
        assert [type(m) for m in model.net] == [torch.nn.Linear, kind, torch.nn.Linear, kind, torch.nn.Linear]
        x = physical_inputs(7)
        x[0] = MEAN  # on the kink: normalised inputs exactly 0 and zero biases put every first-layer unit at a = 0
        assert torch.equal(model.net[0](model.normalise_inputs(x[:1])), torch.zeros(1, 32, dtype=torch.float64))
        predictions, jacobian = model.predict_with_jacobian(x)
        autograd = model.jacobian(x).detach()
        assert torch.equal(predictions, model.predict(x))
        scale = autograd.abs().amax(dim=(0, 1), keepdim=True)
        assert ((jacobian - autograd).abs() / scale).max() < 1e-10, (activation, output_activation)
    # ReLU's Jacobian is piecewise constant in normalised space: two points in one linear region share it
    relu = model_with_stats(torch.float64)
    relu.net = torch.nn.Sequential(*[torch.nn.ReLU() if isinstance(m, torch.nn.GELU) else m for m in relu.net])
    x = physical_inputs(1)
    _, near = relu.predict_with_jacobian(x + 1e-9 * STD)
    _, at = relu.predict_with_jacobian(x)
    assert torch.allclose(near, at, rtol=1e-12, atol=0)


def test_activation_is_a_model_choice_and_old_configs_mean_gelu():
    old = {"inputs": ["a", "b", "c", "d"], "outputs": ["y", "z"], "hidden": 8, "layers": 2}  # before --activation
    assert sum(isinstance(m, torch.nn.GELU) for m in from_run_config(old).net) == 2
    relu = from_run_config({**old, "activation": "relu"})
    assert sum(isinstance(m, torch.nn.ReLU) for m in relu.net) == 2 and relu.activation == "relu"
    assert [type(m) for m in from_run_config({**old, "activation": "identity", "layers": 1}).net] == [
        torch.nn.Linear, torch.nn.Identity, torch.nn.Linear]
    try:
        UfsEmulator(MEAN, STD, MEAN[:1], STD[:1], activation="tanh")
    except ValueError as error:
        assert "gelu, relu, identity" in str(error)
    else:
        raise AssertionError("activation 'tanh' was accepted")


def test_is_icenet_is_socas_network_and_nothing_else():
    zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    icenet = dict(hidden=4, layers=1, activation="identity", output_activation="sigmoid")
    assert is_icenet(UfsEmulator(MEAN, STD, zero, one, **icenet))
    for change in ({"layers": 2}, {"activation": "gelu"}, {"activation": "relu"}, {"output_activation": "none"}):
        assert not is_icenet(UfsEmulator(MEAN, STD, zero, one, **{**icenet, **change})), change
    assert not is_icenet(UfsEmulator(MEAN, STD, zero + 0.3, one * 0.2, **icenet))  # output statistics
