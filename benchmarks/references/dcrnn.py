"""Our DCRNN recipe (cpu preset) against chnsh/DCRNN_PyTorch (`dcrnn_train_pytorch.py`), per-epoch training time
side by side, same sizes, same training windows.

    git clone https://github.com/chnsh/DCRNN_PyTorch /path/to/DCRNN_PyTorch      # once; nothing is fetched here
    python benchmarks/references/dcrnn.py --reference /path/to/DCRNN_PyTorch [--data DIR] [--threads 1] [--epochs 1]

--data: a directory from `python -m toolkit.data.traffic synth` (or METR-LA's files); without it, a 50-sensor
network of --days days is generated into the work directory. Both train 2 DCGRU layers of 16 units, K=2 dual random
walk, batch 64, Adam 0.01 (eps 1e-3), clip 5, scheduled sampling decay 80 steps (our `cpu` preset), on the same
windows: our split_windows() (70/10/20 in time, no window across a boundary) written as the reference's
data/<name>/{train,val,test}.npz (x, y: [windows, 12, sensors, 2], speed in mph and time of day) with the adjacency
pickle in the table's sensor order. --threads sets the intra-op threads of both (1: the cpu preset's), each with
the OpenMP wait policy the toolkit chooses for this machine's load (toolkit/process/openmp.py: PASSIVE when busy,
libgomp's
spin when idle; an exported OMP_WAIT_POLICY is used as given).

The reference needs scipy and tensorboard besides torch, numpy, pandas and PyYAML (give its interpreter with
--python if this one lacks them). It is copied into a temporary directory (it writes runs/, models/ and its logs
into its working directory) and two lines are changed there, without which it does not start today:
dcrnn_train_pytorch.py calls yaml.load(f) without a Loader (an error since PyYAML 6), and lib/utils.py imports
tensorflow at the top for two TF-only helpers that the PyTorch training never calls. Nothing else is changed: its
masking and its learning-rate schedule are left as they are (they do not change a step's work).

Per-epoch training seconds: ours from the run's metrics.csv (see side_by_side.our_epoch_time); the reference's from
the arrival times of its log lines, from the last line before an epoch's first step to its "epoch complete" line
(its own "{x}s" figure also holds the validation pass). Ours drops the last partial batch, the reference pads it:
both ratios are printed, per epoch and per step.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from side_by_side import (
    PROJECT_ROOT,
    EpochTime,
    alternate,
    our_epoch_time,
    report,
    require_checkout,
    run_timed,
    thread_settings,
    usage_error,
)

REPOSITORY = "chnsh/DCRNN_PyTorch"
TRAINING_SCRIPT = "dcrnn_train_pytorch.py"
DATASET_NAME = "OURS"
# (file, text in the reference, what the temporary copy gets instead): what today's packages need.
PATCHES = (
    (TRAINING_SCRIPT, "yaml.load(f)", "yaml.safe_load(f)"),
    ("lib/utils.py", "import tensorflow as tf\n", ""),
)
EPOCH_START_LINES = ("num_batches:", "Epoch [", "Saved model at", "Val loss decrease")  # the last one before a step
BATCHES_LINE = re.compile(r"num_batches:(\d+)")
VALIDATION_LINE = re.compile(r"Epoch \[(\d+)/\d+\] \(\d+\) train_mae: ([0-9.]+), val_mae: ([0-9.]+)")


def copy_reference(reference: Path, copy: Path) -> None:
    """The reference's code in `copy`, with PATCHES applied; a checkout that differs there is refused."""
    shutil.copytree(reference, copy, ignore=shutil.ignore_patterns(".git", "figures", "data"))
    for name, before, after in PATCHES:
        text = (copy / name).read_text()
        if before not in text:
            usage_error(
                f"--reference {reference}: {name} does not hold {before.strip()!r}; this script knows the "
                "reference at commit d92490b (2019-11-03)"
            )
        (copy / name).write_text(text.replace(before, after, 1))


