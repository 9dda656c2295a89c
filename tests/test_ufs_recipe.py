"""recipes/ufs_emulator.py as real processes: 1 process x 2 threads and 2 gloo processes (world size seen inside,
threads recorded), verify, bit-identical resume for 1 and 2 processes, 2 processes against 1 (SGD weights, Adam
losses and Jacobian columns, the statistics buffers), the logged Jacobian against the checkpoint's, CICE files in
two files under the gdas preset (patience reported only, --min-epochs), bad inputs as one line with nothing
created, and the 2-node sbatch run."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
import torch
import xarray as xr
from accelerate import Accelerator
from conftest import assert_refused, final_weights, logged_losses, ranks_seen, read_json, run_recipe, sbatch_cpu_run

from toolkit.data.ufs import DEFAULT_INPUTS, load_patterns, synthesize
from toolkit.models.ufs_emulator import from_run_config
from toolkit.tools.verify import verify_run

pytestmark = pytest.mark.slow

# 24 x 48 grid: ~470 domain patterns, ~420 for training: 10 steps of batch 40 per epoch.
TINY_UFS = ["--batch-size", "40", "--lr", "3e-3", "--log-with", "csv", "--log-every", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("ufs-data") / "grid.nc", seed=7, nlat=24, nlon=48)


def ufs(args, data, **kwargs):
    return run_recipe(["--data", str(data), *TINY_UFS, *args], recipe="ufs_emulator", **kwargs)


def threads_seen(stderr: str) -> dict[int, int]:
    return {int(r): int(t) for r, t in re.findall(r"^\[rank (\d+)/\d+\].* threads=(\d+)", stderr, re.MULTILINE)}


SMOKE = {1: (None, 2), 2: ("cpu_2proc.yaml", 1)}  # world size: (launch config, --threads)


@pytest.fixture(scope="module")
def smoke_runs(data, tmp_path_factory):
    """1 process x 2 threads and 2 gloo processes x 1 thread, 2 epochs (22 steps) each; shared by the smoke test
    and the Adam loss-curve comparison (the thread count changes rounding only)."""
    runs = {}
    for world, (config, threads) in SMOKE.items():
        out = tmp_path_factory.mktemp(f"smoke{world}") / "run"
        result = ufs(["--epochs", "2", "--threads", str(threads), "--output-dir", str(out)], data, config=config)
        runs[world] = (result, out)
    return runs


@pytest.mark.parametrize("world", [1, 2], ids=["1proc-2threads", "2proc-1thread"])
def test_smoke_run_trains_verifies_and_writes_its_plots(world, smoke_runs):
    result, out = smoke_runs[world]
    threads = SMOKE[world][1]
    assert ranks_seen(result.stderr) == {(rank, world) for rank in range(world)}
    assert threads_seen(result.stderr) == {rank: threads for rank in range(world)}
    recorded = read_json(out / "config.json")
    assert recorded["config"]["threads"] == threads and recorded["threads"] == threads
    assert recorded["world_size"] == world and recorded["data"]["noise_sigma"] == 0.05
    assert verify_run(out, expect_world_size=world, expect_backend="gloo" if world > 1 else None) == []
    summary = read_json(out / "summary.json")
    best = summary["test_metrics_at_best"]
    assert best["best_val_rmse_over_sigma"] == pytest.approx(best["best_val_rmse_aice"] / 0.05)
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["step"] for r in rows] == ["11", "22"]
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])  # it learns
    assert 0 < float(rows[-1]["val_r2_aice"]) < 1
    for plot in ("curves.png", "val_scatter.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.partial*"))


JACOBIAN_COLUMNS = [f"val_jac_abs_mean/{name}" for name in DEFAULT_INPUTS]


def test_two_processes_match_one_process_loss_curve_with_adam(smoke_runs):
    l1, l2 = logged_losses(smoke_runs[1][1]), logged_losses(smoke_runs[2][1])
    assert sorted(l1) == sorted(l2) == list(range(1, 23))
    assert max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1) < 1e-4
    assert l1[22] < l1[1]
    # the Jacobian columns: the same names, and values that agree as the weights do (gathered over both ranks)
    rows = {world: list(csv.DictReader(open(smoke_runs[world][1] / "metrics.csv"))) for world in (1, 2)}
    for world in (1, 2):
        assert [c for c in rows[world][0] if "jac_abs_mean" in c] == JACOBIAN_COLUMNS
    for one, two in zip(rows[1], rows[2], strict=True):
        for column in [*JACOBIAN_COLUMNS, "val_jacobian_frobenius"]:
            assert float(one[column]) > 0
            assert abs(float(one[column]) - float(two[column])) / float(one[column]) < 1e-5, column  # 1.5e-7 seen


@pytest.mark.parametrize("world", [1, 2], ids=["1proc", "2proc"])
def test_logged_jacobian_is_the_checkpoints_on_the_validation_patterns(world, smoke_runs, data):
    """The last row's mean |d aice / d x| equals the final checkpoint's weights' Jacobian recomputed here, in
    physical units, over the validation patterns read on one process."""
    out = smoke_runs[world][1]
    last = list(csv.DictReader(open(out / "metrics.csv")))[-1]
    assert last["step"] == "22"
    model = from_run_config(read_json(out / "config.json")["config"])
    model.load_state_dict(final_weights(out, 22))
    valid = load_patterns(Accelerator(cpu=True), data, seed=0).valid_inputs
    expected = model.jacobian(valid).abs().mean(dim=0)[0]  # [inputs]
    logged = torch.tensor([float(last[column]) for column in JACOBIAN_COLUMNS], dtype=torch.float64)
    assert torch.allclose(logged, expected, rtol=1e-9, atol=0), (logged, expected)  # 2.5e-16 seen
    summary = read_json(out / "summary.json")  # the best weights' Jacobian is in the final metrics too
    assert all(f"best_val_jac_abs_mean/{name}" in summary["test_metrics_at_best"] for name in DEFAULT_INPUTS)


@pytest.fixture(scope="module")
def cice_data(tmp_path_factory):
    where = tmp_path_factory.mktemp("ufs-cice")
    synthesize(where / "ocean.nc", seed=7, nlat=24, nlon=48, naming="cice", atmos_out=where / "atmos.nc")
    return where / "ocean.nc", where / "atmos.nc"


def test_gdas_preset_on_cice_files_in_two_files_reports_its_patience_and_trains_on(cice_data, tmp_path):
    ocean, atmos = cice_data
    out = tmp_path / "run"
    result = run_recipe(["--preset", "gdas", "--data", str(ocean), "--data-atmos", str(atmos), *TINY_UFS,
                         "--epochs", "4", "--patience", "1", "--min-delta", "10", "--output-dir", str(out)],
                        recipe="ufs_emulator")
    assert ("variables: sst<-sst_h, sss<-sss_h, tair<-Tair_h, tsfc<-Tsfc_h, hi<-hi_h, hs<-hs_h, sice<-sice_h, "
            "uocn<-uocn_h, vocn<-vocn_h, uatm<-uatm_h, vatm<-vatm_h, qref<-Qref_h, flwdn<-flwdn_h, fswdn<-fswdn_h, "
            "aice<-aice_h, mask<-umask; from --data-atmos: tair, uatm, vatm, qref, flwdn, fswdn"
            ) in result.stdout
    # patience 1 with min-delta 10 runs out at epoch 2; the gdas preset only says so, once, and trains on
    assert result.stdout.count("val_loss has not improved by 10.0 for 1 evaluations (reported only") == 1
    recorded = read_json(out / "config.json")
    config = recorded["config"]
    assert (config["preset"], config["stop_early"], config["min_epochs"], config["domain"], config["max_patterns"],
            config["max_patterns_per_rank"]) == ("gdas", False, 3000, "aibalance-c710abb", 400000, 0)
    assert "domain (aibalance-c710abb): umask == 1 and aice >= 0" in result.stdout
    assert config["activation"] == "relu" and "model: 3 x 64 ReLU MLP, 14 -> 1" in result.stdout  # c710abb's model.py
    assert {type(m).__name__ for m in from_run_config(config).net} == {"Linear", "ReLU"}
    assert config["epochs"] == 4 and config["patience"] == 1  # flags win over the preset
    assert recorded["data"]["variables"]["qref"] == "Qref_h" and recorded["data"]["atmos_path"] == str(atmos)
    assert "+" in recorded["data"]["fingerprint"]  # both files
    summary = read_json(out / "summary.json")
    assert summary["epochs_completed"] == 4 and verify_run(out) == []


def test_cap_per_rank_takes_n_per_process_and_a_resume_on_other_processes_is_refused(data, tmp_path):
    out = tmp_path / "run"
    ufs(["--max-patterns-per-rank", "200", "--max-steps", "2", "--output-dir", str(out)], data)
    assert read_json(out / "config.json")["data"]["patterns"] == 200  # 1 process x 200
    again = ufs(["--max-patterns-per-rank", "200", "--max-steps", "4", "--output-dir", str(out), "--resume-from",
                 "auto"], data, config="cpu_2proc.yaml", check=False)
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    # the launcher turns the ranks' exit 2 into its own failure; the line is the run's (2 x 200 patterns now)
    assert again.returncode != 0 and len(errors) == 1, again.stderr
    assert "the data changed since the run" in errors[0] and "/200 -> " in errors[0] and errors[0].endswith(
        "resume with the same data, or start a new run with another --output-dir")


def test_min_epochs_holds_early_stopping_back(data, tmp_path):
    out = tmp_path / "run"
    ufs(["--epochs", "50", "--patience", "1", "--min-delta", "10", "--min-epochs", "4", "--output-dir", str(out)],
        data)
    summary = read_json(out / "summary.json")
    assert "val_loss has not improved by 10.0 for 1 evaluations" in summary["stop_reason"]
    assert summary["epochs_completed"] == 4  # patience 1 runs out at epoch 2; stopping waits for epoch 4


RESUME = ["--epochs", "3", "--eval-every-steps", "4", "--checkpoint-every", "4"]


@pytest.mark.parametrize("config", [None, "cpu_2proc.yaml"], ids=["1proc", "2proc"])
def test_resumed_run_is_bit_identical_to_uninterrupted(config, data, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ufs([*RESUME, "--max-steps", "23", "--output-dir", str(straight)], data, config=config)
    ufs([*RESUME, "--max-steps", "13", "--output-dir", str(resumed)], data, config=config)  # mid-epoch 2
    second = ufs(
        [*RESUME, "--max-steps", "23", "--output-dir", str(resumed), "--resume-from", "auto"], data, config=config
    )
    assert "step_13" in second.stdout.split("resuming from", 1)[1].splitlines()[0]
    files = [d / "checkpoints" / "step_23" for d in (straight, resumed)]
    assert (files[0] / "model.safetensors").read_bytes() == (files[1] / "model.safetensors").read_bytes()
    states = [torch.load(f / "optimizer.bin", weights_only=False)["state"] for f in files]
    assert all(torch.equal(states[0][k]["exp_avg_sq"], states[1][k]["exp_avg_sq"]) for k in states[0])
    rows = [list(csv.DictReader(open(d / "metrics.csv"))) for d in (straight, resumed)]
    columns = ["step", "train_loss", "val_loss", "val_rmse_aice", "val_r2_aice"]
    # the stopped life also evaluated its last step (13), which the uninterrupted run did not: compare the others
    steps = [r["step"] for r in rows[0]]
    assert steps[-3:] == ["16", "20", "23"] and [r["step"] for r in rows[1]] == sorted([*steps, "13"], key=int)
    assert [[r[c] for c in columns] for r in rows[0]] == [[r[c] for c in columns] for r in rows[1] if r["step"] != "13"]


EQUIV = ["--max-steps", "20", "--eval-every-steps", "100"]


def test_two_processes_match_one_process_with_sgd_and_share_its_statistics(data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    args = [*EQUIV, "--optimizer", "sgd", "--lr", "0.05"]
    ufs([*args, "--output-dir", str(one)], data)
    result = ufs([*args, "--output-dir", str(two)], data, config="cpu_2proc.yaml")
    assert ranks_seen(result.stderr) == {(0, 2), (1, 2)}
    w1, w2 = final_weights(one, 20), final_weights(two, 20)
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5
    for name in ["input_mean", "input_std", "output_mean", "output_std"]:  # read from 2 shards vs 1
        assert w1[name].dtype == torch.float64
        assert ((w1[name] - w2[name]).abs() / w1[name].abs()).max() < 1e-12


def test_early_stopping_ends_the_run_and_verify_accepts_it(data, tmp_path):
    out = tmp_path / "run"
    ufs(["--epochs", "50", "--patience", "2", "--min-delta", "10", "--output-dir", str(out)], data)
    summary = read_json(out / "summary.json")
    assert "val_loss has not improved by 10.0 for 2 evaluations" in summary["stop_reason"]
    assert summary["epochs_completed"] == 3  # epoch 1 sets the best; 2 and 3 do not beat it by 10
    assert verify_run(out) == []


def test_a_file_stored_ni_nj_throughout_trains_the_same_weights_as_nj_ni(data, tmp_path):
    """The same data stored (ni, nj) gives the run of the file stored (nj, ni), bit for bit: one cell order."""
    ds = xr.open_dataset(data, engine="netcdf4").load()
    turned = tmp_path / "turned.nc"
    ds.transpose(..., "ni", "nj").to_netcdf(turned, engine="netcdf4")
    with xr.open_dataset(turned) as check:
        assert check["sst"].dims == ("time", "ni", "nj") and check["tmask"].dims == ("ni", "nj")
    runs = {name: tmp_path / name for name in ("plain", "turned")}
    for name, path in (("plain", data), ("turned", turned)):
        ufs(["--max-steps", "3", "--eval-every-steps", "100", "--output-dir", str(runs[name])], path)
    plain, other = final_weights(runs["plain"], 3), final_weights(runs["turned"], 3)
    assert plain.keys() == other.keys() and all(torch.equal(plain[k], other[k]) for k in plain)
    assert logged_losses(runs["plain"]) == logged_losses(runs["turned"])


# ---- bad inputs: one error line, exit 2, the directory tree unchanged -----------------------------------------


def _nan_file(case_dir, data):
    ds = xr.open_dataset(data, engine="netcdf4").load()
    inside = (ds["tmask"].values > 0.5) & (np.abs(ds["TLAT"].values) >= 40)
    values = ds["sst"].values.copy()
    values[0][np.nonzero(inside)[0][:3], np.nonzero(inside)[1][:3]] = np.nan
    ds["sst"] = (ds["sst"].dims, values, ds["sst"].attrs)
    path = case_dir / "holes.nc"
    ds.to_netcdf(path, engine="netcdf4")
    return str(path)


def _nan_latitude_file(case_dir, data):
    """TLAT NaN at 20 ocean cells: each would otherwise be dropped from the domain without a word."""
    ds = xr.open_dataset(data, engine="netcdf4").load()
    values = ds["TLAT"].values.copy()
    values.reshape(-1)[np.flatnonzero(ds["tmask"].values.reshape(-1) > 0.5)[::7][:20]] = np.nan
    ds["TLAT"] = (ds["TLAT"].dims, values, ds["TLAT"].attrs)
    path = case_dir / "no-latitude.nc"
    ds.to_netcdf(path, engine="netcdf4")
    return str(path)


def _ocean_and_atmos(case_dir, atmos_grid=(24, 48)):
    """--data ocean.nc --data-atmos air.nc (CICE names), the atmosphere on `atmos_grid`."""
    synthesize(case_dir / "ocean.nc", seed=7, nlat=24, nlon=48, naming="cice", atmos_out=case_dir / "unused.nc")
    synthesize(case_dir / "other.nc", seed=7, nlat=atmos_grid[0], nlon=atmos_grid[1], naming="cice",
               atmos_out=case_dir / "air.nc")
    return ["--data", str(case_dir / "ocean.nc"), "--data-atmos", str(case_dir / "air.nc")]


BAD_INPUTS = [
    ("no-data", lambda d, data: [], ["--data is required"]),
    ("missing-file", lambda d, data: ["--data", str(d / "nowhere.nc")], ["nowhere.nc does not exist"]),
    (
        "missing-variable",
        lambda d, data: ["--data", str(data), "--inputs", "sst", "salinity"],
        ["grid.nc has no input variable 'salinity'"],
    ),
    (
        "missing-output",
        lambda d, data: ["--data", str(data), "--outputs", "vice"],
        ["grid.nc has no output variable 'vice'"],
    ),
    ("all-masked", lambda d, data: ["--data", str(data), "--min-abs-lat", "90"], ["sea-ice domain is empty"]),
    (
        "nan-in-input",
        lambda d, data: ["--data", _nan_file(d, data)],
        ["holes.nc", "input field 'sst' has 3 NaN/inf values"],
    ),
    (
        "nan-latitudes",
        lambda d, data: ["--data", _nan_latitude_file(d, data)],
        ["no-latitude.nc", "latitude 'TLAT' is NaN/inf at 20 of the cells the mask keeps (e.g. nj=",
         "latitudes there must be finite degrees north, -90 .. 90"],
    ),
    (
        "batch-too-large",
        lambda d, data: ["--data", str(data), "--batch-size", "100000"],
        ["--batch-size 100000 exceeds"],
    ),
    (
        "data-atmos-missing",
        lambda d, data: ["--data", str(data), "--data-atmos", str(d / "air.nc")],
        ["--data-atmos", "air.nc does not exist"],
    ),
    (
        "data-atmos-is-data",
        lambda d, data: ["--data", str(data), "--data-atmos", str(data)],
        ["--data-atmos", "is the --data file"],
    ),
    (
        "data-atmos-other-grid",
        lambda d, data: _ocean_and_atmos(d, (12, 24)),
        ["ocean.nc and --data-atmos", "air.nc are on different grids: 'sst_h' is (24, 48) in the first, 'Tair_h' is "
         "(12, 24) in the second"],
    ),
    (
        "data-atmos-unused",
        lambda d, data: ["--data", str(data), "--data-atmos", _ocean_and_atmos(d)[3]],
        ["air.nc: no field was taken from it", "grid.nc (searched first) holds all of sst, sss,"],
    ),
    ("variables-no-equals", lambda d, data: ["--data", str(data), "--variables", "sst"],
     ["--variables sst is invalid; give NAME=VARIABLE"]),
    ("variables-unknown-name", lambda d, data: ["--data", str(data), "--variables", "salt=sss"],
     ["--variables salt=sss: 'salt' is not one of --inputs/--outputs"]),
    ("variables-twice", lambda d, data: ["--data", str(data), "--variables", "sst=a", "sst=b"],
     ["--variables names 'sst' twice"]),
    ("variables-not-in-file", lambda d, data: ["--data", str(data), "--variables", "sst=SST"],
     ["grid.nc has no input variable 'SST'"]),
    ("mask-variable-not-in-file", lambda d, data: ["--data", str(data), "--mask-variable", "umask"],
     ["grid.nc has no mask variable 'umask'"]),
    ("lat-variable-not-in-file", lambda d, data: ["--data", str(data), "--lat-variable", "ULAT"],
     ["grid.nc has no latitude variable 'ULAT'"]),
    ("hemisphere-unknown", lambda d, data: ["--data", str(data), "--hemisphere", "east"],
     ["--hemisphere", "east"]),
    ("preset-unknown", lambda d, data: ["--data", str(data), "--preset", "paper"], ["--preset", "paper"]),
    ("max-patterns-per-rank-negative", lambda d, data: ["--data", str(data), "--max-patterns-per-rank", "-1"],
     ["--max-patterns-per-rank -1 is invalid; it must be >= 0"]),
    ("min-epochs-negative", lambda d, data: ["--data", str(data), "--min-epochs", "-2"],
     ["--min-epochs -2 is invalid; it must be >= 0"]),
    ("activation-unknown", lambda d, data: ["--data", str(data), "--activation", "tanh"],
     ["--activation", "tanh"]),
    ("icenet-with-mlp-flags", lambda d, data: ["--data", str(data), "--architecture", "icenet"],
     ["--architecture icenet is SOCA's IceNet, fc1 -> fc2 -> sigmoid: it needs --layers 1 --activation identity "
      "--output-activation sigmoid (given --layers 3 --activation gelu --output-activation none); --preset soca "
      "sets them"]),
    ("soca-preset-two-layers", lambda d, data: ["--data", str(data), "--preset", "soca", "--layers", "2"],
     ["--architecture icenet", "(given --layers 2 --activation identity --output-activation sigmoid)"]),
]


@pytest.mark.parametrize("make_flags, fragments", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_created(make_flags, fragments, data, tmp_path):
    flags = make_flags(tmp_path, data)
    assert_refused([*flags, "--log-with", "none", "--output-dir", str(tmp_path / "run")], fragments,
                   recipe="ufs_emulator", case_dir=tmp_path)


# ---- the 2-node CPU sbatch run on the local SLURM cluster ------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_two_node_sbatch_run_verifies(slurm_env, data, tmp_path):
    sbatch_cpu_run(slurm_env, ["recipes/ufs_emulator.py", "--data", str(data), *TINY_UFS, "--epochs", "2"], tmp_path)
