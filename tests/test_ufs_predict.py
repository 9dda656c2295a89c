"""`python -m toolkit.export predict` as the run trained: from an ocean/ice + atmosphere
pair (--data-atmos), on the run's own domain (hemisphere, --no-open-water: the selection is the run's, said in one
line) or every ocean cell (--whole-grid); aice clipped to [0, 1] with the share reported; standard_name and the
input's time dimension; SOCA's per-point layout; the maps (--plot); the sigmoid output's closed-form Jacobian
against autograd; the logged Jacobian Frobenius norm. One tiny run (SOCA's 7 inputs, the north, 0 < aice, sigmoid
output), predicted from in this process."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dir_tree, final_weights, read_json, run_recipe
from safetensors.torch import load_file
from test_ufs_export import run_export

from toolkit.data.ufs import synthesize
from toolkit.models.ufs_emulator import UfsEmulator, from_run_config

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ufs-predict")]

SOCA_INPUTS = ["sst", "sss", "tair", "tsfc", "hi", "hs", "sice"]  # IceEmul.h's inputs; tair in the atmosphere file
SOCA_JACOBIAN = {"dcdt": "sst", "dcds": "sss", "dcdtair": "tair", "dcdtsfc": "tsfc", "dcdhi": "hi", "dcdhs": "hs",
                 "dcdsi": "sice"}


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory):
    where = tmp_path_factory.mktemp("ufs-predict")
    ocean, atmos = where / "ocean.nc", where / "atmos.nc"
    synthesize(ocean, seed=5, nlat=24, nlon=48, atmos_out=atmos)
    run_dir = where / "run"
    run_recipe(["--data", str(ocean), "--data-atmos", str(atmos), "--inputs", *SOCA_INPUTS, "--hemisphere", "north",
                "--no-open-water", "--output-activation", "sigmoid", "--hidden", "16", "--batch-size", "20",
                "--epochs", "2", "--lr", "3e-3", "--threads", "1", "--log-with", "none", "--output-dir",
                str(run_dir)], recipe="ufs_emulator")
    return run_dir, ocean, atmos


def best_model(run_dir: Path) -> UfsEmulator:
    model = from_run_config(read_json(run_dir / "config.json")["config"])
    step = read_json(run_dir / "summary.json")["best_step"]
    model.load_state_dict(load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors")))
    return model.eval().requires_grad_(False)


def file_cells(ocean: Path, atmos: Path, *, north: bool = True, ice: bool = True) -> tuple[np.ndarray, torch.Tensor]:
    """The domain computed here from the files, not by the code under test (tmask; TLAT >= 40 with `north`; aice > 0
    with `ice`): (the 2-D domain, its cells' inputs, float64)."""
    import xarray as xr

    with xr.open_dataset(ocean) as ds, xr.open_dataset(atmos) as air:
        domain = ds["tmask"].values > 0.5
        if north:
            domain &= ds["TLAT"].values >= 40
        if ice:
            domain &= np.nan_to_num(ds["aice"].values[0]) > 0
        cells = np.flatnonzero(domain.ravel())
        columns = [(air if name == "tair" else ds)[name].values[0].astype(np.float64).ravel()[cells]
                   for name in SOCA_INPUTS]
    return domain, torch.from_numpy(np.stack(columns, axis=1))


def predict(run_dir, ocean, atmos, out, capfd, *more) -> str:
    code, stdout, stderr = run_export(["predict", str(run_dir), "--data", str(ocean), "--data-atmos", str(atmos),
                                       "--out", str(out), *more], capfd)
    assert code == 0, stderr
    return stdout


def test_predict_takes_the_runs_domain_from_the_pair(pair_run, tmp_path, capfd):
    import xarray as xr

    run_dir, ocean, atmos = pair_run
    out = tmp_path / "emulated.nc"
    stdout = predict(run_dir, ocean, atmos, out, capfd)
    domain, x = file_cells(ocean, atmos)
    lines = stdout.splitlines()
    assert lines[0].startswith("domain: as the run selected it (tmask > 0.5 and TLAT >= 40")  # the north
    assert lines[0].endswith(f" and aice > 0), {len(x)} cells; --whole-grid for every ocean cell")  # no open water
    assert f"aice clipped to [0, 1] at 0 of {len(x)} cells (0.00%)" in lines[1]
    north_ocean, _ = file_cells(ocean, atmos, ice=False)
    assert 50 < domain.sum() < north_ocean.sum()  # open water really left out, as in training
    model = best_model(run_dir)
    with xr.open_dataset(out, decode_times=False) as emulated, xr.open_dataset(ocean, decode_times=False) as source:
        assert np.array_equal(emulated["domain_mask"].values, domain.astype(np.int8))  # no south, no open water
        cells = np.flatnonzero(domain.ravel())
        aice = emulated["aice"]
        assert aice.dims == ("time", "nj", "ni") and emulated["daice_dsst"].dims == ("time", "nj", "ni")
        assert np.array_equal(emulated["time"].values, source["time"].values)
        assert emulated["time"].attrs["units"] == source["time"].attrs["units"]
        assert aice.attrs["standard_name"] == "sea_ice_area_fraction"
        assert emulated.attrs["aice_clipped_share"] == 0.0
        predictions, jacobian = model.predict_with_jacobian(x)
        assert torch.equal(torch.from_numpy(aice.values.ravel()[cells]), model.predict(x)[:, 0])  # exactly
        assert 0 <= float(predictions.min()) and float(predictions.max()) <= 1  # the sigmoid's
        written = torch.stack([torch.from_numpy(emulated[f"daice_d{n}"].values.ravel()[cells]) for n in SOCA_INPUTS],
                              dim=1)
        assert torch.equal(written, jacobian[:, 0])


def test_whole_grid_takes_every_ocean_cell(pair_run, tmp_path, capfd):
    import xarray as xr

    run_dir, ocean, atmos = pair_run
    out = tmp_path / "whole.nc"
    stdout = predict(run_dir, ocean, atmos, out, capfd, "--whole-grid")
    domain, x = file_cells(ocean, atmos, north=False, ice=False)
    assert stdout.splitlines()[0] == f"domain: every ocean cell (tmask > 0.5; --whole-grid), {len(x)} cells"  # only
    with xr.open_dataset(out) as emulated:
        assert np.array_equal(emulated["domain_mask"].values, domain.astype(np.int8))
        cells = np.flatnonzero(domain.ravel())
        written = torch.from_numpy(emulated["aice"].values.ravel()[cells])
        assert torch.equal(written, best_model(run_dir).predict(x)[:, 0])


def test_aice_is_clipped_to_0_1_and_the_share_reported(pair_run, tmp_path, capfd):
    """The same weights read without the sigmoid (config.json says none): the logits as normalised aice leave
    [0, 1] at some cells."""
    import xarray as xr

    run_dir, ocean, atmos = pair_run
    unbounded = tmp_path / "run"
    shutil.copytree(run_dir, unbounded)
    config = read_json(unbounded / "config.json")
    config["config"]["output_activation"] = "none"
    (unbounded / "config.json").write_text(json.dumps(config))
    out = tmp_path / "clipped.nc"
    stdout = predict(unbounded, ocean, atmos, out, capfd, "--whole-grid")
    domain, x = file_cells(ocean, atmos, north=False, ice=False)
    model = best_model(unbounded)
    raw, jacobian = model.predict_with_jacobian(x)
    outside = int(((raw < 0) | (raw > 1)).sum())
    assert 0 < outside < len(x)
    assert f"aice clipped to [0, 1] at {outside} of {len(x)} cells ({100 * outside / len(x):.2f}%)" in stdout
    with xr.open_dataset(out) as emulated:
        cells = np.flatnonzero(domain.ravel())
        assert emulated.attrs["aice_clipped_share"] == outside / len(x)
        assert emulated.attrs["aice_clipped_cells"] == outside
        assert torch.equal(torch.from_numpy(emulated["aice"].values.ravel()[cells]), raw[:, 0].clamp(0, 1))
        assert torch.equal(torch.from_numpy(emulated["daice_dhi"].values.ravel()[cells]), jacobian[:, 0, 4])


def iceemul_results(path: Path, lon, lat, ice_original, ice_ffnn, doutdx, input_size: int) -> None:
    """IceEmul.h predict's file (guillaumevernieres/daml src/daml/IceEmul/IceEmul.h), transcribed with netCDF4:
    NcFile replace, the dimensions n and n_inputs, every variable ncFloat on n, in its order; `doutdx` the
    Jacobian columns by its names."""
    import netCDF4

    with netCDF4.Dataset(path, "w") as nc:
        nc.createDimension("n", len(ice_original))
        nc.createDimension("n_inputs", input_size)
        for name, values in (("lon", lon), ("lat", lat), ("aice", ice_original), ("aice_ffnn", ice_ffnn),
                             *((name, doutdx[name]) for name in ("dcdt", "dcds", "dcdhs", "dcdhi", "dcdsi",
                                                                 "dcdtsfc", "dcdtair"))):
            nc.createVariable(name, "f4", ("n",))[:] = np.asarray(values, dtype=np.float32)


def test_soca_layout_per_point(pair_run, tmp_path, capfd):
    """--layout soca is the file IceEmul.h's predict writes (a transcription of its writer, here, on the same
    points): the same dimensions (n, n_inputs), variables, float32 types and values; units and names beside."""
    import netCDF4
    import xarray as xr

    from toolkit.export.netcdf import soca_name

    run_dir, ocean, atmos = pair_run
    out = tmp_path / "soca.nc"
    stdout = predict(run_dir, ocean, atmos, out, capfd, "--layout", "soca")
    assert "aice_ffnn and dc/d<input> at" in stdout and "points (SOCA's layout)" in stdout
    domain, x = file_cells(ocean, atmos)
    cells = np.flatnonzero(domain.ravel())
    model = best_model(run_dir)
    predictions, jacobian = model.predict_with_jacobian(x)
    with xr.open_dataset(ocean) as source:
        lat, lon = source["TLAT"].values.ravel()[cells], source["TLON"].values.ravel()[cells]
        truth = source["aice"].values[0].ravel()[cells]
    theirs = tmp_path / "iceemul.nc"
    iceemul_results(theirs, lon, lat, truth, predictions[:, 0].numpy(),
                    {name: jacobian[:, 0, SOCA_INPUTS.index(ours)].numpy() for name, ours in SOCA_JACOBIAN.items()},
                    len(SOCA_INPUTS))
    with netCDF4.Dataset(out) as per_point, netCDF4.Dataset(theirs) as expected:
        assert {name: len(d) for name, d in per_point.dimensions.items()} == {
            name: len(d) for name, d in expected.dimensions.items()} == {"n": len(cells), "n_inputs": 7}
        assert set(per_point.variables) == set(expected.variables) == {"lat", "lon", "aice", "aice_ffnn",
                                                                       *SOCA_JACOBIAN}
        for name, variable in expected.variables.items():
            ours = per_point.variables[name]
            assert (ours.dtype, ours.dimensions) == (variable.dtype, variable.dimensions) == (np.float32, ("n",)), name
            assert np.array_equal(ours[:].data, variable[:].data), name
        assert per_point["dcdt"].units == "1/K" and per_point["dcdhi"].units == "1/m"
        assert per_point["aice_ffnn"].standard_name == "sea_ice_area_fraction"
    assert [soca_name(n) for n in ("uocn", "qref", "fswdn")] == ["dcduocn", "dcdqref", "dcdfswdn"]  # not in IceEmul


def test_lat_variable_names_the_latitude_as_lon_variable_names_the_longitude(pair_run, tmp_path, capfd):
    """A file whose coordinates are under other names: without --lat-variable one line naming the training's
    latitude; with --lat-variable and --lon-variable the same domain, values and coordinates as the training's file."""
    import xarray as xr

    run_dir, ocean, atmos = pair_run
    for source, target in ((ocean, "renamed.nc"), (atmos, "atmos.nc")):  # both files hold the coordinates
        with xr.open_dataset(source, decode_times=False) as ds:
            ds.load().rename_vars(TLAT="nav_lat", TLON="nav_lon").to_netcdf(tmp_path / target)
    renamed, plain_atmos, atmos = tmp_path / "renamed.nc", atmos, tmp_path / "atmos.nc"
    plain, other = tmp_path / "plain.nc", tmp_path / "other.nc"
    predict(run_dir, ocean, plain_atmos, plain, capfd)
    case = tmp_path / "case"
    case.mkdir()
    assert_refused_here(["predict", str(run_dir), "--data", str(renamed), "--data-atmos", str(atmos), "--out",
                         str(case / "out.nc")], ["no latitude variable 'TLAT' (the training's", "--lat-variable NAME"],
                        case, capfd)
    assert_refused_here(["predict", str(run_dir), "--data", str(renamed), "--data-atmos", str(atmos), "--out",
                         str(case / "out.nc"), "--lat-variable", "nav_lat", "--lon-variable", "nope"],
                        ["--lon-variable nope", "no longitude variable 'nope'"], case, capfd)
    stdout = predict(run_dir, renamed, atmos, other, capfd, "--lat-variable", "nav_lat", "--lon-variable", "nav_lon")
    assert "nav_lat >= 40" in stdout.splitlines()[0]
    with xr.open_dataset(plain, decode_times=False) as a, xr.open_dataset(other, decode_times=False) as b:
        assert np.array_equal(a["domain_mask"].values, b["domain_mask"].values)
        assert np.array_equal(a["aice"].values, b["aice"].values, equal_nan=True)
        assert np.array_equal(a["TLAT"].values, b["nav_lat"].values) and b["aice"].encoding["coordinates"] == (
            "nav_lon nav_lat")


def test_plot_draws_a_map_per_field(pair_run, tmp_path, capfd):
    run_dir, ocean, atmos = pair_run
    maps = tmp_path / "maps" / "here"
    stdout = predict(run_dir, ocean, atmos, tmp_path / "emulated.nc", capfd, "--plot", str(maps))
    expected = ["aice.png", "aice_error.png", *[f"daice_d{name}.png" for name in SOCA_INPUTS]]
    assert sorted(p.name for p in maps.iterdir()) == sorted(expected)  # no temporary file left
    for name in expected:
        png = (maps / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    assert f"wrote {len(expected)} maps to {maps}" in stdout


def test_sigmoid_jacobian_is_autograds_and_none_is_todays():
    torch.manual_seed(3)
    mean, std = torch.randn(6) * 50, torch.rand(6) + 0.2
    x = (mean + std * torch.randn(40, 6)).double()
    bounded = UfsEmulator(mean, std, torch.tensor([0.4]), torch.tensor([0.3]), hidden=8, layers=2,
                          output_activation="sigmoid").double()
    predictions, jacobian = bounded.predict_with_jacobian(x)
    needs_grad = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(bounded.predict(needs_grad).sum(), needs_grad)  # rows are independent
    assert torch.allclose(jacobian[:, 0], gradient, rtol=1e-10, atol=1e-15)
    assert torch.allclose(jacobian, bounded.jacobian(x), rtol=1e-10, atol=1e-15)  # through the normalised forward
    assert torch.equal(predictions, bounded.predict(x)) and 0 < predictions.min() and predictions.max() < 1
    plain = UfsEmulator(mean, std, torch.tensor([0.4]), torch.tensor([0.3]), hidden=8, layers=2)
    z = plain.normalise_inputs(x)
    assert torch.equal(plain(z), plain.net(z))  # the default: the network's output as before
    assert torch.equal(plain.predict(x), plain.to_physical_outputs(plain.net(z)))
    with pytest.raises(ValueError, match="output_activation"):
        UfsEmulator(mean, std, torch.tensor([0.4]), torch.tensor([0.3]), output_activation="relu")


def test_logged_jacobian_frobenius_is_the_checkpoints(pair_run):
    """val_jacobian_frobenius (each evaluation): the mean over the validation patterns of the Jacobian's Frobenius
    norm in normalised units, recomputed here from the final checkpoint's weights."""
    from accelerate import Accelerator

    from toolkit.data.ufs import load_patterns

    run_dir, ocean, atmos = pair_run
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert all(float(row["val_jacobian_frobenius"]) > 0 for row in rows)
    last = rows[-1]
    model = from_run_config(read_json(run_dir / "config.json")["config"])
    model.load_state_dict(final_weights(run_dir, int(last["step"])))
    valid = load_patterns(Accelerator(cpu=True), ocean, atmos_path=atmos, inputs=SOCA_INPUTS, hemisphere="north",
                          open_water=False, seed=0).valid_inputs
    normalised = model.jacobian(valid) * model.input_std / model.output_std[:, None]
    expected = normalised.detach().square().sum(dim=(1, 2)).sqrt().mean()
    assert abs(float(last["val_jacobian_frobenius"]) - float(expected)) <= 1e-9 * float(expected)
    assert "best_val_jacobian_frobenius" in read_json(run_dir / "summary.json")["test_metrics_at_best"]


def assert_refused_here(argv: list[str], fragments, case_dir: Path, capfd) -> None:
    before = dir_tree(case_dir)
    code, out, err = run_export(argv, capfd)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert "Traceback" not in err + out
    assert dir_tree(case_dir) == before  # nothing created, nothing changed


def test_predict_refuses_bad_input_in_one_line(pair_run, tmp_path, capfd):
    import xarray as xr

    run_dir, ocean, atmos = pair_run
    case = tmp_path / "case"
    case.mkdir()
    (case / "a-file").write_text("not a directory\n")
    with xr.open_dataset(ocean) as ds:
        ds.load()
    ds.drop_vars("aice").to_netcdf(case / "no-aice.nc")
    out = str(case / "out.nc")
    run, grid, air = str(run_dir), str(ocean), str(atmos)
    cases = [
        ([run, "--data", grid, "--data-atmos", air, "--out", out, "--plot", str(case / "a-file")],
         ["--plot", "is a file"]),
        ([run, "--data", grid, "--data-atmos", air, "--out", out, "--plot", str(case / "a-file" / "maps")],
         ["--plot", "a-file is a file, not a directory"]),
        ([run, "--data", grid, "--data-atmos", air, "--out", out, "--plot", str(case / "out.nc" / "maps")],
         ["--plot", "inside it"]),
        ([run, "--data", grid, "--out", out], ["'tair'", "trained with --data-atmos", "give the atmosphere file"]),
        ([run, "--data", grid, "--data-atmos", grid, "--out", out], ["--data-atmos", "is the --data file"]),
        ([run, "--data", grid, "--data-atmos", str(case / "missing.nc"), "--out", out],
         ["--data-atmos", "missing.nc does not exist"]),
        ([run, "--data", str(case / "no-aice.nc"), "--data-atmos", air, "--out", out],
         ["--no-open-water", "'aice'", "--whole-grid"]),
        ([run, "--data", grid, "--data-atmos", air, "--out", air], ["--out", "is the --data-atmos file"]),
        ([run, "--data", grid, "--data-atmos", air, "--out", out, "--layout", "csv"], ["--layout csv", "grid, soca"]),
    ]
    for argv, fragments in cases:
        assert_refused_here(["predict", *argv], fragments, case, capfd)
    # the same file without aice predicts on every ocean cell when asked (no aice: no error map, no truth)
    code, stdout, stderr = run_export(["predict", run, "--data", str(case / "no-aice.nc"), "--data-atmos", air,
                                       "--out", out, "--whole-grid"], capfd)
    assert code == 0 and "every ocean cell" in stdout, stderr


def test_every_domain_option_of_the_config_flows_to_select_patterns():
    """selection_options, the one place predict derives its selection: each argument of select_patterns that the
    run's config holds passes through as the run had it (a domain option added to both needs nothing here), the
    training's sampling is off, the resolved mask/latitude names win over "auto", --no-open-water is aice > 0;
    --whole-grid puts every option back to select_patterns' default but the mask."""
    import inspect

    from toolkit.data.ufs import select_patterns
    from toolkit.export.netcdf import SAMPLING, selection_options

    parameters = inspect.signature(select_patterns).parameters
    options_of_the_domain = [name for name in parameters
                             if name not in ("ds", "path", "names", "mask_variable", "lat_variable", *SAMPLING)]
    config = {name: f"<{name}>" for name in options_of_the_domain}
    config.update(min_abs_lat=55.0, open_water=False, thin=7, max_patterns=9, val_fraction=0.5, seed=3,
                  mask_variable="auto", lat_variable="auto")
    meta = {"config": config, "domain": {"mask_variable": "umask", "lat_variable": "ULAT"}}
    options = selection_options(meta)
    for name in options_of_the_domain:
        if name != "ice_variable" and name != "min_abs_lat":
            assert options[name] == f"<{name}>", name
    assert options["min_abs_lat"] == 55.0 and options["mask_variable"] == "umask" and options["lat_variable"] == "ULAT"
    assert {key: options[key] for key in SAMPLING if key in parameters} == {k: v for k, v in SAMPLING.items()
                                                                           if k in parameters}
    if "ice_variable" in parameters and "open_water" not in parameters:
        assert options["ice_variable"] == "aice"
    whole = selection_options(meta, whole_grid=True)
    assert whole["mask_variable"] == "umask" and whole["min_abs_lat"] == 0.0
    for name in options_of_the_domain:
        if name != "min_abs_lat" and parameters[name].default is not inspect.Parameter.empty:
            assert whole[name] == parameters[name].default, name
