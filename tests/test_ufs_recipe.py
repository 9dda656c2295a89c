"""recipes/ufs_emulator.py as real processes: 1 process x 2 threads and 2 gloo processes (world size seen inside,
threads recorded), verify, bit-identical resume for 1 and 2 processes, 2 processes against 1 (SGD weights, Adam
losses, the statistics buffers), bad inputs as one line with nothing created, and the 2-node sbatch run."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
import torch
import xarray as xr
from conftest import assert_refused, final_weights, logged_losses, ranks_seen, read_json, run_recipe, sbatch_cpu_run

from toolkit.data.ufs import synthesize
from toolkit.verify import verify_run

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


def test_two_processes_match_one_process_loss_curve_with_adam(smoke_runs):
    l1, l2 = logged_losses(smoke_runs[1][1]), logged_losses(smoke_runs[2][1])
    assert sorted(l1) == sorted(l2) == list(range(1, 23))
    assert max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1) < 1e-4
    assert l1[22] < l1[1]


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
        "batch-too-large",
        lambda d, data: ["--data", str(data), "--batch-size", "100000"],
        ["--batch-size 100000 exceeds"],
    ),
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
