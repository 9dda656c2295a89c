"""Traffic data: the real file formats round trip, missing readings are zeros and masked, windows stay inside their
part of the timeline, the scaler sees only training inputs, the baselines and masked metrics match hand-computed
values, and bad files are one-line errors naming the file."""

import pickle
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from toolkit.data.traffic import (
    INPUT_STEPS,
    MIN_STEPS_PER_EPOCH,
    OUTPUT_STEPS,
    baseline_forecasts,
    data_warnings,
    generate,
    historical_average,
    horizon_metrics,
    minimum_timesteps,
    prepare_traffic,
    split_windows,
    write_dataset,
)
from toolkit.errors import UsageError
from toolkit.run.metrics import masked_error_sums


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    frame, ids, adjacency = generate(sensors=12, days=8, seed=3, progress=False)
    write_dataset(out, frame, ids, adjacency)
    return out, frame, ids, adjacency


def test_round_trip_through_both_files_in_the_real_formats(generated, tmp_path):
    out, frame, ids, adjacency = generated
    # what users have: pandas HDF5 under key "df", and a pickle of [sensor_ids, id_to_index, matrix]
    stored = pd.read_hdf(out / "metr-la.h5", key="df")
    pd.testing.assert_frame_equal(stored, frame)
    assert (
        isinstance(stored.index, pd.DatetimeIndex)
        and (stored.index[1:] - stored.index[:-1] == pd.Timedelta("5min")).all()
    )
    with open(out / "adj_mx.pkl", "rb") as handle:
        sensor_ids, id_to_index, matrix = pickle.load(handle, encoding="latin1")
    assert sensor_ids == ids and id_to_index == {s: i for i, s in enumerate(ids)}
    assert matrix.shape == (12, 12) and np.allclose(np.diag(matrix), 1.0)
    assert ((matrix == 0) | (matrix >= 0.1)).all()  # Gaussian kernel with weights below 0.1 cut
    ds, meta = prepare_traffic(out, tmp_path / "cache")
    table = ds.with_format("numpy")[:]
    assert np.array_equal(table["speed"], frame.to_numpy(dtype=np.float32))
    assert meta["sensor_ids"] == ids and np.allclose(meta["adjacency"], matrix)
    assert meta["interval_minutes"] == 5 and meta["num_timesteps"] == 8 * 288
    # time of day and slot of the week from the timestamps (2012-03-01 was a Thursday: day 3)
    assert table["time_of_day"][1] == pytest.approx(5 / 1440) and table["slot_of_week"][0] == 3 * 288
    again, meta_again = prepare_traffic(out, tmp_path / "cache")  # from the cache now
    assert meta_again["fingerprint"] == meta["fingerprint"]
    assert np.array_equal(again.with_format("numpy")["speed"], table["speed"])


def test_adjacency_is_reordered_to_the_tables_columns(generated, tmp_path):
    out, frame, ids, adjacency = generated
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    (shuffled / "metr-la.h5").write_bytes((out / "metr-la.h5").read_bytes())
    order = np.random.default_rng(0).permutation(len(ids))
    with open(shuffled / "adj_mx.pkl", "wb") as handle:  # the same graph, listed in another sensor order
        pickle.dump(
            [[ids[i] for i in order], {ids[i]: k for k, i in enumerate(order)}, adjacency[np.ix_(order, order)]], handle
        )
    _, meta = prepare_traffic(shuffled, tmp_path / "cache")
    assert np.allclose(meta["adjacency"], adjacency)


def test_generator_is_deterministic_and_plausible():
    a, ids_a, adj_a = generate(sensors=20, days=14, seed=7, progress=False)
    b, ids_b, adj_b = generate(sensors=20, days=14, seed=7, progress=False)
    c, _, _ = generate(sensors=20, days=14, seed=8, progress=False)
    pd.testing.assert_frame_equal(a, b)
    assert ids_a == ids_b and np.array_equal(adj_a, adj_b)
    assert not a.equals(c)
    speeds = a.to_numpy()
    missing = speeds == 0
    assert 0.04 < missing.mean() < 0.13  # METR-LA: 8.1% zeros
    assert not np.isnan(speeds).any() and speeds.max() <= 75
    # rush hour: weekday 7:30-9:00 is slower than 2:00-4:00 (readings only)
    hour = a.index.hour + a.index.minute / 60
    weekday = a.index.day_of_week < 5
    observed = np.where(missing, np.nan, speeds)
    rush = np.nanmean(observed[weekday & (hour >= 7.5) & (hour < 9)])
    night = np.nanmean(observed[weekday & (hour >= 2) & (hour < 4)])
    assert rush < night - 2, (rush, night)


