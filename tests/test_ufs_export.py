"""The UFS emulator outside training: `python -m toolkit.export aoti` (torch.export + AOTInductor, no deprecation
warning) writes a package whose program returns predictions AND the Jacobian in physical units; the C++ consumer in
export/cpp (built with cmake/g++) prints both as Python computes them; `python -m toolkit.export predict` writes them
to netCDF on the input file's grid. One tiny run (hidden 16) and ONE export per module: AOTInductor compiles C++."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cmake_configure import environment_problem
from conftest import ROOT, dir_tree, read_json, run_recipe
from safetensors.torch import load_file

from toolkit.data.ufs import DEFAULT_INPUTS, synthesize
from toolkit.export import main as export_main
from toolkit.models.ufs_emulator import UfsEmulator, from_run_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ufs-export")]  # one worker: one run, one compile


def train_tiny_run(where: Path) -> tuple[Path, Path]:
    """(run directory, its data file): a generated 24 x 48 grid, a 3 x 16 emulator trained 3 epochs (seconds)."""
    data = synthesize(where / "grid.nc", seed=5, nlat=24, nlon=48)
    run_dir = where / "run"
    args = ["--data", str(data), "--hidden", "16", "--batch-size", "40", "--epochs", "3", "--lr", "3e-3"]
    run_recipe([*args, "--log-with", "none", "--output-dir", str(run_dir)], recipe="ufs_emulator")
    return run_dir, data


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    return train_tiny_run(tmp_path_factory.mktemp("ufs-export"))


def export_cli(artefact: str, run_dir: Path, out: Path) -> subprocess.CompletedProcess:
    """`python -m toolkit.export ARTEFACT RUN --out OUT` in a fresh interpreter where any DeprecationWarning is an
    error (so TorchScript, deprecated in torch 2.13, is on no export path but its own, imports included)."""
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-m", "toolkit.export", artefact, str(run_dir), "--out",
         str(out)],
        cwd=ROOT, capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"},
    )
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "step_" in done.stdout
    assert "Warning" not in done.stderr, done.stderr
    return done


@pytest.fixture(scope="module")
def exported(trained_run):
    """The package, written by the CLI (export_cli)."""
    run_dir, _ = trained_run
    out = run_dir.parent / "emulator.pt2"
    assert "Jacobian" in export_cli("aoti", run_dir, out).stdout
    return out


def best_model(run_dir: Path) -> UfsEmulator:
    model = from_run_config(read_json(run_dir / "config.json")["config"])
    step = read_json(run_dir / "summary.json")["best_step"]
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")))
    return model.eval().requires_grad_(False)


def domain_inputs(data: Path) -> tuple[np.ndarray, torch.Tensor]:
    """The generated file's domain cells (tmask and |TLAT| >= 40, computed here from the file, not by the code under
    test) and their 14 inputs, float64."""
    import xarray as xr

    with xr.open_dataset(data) as ds:
        domain = (ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40)
        cells = np.flatnonzero(domain.ravel())
        x = np.stack([ds[name].values[0].astype(np.float64).ravel()[cells] for name in DEFAULT_INPUTS], axis=1)
    return domain, torch.from_numpy(x)


def per_input_error(a: torch.Tensor, b: torch.Tensor, over: torch.Tensor | None = None) -> float:
    """max |a - b| relative to each input's largest entry in `over` (default b) (Jacobian columns span their units:
    1/K ... 1/(kg/kg))."""
    a, b = a.detach(), b.detach()
    scale = (b if over is None else over.detach()).abs().amax(dim=(0, 1), keepdim=True)
    return float(((a - b).abs() / scale).max())


def load_quietly(package: Path):
    """Load the package with every DeprecationWarning an error."""
    import warnings

    from toolkit.export import load_package

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return load_package(package)


def test_package_returns_predictions_and_jacobian_in_physical_units(trained_run, exported):
    run_dir, data = trained_run
    program, meta = load_quietly(exported)
    assert meta["inputs"] == list(DEFAULT_INPUTS) and meta["outputs"] == ["aice"]
    assert meta["units"]["sst"] == "K" and meta["units"]["qref"] == "kg/kg" and meta["checkpoint"].startswith("step_")
    assert program.get_metadata()["inputs"] == ",".join(DEFAULT_INPUTS)  # what C++ reads
    _, x = domain_inputs(data)
    model = best_model(run_dir)
    predictions, jacobian = program(x)
    assert predictions.dtype == jacobian.dtype == torch.float64
    assert predictions.shape == (len(x), 1) and jacobian.shape == (len(x), 1, 14)
    # the compiled float32 kernels round differently from eager ones: equal to float32 accuracy
    assert (predictions - model.predict(x)).abs().max() < 1e-6
    assert per_input_error(jacobian, model.jacobian(x)) < 1e-5
    assert predictions.std() > 1e-3 and jacobian[:, 0, 11].abs().max() > 10 * jacobian[:, 0, 0].abs().max()
    one_point, one_jacobian = program(x[:1])  # any number of points, one included
    # float32 kernels for one row and for many take other vector paths: equal to float32 accuracy, as above, relative
    # to each input's scale over the domain (one row's own entry of an input can be ~0: 2.7e-5 relative to it was seen
    # once fused Adam trained the emulator)
    assert one_point.shape == (1, 1) and per_input_error(one_jacobian, jacobian[:1], over=jacobian) < 1e-5


def run_export(argv: list[str], capfd) -> tuple[int, str, str]:
    try:
        export_main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def assert_refused_here(argv: list[str], fragments, case_dir: Path, capfd) -> None:
    before = dir_tree(case_dir)
    code, out, err = run_export(argv, capfd)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert "Traceback" not in err + out
    assert dir_tree(case_dir) == before  # nothing created, nothing changed


def test_export_refuses_bad_input_in_one_line(trained_run, tmp_path, capfd, monkeypatch):
    run_dir, _ = trained_run
    (tmp_path / "taken").mkdir()
    cases = [
        ([str(run_dir / "checkpoints"), "--out", str(tmp_path / "x.pt2")], ["config.json"]),
        ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.pt2")], ["RUN_DIR", "not a directory"]),
        ([str(run_dir), "--out", str(tmp_path / "taken")], ["--out", "is a directory"]),
        ([str(run_dir), "--out", str(tmp_path / "emulator.pt")], ["--out", ".pt2"]),
        ([str(run_dir), "--out", str(tmp_path / "x.pt2"), "--step", "99999"], ["step_99999", "--step"]),
    ]
    for argv, fragments in cases:
        assert_refused_here(["aoti", *argv], fragments, tmp_path, capfd)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # AOTInductor compiles C++: no compiler, no export
    assert_refused_here(["aoti", str(run_dir), "--out", str(tmp_path / "x.pt2")], ["CXX", "g++"], tmp_path, capfd)


PROGRAMS = ("ufs_emulator", "soca_icenet")  # export/cpp/CMakeLists.txt's executables


def build_cpp_consumer(program: str = "ufs_emulator") -> Path:
    """cmake + g++ against the torch wheel's LibTorch, into a temporary build directory kept per source version and
    LibTorch (a LibTorch compile takes minutes on 2 cores; later runs reuse it); every program of export/cpp is built
    (ufs_emulator, soca_icenet), `program`'s path returned. The binary finds LibTorch by the path it was linked at,
    so that path is in the key: a build linked against a venv since removed is not reused. Skips when LibTorch
    cannot be configured on this machine (tests/cmake_configure.py); fails on our own errors."""
    import hashlib

    from filelock import FileLock

    sources = ROOT / "export" / "cpp"
    digest = hashlib.sha1(f"{torch.__version__} {torch.utils.cmake_prefix_path}".encode())
    for path in sorted(sources.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    build = Path("/tmp") / f"toolkit-ufs-cpp-{digest.hexdigest()[:12]}"
    binary = build / program
    with FileLock(str(build) + ".lock"):
        if not all((build / name).exists() for name in PROGRAMS):
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
            if configure.returncode != 0:
                shutil.rmtree(build, ignore_errors=True)
                output = configure.stdout + configure.stderr
                # this machine (a CUDA build of torch without the CUDA toolkit): skip, with cmake's reason
                reason = environment_problem(output, sources)
                if reason is not None:
                    pytest.skip(f"LibTorch cannot be configured here: {reason}")
                raise AssertionError(f"cmake could not configure {sources}:\n{output}")  # our CMakeLists.txt
            compiled = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
            # a compile or link error is ours (export/cpp's sources): it fails the test
            assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert binary.exists(), f"{program} is not a program of {sources}/CMakeLists.txt ({', '.join(PROGRAMS)})"
    return binary


def test_cpp_consumer_prints_what_python_computes(trained_run, exported, tmp_path):
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (make test installs them; apt-get install cmake g++)")
    binary = build_cpp_consumer()
    run_dir, data = trained_run
    _, x = domain_inputs(data)
    x = x[:50]
    csv = tmp_path / "inputs.csv"
    rows = "".join(",".join(repr(v) for v in row) + "\n" for row in x.tolist())
    csv.write_text(",".join(DEFAULT_INPUTS) + "\n" + rows)
    done = subprocess.run([str(binary), str(exported), str(csv)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split(",") == ["aice", *[f"daice_d{name}" for name in DEFAULT_INPUTS]]
    assert len(lines) == 1 + len(x)
    from_cpp = torch.tensor([[float(v) for v in line.split(",")] for line in lines[1:]], dtype=torch.float64)
    model = best_model(run_dir)
    python_predictions, python_jacobian = model.predict(x).detach(), model.jacobian(x)
    assert (from_cpp[:, :1] - python_predictions).abs().max() < 1e-6
    assert per_input_error(from_cpp[:, None, 1:], python_jacobian) < 1e-5
    program, _ = load_quietly(exported)  # the same compiled program, run from Python: to float64 print precision
    package_predictions, package_jacobian = program(x)
    assert (from_cpp[:, :1] - package_predictions).abs().max() < 1e-12
    assert per_input_error(from_cpp[:, None, 1:], package_jacobian) < 1e-12
    explicit = subprocess.run([str(binary), str(exported), str(csv), "--format", "aoti"], capture_output=True,
                              text=True)
    assert explicit.returncode == 0 and explicit.stdout == done.stdout  # --format aoti is the default
    assert python_predictions.std() > 1e-3  # the inputs really differ: not one constant compared with itself
    bad = tmp_path / "short.csv"
    bad.write_text("1,2,3\n")
    refused = subprocess.run([str(binary), str(exported), str(bad)], capture_output=True, text=True)
    assert refused.returncode == 2 and "has 3 values; the model takes 14" in refused.stderr
    not_a_package = subprocess.run([str(binary), str(csv), str(csv)], capture_output=True, text=True)
    assert not_a_package.returncode == 2 and len(not_a_package.stderr.strip().splitlines()) == 1
    assert "is not an AOTInductor package" in not_a_package.stderr


# ---- python -m toolkit.export predict: netCDF on the input's grid --------------------------------------------


def test_predict_writes_predictions_and_jacobian_on_the_grid(trained_run, exported, tmp_path, capfd):
    import netCDF4
    import xarray as xr

    run_dir, data = trained_run
    out = tmp_path / "sub" / "emulated.nc"
    code, stdout, stderr = run_export(["predict", str(run_dir), "--data", str(data), "--out", str(out)], capfd)
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and "domain cells of a 24 x 48 grid" in stdout
    assert [p.name for p in out.parent.iterdir()] == ["emulated.nc"]  # no temporary file left
    domain, x = domain_inputs(data)
    model = best_model(run_dir)
    jacobian_names = [f"daice_d{name}" for name in DEFAULT_INPUTS]
    with xr.open_dataset(out) as emulated, xr.open_dataset(data) as source:
        assert np.array_equal(emulated["domain_mask"].values, domain.astype(np.int8))
        cells = np.flatnonzero(domain.ravel())
        aice = emulated["aice"].values.ravel()
        assert emulated["aice"].dims == ("time", "nj", "ni")  # the input's time dimension kept
        assert torch.equal(torch.from_numpy(aice[cells]), model.predict(x)[:, 0].clamp(0, 1))  # float64, exactly
        jacobian = torch.stack([torch.from_numpy(emulated[n].values.ravel()[cells]) for n in jacobian_names], dim=1)
        assert per_input_error(jacobian[:, None, :], model.jacobian(x)) < 1e-6
        assert torch.equal(jacobian[:, None, :], model.predict_with_jacobian(x)[1])  # the closed form, exactly
        assert np.isnan(aice[~domain.ravel()]).all() and (~domain).sum() > 100  # fill outside (decoded as NaN)
        assert np.array_equal(emulated["TLAT"].values, source["TLAT"].values)
        assert np.array_equal(emulated["TLON"].values, source["TLON"].values)
        assert emulated["daice_dsst"].attrs["units"] == "1/K"
        assert emulated["daice_dqref"].attrs["units"] == "1/(kg/kg)"
        assert emulated.attrs["Conventions"].startswith("CF-")
    raw = netCDF4.Dataset(out)  # the file as written: fill values and CF attributes
    try:
        for name in ["aice", *jacobian_names]:
            variable = raw[name]
            assert {"long_name", "units", "_FillValue", "coordinates"} <= set(variable.ncattrs()), name
            assert variable.coordinates == "TLON TLAT" and variable._FillValue == 1e30
            values = variable[:].filled()[0]  # (time, nj, ni): the one time
            assert (values[~domain] == 1e30).all() and (values[domain] != 1e30).all()
        assert raw["TLAT"].standard_name == "latitude" and raw["TLON"].standard_name == "longitude"
        assert "_FillValue" not in raw["TLAT"].ncattrs() and raw["domain_mask"].flag_meanings
    finally:
        raw.close()
    # the same from the exported package (compiled float32 kernels: equal to float32 accuracy)
    from_package = tmp_path / "from-package.nc"
    code, stdout, stderr = run_export(
        ["predict", "--model", str(exported), "--data", str(data), "--out", str(from_package)], capfd
    )
    assert code == 0, stderr
    with xr.open_dataset(from_package) as packaged, xr.open_dataset(out) as emulated:
        assert np.array_equal(np.isnan(packaged["aice"].values[0]), ~domain)
        assert np.nanmax(np.abs(packaged["aice"].values - emulated["aice"].values)) < 1e-6
        for name in jacobian_names:
            scale = np.nanmax(np.abs(emulated[name].values))
            assert np.nanmax(np.abs(packaged[name].values - emulated[name].values)) < 1e-5 * scale, name


def test_predict_refuses_bad_input_in_one_line(trained_run, exported, tmp_path, capfd):
    import xarray as xr

    run_dir, data = trained_run
    case = tmp_path / "case"
    case.mkdir()
    (case / "taken").mkdir()
    (case / "not-a-package.pt2").write_text("hello\n")
    with xr.open_dataset(data) as ds:
        ds.load()
    ds.drop_vars("sst").to_netcdf(case / "no-sst.nc")
    celsius = ds.copy()
    celsius["sst"] = ds["sst"] - 273.15
    celsius["sst"].attrs.update(units="degC")
    celsius.to_netcdf(case / "celsius.nc")
    holes = ds.copy(deep=True)
    inside = np.argwhere((ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40))[:3]
    for j, i in inside:
        holes["hi"][0, j, i] = np.nan
    holes.to_netcdf(case / "holes.nc")
    ds.drop_vars("TLON").to_netcdf(case / "no-lon.nc")
    out = str(case / "out.nc")
    run, model, grid = str(run_dir), str(exported), str(data)
    cases = [
        ([run, "--data", grid, "--out", str(case / "taken")], ["--out", "is a directory"]),
        ([run, "--model", model, "--data", grid, "--out", out], ["RUN_DIR", "--model", "not both"]),
        (["--data", grid, "--out", out], ["RUN_DIR", "--model"]),
        (["--model", model, "--step", "3", "--data", grid, "--out", out], ["--step"]),
        (["--model", str(case / "missing.pt2"), "--data", grid, "--out", out], ["--model", "does not exist"]),
        (["--model", str(case / "not-a-package.pt2"), "--data", grid, "--out", out], ["not an AOTInductor package"]),
        ([run, "--data", str(case / "missing.nc"), "--out", out], ["--data", "does not exist"]),
        ([run, "--data", str(case / "no-sst.nc"), "--out", out], ["no-sst.nc", "'sst'"]),
        ([run, "--data", str(case / "celsius.nc"), "--out", out], ["'sst'", "degC", "trained on K"]),
        ([run, "--data", str(case / "holes.nc"), "--out", out], ["'hi'", "3 missing values", "inside the sea-ice"]),
        ([run, "--data", str(case / "no-lon.nc"), "--out", out], ["TLON", "--lon-variable"]),
        ([run, "--data", grid, "--out", out, "--lon-variable", "nowhere"], ["'nowhere'", "--lon-variable"]),
        ([run, "--data", str(case / "holes.nc"), "--out", str(case / "holes.nc")], ["--out", "--data file"]),
    ]
    for argv, fragments in cases:
        assert_refused_here(["predict", *argv], fragments, case, capfd)
