"""SOCA's IceNet from Python: `--preset soca` trains IceNet's network on SOCA's inputs in MLJac.h's order, `python
-m toolkit.export torchscript RUN --format soca` writes the two files as IceNet's torch::load and loadNorm read them
(float32; fc1, fc2, input_mean, input_std; a normalization file of exactly 2 tensors) and refuses in one line what
SOCA cannot run; `--format ufsnet` keeps our general MLP (with its activation) for export/cpp/ufs_net.h. The C++
side, SOCA's own loading path: tests/test_ufs_soca_cpp.py. One tiny run per module (IceNet of width 8, 10 epochs:
seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_json, run_recipe
from test_ufs_export import assert_refused_here, best_model

from toolkit.data.ufs import DEFAULT_INPUTS, synthesize
from toolkit.errors import UsageError
from toolkit.export.soca import (
    ICENET_TENSORS,
    normalization_path,
    read_soca,
    read_tensor_vector,
    soca_emulator,
    ufsnet_emulator,
    write_soca,
    write_ufsnet,
)
from toolkit.export.torchscript import quiet_torchscript
from toolkit.models.ufs_emulator import ICENET_INPUTS, UfsEmulator

pytestmark = pytest.mark.slow

CICE_NAMES = {"tair": "Tair_h", "tsfc": "Tsfc_h", "sst": "sst_h", "sss": "sss_h", "hs": "hs_h", "hi": "hi_h",
              "sice": "sice_h"}  # IceEmul.h prepData's readCice names
HIDDEN = 8


def train_soca_run(where: Path) -> tuple[Path, Path]:
    """(run directory, data): a generated CICE file (48 x 96) and `--preset soca` trained 10 epochs on it."""
    data = synthesize(where / "cice.nc", seed=5, nlat=48, nlon=96, naming="cice")
    run_dir = where / "run"
    result = run_recipe(["--preset", "soca", "--data", str(data), "--hidden", str(HIDDEN), "--batch-size", "40",
                         "--epochs", "10", "--lr", "1e-2", "--log-with", "csv", "--output-dir", str(run_dir)],
                        recipe="ufs_emulator")
    assert f"model: IceNet (SOCA): fc1 7 -> {HIDDEN}, fc2 {HIDDEN} -> 1, sigmoid, no output statistics" in result.stdout
    assert "domain (soca): umask == 1 and ULAT > 40 and 0 < aice <= 1" in result.stdout
    return run_dir, data


def export_soca_files(run_dir: Path) -> Path:
    """--format soca of the run, written by the CLI."""
    out = run_dir.parent / "soca" / "arctic.pt"
    from toolkit.export import main

    main(["torchscript", str(run_dir), "--out", str(out), "--format", "soca"])
    return out


@pytest.fixture(scope="module")
def soca_run(tmp_path_factory):
    return train_soca_run(tmp_path_factory.mktemp("ufs-soca"))


@pytest.fixture(scope="module")
def soca_files(soca_run):
    return export_soca_files(soca_run[0])


def soca_points(data: Path, n: int = 40) -> torch.Tensor:
    """n cells spread over SOCA's northern domain (IceEmul.h selectData, clean data: umask == 1, ULAT > 40, 0 <
    aice <= 1; computed here from the file) and their inputs in SOCA's order, as float32 values (SOCA reads
    float32), held in float64."""
    import xarray as xr

    with xr.open_dataset(data) as ds:
        aice = ds["aice_h"].values[0].ravel()
        keep = (ds["umask"].values.ravel() == 1) & (ds["ULAT"].values.ravel() > 40) & (aice > 0) & (aice <= 1)
        cells = np.flatnonzero(keep)
        cells = cells[:: max(1, len(cells) // n)][:n]
        x = np.stack([ds[CICE_NAMES[name]].values[0].ravel()[cells] for name in ICENET_INPUTS], axis=1)
    return torch.from_numpy(x.astype(np.float32)).double()


def test_soca_preset_trains_icenet_on_socas_inputs_and_domain(soca_run):
    run_dir, _ = soca_run
    config = read_json(run_dir / "config.json")["config"]
    assert (config["preset"], config["architecture"], config["layers"], config["activation"],
            config["output_activation"]) == ("soca", "icenet", 1, "identity", "sigmoid")
    assert tuple(config["inputs"]) == ("tair", "tsfc", "sst", "sss", "hs", "hi", "sice") and config["outputs"] == [
        "aice"]
    assert (config["domain"], config["hemisphere"], config["max_patterns_per_rank"]) == ("soca", "north", 400_000)
    model = best_model(run_dir)
    assert [type(layer).__name__ for layer in model.net] == ["Linear", "Identity", "Linear"]
    assert tuple(model.net[0].weight.shape) == (HIDDEN, 7) and tuple(model.net[2].weight.shape) == (1, HIDDEN)
    assert torch.equal(model.output_mean, torch.zeros(1, dtype=torch.float64))  # no output statistics: aice itself
    assert torch.equal(model.output_std, torch.ones(1, dtype=torch.float64))
    summary = read_json(run_dir / "summary.json")["test_metrics_at_best"]
    # the loss is the MSE of aice: the validation loss is the squared RMSE in aice's units
    assert summary["best_val_loss"] == pytest.approx(summary["best_val_rmse_aice"] ** 2, rel=1e-9)
    assert summary["best_val_r2_aice"] > 0.5  # it learns (0.94 seen)


def test_soca_files_are_what_icenet_loads(soca_run, soca_files):
    run_dir, data = soca_run
    model = best_model(run_dir)
    assert sorted(p.name for p in soca_files.parent.iterdir()) == ["arctic.pt", "normalization.arctic.pt"]
    moments = read_tensor_vector(normalization_path(soca_files))  # as loadNorm's torch::load(vector) reads it
    assert len(moments) == 2 and all(moment.dtype == torch.float32 for moment in moments)
    assert torch.equal(moments[0], model.input_mean.float()) and torch.equal(moments[1], model.input_std.float())
    with quiet_torchscript():
        module = torch.jit.load(str(soca_files))
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    assert sorted(tensors) == sorted(ICENET_TENSORS)  # what torch::load(IceNet) reads, nothing else
    assert sorted(name for name, _ in module.named_children()) == ["fc1", "fc2"]
    assert all(tensor.dtype == torch.float32 for tensor in tensors.values())
    read, _, meta = read_soca(soca_files)
    for name, key in (("fc1", "net.0"), ("fc2", "net.2")):
        for part in ("weight", "bias"):
            assert torch.equal(read[f"{name}.{part}"], getattr(model.net[int(key[-1])], part)), (name, part)
    assert meta["format"] == "soca" and tuple(meta["inputs"]) == ICENET_INPUTS and meta["moments"] == [
        "input_mean", "input_std"]  # the archive's extra file meta.json, which torch::load never opens
    assert meta["checkpoint"].startswith("step_") and meta["dtype"] == "float32"
    x = soca_points(data)
    rebuilt = soca_emulator(soca_files)  # float32 statistics in float64 buffers: float32 rounding of the inputs'
    assert (rebuilt.predict(x) - model.predict(x)).abs().max() < 1e-6
    jacobian = model.jacobian(x)
    assert ((rebuilt.jacobian(x) - jacobian).abs() / jacobian.abs().amax(dim=0)).max() < 1e-5


def icenet_model(inputs_std: float = 1.0) -> UfsEmulator:
    generator = torch.Generator().manual_seed(3)
    mean = torch.rand(7, generator=generator, dtype=torch.float64) * 300
    return UfsEmulator(mean, torch.full((7,), inputs_std, dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                       torch.ones(1, dtype=torch.float64), hidden=4, layers=1, activation="identity",
                       output_activation="sigmoid")


SOCA_META = {"recipe": "ufs_emulator", "checkpoint": "untrained", "inputs": list(ICENET_INPUTS), "outputs": ["aice"]}


@pytest.mark.parametrize("change, fragment", [
    ({"inputs": ["sst", "sss", "tair", "tsfc", "hi", "hs", "sice"]}, "the inputs sst sss tair tsfc hi hs sice"),
    ({"inputs": [*ICENET_INPUTS, "uocn"]}, "the inputs tair tsfc sst sss hs hi sice uocn"),
    ({"outputs": ["hi"]}, "the outputs hi"),
    ({"activation": "relu"}, "ReLU between"),
    ({"layers": 2}, "2 hidden layer(s)"),
    ({"output_activation": "none"}, "output activation none"),
    ({"output_statistics": True}, "outputs normalised by their statistics"),
], ids=["our-order", "eight-inputs", "other-output", "relu", "two-layers", "no-sigmoid", "output-statistics"])
def test_write_soca_refuses_what_icenet_cannot_run(change, fragment, tmp_path):
    meta = {**SOCA_META, **{k: v for k, v in change.items() if k in ("inputs", "outputs")}}
    shape = {"hidden": 4, "layers": 1, "activation": "identity", "output_activation": "sigmoid",
             **{k: v for k, v in change.items() if k in ("layers", "activation", "output_activation")}}
    statistics = (torch.tensor([0.3]), torch.tensor([0.2])) if change.get("output_statistics") else (
        torch.zeros(1), torch.ones(1))
    model = UfsEmulator(torch.zeros(len(meta["inputs"])), torch.ones(len(meta["inputs"])), *statistics, **shape)
    out = tmp_path / "arctic.pt"
    with pytest.raises(UsageError) as refused:
        write_soca(model, meta, {}, out)
    message = str(refused.value)
    assert fragment in message and "\n" not in message
    assert "tair tsfc sst sss hs hi sice -> aice" in message and "--preset soca" in message  # what SOCA expects
    assert list(tmp_path.iterdir()) == []
    write_soca(icenet_model(), SOCA_META, {}, out)  # IceNet on SOCA's inputs: written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arctic.pt", "normalization.arctic.pt"]


def test_cli_refuses_a_default_run_for_soca_in_one_line(soca_run, tmp_path, capfd):
    """A run of the default preset (3 x 16 GELU, our 14 inputs in our order) exported for SOCA: one line, exit 2,
    nothing written; the same run's general layout is no longer what --format soca means."""
    _, data = soca_run
    run_dir = tmp_path / "default-run"
    run_recipe(["--data", str(data), "--hidden", "16", "--batch-size", "40", "--max-steps", "2", "--log-with", "none",
                "--output-dir", str(run_dir)], recipe="ufs_emulator")
    case = tmp_path / "case"
    case.mkdir()
    fragments = ["--format soca", "IceNet", "tair tsfc sst sss hs hi sice -> aice", "3 hidden layer(s) of 16 with GELU",
                 "the inputs sst sss tair tsfc hi hs sice uocn", "--preset soca"]
    assert_refused_here(["torchscript", str(run_dir), "--out", str(case / "arctic.pt"), "--format", "soca"],
                        fragments, case, capfd)