def test_missing_readings_are_zeros_and_left_out_of_the_metrics(generated, tmp_path):
    out, frame, _, _ = generated
    ds, meta = prepare_traffic(out, tmp_path / "cache")
    speed = ds.with_format("torch")[:]["speed"]
    zeros = speed == 0
    assert meta["missing_fraction"] == pytest.approx(zeros.float().mean().item())
    assert 0.03 < meta["missing_fraction"] < 0.15
    # a forecast that is wrong ONLY where readings are missing has no error at all
    forecast = torch.where(zeros, torch.full_like(speed, 99.0), speed)
    sums = masked_error_sums(forecast, speed)
    assert sums[0].item() == 0 and sums[3].item() == (~zeros).sum().item()


def test_masked_horizon_metrics_against_hand_computed_values():
    # 1 window, 12 horizons, 2 sensors; horizon 3 (index 2): errors 2 (target 40) and a missing reading (target 0)
    target = torch.full((1, OUTPUT_STEPS, 2), 50.0)
    prediction = target.clone()
    target[0, 2] = torch.tensor([40.0, 0.0])
    prediction[0, 2] = torch.tensor([42.0, 13.0])
    target[0, 11] = torch.tensor([20.0, 25.0])  # horizon 12: errors 5 and -5
    prediction[0, 11] = torch.tensor([25.0, 20.0])
    metrics = horizon_metrics(masked_error_sums(prediction, target, keep_dims=1), "test", interval_minutes=5)
    assert metrics["test_mae@15min"] == pytest.approx(2.0)  # the missing reading does not count: 2 / 1
    assert metrics["test_rmse@15min"] == pytest.approx(2.0)
    assert metrics["test_mape@15min"] == pytest.approx(2 / 40)
    assert metrics["test_mae@30min"] == 0.0
    assert metrics["test_mae@60min"] == pytest.approx(5.0) and metrics["test_rmse@60min"] == pytest.approx(5.0)
    assert metrics["test_mape@60min"] == pytest.approx((5 / 20 + 5 / 25) / 2)
    assert metrics["test_mae"] == pytest.approx((2 + 10) / 23)  # 24 readings, one missing
    assert metrics["test_rmse"] == pytest.approx(((4 + 50) / 23) ** 0.5)


def test_no_window_crosses_a_split_boundary_and_the_scaler_sees_training_inputs_only(generated, tmp_path):
    out, frame, _, _ = generated
    ds, _ = prepare_traffic(out, tmp_path / "cache")
    split = split_windows(ds)
    begin, train_end, valid_end, end = split.bounds
    assert (train_end, valid_end, end) == (round(0.7 * end), round(0.7 * end) + round(0.1 * end), len(frame))
    for part, (lo, hi) in zip(
        [split.train, split.valid, split.test],
        [(begin, train_end), (train_end, valid_end), (valid_end, end)],
        strict=True,
    ):
        starts = part.starts
        assert starts.min() == lo and starts.max() + INPUT_STEPS + OUTPUT_STEPS == hi  # every window that fits
        assert len(part) == hi - lo - INPUT_STEPS - OUTPUT_STEPS + 1
        item = part[len(part) - 1]
        assert item["x"].shape == (INPUT_STEPS, 12, 2) and item["y"].shape == (OUTPUT_STEPS, 12)
    item = split.test[5]
    start = int(split.test.starts[5])
    assert torch.equal(item["y"], torch.tensor(frame.to_numpy(np.float32)[start + 12 : start + 24]))
    assert torch.allclose(
        split.scaler.inverse(item["x"][..., 0]), torch.tensor(frame.to_numpy(np.float32)[start : start + 12]), atol=1e-4
    )
    # the scaler: readings (not zeros) of the training inputs only; later parts do not move it
    train_inputs = frame.to_numpy()[: train_end - OUTPUT_STEPS]
    readings = train_inputs[train_inputs > 0]
    assert split.scaler.mean == pytest.approx(readings.mean()) and split.scaler.std == pytest.approx(readings.std())
    changed = frame.copy()
    changed.iloc[train_end - OUTPUT_STEPS :] = 1.0  # everything after the last training input
    other = tmp_path / "changed"
    write_dataset(other, changed, list(frame.columns), np.eye(12))
    ds2, _ = prepare_traffic(other, tmp_path / "cache")
    assert split_windows(ds2).scaler == split.scaler


