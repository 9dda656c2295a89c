"""`python -m toolkit.export torchscript`: the TorchScript archives that the UFS teams' C++ programs load.
aibalance's layouts (HEAD's: predict, jac, jac_physical, its metadata attributes, float32 out; c710abb's: forward on
physical inputs) and our MLP in SOCA's two-file form (--format ufsnet: MODEL.pt as torch::load reads it,
normalization.MODEL.pt as loadNorm reads it) equal the model in Python (its autograd Jacobian) and, through
export/cpp's consumer (--format torchscript / ufsnet, the build shared with test_ufs_export.py), in C++; torch's
TorchScript deprecation warnings stay inside the export. SOCA's own IceNet files (--format soca): test_ufs_soca.py.
One tiny run per module; models with a sigmoid output and another depth are made here, untrained."""

from __future__ import annotations

import copy
import inspect
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from conftest import read_json
from safetensors.torch import load_file
from test_ufs_export import (
    assert_refused_here,
    best_model,
    build_cpp_consumer,
    domain_inputs,
    export_cli,
    per_input_error,
    run_export,
    train_tiny_run,
)

from toolkit.data.ufs import DEFAULT_INPUTS
from toolkit.export import load_torchscript
from toolkit.export.soca import (
    SocaMoments,
    normalization_path,
    read_tensor_vector,
    read_ufsnet,
    ufsnet_emulator,
    write_ufsnet,
)
from toolkit.export.torchscript import quiet_torchscript, write_torchscript
from toolkit.models.ufs_emulator import UfsEmulator

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ufs-export")]  # with test_ufs_export: one C++ build

AIBALANCE_META = (
    "model_class",
    "hidden_layers",
    "hidden_size",
    "input_variables",
    "output_variables",
    "input_short_names",
    "output_short_names",
    "optimizer",
    "loss",
)  # export_to_torchscript.py:175-185
STATISTICS = ("input_mean", "input_std", "output_mean", "output_std")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry (predictions)."""
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def quietly(function, *args):
    """Call with every DeprecationWarning an error: the TorchScript ones must stay inside the export."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return function(*args)


def assert_equals_model(predict, jac, jac_physical, model: UfsEmulator, x: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> None:
    """An artefact's predict (physical), jac (normalised) and jac_physical equal the model's predict and autograd
    Jacobian (UfsEmulator.jacobian) to 1e-6, relative to each input's largest entry; all in `dtype` (aibalance's
    layout: float32, as its float32 module returns them)."""
    physical = model.jacobian(x)
    normalised = physical * model.input_std / model.output_std[:, None]
    predictions, jacobian, jacobian_physical = predict(x), jac(x), jac_physical(x)
    assert predictions.dtype == jacobian.dtype == jacobian_physical.dtype == dtype
    assert predictions.shape == (len(x), model.output_mean.numel())
    assert jacobian.shape == jacobian_physical.shape == physical.shape
    assert relative(predictions, model.predict(x)) < 1e-6
    assert per_input_error(jacobian, normalised) < 1e-6
    assert per_input_error(jacobian_physical, physical) < 1e-6


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("ufs-torchscript"))


@pytest.fixture(scope="module")
def torchscript_export(trained_run):
    """aibalance's layout, written by the CLI in a fresh interpreter where any DeprecationWarning is an error."""
    run_dir, _ = trained_run
    out = run_dir.parent / "torchscript" / "emulator.pt"
    assert "jac_physical" in export_cli("torchscript", run_dir, out).stdout
    return out


@pytest.fixture(scope="module")
def ufsnet_export(trained_run):
    """Our MLP in SOCA's two-file form, written by the CLI (in this process, DeprecationWarnings as errors)."""
    run_dir, _ = trained_run
    out = run_dir.parent / "ufsnet" / "arctic.pt"
    code, stdout = None, ""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            from toolkit.export import main

            main(["torchscript", str(run_dir), "--out", str(out), "--format", "ufsnet"])
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    assert code == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["arctic.pt", "normalization.arctic.pt"], stdout
    return out


# aibalance b1eccbc cf_mappings.py CF_ATM (its atmosphere; with our two fluxes) and CF_OCN: the levels its export
# gives them, nlevs - 1 (127 by default: data.py's atm_level_index) and 0
ATMOSPHERE = {"tair", "uatm", "vatm", "tsfc", "qref", "flwdn", "fswdn"}


