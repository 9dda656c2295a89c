"""Traffic speed forecasting data (DCRNN): the real METR-LA / PEMS-BAY formats, windows, split, scaler, baselines,
and a generator of plausible road networks that writes the same two files.

    python -m toolkit.data.traffic synth --out data/synth-la --sensors 207 --days 120 [--seed 0]

A data directory holds
    <name>.h5       pandas HDF5 table (metr-la.h5: key "df"), rows = timestamps every 5 minutes, columns = sensor ids,
                    speeds in mph; 0 = a missing reading
    adj_mx*.pkl     pickle of [sensor_ids, id_to_index, adjacency (N x N float)], Gaussian-kernel weights
                    exp(-(d / sigma)^2) of road distances, entries below 0.1 cut to 0 (DCRNN's gen_adj_mx.py)

prepare_traffic() reads and checks both (one-line UsageError naming the file), caches the processed table with
`datasets` (toolkit.data.cache) and returns it; split_windows() cuts the timeline chronologically 70/10/20 and makes
the standard windows INSIDE each part (12 steps in, 12 out; no window crosses a boundary), inputs = speed
(standardised with a mean/std of the training inputs' readings) + time of day, targets = speed in mph.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from toolkit.data.cache import cached_dataset, file_fingerprint
from toolkit.data.prepared import Prepared
from toolkit.errors import UsageError
from toolkit.process import extras
from toolkit.run.metrics import masked_error_sums

FORMAT_VERSION = 1  # bump when the processed layout changes
INPUT_STEPS = 12
OUTPUT_STEPS = 12
SPLIT = (0.7, 0.1, 0.2)  # train, validation, test: chronological
HORIZONS = (3, 6, 12)  # reported horizons (15, 30, 60 minutes at 5-minute readings)
SPEEDS_KEY = "df"  # the key metr-la.h5 stores its table under


# ----------------------------------------------------------------------------------------------------
# Reading the real formats
# ----------------------------------------------------------------------------------------------------


def find_files(data: Path) -> tuple[Path, Path]:
    """(speed table, adjacency pickle) of a data directory: one *.h5 and one adj*.pkl file."""
    data = Path(data).expanduser()
    if not data.is_dir():
        raise UsageError(
            f"--data {data} is not a directory; give a directory holding metr-la.h5 (or another .h5 "
            "speed table) and adj_mx.pkl, e.g. from `python -m toolkit.data.traffic synth --out DIR`"
        )
    tables = sorted(p for p in data.iterdir() if p.suffix in (".h5", ".hdf5") and p.is_file())
    pickles = sorted(p for p in data.iterdir() if p.suffix == ".pkl" and p.name.startswith("adj") and p.is_file())
    for found, what in ((tables, "speed table (*.h5)"), (pickles, "adjacency pickle (adj*.pkl)")):
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise UsageError(f"--data {data} must hold exactly one {what}, found {names}")
    return tables[0], pickles[0]


MAX_SPEED = 200.0  # mph: no road sensor reads more; the DCRNN recipe's --max-speed widens it


def read_speeds(path: Path, max_speed: float = MAX_SPEED) -> pd.DataFrame:
    """The speed table: a DatetimeIndex at a constant interval, numeric columns (one per sensor); NaN -> 0 (missing,
    like METR-LA's own zeros). Speeds above max_speed (mph), negative or infinite ones, and a table without a single
    reading are refused."""
    path = Path(path)
    extras.require("traffic")  # pandas reads HDF5 through PyTables
    try:
        with pd.HDFStore(path, mode="r") as store:
            keys = store.keys()
            key = f"/{SPEEDS_KEY}" if f"/{SPEEDS_KEY}" in keys else (keys[0] if len(keys) == 1 else None)
            if key is None:
                raise UsageError(
                    f"{path} holds {len(keys)} tables ({', '.join(keys) or 'none'}); expected one "
                    f"table, or one under the key '{SPEEDS_KEY}' (as metr-la.h5)"
                )
            frame = store[key]
    except UsageError:
        raise
    except Exception as error:  # not HDF5, not written by pandas, truncated...
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"{path} is not a pandas HDF5 speed table ({reason}); write one with "
            f"DataFrame.to_hdf(path, key='{SPEEDS_KEY}')"
        ) from None
    if not isinstance(frame, pd.DataFrame):
        raise UsageError(f"{path} holds a {type(frame).__name__}, not a table of timestamps x sensors")
    if not isinstance(frame.index, pd.DatetimeIndex):
        raise UsageError(
            f"{path} has no time index (its rows are indexed by {frame.index.dtype}); the rows must "
            "be timestamps (a DatetimeIndex), one per reading interval"
        )
    if len(frame) < minimum_timesteps():
        raise UsageError(
            f"{path} holds {len(frame)} timesteps, fewer than one window ({INPUT_STEPS} in + "
            f"{OUTPUT_STEPS} out) in each of the 70/10/20 train/validation/test parts; it needs at "
            f"least {minimum_timesteps()}"
        )
    if frame.shape[1] < 1:
        raise UsageError(f"{path} has no sensor columns")
    steps = np.diff(frame.index.asi8)
    if (steps <= 0).any() or len(np.unique(steps)) != 1:
        raise UsageError(
            f"{path}: the timestamps must increase at one constant interval (found intervals "
            f"{sorted(set(pd.to_timedelta(np.unique(steps)[:3]).astype(str)))}...)"
        )
    flags = [str(c) for c, dtype in frame.dtypes.items() if pd.api.types.is_bool_dtype(dtype)]
    if flags:  # pandas counts bool as numeric: it would pass as a sensor and surface as an adjacency size mismatch
        raise UsageError(f"{path}: column(s) {', '.join(flags[:3])} hold True/False values, not speeds in mph; every "
                         "column of the table is one sensor's speeds: drop the flag column(s)")
    non_numeric = [str(c) for c, dtype in frame.dtypes.items() if not pd.api.types.is_numeric_dtype(dtype)]
    if non_numeric:
        raise UsageError(f"{path}: sensor column(s) {', '.join(non_numeric[:3])} are not numeric speeds")
    values = frame.to_numpy(dtype=np.float64)
    if np.isinf(values).any() or (values < 0).any():
        raise UsageError(f"{path} holds negative or infinite speeds; missing readings must be 0 (or NaN)")
    too_fast = values > max_speed
    if too_fast.any():
        raise UsageError(
            f"{path} holds {int(too_fast.sum())} speed(s) above {max_speed:g} mph (up to {np.nanmax(values):.4g}); "
            "speeds are mph, a missing reading is 0 or NaN; if these are real, widen the range with --max-speed"
        )
    if not (values > 0).any():
        raise UsageError(f"{path} holds no reading: every speed is 0 or NaN (missing); give a table with readings")
    return frame.fillna(0.0)


def read_adjacency(path: Path, sensor_ids: list[str], speeds_path: Path) -> np.ndarray:
    """The adjacency pickle [sensor_ids, id_to_index, matrix], reordered to the speed table's column order."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            content = pickle.load(handle, encoding="latin1")  # DCRNN's files were pickled by Python 2
    except Exception as error:
        raise UsageError(
            f"{path} is not a readable adjacency pickle ({type(error).__name__}); expected "
            "[sensor_ids, id_to_index, adjacency matrix]"
        ) from None
    if not (isinstance(content, (list, tuple)) and len(content) == 3):
        raise UsageError(f"{path} does not hold [sensor_ids, id_to_index, adjacency matrix]")
    ids, id_to_index, matrix = content
    try:
        matrix = np.asarray(matrix, dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"{path}: the adjacency is not a numeric matrix") from None
    n = len(sensor_ids)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] != n:
        raise UsageError(
            f"{path}: the adjacency is {' x '.join(map(str, matrix.shape))} but {speeds_path.name} has "
            f"{n} sensors; it must be {n} x {n}"
        )
    if not np.isfinite(matrix).all() or (matrix < 0).any():
        raise UsageError(f"{path}: the adjacency holds negative or non-finite weights")
    try:
        index = {str(k): int(v) for k, v in dict(id_to_index).items()}
    except (TypeError, ValueError):
        raise UsageError(f"{path}: id_to_index is not a map of sensor ids to row numbers") from None
    rows = [index[s] for s in sensor_ids if s in index]
    outside = sorted({r for r in rows if not 0 <= r < n})
    if outside:
        raise UsageError(f"{path}: id_to_index sends sensor ids to row {outside[0]}, outside the {n} x {n} adjacency "
                         f"(rows 0 .. {n - 1})")
    if len(set(rows)) != len(rows):
        shared = next(r for r in rows if rows.count(r) > 1)
        ids_there = [s for s in sensor_ids if index.get(s) == shared]
        raise UsageError(f"{path}: id_to_index sends sensors {', '.join(ids_there[:3])} to the same row {shared}; "
                         "each sensor needs its own row")
    missing = [s for s in sensor_ids if s not in index]
    if missing or len({str(i) for i in ids}) != n:
        raise UsageError(
            f"{path}: sensor ids do not match the columns of {speeds_path.name} (e.g. {missing[:3]} "
            "missing from id_to_index)"
        )
    order = np.array([index[s] for s in sensor_ids])
    return matrix[np.ix_(order, order)]


