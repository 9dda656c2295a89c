"""The DCRNN recipe end to end through real launchers on a small generated road network: 1 and 2 gloo processes
(world size seen inside), every test window scored once, bit-identical resume, 2 processes against 1, `verify`,
bad inputs (one error line, exit 2, nothing created), and the 2-node CPU sbatch job on the local SLURM cluster."""

import csv
import math
import pickle
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import (
    DATA_CACHE,
    DCRNN_SYNTH,
    assert_refused,
    final_weights,
    logged_losses,
    one_and_two_process_runs,
    ranks_seen,
    read_json,
    run_recipe,
    sbatch_cpu_run,
)

from toolkit.data.traffic import INPUT_STEPS, OUTPUT_STEPS, minimum_timesteps, part_bounds, write_dataset
from toolkit.tools.verify import verify_run

pytestmark = pytest.mark.slow

# A tiny model; scheduled sampling decays within the few steps, so its keyed coins are exercised.
TINY_DCRNN = [
    "--cache-dir",
    str(DATA_CACHE),
    "--units",
    "8",
    "--batch-size",
    "32",
    "--log-with",
    "none",
    "--sampling-decay-steps",
    "3",
    "--lr-decay-epochs",
    "1",
    "--threads",
    "1",
]


def args(*extra):
    return [*TINY_DCRNN, "--data", str(DCRNN_SYNTH), *extra]


def readings_by_hand(synth_data):
    """The test windows' target readings, counted straight from the file (each window counts its own)."""
    speed = pd.read_hdf(synth_data / "metr-la.h5", key="df").to_numpy()
    _, _, test_begin, end = part_bounds(len(speed))
    starts = range(test_begin, end - INPUT_STEPS - OUTPUT_STEPS + 1)
    assert len(starts) == 265
    return sum(int((speed[s + INPUT_STEPS : s + INPUT_STEPS + OUTPUT_STEPS] > 0).sum()) for s in starts)


SEED_003_COLUMNS = [
    "epoch",
    "train_loss",
    "val_loss",
    "val_mae",
    "val_rmse",
    "epoch_time_sec",
    "throughput_samples_per_sec",
    "data_load_time_sec",
    "compute_time_sec",
    "gpu_util_avg",
    "cpu_util_avg",
]