def aibalance_cpp_reads(module) -> dict:
    """What aibalance's ufs_emulator.cpp (b1eccbc) reads of a module, transcribed: input_names (toListRef of
    strings), input_levels (toInt), output_names, output_levels, meta (toGenericDict, each value toString), then
    forward on a float32 [1, input_size] and its Jacobian by backward through forward, one output at a time."""
    read = {"input_names": [str(v) for v in module.input_names], "input_levels": [int(v) for v in module.input_levels],
            "output_names": [str(v) for v in module.output_names],
            "output_levels": [int(v) for v in module.output_levels]}
    assert all(isinstance(key, str) and isinstance(value, str) for key, value in module.meta.items())  # toString
    read["meta"] = dict(module.meta)
    x = torch.randn(1, len(read["input_names"]), dtype=torch.float)
    y = module.forward(x)
    x_req = x.detach().clone().requires_grad_(True)
    y2 = module.forward(x_req)
    rows = []
    for i in range(y2.size(1)):
        if x_req.grad is not None:
            x_req.grad.zero_()
        grad_out = torch.zeros_like(y2)
        grad_out[0, i] = 1.0
        y2.backward(grad_out, retain_graph=True)
        rows.append(x_req.grad.detach().clone())
    read.update(x=x, output=y, jacobian=torch.stack(rows).squeeze(1))
    return read


def test_aibalance_layout_predicts_as_the_model(trained_run, torchscript_export):
    run_dir, data = trained_run
    module, meta = quietly(load_torchscript, torchscript_export)
    model = best_model(run_dir)
    _, x = domain_inputs(data)
    assert_equals_model(module.predict, module.jac, module.jac_physical, model, x)
    assert torch.equal(module.predict(x), model.predict(x).float())  # the model's numbers, rounded once: bit for bit
    assert torch.equal(module.jac_physical(x), model.jacobian(x).float())
    with torch.no_grad():  # jac turns grad mode on for itself, and back off
        assert torch.equal(module.jac_physical(x[:5]), model.jacobian(x[:5]).float()) and not torch.is_grad_enabled()
    assert torch.equal(module.predict(x[:5].float()), model.predict(x[:5].float()).float())  # float32 inputs too
    assert torch.equal(module(module.normalize_input(x)), model(model.normalise_inputs(x)))  # forward: normalised
    assert module.denormalize_output(module(module.normalize_input(x))).dtype == torch.float32
    # aibalance's names and metadata (model.py:47-66, export_to_torchscript.py:139-186)
    assert [name for name, _ in module.named_parameters()][:2] == ["network.0.weight", "network.0.bias"]
    assert {name for name, _ in module.named_buffers()} == set(STATISTICS)
    assert set(AIBALANCE_META) <= set(module.meta) and module.meta["input_short_names"] == ",".join(DEFAULT_INPUTS)
    assert module.meta["hidden_size"] == "16" and module.meta["hidden_layers"] == "3"
    assert module.meta["input_units"].split(",")[0] == "K" and module.meta["output_activation"] == "none"
    assert meta["checkpoint"] == f"step_{read_json(run_dir / 'summary.json')['best_step']}"  # the meta.json file
    assert meta["inputs"] == list(DEFAULT_INPUTS) and meta["domain"]["lat_variable"] == "TLAT"
    # as aibalance's ufs_emulator.cpp reads it: levels 127 (the atmosphere, no --data-atmos level read) and 0, the
    # optimizer's settings dict as str(), loss as its exporter writes it (its configs say loss_function), float32
    read = aibalance_cpp_reads(module)
    assert read["input_names"][0] == "sea_water_potential_temperature" and len(read["input_names"]) == 14
    assert read["output_names"] == ["sea_ice_area_fraction"] and read["output_levels"] == [0]
    assert read["input_levels"] == [127 if name in ATMOSPHERE else 0 for name in DEFAULT_INPUTS]
    assert read["meta"]["optimizer"] == "{'type': 'adam', 'learning_rate': 0.003, 'weight_decay': 0.0001}"
    assert read["meta"]["loss"] == "" and read["meta"]["loss_function"] == "mse"
    assert read["output"].dtype == read["jacobian"].dtype == torch.float32  # data_ptr<float>() reads them
    assert torch.equal(read["output"], model(read["x"]))  # forward: normalised in and out
    point = read["x"].double() * model.input_std + model.input_mean  # the physical point of that normalised input
    normalised = model.jacobian(point) * model.input_std / model.output_std[:, None]
    assert per_input_error(read["jacobian"][None].double(), normalised) < 1e-5