# ----------------------------------------------------------------------------------------------------
# The processed table (cached) and the windows
# ----------------------------------------------------------------------------------------------------


def prepare_traffic(data: Path, cache_dir: Path, max_speed: float = MAX_SPEED) -> Prepared:
    """(ds, meta): ds has one row per timestep: speed [N] float32 (mph, 0 = missing), time_of_day (fraction of the
    day), slot_of_week (0 .. readings per week - 1); meta: sensor_ids, adjacency (N x N), interval_minutes, start,
    num_timesteps, num_sensors, missing_fraction, source, fingerprint. Built once per pair of files."""
    datasets.disable_progress_bars()
    speeds_path, adjacency_path = find_files(data)
    key = hashlib.sha1(
        f"{file_fingerprint(speeds_path, FORMAT_VERSION)}:{file_fingerprint(adjacency_path, FORMAT_VERSION)}"
        f"{'' if max_speed == MAX_SPEED else f':{max_speed!r}'}".encode()  # a table built under a wider range
    ).hexdigest()[:16]

    def build() -> tuple[datasets.Dataset, dict]:
        frame = read_speeds(speeds_path, max_speed)
        sensor_ids = [str(c) for c in frame.columns]
        adjacency = read_adjacency(adjacency_path, sensor_ids, speeds_path)
        stamps = frame.index
        interval = (stamps[1] - stamps[0]).total_seconds()
        since_midnight = (stamps - stamps.normalize()).total_seconds().to_numpy()
        per_week = int(round(7 * 86400 / interval))
        slot = ((stamps.day_of_week.to_numpy() * 86400 + since_midnight) // interval).astype(np.int64) % per_week
        speeds = frame.to_numpy(dtype=np.float32)
        ds = datasets.Dataset.from_dict(
            {
                "speed": speeds,
                "time_of_day": (since_midnight / 86400.0).astype(np.float32),
                "slot_of_week": slot,
            }
        )
        meta = {
            "sensor_ids": sensor_ids,
            "adjacency": adjacency.tolist(),
            "interval_minutes": interval / 60.0,
            "start": str(stamps[0]),
            "num_timesteps": len(frame),
            "num_sensors": len(sensor_ids),
            "missing_fraction": float((speeds == 0).mean()),
        }
        return ds, meta

    ds, meta = cached_dataset(cache_dir, "traffic", key, build)
    meta.update(source=str(speeds_path.parent), fingerprint=f"traffic-{key}")
    return Prepared(ds, meta)


class TrafficWindows(torch.utils.data.Dataset):
    """Item i = {"window": start, "x": inputs[start : start + 12] ([12, N, 2]: scaled speed, time of day),
    "y": speed[start + 12 : start + 24] ([12, N], mph, 0 = missing)}; `start` (the window's first timestep) is
    the window's id, unique over all parts: it keys per-sample randomness."""

    def __init__(self, inputs: torch.Tensor, speed: torch.Tensor, starts: torch.Tensor):
        self.inputs, self.speed, self.starts = inputs, speed, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[index])
        middle = start + INPUT_STEPS
        return {
            "window": self.starts[index],
            "x": self.inputs[start:middle],
            "y": self.speed[middle : middle + OUTPUT_STEPS],
        }

    # toolkit.run.device_data: windows cut on the device from the whole table, moved there once
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.inputs, self.speed, self.starts))

    def on_device(self, device: torch.device):
        """The table on `device`; cut(positions) = the collated windows at those positions (1-D, on the device)."""
        inputs, speed, starts = self.inputs.to(device), self.speed.to(device), self.starts.to(device)
        steps_in = torch.arange(INPUT_STEPS, device=device)
        steps_out = torch.arange(INPUT_STEPS, INPUT_STEPS + OUTPUT_STEPS, device=device)

        def cut(positions: torch.Tensor) -> dict[str, torch.Tensor]:
            start = starts[positions]
            return {"window": start, "x": inputs[start[:, None] + steps_in], "y": speed[start[:, None] + steps_out]}

        return cut