def test_one_and_two_processes_train_alike_with_sgd_and_score_every_window_once(synth_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    flags = args("--optimizer", "sgd", "--lr", "0.05", "--max-steps", "8", "--eval-every-steps", "4")
    first = run_recipe([*flags, "--output-dir", str(one)], recipe="dcrnn", config="cpu.yaml")
    second = run_recipe([*flags, "--output-dir", str(two)], recipe="dcrnn", config="cpu_2proc.yaml")
    assert ranks_seen(first.stderr) == {(0, 1)}
    assert ranks_seen(second.stderr) == {(0, 2), (1, 2)} and "backend=gloo" in second.stderr
    assert verify_run(one, expect_world_size=1) == []
    assert verify_run(two, expect_world_size=2, expect_backend="gloo") == []
    w1, w2 = final_weights(one, 8), final_weights(two, 8)
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    s1, s2 = read_json(one / "summary.json"), read_json(two / "summary.json")
    readings = readings_by_hand(synth_data)
    # gather_for_metrics: 265 test windows (a padded last batch on 2 ranks), each counted exactly once
    assert s1["test_metrics_at_best"]["test_readings"] == s2["test_metrics_at_best"]["test_readings"] == readings
    for key, value in s1["test_metrics_at_best"].items():
        assert value == pytest.approx(s2["test_metrics_at_best"][key], rel=1e-4), key
    for minutes in ("15min", "30min", "60min"):
        for name in ("mae", "rmse", "mape"):
            assert s1["test_metrics_at_best"][f"test_{name}@{minutes}"] > 0
    assert s1["baselines"] == s2["baselines"]
    assert set(s1["baselines"]) == {"historical_average", "last_value"}
    assert s1["baselines"]["last_value"]["test_mae@15min"] < s1["baselines"]["last_value"]["test_mae@60min"]
    rows = list(csv.DictReader(open(two / "metrics.csv")))
    assert [r["step"] for r in rows] == ["4", "8"]
    for column in [*SEED_003_COLUMNS, "val_mae@15min", "val_rmse@30min", "val_mape@60min", "world_size"]:
        assert column in rows[-1], column
    assert float(rows[-1]["val_mae"]) == float(rows[-1]["val_loss"]) > 0
    assert float(rows[-1]["throughput_samples_per_sec"]) > 0


ADAM = args("--max-steps", "8", "--eval-every-steps", "4", "--log-with", "csv", "--log-every", "1")


@pytest.fixture(scope="module")
def adam_runs(synth_data, tmp_path_factory):
    """Uninterrupted Adam runs, 1 and 2 processes."""
    return one_and_two_process_runs(ADAM, recipe="dcrnn", root=tmp_path_factory.mktemp("adam"))


def test_two_processes_match_one_process_loss_curve_with_adam(adam_runs):
    l1, l2 = logged_losses(adam_runs[None]), logged_losses(adam_runs["cpu_2proc.yaml"])
    assert sorted(l1) == sorted(l2) == list(range(1, 9))
    worst = max(abs(l1[s] - l2[s]) / abs(l1[s]) for s in l1)
    assert worst < 1e-4, worst
    assert l1[8] < l1[1]  # it trained
    assert verify_run(adam_runs["cpu_2proc.yaml"], expect_world_size=2, expect_backend="gloo") == []


@pytest.mark.parametrize("config", [None, "cpu_2proc.yaml"], ids=["1proc", "2proc"])
def test_resumed_run_is_bit_identical_to_uninterrupted(config, adam_runs, tmp_path):
    straight, resumed = adam_runs[config], tmp_path / "resumed"
    run_recipe([*ADAM, "--max-steps", "3", "--output-dir", str(resumed)], recipe="dcrnn", config=config)
    second = run_recipe([*ADAM, "--output-dir", str(resumed), "--resume-from", "auto"], recipe="dcrnn", config=config)
    assert "resuming from" in second.stdout and "step_3" in second.stdout
    a, b = (d / "checkpoints" / "step_8" / "model.safetensors" for d in (straight, resumed))
    assert a.read_bytes() == b.read_bytes()
    assert torch.equal(
        *(
            torch.load(d / "checkpoints" / "step_8" / "optimizer.bin", weights_only=False)["state"][0]["exp_avg"]
            for d in (straight, resumed)
        )
    )
    assert logged_losses(straight) == logged_losses(resumed)  # the steps after the resume too, bit for bit
    rows = [[r for r in csv.DictReader(open(d / "metrics.csv")) if r["step"] == "8"][0] for d in (straight, resumed)]
    assert rows[0]["val_mae@60min"] == rows[1]["val_mae@60min"] and rows[0]["train_loss"] == rows[1]["train_loss"]
    assert verify_run(resumed) == []


def test_the_fused_sequence_kernel_trains_and_resumes_bit_identically(tmp_path):
    # --sequence-kernel fused on CPU (auto takes it on CUDA): a run of 6 steps, and the same run resumed from its
    # step_3 checkpoint (its step_6 removed), end with the same weights, byte for byte, and log the same losses.
    flags = args("--max-steps", "6", "--checkpoint-every", "3", "--eval-every-steps", "3", "--log-with", "csv",
                 "--log-every", "1", "--sequence-kernel", "fused")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = run_recipe([*flags, "--output-dir", str(straight)], recipe="dcrnn")
    assert "K=2, fused sequence kernel" in first.stdout
    assert "kernels: toolkit.kernels.dcrnn.DCRNN, toolkit.kernels.dcrnn.GraphDiffusion, proven equal" in first.stdout
    assert read_json(straight / "config.json")["config"]["sequence_kernel"] == "fused"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_6")
    second = run_recipe([*flags, "--output-dir", str(resumed), "--resume-from", "auto"], recipe="dcrnn")
    assert "resuming from" in second.stdout and "step_3" in second.stdout
    a, b = (d / "checkpoints" / "step_6" / "model.safetensors" for d in (straight, resumed))
    assert a.read_bytes() == b.read_bytes()
    assert logged_losses(straight) == logged_losses(resumed)
    losses = logged_losses(straight)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]  # it trained


