"""The UFS emulator model: statistics as buffers, predictions and the Jacobian in physical units (against finite
differences), TorchScript export (in-process and by `python -m toolkit.export` from a real run, loaded with
torch.jit.load) and the C++ LibTorch consumer in export/cpp (built with cmake/g++, predictions equal Python's)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, read_json, run_recipe
from safetensors.torch import load_file

from toolkit.data.ufs import synthesize
from toolkit.models.ufs_emulator import PhysicalEmulator, UfsEmulator, from_run_config

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


def test_torchscript_module_predicts_what_the_model_predicts(tmp_path):
    model = model_with_stats()
    exported = torch.jit.script(PhysicalEmulator(model, ["tair", "tsfc", "qref", "uatm"], ["aice", "hi"]))
    torch.jit.save(exported, str(tmp_path / "m.pt"))
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    x = physical_inputs()
    assert torch.equal(loaded(x), model.predict(x))
    assert list(loaded.input_names) == ["tair", "tsfc", "qref", "uatm"] and list(loaded.output_names) == ["aice", "hi"]


# ---- from a real run: python -m toolkit.export, then the C++ consumer ----------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    where = tmp_path_factory.mktemp("ufs-run")
    data = synthesize(where / "grid.nc", seed=5, nlat=24, nlon=48)
    run_dir = where / "run"
    run_recipe(
        [
            "--data",
            str(data),
            "--batch-size",
            "40",
            "--epochs",
            "3",
            "--lr",
            "3e-3",
            "--log-with",
            "none",
            "--output-dir",
            str(run_dir),
        ],
        recipe="ufs_emulator",
    )
    return run_dir, data


def best_model(run_dir: Path) -> UfsEmulator:
    model = from_run_config(read_json(run_dir / "config.json")["config"])
    step = read_json(run_dir / "summary.json")["best_step"]
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")))
    return model.eval()


def validation_like_inputs(data: Path, n: int = 50) -> torch.Tensor:
    from accelerate import Accelerator

    from toolkit.data.ufs import load_patterns

    return load_patterns(Accelerator(cpu=True), data).valid_inputs[:n]


@pytest.fixture(scope="module")
def exported(trained_run):
    run_dir, _ = trained_run
    out = run_dir.parent / "emulator.pt"
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.export", "torchscript", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "step_" in done.stdout
    return out


@pytest.mark.slow
def test_export_cli_writes_the_best_checkpoint_as_torchscript(trained_run, exported):
    run_dir, data = trained_run
    loaded = torch.jit.load(str(exported))
    x = validation_like_inputs(data)
    assert torch.equal(loaded(x), best_model(run_dir).predict(x))
    assert list(loaded.output_names) == ["aice"] and len(loaded.input_names) == 14
    # one error line for a directory that is not a run
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.export",
            "torchscript",
            str(run_dir / "checkpoints"),
            "--out",
            str(run_dir.parent / "x.pt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "config.json" in bad.stderr
    assert not (run_dir.parent / "x.pt").exists()


def build_cpp_consumer() -> Path:
    """cmake + g++ against the torch wheel's LibTorch, into a temporary build directory kept per source version
    (a LibTorch compile takes minutes on 2 cores; later runs reuse it)."""
    from filelock import FileLock

    sources = ROOT / "export" / "cpp"
    digest = hashlib.sha1(torch.__version__.encode())
    for path in sorted(sources.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    build = Path("/tmp") / f"toolkit-ufs-cpp-{digest.hexdigest()[:12]}"
    binary = build / "ufs_emulator"
    with FileLock(str(build) + ".lock"):
        if not binary.exists():
            shutil.rmtree(build, ignore_errors=True)
            configure = subprocess.run(
                [
                    "cmake",
                    "-S",
                    str(sources),
                    "-B",
                    str(build),
                    "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                ],
                capture_output=True,
                text=True,
            )
            assert configure.returncode == 0, configure.stdout + configure.stderr
            compiled = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
            assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return binary


@pytest.mark.slow
def test_cpp_consumer_predicts_what_python_predicts(trained_run, exported, tmp_path):
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (make test installs them; apt-get install cmake g++)")
    binary = build_cpp_consumer()
    run_dir, data = trained_run
    x = validation_like_inputs(data)
    names = list(torch.jit.load(str(exported)).input_names)
    csv = tmp_path / "inputs.csv"
    csv.write_text(",".join(names) + "\n" + "".join(",".join(repr(v) for v in row) + "\n" for row in x.tolist()))
    done = subprocess.run([str(binary), str(exported), str(csv)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "aice" and len(lines) == 1 + len(x)
    from_cpp = torch.tensor([[float(v) for v in line.split(",")] for line in lines[1:]], dtype=torch.float64)
    python = best_model(run_dir).predict(x).detach()
    assert (from_cpp - python).abs().max() < 1e-6
    assert python.std() > 1e-3  # the inputs really differ: not one constant compared with itself
    bad = tmp_path / "short.csv"
    bad.write_text("1,2,3\n")
    refused = subprocess.run([str(binary), str(exported), str(bad)], capture_output=True, text=True)
    assert refused.returncode == 2 and "has 3 values; the model takes 14" in refused.stderr