def write_reference_data(data: Path, cache_dir: Path, copy: Path, epochs: int) -> int:
    """Our windows, adjacency and cpu-preset sizes in the reference's formats; returns the number of sensors."""
    import pickle  # heavy imports below (pandas, datasets, torch): only once the checks passed

    import numpy as np
    import yaml

    from toolkit.data.traffic import INPUT_STEPS, OUTPUT_STEPS, prepare_traffic, split_windows
    from toolkit.errors import UsageError

    try:
        table, meta = prepare_traffic(data, cache_dir)
    except UsageError as error:
        usage_error(str(error))
    split = split_windows(table)
    speed = split.speed.numpy()
    time_of_day = np.asarray(table["time_of_day"], dtype=np.float32)
    features = np.stack([speed, np.broadcast_to(time_of_day[:, None], speed.shape)], axis=-1)  # [T, N, 2]
    folder = copy / "data" / DATASET_NAME
    folder.mkdir(parents=True)
    for name, windows in (("train", split.train), ("val", split.valid), ("test", split.test)):
        starts = windows.starts.numpy()[:, None]
        x = features[starts + np.arange(INPUT_STEPS)]
        y = features[starts + INPUT_STEPS + np.arange(OUTPUT_STEPS)]
        np.savez(
            folder / f"{name}.npz",
            x=x,
            y=y,
            x_offsets=np.arange(-INPUT_STEPS + 1, 1)[:, None],
            y_offsets=np.arange(1, OUTPUT_STEPS + 1)[:, None],
        )
    graph = copy / "data" / "sensor_graph" / "adj_ours.pkl"
    graph.parent.mkdir(parents=True)
    ids = meta["sensor_ids"]
    with open(graph, "wb") as handle:  # the table's sensor order, as the windows' columns
        pickle.dump([ids, {s: i for i, s in enumerate(ids)}, np.asarray(meta["adjacency"], np.float32)], handle)
    config = {
        "base_dir": "logs",
        "log_level": "INFO",
        "data": {
            "batch_size": 64,
            "dataset_dir": f"data/{DATASET_NAME}",
            "test_batch_size": 64,
            "val_batch_size": 64,
            "graph_pkl_filename": "data/sensor_graph/adj_ours.pkl",
        },
        "model": {
            "cl_decay_steps": 80,
            "filter_type": "dual_random_walk",
            "horizon": OUTPUT_STEPS,
            "input_dim": 2,
            "l1_decay": 0,
            "max_diffusion_step": 2,
            "num_nodes": len(ids),
            "num_rnn_layers": 2,
            "output_dim": 1,
            "rnn_units": 16,
            "seq_len": INPUT_STEPS,
            "use_curriculum_learning": True,
        },
        "train": {
            "base_lr": 0.01,
            "dropout": 0,
            "epoch": 0,
            "epochs": epochs,
            "epsilon": 1.0e-3,
            "global_step": 0,
            "lr_decay_ratio": 0.1,
            "max_grad_norm": 5,
            "max_to_keep": 100,
            "min_learning_rate": 2.0e-6,
            "optimizer": "adam",
            "patience": 50,
            "steps": [4],
            "test_every_n_epochs": 10,
        },
    }
    (copy / "data" / "model").mkdir(parents=True)
    (copy / "data" / "model" / "ours.yaml").write_text(yaml.safe_dump(config))
    return len(ids)


def generate_network(out: Path, days: int) -> Path:
    from toolkit.data.traffic import generate, write_dataset

    print(f"generating a 50-sensor network of {days} days into {out} ...", flush=True)
    frame, sensor_ids, adjacency = generate(50, days, seed=0, progress=False)
    write_dataset(out, frame, sensor_ids, adjacency)
    return out


