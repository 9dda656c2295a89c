"""Training throughput of the SASRec recipe and the share of step time spent waiting for data.

    python benchmarks/sasrec_throughput.py [--epochs 4] [recipe flags...]
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml benchmarks/sasrec_throughput.py

Runs the real recipe (default model, MovieLens-100K) for a few epochs, evaluating only at the end, and reads
the last epoch's row of metrics.csv (the first epochs include warm-up). Goal: data wait under 5% of step time.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))

import sasrec  # noqa: E402


def sasrec_threads(flags: list[str]) -> str:
    """The run's intra-op threads as its flags give them (else the recipe's default)."""
    return flags[flags.index("--threads") + 1] if "--threads" in flags[:-1] else "the recipe's default"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", default="4", help="epochs to train; the last one is reported")
    known, recipe_flags = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="sasrec-throughput-")) / "run"
    args = ["--epochs", known.epochs, "--eval-every", known.epochs, "--log-with", "none", "--output-dir", str(out)]
    sasrec.main([*args, *recipe_flags])
    if not (out / "metrics.csv").exists():
        return  # not the main process
    row = list(csv.DictReader(open(out / "metrics.csv")))[-1]
    epoch_time = float(row["epoch_time_sec"])
    data_wait = float(row["data_load_time_sec"])
    from toolkit.run.precision import cpu_kind

    print(f"CPU: {cpu_kind(threads=sasrec_threads(recipe_flags))}")
    print(f"world size {row['world_size']}: {float(row['throughput_samples_per_sec']):.0f} training sequences/s "
          f"(epoch {row['epoch']}: {epoch_time:.2f} s), data wait {100 * data_wait / epoch_time:.2f}% of step time "
          "(goal < 5%)")


if __name__ == "__main__":
    main()