@dataclass
class Scaler:
    """One scalar mean/std of speed (fitted on the training inputs' real readings; 0 = missing is left out)."""

    mean: float
    std: float

    def transform(self, mph: torch.Tensor) -> torch.Tensor:
        return (mph - self.mean) / self.std

    def inverse(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled * self.std + self.mean


@dataclass
class TrafficSplit:
    train: TrafficWindows
    valid: TrafficWindows
    test: TrafficWindows
    scaler: Scaler
    bounds: tuple[int, int, int, int]  # timestep boundaries 0 <= train < valid < test <= T
    speed: torch.Tensor  # [T, N] mph
    slot_of_week: torch.Tensor  # [T]


def part_bounds(num_timesteps: int) -> tuple[int, int, int, int]:
    train_end = round(num_timesteps * SPLIT[0])
    valid_end = train_end + round(num_timesteps * SPLIT[1])
    return 0, train_end, valid_end, num_timesteps


def minimum_timesteps() -> int:
    """The shortest table whose three parts each hold a window."""
    total = INPUT_STEPS + OUTPUT_STEPS
    while min(np.diff(part_bounds(total))) < INPUT_STEPS + OUTPUT_STEPS:
        total += 1
    return total


def window_starts(begin: int, end: int) -> torch.Tensor:
    """Starts of every window lying wholly inside timesteps [begin, end)."""
    return torch.arange(begin, max(begin, end - INPUT_STEPS - OUTPUT_STEPS + 1))


def split_windows(ds: datasets.Dataset) -> TrafficSplit:
    table = ds.with_format("torch")[:]  # every row: {column: tensor}
    speed = table["speed"].float()
    time_of_day = table["time_of_day"].float()
    bounds = part_bounds(len(speed))
    train_inputs = speed[: bounds[1] - OUTPUT_STEPS]  # every timestep some training window takes as input
    readings = train_inputs[train_inputs > 0].double()
    scaler = Scaler(mean=float(readings.mean()), std=float(readings.std(correction=0)) or 1.0)
    inputs = torch.stack([scaler.transform(speed), time_of_day[:, None].expand_as(speed)], dim=-1)
    parts = [TrafficWindows(inputs, speed, window_starts(bounds[i], bounds[i + 1])) for i in range(3)]
    return TrafficSplit(*parts, scaler=scaler, bounds=bounds, speed=speed, slot_of_week=table["slot_of_week"])


MIN_STEPS_PER_EPOCH = 10  # fewer optimizer steps an epoch than this is said in one line


def data_warnings(speed: torch.Tensor, meta: dict, *, batches: int = 0, grad_accum: int = 1,
                  batch_size: int = 0) -> list[str]:
    """One `warning:` line for each thing that trains without error but teaches little (the run goes on; the recipe
    prints them once, from the main process): a graph with no edges between sensors (an all-zero adjacency, or only
    its diagonal), sensors with no reading in the whole table, sensors that read one constant speed throughout, and
    a --grad-accum that leaves fewer than MIN_STEPS_PER_EPOCH optimizer steps an epoch (`batches` a process
    takes an epoch)."""
    where = f"--data {meta.get('source', '?')}"
    ids = meta["sensor_ids"]
    lines = []

    def sensors(chosen: np.ndarray) -> str:
        shown = ", ".join(ids[i] for i in chosen[:3]) + (", ..." if len(chosen) > 3 else "")
        return f"sensor{'s' if len(chosen) > 1 else ''} {shown} ({len(chosen)} of {len(ids)})"

    adjacency = np.asarray(meta["adjacency"], dtype=np.float64)
    between = adjacency * (1 - np.eye(len(adjacency)))
    if not (between > 0).any():
        what = "the adjacency is all zeros" if not (adjacency > 0).any() else "the adjacency has no edge between " \
            "two sensors (only its diagonal)"
        lines.append(f"warning: {where}: {what}: the graph diffusion carries nothing from one sensor to another, so "
                     "each is forecast from its own readings alone; check adj*.pkl")
    observed = speed > 0
    counts = observed.sum(dim=0)
    never = np.flatnonzero((counts == 0).numpy())
    if len(never):
        lines.append(f"warning: {where}: {sensors(never)} {'have' if len(never) > 1 else 'has'} no reading in the "
                     f"whole table (every speed 0 or NaN): never scored, and {'their' if len(never) > 1 else 'its'} "
                     "zeros are fed to the graph as inputs; drop them or check the table")
    low = torch.where(observed, speed, torch.full_like(speed, math.inf)).amin(dim=0)
    high = torch.where(observed, speed, torch.full_like(speed, -math.inf)).amax(dim=0)
    constant = np.flatnonzero(((counts > 1) & (low == high)).numpy())
    if len(constant):
        first = int(constant[0])
        lines.append(f"warning: {where}: {sensors(constant)} read{'' if len(constant) > 1 else 's'} one constant "
                     f"speed at every reading (e.g. {float(low[first]):g} mph at all {int(counts[first])}): a stuck "
                     "sensor or filled-in data, nothing there varies to forecast; check the table")
    if grad_accum > 1 and batches:
        steps = math.ceil(batches / grad_accum)
        if steps < MIN_STEPS_PER_EPOCH:
            lines.append(f"warning: --grad-accum {grad_accum} leaves {steps} optimizer step{'s' if steps > 1 else ''} "
                         f"an epoch ({batches} batches of --batch-size {batch_size}), fewer than "
                         f"{MIN_STEPS_PER_EPOCH}: the weights barely move; lower --grad-accum or --batch-size")
    return lines


# ----------------------------------------------------------------------------------------------------
# Baselines on the same windows, and the metrics layout shared with the recipe
# ----------------------------------------------------------------------------------------------------


def horizon_metrics(sums: torch.Tensor, prefix: str, interval_minutes: float) -> dict[str, float]:
    """{prefix_mae, prefix_rmse, prefix_mape, prefix_mae@15min, ...} from per-horizon sums [OUTPUT_STEPS, 5]."""
    from toolkit.run.metrics import error_metrics

    overall = error_metrics(sums.sum(dim=0))
    metrics = {f"{prefix}_{name}": overall[name] for name in ("mae", "rmse", "mape")}
    for horizon in HORIZONS:
        at = error_metrics(sums[horizon - 1])
        minutes = f"{horizon * interval_minutes:g}min"
        for name in ("mae", "rmse", "mape"):
            metrics[f"{prefix}_{name}@{minutes}"] = at[name]
    return metrics


def historical_average(split: TrafficSplit) -> torch.Tensor:
    """[slots per week, N]: the mean training reading of each sensor at each slot of the week (missing readings
    left out); a slot never observed falls back to the sensor's training mean."""
    begin, end = split.bounds[0], split.bounds[1]
    speed, slot = split.speed[begin:end].double(), split.slot_of_week[begin:end]
    slots = int(split.slot_of_week.max()) + 1
    observed = (speed > 0).double()
    sums = torch.zeros(slots, speed.shape[1], dtype=torch.float64).index_add_(0, slot, speed * observed)
    counts = torch.zeros_like(sums).index_add_(0, slot, observed)
    sensor_mean = (speed * observed).sum(0) / observed.sum(0).clamp_min(1)
    return torch.where(counts > 0, sums / counts.clamp_min(1), sensor_mean.expand_as(sums))


def baseline_forecasts(split: TrafficSplit, windows: TrafficWindows, table: torch.Tensor):
    """(historical average, last observed value) forecasts [W, OUTPUT_STEPS, N] in mph for the windows."""
    starts = windows.starts
    target_steps = starts[:, None] + INPUT_STEPS + torch.arange(OUTPUT_STEPS)
    average = table[split.slot_of_week[target_steps]]
    inputs = split.speed[starts[:, None] + torch.arange(INPUT_STEPS)].double()  # [W, 12, N]
    seen = inputs > 0
    newest = torch.where(seen, torch.arange(INPUT_STEPS)[None, :, None], -1).amax(dim=1)  # [W, N]
    last = inputs.gather(1, newest.clamp_min(0)[:, None, :]).squeeze(1)
    last = torch.where(newest >= 0, last, table.mean(dim=0).expand_as(last))  # nothing seen: the sensor's mean
    return average, last[:, None, :].expand(-1, OUTPUT_STEPS, -1)


def baseline_metrics(split: TrafficSplit, windows: TrafficWindows, prefix: str, interval_minutes: float) -> dict:
    """{"historical_average": metrics, "last_value": metrics} on the windows, masked like the model's metrics."""
    average, last = baseline_forecasts(split, windows, historical_average(split))
    target = split.speed[windows.starts[:, None] + INPUT_STEPS + torch.arange(OUTPUT_STEPS)]
    return {
        name: horizon_metrics(masked_error_sums(forecast, target, keep_dims=1), prefix, interval_minutes)
        for name, forecast in (("historical_average", average), ("last_value", last))
    }


# ----------------------------------------------------------------------------------------------------
# The generator: a road network and its speeds
# ----------------------------------------------------------------------------------------------------

START = pd.Timestamp("2012-03-01 00:00:00")  # METR-LA's first reading
INTERVAL_MIN = 5
PER_DAY = 24 * 60 // INTERVAL_MIN


def _road_network(sensors: int, rng: np.random.Generator):
    """Sensors along a few one-way roads crossing a 30 x 30 km area; the directed road distance between them
    (along a road downstream, and across where roads pass within 1.5 km: interchanges)."""
    roads = max(2, round(math.sqrt(sensors) / 1.6))
    owner = np.sort(np.arange(sensors) % roads)
    position = np.zeros(sensors)
    coordinates = np.zeros((sensors, 2))
    for road in range(roads):
        members = np.flatnonzero(owner == road)
        angle = rng.uniform(0, np.pi)
        direction = np.array([np.cos(angle), np.sin(angle)]) * rng.choice([-1, 1])
        centre = rng.uniform(-6, 6, size=2)
        length = rng.uniform(24, 34)
        along = np.sort(rng.uniform(0, length, size=len(members)))
        position[members] = along
        coordinates[members] = (
            centre + (along - length / 2)[:, None] * direction + rng.normal(0, 0.05, (len(members), 2))
        )
    distance = np.full((sensors, sensors), np.inf)
    np.fill_diagonal(distance, 0.0)
    for road in range(roads):
        members = np.flatnonzero(owner == road)  # sorted by position: traffic flows to higher positions
        for a, b in zip(members[:-1], members[1:], strict=True):
            distance[a, b] = position[b] - position[a]
    euclid = np.linalg.norm(coordinates[:, None] - coordinates[None], axis=-1)
    interchange = (euclid < 1.5) & (owner[:, None] != owner[None, :])
    distance[interchange] = np.minimum(distance[interchange], euclid[interchange])
    for k in range(sensors):  # Floyd-Warshall: shortest directed road distances
        distance = np.minimum(distance, distance[:, k : k + 1] + distance[k : k + 1, :])
    distance[distance > 12.0] = np.inf  # like METR-LA's distance list, which holds nearby pairs only
    return owner, position, distance


def gaussian_adjacency(distance: np.ndarray, cut: float = 0.1) -> np.ndarray:
    """exp(-(d / sigma)^2), sigma = the std of the finite distances, weights below `cut` set to 0 (DCRNN)."""
    finite = distance[np.isfinite(distance)]
    sigma = finite.std() or 1.0
    adjacency = np.exp(-np.square(distance / sigma))
    adjacency[adjacency < cut] = 0.0
    return adjacency


def generate(sensors: int, days: int, seed: int = 0, progress: bool = True):
    """(speed table, sensor_ids, adjacency): a deterministic function of the arguments.

    Speeds: free flow 58-70 mph per sensor; morning and evening rush hours on weekdays (weaker on weekends) whose
    congestion starts at a few bottlenecks and travels upstream along the directed road graph at ~18 km/h (so
    a sensor 6 km upstream slows ~20 minutes later), with a different intensity every day; incidents (a sudden
    drop lasting 20-90 minutes whose queue grows upstream); AR(1) sensor noise. Missing readings are 0: whole
    sensor-days down, outages of 30 minutes to 6 hours, and single dropped readings (about 8% in all, like
    METR-LA's 8.1%).
    """
    rng = np.random.default_rng(seed)
    owner, _, distance = _road_network(sensors, rng)
    adjacency = gaussian_adjacency(distance)
    sensor_ids = [str(i) for i in rng.choice(np.arange(700000, 800000), size=sensors, replace=False)]
    free_flow = rng.uniform(58, 70, size=sensors)
    bottlenecks = rng.choice(sensors, size=max(1, sensors // 10), replace=False)
    wave_kmh, reach_km = 18.0, 8.0
    upstream = distance[:, bottlenecks]  # [N, B] road distance from each sensor down to each bottleneck
    delay_steps = upstream / wave_kmh * 60 / INTERVAL_MIN
    strength = np.where(np.isfinite(upstream), np.exp(-upstream / reach_km), 0.0)
    delay_steps = np.where(np.isfinite(delay_steps), delay_steps, 0.0)
    capacity_drop = rng.uniform(0.35, 0.7, size=sensors)

    total = days * PER_DAY
    speed = np.empty((total, sensors))
    noise = np.zeros(sensors)
    step_of_day = np.arange(PER_DAY)[:, None, None]  # [S, 1, 1]
    incidents = rng.poisson(max(days * sensors / 60.0, 1.0))
    incident_start = rng.integers(0, total, size=incidents)
    incident_at = rng.integers(0, sensors, size=incidents)
    incident_steps = rng.integers(4, 18, size=incidents)
    incident_severity = rng.uniform(0.3, 0.8, size=incidents)
    for day in tqdm(range(days), desc="generating speeds", unit="day", disable=not progress):
        weekday = (START + pd.Timedelta(days=day)).day_of_week
        weekend = weekday >= 5
        hours = (step_of_day - delay_steps[None]) * INTERVAL_MIN / 60.0  # local clock shifted by the wave delay
        peaks = (0.25, 0.35) if weekend else (rng.uniform(0.6, 1.3), rng.uniform(0.7, 1.4))
        centres = (8.0 + rng.normal(0, 0.25), 17.5 + rng.normal(0, 0.3))
        widths = (rng.uniform(0.8, 1.2), rng.uniform(1.0, 1.5))
        intensity = rng.uniform(0.6, 1.2, size=len(bottlenecks))
        wave = sum(p * np.exp(-0.5 * ((hours - c) / w) ** 2) for p, c, w in zip(peaks, centres, widths, strict=True))
        if weekend:
            wave = wave + 0.3 * np.exp(-0.5 * ((hours - 13.5) / 2.0) ** 2)
        congestion = np.clip((wave * strength[None] * intensity).max(axis=2), 0, 1)  # [S, N]
        day_speed = free_flow * (1 - capacity_drop * congestion)
        for t in range(PER_DAY):  # AR(1) noise, continuous across days
            noise = 0.85 * noise + rng.normal(0, 1.2, size=sensors)
            day_speed[t] += noise
        speed[day * PER_DAY : (day + 1) * PER_DAY] = day_speed
    for start, at, steps, severity in zip(incident_start, incident_at, incident_steps, incident_severity, strict=True):
        reach = np.flatnonzero(np.isfinite(distance[:, at]) & (distance[:, at] < 5.0))  # upstream of the incident
        for sensor in reach:
            lag = int(round(distance[sensor, at] / wave_kmh * 60 / INTERVAL_MIN))
            begin, end = start + lag, min(total, start + lag + steps)
            speed[begin:end, sensor] *= 1 - severity * math.exp(-distance[sensor, at] / 2.5)
    speed = np.clip(speed, 3.0, 75.0).round(3)
    missing = np.zeros_like(speed, dtype=bool)
    sensor_days = rng.random((days, sensors)) < 0.045
    missing |= np.repeat(sensor_days, PER_DAY, axis=0)
    outages = rng.poisson(0.15 * days * sensors)
    for begin, sensor, length in zip(
        rng.integers(0, total, outages), rng.integers(0, sensors, outages), rng.integers(6, 72, outages), strict=True
    ):
        missing[begin : begin + length, sensor] = True
    missing |= rng.random(speed.shape) < 0.015
    speed[missing] = 0.0
    index = pd.date_range(START, periods=total, freq=f"{INTERVAL_MIN}min")
    return pd.DataFrame(speed, index=index, columns=sensor_ids), sensor_ids, adjacency


def write_dataset(
    out: Path, frame: pd.DataFrame, sensor_ids: list[str], adjacency: np.ndarray, speeds_name: str = "metr-la.h5"
) -> tuple[Path, Path]:
    """The two files in the real formats: <out>/metr-la.h5 (key "df") and <out>/adj_mx.pkl."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    speeds_path, adjacency_path = out / speeds_name, out / "adj_mx.pkl"
    extras.require("traffic")
    frame.to_hdf(speeds_path, key=SPEEDS_KEY, mode="w")
    with open(adjacency_path, "wb") as handle:
        pickle.dump(
            [sensor_ids, {s: i for i, s in enumerate(sensor_ids)}, adjacency.astype(np.float32)], handle, protocol=2
        )
    return speeds_path, adjacency_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.data.traffic", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    synth = commands.add_parser("synth", help="write a generated road network in the METR-LA formats")
    synth.add_argument("--out", type=Path, required=True, help="directory for metr-la.h5 and adj_mx.pkl")
    synth.add_argument("--sensors", type=int, default=207, help="number of sensors (METR-LA: 207)")
    synth.add_argument("--days", type=int, default=120, help="days of 5-minute readings (METR-LA: 119)")
    synth.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problems = []
    if args.sensors < 2:
        problems.append(f"--sensors {args.sensors} is invalid; give at least 2")
    if args.days < 2:
        problems.append(f"--days {args.days} is invalid; give at least 2 (the 10% validation part needs a window)")
    if not 0 <= args.seed < 2**32:
        problems.append(f"--seed {args.seed} is invalid; give an integer in 0 .. {2**32 - 1}")
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out} is a file; give a directory")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    frame, sensor_ids, adjacency = generate(args.sensors, args.days, args.seed)
    speeds_path, adjacency_path = write_dataset(args.out, frame, sensor_ids, adjacency)
    print(
        f"wrote {speeds_path} ({len(frame)} timesteps x {len(sensor_ids)} sensors, "
        f"{(frame.to_numpy() == 0).mean():.1%} missing) and {adjacency_path} "
        f"({int((adjacency > 0).sum())} nonzero weights)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
