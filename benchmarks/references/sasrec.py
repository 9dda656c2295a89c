"""Our SASRec recipe against pmixer/SASRec.pytorch (`python/main.py`), per-epoch training time side by side.

    git clone https://github.com/pmixer/SASRec.pytorch /path/to/SASRec.pytorch      # once; nothing is fetched here
    python benchmarks/references/sasrec.py --reference /path/to/SASRec.pytorch [--maxlen 200] [--epochs 3]

Both train the same model (d 50, 2 blocks, 1 head, dropout 0.2, Adam 1e-3 (0.9, 0.98), batch 128, fp32, --maxlen)
on the same MovieLens-100K sequences: ours as prepared by toolkit/data/movielens.py (from --cache-dir), written in
the reference's format (data/<name>.txt, one `user item` line per rating, users and items numbered from 1, each
user's lines in time order; both split them leave-one-out). The reference's python/*.py are copied into a
temporary directory and run there unchanged with `--device cpu` (it writes its logs and weights into its working
directory, never into the checkout). Rounds alternate the order of the two.

Per-epoch training seconds: ours from the run's metrics.csv (all epochs, the checkpoint saved at every epoch end
and the first epoch's warm-up included; evaluation once, at the end, not timed); the reference's from the arrival
times of the loss line it prints after every step (from its last line before training to the last step of each
epoch; an epoch that follows one of its evaluations, every 20 epochs, is left out). Ours drops the last partial
batch (7 steps per epoch on ML-100K), the reference samples 8 batches per epoch: both ratios are printed, per
epoch and per step. At --epochs 20 (or a multiple), both validation NDCG@10 at the last epoch are printed too.
"""

from __future__ import annotations

import argparse
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

REPOSITORY = "pmixer/SASRec.pytorch"
TRAINING_SCRIPT = "python/main.py"
DATASET_NAME = "ml-100k-ours"
STEP_LINE = re.compile(r"loss in epoch (\d+) iteration (\d+):")
EVALUATION_LINE = re.compile(r"epoch:(\d+), time: ([0-9.]+)\(s\), valid \(NDCG@10: ([0-9.]+), HR@10: ([0-9.]+)\)")
EVALUATION_EVERY = 20  # the reference evaluates (and may save) after every 20th epoch


def write_reference_data(cache_dir: Path, folder: Path) -> None:
    """Our prepared MovieLens-100K as the reference's data/<name>.txt."""
    from toolkit.data.movielens import prepare_movielens  # heavy (datasets, torch): only once the checks passed
    from toolkit.errors import UsageError

    try:
        sequences, _ = prepare_movielens("ml-100k", None, cache_dir)
    except UsageError as error:
        usage_error(str(error))
    table = sequences.with_format("python")[:]
    folder.mkdir(parents=True)
    with open(folder / f"{DATASET_NAME}.txt", "w") as handle:
        for user, items in zip(table["user"], table["items"], strict=True):
            handle.writelines(f"{user + 1} {item}\n" for item in items)


def reference_epoch_time(output) -> EpochTime:
    """Per-epoch training seconds of the reference from its lines' arrival times (see the module's docstring)."""
    start = output.first("average sequence length")
    epoch_end: dict[int, float] = {}
    steps: dict[int, int] = {}
    evaluated: dict[int, float] = {}
    for stamp, line in output.lines:
        if match := STEP_LINE.match(line):
            epoch = int(match[1])
            epoch_end[epoch] = stamp
            steps[epoch] = steps.get(epoch, 0) + 1
        if match := EVALUATION_LINE.search(line):
            evaluated[int(match[1])] = float(match[3])
    durations, previous = [], start
    for epoch in sorted(epoch_end):
        if epoch - 1 not in evaluated:
            durations.append(epoch_end[epoch] - previous)
        previous = epoch_end[epoch]
    quality = {f"val NDCG@10 at epoch {max(evaluated)}": evaluated[max(evaluated)]} if evaluated else {}
    return EpochTime(sum(durations) / len(durations), steps[1], quality)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", type=Path, help=f"a checkout of {REPOSITORY}")
    parser.add_argument("--maxlen", type=int, default=200, help="longest history (the reference's default: 200)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (20: also validation NDCG@10)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads of each (0: torch's default)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("~/.cache/accelerate-recipes"),
        help="our recipe's --cache-dir, holding the prepared MovieLens-100K",
    )
    parser.add_argument("--keep", type=Path, help="keep both runs' outputs and logs here (default: removed)")
    args = parser.parse_args()
    reference = require_checkout(args.reference, TRAINING_SCRIPT, REPOSITORY)
    for name in ("maxlen", "epochs", "rounds"):
        if getattr(args, name) < 1:
            usage_error(f"--{name} {getattr(args, name)} is invalid; give an integer >= 1")
    if args.threads < 0:
        usage_error(f"--threads {args.threads} is invalid; give 0 (each program's default) or more")
    cache_dir = args.cache_dir.expanduser()
    workdir = Path(tempfile.mkdtemp(prefix="sasrec-reference-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    environment = thread_settings(args.threads)
    settings = {"maxlen": args.maxlen, "hidden": 50, "blocks": 2, "heads": 1, "dropout": 0.2, "lr": 1e-3, "batch": 128}
    print(
        f"SASRec {settings}, fp32, {args.epochs} epoch(s) per run, {args.rounds} round(s), threads "
        f"{args.threads or 'default'}; work in {workdir}",
        flush=True,
    )

    # The reference's scripts, copied: it reads data/<name>.txt and writes <name>_<train_dir>/ in its working dir.
    copy = workdir / "reference"
    copy.mkdir(exist_ok=True)
    for script in (reference / "python").glob("*.py"):
        shutil.copy2(script, copy / script.name)
    if not (copy / "data" / f"{DATASET_NAME}.txt").exists():
        write_reference_data(cache_dir, copy / "data")

    def ours(index: int) -> EpochTime:
        run_dir = workdir / f"ours-{index}"
        command = [
            sys.executable,
            str(PROJECT_ROOT / "recipes" / "sasrec.py"),
            "--maxlen",
            str(args.maxlen),
            "--hidden",
            "50",
            "--blocks",
            "2",
            "--heads",
            "1",
            "--dropout",
            "0.2",
            "--lr",
            "0.001",
            "--batch-size",
            "128",
            "--epochs",
            str(args.epochs),
            "--eval-every",
            str(args.epochs),
            "--log-with",
            "none",
            "--seed",
            str(index),
            "--cache-dir",
            str(cache_dir),
            "--output-dir",
            str(run_dir),
        ] + (["--threads", str(args.threads)] if args.threads else [])
        run_timed("our recipe", command, PROJECT_ROOT, environment, workdir / f"ours-{index}.log")
        return our_epoch_time(run_dir, args.epochs, ("val_sampled_ndcg@10",))

    def theirs(index: int) -> EpochTime:
        command = [
            sys.executable,
            "main.py",
            "--dataset",
            DATASET_NAME,
            "--train_dir",
            f"bench{index}",
            "--device",
            "cpu",
            "--maxlen",
            str(args.maxlen),
            "--hidden_units",
            "50",
            "--num_blocks",
            "2",
            "--num_heads",
            "1",
            "--dropout_rate",
            "0.2",
            "--lr",
            "0.001",
            "--batch_size",
            "128",
            "--num_epochs",
            str(args.epochs),
        ]
        output = run_timed("the reference", command, copy, environment, workdir / f"reference-{index}.log")
        return reference_epoch_time(output)

    report(alternate(args.rounds, {"ours": ours, "reference": theirs}), args.threads)
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