def test_aibalance_c710abb_layout_takes_physical_inputs(trained_run, torchscript_export, tmp_path, capfd):
    """--format aibalance-c710abb: forward takes physical inputs and returns physical outputs, float32, as c710abb's
    forward (ufsemulator/model.py: it normalises x itself); its ufs_emulator.cpp's Jacobian (backward through
    forward) is the physical one; jac is d forward / d x. HEAD's layout fed the same physical values is far off."""
    run_dir, data = trained_run
    out = tmp_path / "c710abb.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        code, stdout, stderr = run_export(["torchscript", str(run_dir), "--out", str(out), "--format",
                                           "aibalance-c710abb"], capfd)
    assert code == 0 and "forward and jac physical" in stdout and "float32 out" in stdout, stderr
    module, meta = quietly(load_torchscript, out)
    model = best_model(run_dir)
    _, x = domain_inputs(data)
    assert meta["layout"] == "aibalance-c710abb"
    assert torch.equal(module(x), model.predict(x).float()) and module(x).dtype == torch.float32
    assert torch.equal(module(x.float()), model.predict(x.float()).float())  # c710abb's C++ passes float32
    assert torch.equal(module.jac(x), model.jacobian(x).float())
    assert_equals_model(module.predict, lambda v: module.jac(v) * (model.input_std / model.output_std[:, None]).float(),
                        module.jac_physical, model, x)
    point = x[:1].float()  # c710abb's ufs_emulator.cpp: forward, then backward through it per output
    x_req = point.clone().requires_grad_(True)
    y = module.forward(x_req)
    y.backward(torch.ones_like(y))
    # float32 autograd through the float32 network (its error: 3.3e-5 of a column's largest entry, seen)
    assert per_input_error(x_req.grad[None].double(), model.jacobian(point.double())) < 1e-4
    head, _ = quietly(load_torchscript, torchscript_export)
    assert (head(x.float()).double() - model.predict(x)).abs().max() > 1.0  # normalised forward, physical input


def test_ufsnet_layout_reads_back_as_the_cpp_reads_it(trained_run, ufsnet_export):
    run_dir, data = trained_run
    step = read_json(run_dir / "summary.json")["best_step"]
    saved = load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))  # the run's own numbers
    moments = read_tensor_vector(normalization_path(ufsnet_export))  # as torch::load(std::vector<Tensor>&) reads it
    assert len(moments) == 4 and all(moment.dtype == torch.float64 for moment in moments)
    for moment, name in zip(moments, STATISTICS, strict=True):  # [input mean, input std] (SOCA's), then outputs
        assert torch.equal(moment, saved[name]), name
    tensors, _, attributes = read_ufsnet(ufsnet_export)  # MODEL.pt as torch::load(module) finds its tensors
    linears = [key for key in saved if key.startswith("net.") and key.endswith(".weight")]
    assert [key for key in tensors if key.startswith("fc")] == [
        f"fc{k}.{part}" for k in range(1, len(linears) + 1) for part in ("weight", "bias")
    ]
    for k, key in enumerate(linears, start=1):
        assert torch.equal(tensors[f"fc{k}.weight"], saved[key])
        assert torch.equal(tensors[f"fc{k}.bias"], saved[key.replace("weight", "bias")])
    assert all(torch.equal(tensors[name], saved[name]) for name in STATISTICS)
    assert attributes["output_activation"] == "none" and attributes["gelu_approximate"] == "none"
    assert attributes["meta"]["output_short_names"] == "aice"
    model, rebuilt = best_model(run_dir), ufsnet_emulator(ufsnet_export)
    _, x = domain_inputs(data)
    normalised = lambda x: rebuilt.jacobian(x) * rebuilt.input_std / rebuilt.output_std[:, None]  # noqa: E731
    assert_equals_model(rebuilt.predict, normalised, rebuilt.jacobian, model, x, torch.float64)