def ufsnet_model(activation: str) -> UfsEmulator:
    """An untrained 2 x 8 MLP with random biases and the given activation."""
    generator = torch.Generator().manual_seed(11)
    mean = torch.rand(14, generator=generator, dtype=torch.float64) * 300
    std = torch.rand(14, generator=generator, dtype=torch.float64) + 0.1
    model = UfsEmulator(mean, std, torch.tensor([0.4], dtype=torch.float64), torch.tensor([0.35], dtype=torch.float64),
                        hidden=8, layers=2, activation=activation)
    with torch.no_grad():
        for layer in model.net:
            if isinstance(layer, torch.nn.Linear):
                layer.bias.normal_(0.0, 0.3, generator=generator)
    return model.eval().requires_grad_(False)


def ufsnet_points(model: UfsEmulator) -> torch.Tensor:
    noise = torch.randn(20, 14, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return model.input_mean + noise * model.input_std


UFSNET_META = {**SOCA_META, "inputs": list(DEFAULT_INPUTS)}


@pytest.mark.parametrize("activation", ["relu", "gelu", "identity"])
def test_ufsnet_layout_keeps_our_mlp_with_its_activation(activation, tmp_path):
    """--format ufsnet (our MLP in SOCA's two-file form, for export/cpp/ufs_net.h): the activation the run trained
    with (ReLU: the gdas preset's) travels, and the files rebuild the model exactly."""
    model = ufsnet_model(activation)
    out = tmp_path / "ufsnet" / "model.pt"
    write_ufsnet(model, UFSNET_META, {"optimizer": "adam"}, out)
    assert len(read_tensor_vector(normalization_path(out))) == 4
    x = ufsnet_points(model)
    rebuilt = ufsnet_emulator(out)
    assert rebuilt.activation == activation
    assert torch.equal(rebuilt.predict(x), model.predict(x)) and torch.equal(rebuilt.jacobian(x), model.jacobian(x))