def reference_epoch_time(output) -> EpochTime:
    """Per-epoch training seconds of the reference from its log lines' arrival times."""
    durations, anchor, batches, quality = [], None, None, {}
    for stamp, line in output.lines:
        message = line.split(" - ")[-1]
        if match := BATCHES_LINE.match(message):
            batches = int(match[1])
        if message.startswith(EPOCH_START_LINES):
            anchor = stamp
        elif message == "epoch complete":
            durations.append(stamp - anchor)
        if match := VALIDATION_LINE.match(message):
            quality = {f"val MAE at epoch {int(match[1]) + 1} (its own metric)": float(match[3])}
    return EpochTime(sum(durations) / len(durations), batches, quality)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help=f"a checkout of {REPOSITORY}")
    parser.add_argument("--data", type=Path, help="our traffic data directory (default: generate one)")
    parser.add_argument("--days", type=int, default=28, help="days of the generated network (without --data)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each (1: the cpu preset's)")
    parser.add_argument(
        "--python",
        type=Path,
        default=Path(sys.executable),
        help="the interpreter for the reference (needs scipy and tensorboard)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=Path("~/.cache/accelerate-recipes"), help="our recipe's --cache-dir"
    )
    parser.add_argument("--keep", type=Path, help="keep both runs' outputs and logs here (default: removed)")
    args = parser.parse_args()
    reference = require_checkout(args.reference, TRAINING_SCRIPT, REPOSITORY)
    for name in ("days", "epochs", "rounds", "threads"):
        if getattr(args, name) < 1:
            usage_error(f"--{name} {getattr(args, name)} is invalid; give an integer >= 1")
    if args.data is not None and not args.data.expanduser().is_dir():
        usage_error(
            f"--data {args.data} is not a directory; make one with "
            "`python -m toolkit.data.traffic synth --out DIR --sensors 50 --days 28`"
        )
    if not args.python.expanduser().is_file():
        usage_error(f"--python {args.python} does not exist; give the interpreter that has the reference's packages")
    cache_dir = args.cache_dir.expanduser()
    workdir = Path(tempfile.mkdtemp(prefix="dcrnn-reference-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    data = args.data.expanduser() if args.data else workdir / "network"
    if args.data is None and not (data / "metr-la.h5").exists():
        generate_network(data, args.days)
    copy = workdir / "reference"
    shutil.rmtree(copy, ignore_errors=True)  # a kept work directory: the reference's copy is made afresh
    copy_reference(reference, copy)
    sensors = write_reference_data(data, cache_dir, copy, args.epochs)
    # The same OpenMP wait policy for both: the one begin_process() chose for this process by the machine's load
    # (spinning workers on a shared machine stalled both sides at 2 threads: 42 s a step instead of 0.27 s; on an
    # idle one, sleeping workers make a second thread cost instead of help). A no-op at 1 thread.
    from toolkit.process import begin_process

    begin_process()  # sets OMP_WAIT_POLICY when the machine is busy

    policy = os.environ.get("OMP_WAIT_POLICY")
    environment = {**thread_settings(args.threads), **({"OMP_WAIT_POLICY": policy} if policy else {})}
    print(
        f"DCRNN 2x16, K=2, batch 64, {sensors} sensors ({data}), {args.epochs} epoch(s) per run, "
        f"{args.rounds} round(s), {args.threads} thread(s) each, OpenMP wait policy "
        f"{policy or 'libgomp default (spin)'}; work in {workdir}",
        flush=True,
    )

    def ours(index: int) -> EpochTime:
        run_dir = workdir / f"ours-{index}"
        command = [
            sys.executable,
            str(PROJECT_ROOT / "recipes" / "dcrnn.py"),
            "--data",
            str(data),
            "--epochs",
            str(args.epochs),
            "--eval-every",
            str(args.epochs),
            "--threads",
            str(args.threads),
            "--log-with",
            "none",
            "--seed",
            str(index),
            "--cache-dir",
            str(cache_dir),
            "--output-dir",
            str(run_dir),
        ]
        run_timed("our recipe", command, PROJECT_ROOT, environment, workdir / f"ours-{index}.log")
        return our_epoch_time(run_dir, args.epochs, ("val_mae",))

    def theirs(index: int) -> EpochTime:
        command = [str(args.python), TRAINING_SCRIPT, "--config_filename", "data/model/ours.yaml"]
        output = run_timed("the reference", command, copy, environment, workdir / f"reference-{index}.log")
        return reference_epoch_time(output)

    report(alternate(args.rounds, {"ours": ours, "reference": theirs}), args.threads)
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