def synthetic(activation: str, tmp_path: Path) -> tuple[UfsEmulator, Path, Path]:
    """An untrained emulator (2 x 8, random biases) with the given output activation, in aibalance's layout and in
    ufsnet's."""
    if activation != "none" and "output_activation" not in inspect.signature(UfsEmulator).parameters:
        pytest.skip("this UfsEmulator has no output_activation")
    generator = torch.Generator().manual_seed(11)
    mean = torch.rand(14, generator=generator, dtype=torch.float64) * 300
    std = torch.rand(14, generator=generator, dtype=torch.float64) + 0.1
    extra = {"output_activation": activation} if activation != "none" else {}
    model = UfsEmulator(
        mean,
        std,
        torch.tensor([0.4], dtype=torch.float64),
        torch.tensor([0.35], dtype=torch.float64),
        hidden=8,
        layers=2,
        **extra,
    )
    with torch.no_grad():
        for layer in model.net:
            if isinstance(layer, torch.nn.Linear):
                layer.bias.normal_(0.0, 0.3, generator=generator)
    model.eval().requires_grad_(False)
    meta = {
        "recipe": "ufs_emulator",
        "checkpoint": "untrained",
        "inputs": list(DEFAULT_INPUTS),
        "outputs": ["aice"],
        "units": {},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    script, ufsnet = tmp_path / f"{activation}.pt", tmp_path / activation / "model.pt"
    write_torchscript(model, meta, {"optimizer": "adam"}, script)
    write_ufsnet(model, meta, {"optimizer": "adam"}, ufsnet)
    return model, script, ufsnet


@pytest.mark.parametrize("activation", ["none", "sigmoid"])
def test_both_layouts_of_either_output_activation(activation, tmp_path):
    model, script, ufsnet = synthetic(activation, tmp_path)
    x = (
        model.input_mean
        + torch.randn(64, 14, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * model.input_std
    )
    module, _ = quietly(load_torchscript, script)
    assert_equals_model(module.predict, module.jac, module.jac_physical, model, x)
    assert torch.equal(module.predict(x), model.predict(x).float())
    assert module.meta["output_activation"] == activation and module.meta["hidden_layers"] == "2"
    rebuilt = ufsnet_emulator(ufsnet)
    assert torch.equal(rebuilt.predict(x), model.predict(x)) and torch.equal(rebuilt.jacobian(x), model.jacobian(x))


def test_torchscript_export_refuses_bad_input_in_one_line(trained_run, tmp_path, capfd):
    run_dir, _ = trained_run
    (tmp_path / "taken").mkdir()
    (tmp_path / "normalization.norm-taken.pt").mkdir()
    other = tmp_path / "sasrec-run"
    other.mkdir()
    (other / "config.json").write_text('{"recipe": "sasrec", "config": {}}')
    out = str(tmp_path / "x.pt")
    cases = [
        ([str(tmp_path / "nowhere"), "--out", out], ["RUN_DIR", "not a directory"]),
        ([str(run_dir / "checkpoints"), "--out", out], ["config.json"]),
        ([str(other), "--out", out], ["'sasrec'", "ufs_emulator"]),
        ([str(run_dir), "--out", str(tmp_path / "taken")], ["--out", "is a directory"]),
        ([str(run_dir), "--out", str(tmp_path / "x.pt2")], ["--out", ".pt", "aoti"]),
        ([str(run_dir), "--out", out, "--step", "99999"], ["step_99999", "--step"]),
        ([str(run_dir), "--out", out, "--format", "onnx"], ["--format", "'onnx'", "aibalance, aibalance-c710abb, "
                                                            "soca or ufsnet"]),
        ([str(run_dir), "--out", out, "--format", "soca"], ["--format soca:", "IceNet", "--format ufsnet"]),
        (
            [str(run_dir), "--out", str(tmp_path / "norm-taken.pt"), "--format", "ufsnet"],
            ["normalization.norm-taken.pt", "is a directory"],
        ),
    ]
    for argv, fragments in cases:
        assert_refused_here(["torchscript", *argv], fragments, tmp_path, capfd)
    # an existing --out is replaced whole, as `aoti` replaces it (written beside it, then renamed): nothing else left
    target = tmp_path / "replaced" / "emulator.pt"
    target.parent.mkdir()
    target.write_text("an older file\n")
    code, stdout, stderr = run_export(["torchscript", str(run_dir), "--out", str(target)], capfd)
    assert code == 0 and f"wrote {target}" in stdout, stderr
    assert [p.name for p in target.parent.iterdir()] == ["emulator.pt"]
    assert quietly(load_torchscript, target)[1]["checkpoint"].startswith("step_")
    code, _, stderr = run_export(["torchscript", str(run_dir), "--out", str(target), "--format", "ufsnet"], capfd)
    assert code == 0, stderr
    assert sorted(p.name for p in target.parent.iterdir()) == ["emulator.pt", "normalization.emulator.pt"]
    assert len(read_tensor_vector(normalization_path(target))) == 4


def cpp_rows(binary: Path, model: Path, csv: Path, fmt: str) -> tuple[list[str], torch.Tensor]:
    done = subprocess.run([str(binary), str(model), str(csv), "--format", fmt], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr  # no deprecation (or other) warning from libtorch either
    lines = done.stdout.strip().splitlines()
    return lines[0].split(","), torch.tensor(
        [[float(v) for v in line.split(",")] for line in lines[1:]], dtype=torch.float64
    )


def write_csv(path: Path, x: torch.Tensor) -> Path:
    path.write_text(
        ",".join(DEFAULT_INPUTS) + "\n" + "".join(",".join(repr(v) for v in row) + "\n" for row in x.tolist())
    )
    return path


def test_cpp_consumer_loads_both_layouts_as_python_computes(trained_run, torchscript_export, ufsnet_export,
                                                            tmp_path):
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (make test installs them; apt-get install cmake g++)")
    binary = build_cpp_consumer()
    run_dir, data = trained_run
    _, x = domain_inputs(data)
    x = x[:50]
    csv = write_csv(tmp_path / "inputs.csv", x)
    model = best_model(run_dir)
    for fmt, artefact in (("torchscript", torchscript_export), ("ufsnet", ufsnet_export)):
        header, rows = cpp_rows(binary, artefact, csv, fmt)
        assert header == ["aice", *[f"daice_d{name}" for name in DEFAULT_INPUTS]], fmt
        assert len(rows) == len(x)
        assert relative(rows[:, :1], model.predict(x)) < 1e-6, fmt
        assert per_input_error(rows[:, None, 1:], model.jacobian(x)) < 1e-6, fmt
    assert model.predict(x).std() > 1e-3  # the inputs really differ
    # a sigmoid output and two hidden layers (UfsNet's constructor builds three: torch::load adapts it to the file)
    for activation in ("none", "sigmoid"):
        if activation == "sigmoid" and "output_activation" not in inspect.signature(UfsEmulator).parameters:
            continue
        synthetic_model, script, ufsnet = synthetic(activation, tmp_path)
        points = (
            synthetic_model.input_mean
            + torch.randn(20, 14, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
            * synthetic_model.input_std
        )
        points_csv = write_csv(tmp_path / f"points-{activation}.csv", points)
        for fmt, artefact in (("torchscript", script), ("ufsnet", ufsnet)):
            _, rows = cpp_rows(binary, artefact, points_csv, fmt)
            assert relative(rows[:, :1], synthetic_model.predict(points)) < 1e-6, (activation, fmt)
            assert per_input_error(rows[:, None, 1:], synthetic_model.jacobian(points)) < 1e-6, (activation, fmt)
    # the statistics C++ uses are the normalization file's, in SOCA's order (loadNorm after torch::load): other
    # numbers there (for a model without the sigmoid, whose output statistics matter), other predictions, as Python
    # computes them with those numbers
    plain, _, ufsnet = synthetic("none", tmp_path / "moved")
    moved = copy.deepcopy(plain)
    changes = (lambda t: t + 3.0, lambda t: t * 1.5, lambda t: t + 0.1, lambda t: t * 2.0)
    with torch.no_grad():
        for name, change in zip(STATISTICS, changes, strict=True):
            getattr(moved, name).copy_(change(getattr(moved, name)))
    with quiet_torchscript():
        moments = torch.jit.script(SocaMoments([getattr(moved, name) for name in STATISTICS]))
        moments.save(str(normalization_path(ufsnet)))
    points = plain.input_mean + torch.randn(20, 14, dtype=torch.float64) * plain.input_std
    _, rows = cpp_rows(binary, ufsnet, write_csv(tmp_path / "points-moved.csv", points), "ufsnet")
    assert relative(moved.predict(points), plain.predict(points)) > 1e-3
    assert relative(rows[:, :1], moved.predict(points)) < 1e-6
    assert per_input_error(rows[:, None, 1:], moved.jacobian(points)) < 1e-6
    # a wrong --format, or one file given as the other layout: one line, exit 2
    for argv, fragment in (
        ([str(torchscript_export), str(csv), "--format", "onnx"], "is not aoti, torchscript, soca or ufsnet"),
        ([str(torchscript_export), str(csv), "--format", "soca"], "is not SOCA's layout"),
        ([str(ufsnet_export), str(csv), "--format", "torchscript"], "is not aibalance's layout"),
        ([str(csv), str(csv), "--format", "torchscript"], "is not a TorchScript archive"),
    ):
        refused = subprocess.run([str(binary), *argv], capture_output=True, text=True)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert fragment in refused.stderr, refused.stderr
