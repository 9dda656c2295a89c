"""A search against a grid of the same size: SASRec on MovieLens-100K, 16 TPE trials with median pruning
(`python -m toolkit sweep --search`) against a 4 x 4 grid of the same two flags (`--grid`), each through the real
command; prints each side's best validation NDCG@10 (the recipe's main metric at its best step) and wall time.

    python benchmarks/search_vs_grid.py [--out DIR] [--epochs 20] [--trials 16] [--runs-per-device N] [-- FLAGS]

The search's ranges hold the grid's values (lr 1e-4..1e-2 log-uniform, dropout 0..0.5), so the comparison is of how
the 16 runs are spent: the grid spreads them evenly, the search spends them where the finished trials point and
ends trials that are behind the median at an evaluation. Minutes to hours on a CPU: size it with --epochs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRIC = "val_sampled_ndcg@10"
GRID = ["lr=1e-4,3e-4,1e-3,3e-3", "dropout=0,0.2,0.35,0.5"]
SEARCH = ["lr=log:1e-4:1e-2", "dropout=0:0.5"]


def sweep(kind: list[str], out: Path, common: list[str], runs_per_device: int) -> float:
    """Run one sweep command to its end; its wall time in seconds."""
    command = [sys.executable, "-m", "toolkit", "sweep", "recipes/sasrec.py", *kind, "--out", str(out),
               "--runs-per-device", str(runs_per_device), "--", *common]
    began = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - began


def best(out: Path) -> tuple[float, str]:
    """The best main metric over the sweep's finished, unpruned runs, and the run's name."""
    found = []
    for summary in (out / "runs").glob("*/summary.json"):
        data = json.loads(summary.read_text())
        if (data.get("stop_reason") or "").startswith("pruned"):
            continue
        value = (data.get("best_metrics") or {}).get(METRIC)
        if value is not None:
            found.append((float(value), summary.parent.name))
    return max(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="where both sweeps go (default: a new temp dir)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--trials", type=int, default=16, help="the search's trials (the grid has 16 runs)")
    parser.add_argument("--runs-per-device", type=int, default=1, metavar="N")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="search-vs-grid-"))
    common = ["--epochs", str(args.epochs), "--eval-every", "1", "--log-with", "none", *extra]
    sys.path.insert(0, str(ROOT))
    from toolkit.run.precision import cpu_kind

    machine = cpu_kind(threads="the recipe's")
    print(f"CPU: {machine}; {args.runs_per_device} run(s) at a time", flush=True)
    grid_time = sweep(["--grid", *GRID], out / "grid", common, args.runs_per_device)
    search_time = sweep(["--search", *SEARCH, "--trials", str(args.trials), "--metric", METRIC, "--direction", "max",
                         "--prune", "median"], out / "search", common, args.runs_per_device)
    pruned = sum((json.loads(p.read_text()).get("stop_reason") or "").startswith("pruned")
                 for p in (out / "search" / "runs").glob("*/summary.json"))
    for name, seconds, extra_note in (("grid", grid_time, "16 runs"),
                                      ("search", search_time, f"{args.trials} trials, {pruned} pruned")):
        value, run = best(out / name)
        print(f"{name:6s}  best {METRIC} {value:.4f} ({run})  wall {seconds:,.0f} s  ({extra_note})")
    print(f"sweeps in {out}; python -m toolkit compare {out / 'search'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