def test_kernels_plain_trains_the_model_files_cells(tmp_path):
    # --kernels plain: no fast path swapped in, the model file's cells (and its diffusion through autograd) train
    flags = args("--max-steps", "3", "--eval-every-steps", "3", "--log-with", "csv", "--log-every", "1",
                 "--kernels", "plain")
    done = run_recipe([*flags, "--output-dir", str(tmp_path / "plain")], recipe="dcrnn")
    assert "K=2, cells sequence kernel" in done.stdout and "kernels:" not in done.stdout
    assert read_json(tmp_path / "plain" / "config.json")["config"]["kernels"] == "plain"
    losses = logged_losses(tmp_path / "plain")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(loss) for loss in losses.values())


# ---- bad input: one `error:` line, exit 2, the directory tree unchanged ----------------------------------------


def _bad_data(kind):
    """A data directory (in the case's own directory) with one bad file, made from the good generated one."""

    def make(case_dir):
        frame = pd.read_hdf(DCRNN_SYNTH / "metr-la.h5", key="df")
        with open(DCRNN_SYNTH / "adj_mx.pkl", "rb") as handle:
            ids, _, adjacency = pickle.load(handle)
        out = case_dir / "data"
        if kind == "no-time-index":
            frame = frame.reset_index(drop=True)
        elif kind == "too-few-timesteps":
            frame = frame.iloc[:100]
        elif kind == "adjacency-size":
            ids, adjacency = ids[:9], adjacency[:9, :9]
        elif kind == "bool-column":
            frame = frame.assign(incident=frame[frame.columns[0]] < 20)  # a flag beside the speeds, not a sensor
        write_dataset(out, frame, ids, np.asarray(adjacency))
        if kind == "h5-garbage":
            (out / "metr-la.h5").write_bytes(bytes(range(256)) * 4)
        elif kind == "adjacency-garbage":
            (out / "adj_mx.pkl").write_text("not a pickle")
        return str(out)

    return make


def _empty_dir(case_dir):
    (case_dir / "empty").mkdir()
    return str(case_dir / "empty")


BAD_INPUTS = [
    ("no-data", [], ["--data is missing", "toolkit.data.traffic synth"]),
    ("data-missing", ["--data", "/no/such/traffic"], ["--data /no/such/traffic", "not a directory"]),
    ("data-empty-dir", ["--data", _empty_dir], ["--data", "exactly one speed table"]),
    ("h5-without-time-index", ["--data", _bad_data("no-time-index")], ["metr-la.h5", "no time index"]),
    ("adjacency-size-disagrees", ["--data", _bad_data("adjacency-size")], ["adj_mx.pkl", "9 x 9", "10 sensors"]),
    ("speeds-with-a-bool-column", ["--data", _bad_data("bool-column")],
     ["metr-la.h5", "column(s) incident hold True/False values, not speeds"]),
    (
        "fewer-timesteps-than-a-window",
        ["--data", _bad_data("too-few-timesteps")],
        ["metr-la.h5", "100 timesteps", f"at least {minimum_timesteps()}"],
    ),
    ("h5-garbage", ["--data", _bad_data("h5-garbage")], ["metr-la.h5", "not a pandas HDF5"]),
    ("adjacency-garbage", ["--data", _bad_data("adjacency-garbage")], ["adj_mx.pkl", "not a readable"]),
    ("preset", ["--preset", "pems-bay"], ["--preset", "pems-bay"]),
    ("units-zero", ["--units", "0"], ["--units 0", ">= 1"]),
    ("diffusion-steps-zero", ["--diffusion-steps", "0"], ["--diffusion-steps 0"]),
    ("sampling-decay-negative", ["--sampling-decay-steps", "-1"], ["--sampling-decay-steps -1"]),
    ("lr-decay-zero", ["--lr-decay", "0"], ["--lr-decay 0"]),
    ("batch-larger-than-data", ["--batch-size", "4096"], ["--batch-size 4096", "985 training windows"]),
    ("fused-kernel-compiled", ["--sequence-kernel", "fused", "--compile"],
     ["--sequence-kernel fused cannot be compiled", "--compile traces the cells"]),
    ("fused-kernel-plain", ["--sequence-kernel", "fused", "--kernels", "plain"],
     ["--sequence-kernel fused is a fast path", "--kernels plain leaves out", "give --kernels auto with it"]),
]