def test_baselines_against_hand_computed_forecasts(generated, tmp_path):
    out, frame, _, _ = generated
    ds, _ = prepare_traffic(out, tmp_path / "cache")
    split = split_windows(ds)
    table = historical_average(split)
    # the same slot of the week: the mean of the training readings at that slot (zeros left out)
    train = frame.iloc[: split.bounds[1]]
    slot = (train.index.day_of_week * 288 + train.index.hour * 12 + train.index.minute // 5).to_numpy()
    sensor = 4
    at = slot[100]
    values = train.to_numpy()[slot == at, sensor]
    assert table[at, sensor].item() == pytest.approx(values[values > 0].mean())
    average, last = baseline_forecasts(split, split.test, table)
    w = 7
    start = int(split.test.starts[w])
    inputs = frame.to_numpy()[start : start + INPUT_STEPS, sensor]
    assert last[w, :, sensor].unique().item() == pytest.approx(inputs[inputs > 0][-1])  # last non-missing reading
    target_slot = split.slot_of_week[start + INPUT_STEPS + 5]
    assert average[w, 5, sensor].item() == pytest.approx(table[target_slot, sensor].item())


@pytest.mark.parametrize(
    "case", ["no-time-index", "adjacency-size", "too-few-timesteps", "not-hdf5", "irregular-time", "ids-differ",
             "ids-share-a-row", "id-past-the-matrix", "speed-1e6", "all-zero", "all-nan", "negative-speed",
             "infinite-speed", "string-column", "repeated-timestamp", "adjacency-not-pickle", "adjacency-two-items",
             "adjacency-negative", "adjacency-nan", "adjacency-strings", "two-speed-tables", "no-adjacency",
             "two-hdf-tables", "id-map-not-a-map", "adjacency-not-square", "time-runs-backwards", "extra-bool-column"]
)
def test_bad_files_are_one_line_errors_naming_the_file(case, generated, tmp_path):
    out, frame, ids, adjacency = generated
    bad = tmp_path / "bad"
    table, graph = frame, (ids, adjacency)
    if case == "no-time-index":
        table = frame.reset_index(drop=True)
    elif case == "adjacency-size":
        graph = (ids[:-1], adjacency[:-1, :-1])
    elif case == "too-few-timesteps":
        table = frame.iloc[: minimum_timesteps() - 1]
    elif case == "irregular-time":
        table = frame.drop(frame.index[50])
    elif case == "time-runs-backwards":
        table = frame.iloc[::-1]
    elif case == "adjacency-not-square":
        graph = (ids, adjacency[:, :-1])
    elif case == "ids-differ":
        graph = (["x" + s for s in ids], adjacency)
    elif case == "speed-1e6":
        table = frame.copy()
        table.iloc[10, 2] = 1e6
    elif case in ("all-zero", "all-nan"):
        table = frame * (0.0 if case == "all-zero" else float("nan"))
    elif case in ("negative-speed", "infinite-speed"):
        table = frame.copy()
        table.iloc[5, 1] = -3.0 if case == "negative-speed" else float("inf")
    elif case == "string-column":
        table = frame.copy()
        table[table.columns[2]] = "fast"
    elif case == "extra-bool-column":
        table = frame.copy()
        table["incident"] = frame[frame.columns[0]] < 20  # a flag beside the speeds, not a sensor
    elif case == "repeated-timestamp":
        table = frame.copy()
        table.index = table.index.where(np.arange(len(table)) != 30, table.index[29])
    elif case in ("adjacency-negative", "adjacency-nan"):
        matrix = adjacency.copy()
        matrix[0, 1] = -1.0 if case == "adjacency-negative" else float("nan")
        graph = (ids, matrix)
    write_dataset(bad, table, *graph)
    adjacency_file = bad / "adj_mx.pkl"
    if case == "adjacency-not-pickle":
        adjacency_file.write_text("from,to,cost\n")
    elif case in ("adjacency-two-items", "adjacency-strings", "id-map-not-a-map"):
        content = {"adjacency-two-items": [ids, adjacency],
                   "adjacency-strings": [ids, {s: i for i, s in enumerate(ids)}, [["near"] * len(ids)] * len(ids)],
                   "id-map-not-a-map": [ids, [1, 2, 3], adjacency]}[case]
        adjacency_file.write_bytes(pickle.dumps(content, protocol=2))
    elif case == "two-speed-tables":
        shutil.copy(bad / "metr-la.h5", bad / "pems-bay.h5")
    elif case == "no-adjacency":
        adjacency_file.unlink()
    elif case == "two-hdf-tables":
        (bad / "metr-la.h5").unlink()
        frame.to_hdf(bad / "metr-la.h5", key="first")
        frame.to_hdf(bad / "metr-la.h5", key="second")
    if case in ("ids-share-a-row", "id-past-the-matrix"):
        mapping = {s: i for i, s in enumerate(ids)}
        mapping[ids[1]] = 0 if case == "ids-share-a-row" else len(ids) + 5
        with open(bad / "adj_mx.pkl", "wb") as handle:
            pickle.dump([ids, mapping, adjacency.astype(np.float32)], handle, protocol=2)
    if case == "not-hdf5":
        (bad / "metr-la.h5").write_text("sensor,speed\n1,60\n")
    with pytest.raises(UsageError) as error:
        prepare_traffic(bad, tmp_path / "cache")
    message = str(error.value)
    assert "\n" not in message
    expected = {
        "no-time-index": ("metr-la.h5", "no time index"),
        "adjacency-size": ("adj_mx.pkl", "11 x 11", "12"),
        "too-few-timesteps": ("metr-la.h5", f"{minimum_timesteps() - 1} timesteps", "at least"),
        "not-hdf5": ("metr-la.h5", "not a pandas HDF5"),
        "irregular-time": ("metr-la.h5", "interval"),
        "ids-differ": ("adj_mx.pkl", "sensor ids"),
        "ids-share-a-row": ("adj_mx.pkl", f"sends sensors {ids[0]}, {ids[1]} to the same row 0"),
        "id-past-the-matrix": ("adj_mx.pkl", f"to row {len(ids) + 5}, outside the"),
        "speed-1e6": ("metr-la.h5", "1 speed(s) above 200 mph (up to 1e+06)", "--max-speed"),
        "all-zero": ("metr-la.h5", "holds no reading"),
        "all-nan": ("metr-la.h5", "holds no reading"),
        "negative-speed": ("metr-la.h5", "negative or infinite speeds"),
        "infinite-speed": ("metr-la.h5", "negative or infinite speeds"),
        "string-column": ("metr-la.h5", "are not numeric speeds"),
        "repeated-timestamp": ("metr-la.h5", "one constant interval"),
        "adjacency-not-pickle": ("adj_mx.pkl", "not a readable adjacency pickle"),
        "adjacency-two-items": ("adj_mx.pkl", "does not hold [sensor_ids, id_to_index, adjacency matrix]"),
        "adjacency-negative": ("adj_mx.pkl", "negative or non-finite weights"),
        "adjacency-nan": ("adj_mx.pkl", "negative or non-finite weights"),
        "adjacency-strings": ("adj_mx.pkl", "not a numeric matrix"),
        "two-speed-tables": ("must hold exactly one speed table", "metr-la.h5, pems-bay.h5"),
        "no-adjacency": ("must hold exactly one adjacency pickle", "found none"),
        "two-hdf-tables": ("metr-la.h5 holds 2 tables", "/first"),
        "id-map-not-a-map": ("adj_mx.pkl", "id_to_index is not a map"),
        "adjacency-not-square": ("adj_mx.pkl", "the adjacency is 12 x 11", "12"),
        "time-runs-backwards": ("metr-la.h5", "the timestamps must increase"),
        "extra-bool-column": ("metr-la.h5", "column(s) incident hold True/False values, not speeds in mph"),
    }[case]
    for fragment in expected:
        assert fragment in message, message
    assert not (tmp_path / "cache" / "processed").exists() or not any(
        p.name.startswith("traffic-") for p in (tmp_path / "cache" / "processed").iterdir()
    )


def test_synth_command_writes_both_files_and_refuses_bad_flags(tmp_path):
    out = tmp_path / "synth"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.data.traffic",
            "synth",
            "--out",
            str(out),
            "--sensors",
            "5",
            "--days",
            "3",
            "--seed",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "864 timesteps x 5 sensors" in result.stdout
    expected, _, _ = generate(5, 3, seed=2, progress=False)
    pd.testing.assert_frame_equal(pd.read_hdf(out / "metr-la.h5", key="df"), expected)
    bad = subprocess.run(
        [sys.executable, "-m", "toolkit.data.traffic", "synth", "--out", str(tmp_path / "x"), "--sensors", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --sensors 1 is invalid; give at least 2"]
    assert not (tmp_path / "x").exists()


def test_nan_speeds_are_missing_readings_like_zeros(generated, tmp_path):
    """METR-LA marks a missing reading 0; a table with NaN there instead trains exactly as the one with zeros."""
    out, frame, ids, adjacency = generated
    with_nan = frame.copy()
    holes = (slice(40, 60), [0, 3])
    with_nan.iloc[holes] = float("nan")
    with_zero = frame.copy()
    with_zero.iloc[holes] = 0.0
    write_dataset(tmp_path / "nan", with_nan, ids, adjacency)
    write_dataset(tmp_path / "zero", with_zero, ids, adjacency)
    nan_ds, nan_meta = prepare_traffic(tmp_path / "nan", tmp_path / "cache")
    zero_ds, zero_meta = prepare_traffic(tmp_path / "zero", tmp_path / "cache")
    assert torch.equal(torch.as_tensor(np.asarray(nan_ds["speed"])), torch.as_tensor(np.asarray(zero_ds["speed"])))
    assert nan_meta["missing_fraction"] == zero_meta["missing_fraction"] > 0


# ---- data that trains but teaches little: one warning line each, the run goes on -----------------------------


def _column(frame, sensor, value):
    table = frame.copy()
    table[table.columns[sensor]] = value
    return table


def _constant_readings(frame, sensor, mph):
    """The sensor reads `mph` wherever it has a reading (its missing readings stay 0)."""
    table = frame.copy()
    column = table.columns[sensor]
    table[column] = np.where(frame[column] > 0, mph, 0.0)
    return table


# case: (table from the generated one, adjacency from the generated one, data_warnings flags, fragment of the line)
WARNED = {
    "a graph with no edges (only the diagonal)": (lambda f: f, lambda a: np.eye(len(a)), {},
                                                  "the adjacency has no edge between two sensors (only its diagonal)"),
    "an all-zero adjacency": (lambda f: f, np.zeros_like, {}, "the adjacency is all zeros: the graph diffusion "
                              "carries nothing from one sensor to another"),
    "a sensor missing throughout (zeros)": (lambda f: _column(f, 3, 0.0), lambda a: a, {},
                                            "sensor {ids[3]} (1 of 12) has no reading in the whole table"),
    "two sensors missing throughout (NaN)": (lambda f: _column(_column(f, 3, np.nan), 7, np.nan), lambda a: a, {},
                                             "sensors {ids[3]}, {ids[7]} (2 of 12) have no reading in the whole table"),
    "a sensor stuck at 55 mph": (lambda f: _constant_readings(f, 5, 55.0), lambda a: a, {},
                                 "sensor {ids[5]} (1 of 12) reads one constant speed at every reading (e.g. 55 mph"),
    "one constant speed everywhere": (lambda f: (f > 0) * 60.0, lambda a: a, {},
                                      "sensors {ids[0]}, {ids[1]}, {ids[2]}, ... (12 of 12) read one constant speed"),
    "--grad-accum 1000: one step an epoch": (lambda f: f, lambda a: a, {"batches": 30, "grad_accum": 1000,
                                                                        "batch_size": 32},
                                             "warning: --grad-accum 1000 leaves 1 optimizer step an epoch (30 batches "
                                             "of --batch-size 32), fewer than 10"),
    "--grad-accum 4: 8 steps an epoch": (lambda f: f, lambda a: a, {"batches": 30, "grad_accum": 4, "batch_size": 32},
                                         "--grad-accum 4 leaves 8 optimizer steps an epoch"),
}


@pytest.fixture(scope="module")
def generated_split(generated, tmp_path_factory):
    out, _, _, _ = generated
    ds, meta = prepare_traffic(out, tmp_path_factory.mktemp("cache"))
    return split_windows(ds), meta


@pytest.mark.parametrize("case", list(WARNED))
def test_degenerate_data_is_one_warning_line_and_the_data_is_kept(case, generated, generated_split, tmp_path):
    _, frame, ids, adjacency = generated
    table, graph, flags, fragment = WARNED[case]
    if flags:  # the flags alone: the generated data itself
        split, meta = generated_split
    else:
        write_dataset(tmp_path / "data", table(frame), ids, graph(adjacency))
        ds, meta = prepare_traffic(tmp_path / "data", tmp_path / "cache")  # read and cached: training goes on
        split = split_windows(ds)
    lines = data_warnings(split.speed, meta, **flags)
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "\n" not in lines[0], lines
    assert fragment.format(ids=ids) in lines[0], lines[0]
    if not flags:
        assert lines[0].startswith(f"warning: --data {tmp_path / 'data'}: ")


def test_plain_data_and_enough_steps_warn_of_nothing(generated_split):
    split, meta = generated_split
    assert data_warnings(split.speed, meta, batches=30, grad_accum=1, batch_size=32) == []
    assert data_warnings(split.speed, meta, batches=30, grad_accum=3, batch_size=32) == []  # 10 steps: enough
    assert data_warnings(split.speed, meta, batches=MIN_STEPS_PER_EPOCH - 1, batch_size=32) == []  # not --grad-accum's