@pytest.mark.parametrize("flags, fragments", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_created(flags, fragments, synth_data, tmp_path):
    flags = [flag(tmp_path) if callable(flag) else flag for flag in flags]
    data = [] if "--data" in flags or flags == [] else ["--data", str(synth_data)]
    assert_refused(
        [*TINY_DCRNN, *data, *flags, "--output-dir", str(tmp_path / "run")],
        fragments,
        recipe="dcrnn",
        case_dir=tmp_path,
    )


# ---- the 2-node CPU sbatch job on the local SLURM cluster ------------------------------------------------------


# SGD (DCRNN has no dropout): the 2-node job's 2 x 16 windows a step must train exactly as one process's 32.
TWO_NODES = args(
    "--optimizer", "sgd", "--lr", "0.05", "--max-steps", "4", "--eval-every-steps", "2", "--log-with", "csv",
    "--log-every", "1",
)  # fmt: skip


def assert_trained_as_one_process(run_dir, reference, synth_data):
    """run_dir, a 2-process run of TWO_NODES, against reference, the same flags in one process: world size 2 in
    every record, the same global batch, the same losses and final weights, every test window scored once."""
    runs = {2: run_dir, 1: reference}
    for world_size, run in runs.items():
        config, summary = read_json(run / "config.json"), read_json(run / "summary.json")
        assert (config["world_size"], config["num_machines"], summary["world_size"]) == (world_size,) * 3
        assert config["config"]["batch_size"] == 32  # the global batch: 16 windows a process on 2
        assert {row["world_size"] for row in csv.DictReader(open(run / "metrics.csv"))} == {str(world_size)}
        assert summary["global_step"] == 4
        assert summary["test_metrics_at_best"]["test_readings"] == readings_by_hand(synth_data)
    l2, l1 = logged_losses(run_dir), logged_losses(reference)
    assert sorted(l2) == sorted(l1) == [1, 2, 3, 4]
    worst = max(abs(l2[s] - l1[s]) / abs(l1[s]) for s in l1)
    assert worst < 1e-5, (worst, l1, l2)
    w2, w1 = final_weights(run_dir, 4), final_weights(reference, 4)
    assert sorted(w2) == sorted(w1)
    worst = max((w2[k] - w1[k]).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    assert any(not torch.equal(w1[k], w) for k, w in final_weights(reference, 2).items())  # the weights moved
    s2, s1 = (read_json(run / "summary.json")["test_metrics_at_best"] for run in (run_dir, reference))
    assert s2.keys() == s1.keys()
    for key, value in s1.items():
        assert s2[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_two_node_cpu_sbatch_run_of_dcrnn_verifies(slurm_env, synth_data, tmp_path):
    run_dir = sbatch_cpu_run(slurm_env, ["recipes/dcrnn.py", *TWO_NODES], tmp_path)
    logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))
    assert ranks_seen(logs) == {(0, 2), (1, 2)}  # one process per node, each saw world size 2
    reference = tmp_path / "one"
    one = run_recipe([*TWO_NODES, "--output-dir", str(reference)], recipe="dcrnn", config="cpu.yaml")
    assert ranks_seen(one.stderr) == {(0, 1)}
    assert_trained_as_one_process(run_dir, reference, synth_data)
