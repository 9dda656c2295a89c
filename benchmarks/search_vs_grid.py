"""A search against a grid of the same size: SASRec on MovieLens-100K, 16 TPE trials with median pruning
(`python -m toolkit sweep --search`) against a 4 x 4 grid of the same two flags (`--grid`), each through the real
command; prints each side's best validation NDCG@10 (the recipe's main metric at its best step) and wall time.

    python benchmarks/search_vs_grid.py [--out DIR] [--epochs 20] [--trials 16] [--one-after-the-other] [-- FLAGS]

Both cover the same ranges (lr 1e-4..1e-2 on a log scale, dropout 0..0.5), so the comparison is of how the 16 runs
are spent: the grid spreads them evenly (lr 1e-4, 4.6e-4, 2.2e-3, 1e-2 by dropout 0, 0.17, 0.33, 0.5), the search
spends them where the finished trials point and ends trials that are behind the median at an evaluation. Both
sweeps run at once, each on its own core with one thread, so the machine's noise falls on both alike
(--one-after-the-other: each with the whole machine in turn).
About 10 minutes on 2 cores at 20 epochs: size it with --epochs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRIC = "val_sampled_ndcg@10"
# The same ranges: the grid's values evenly spaced over them (lr on a log scale), 4 x 4 = 16 runs
GRID = ["--grid", "lr=1e-4,4.6e-4,2.2e-3,1e-2", "dropout=0,0.17,0.33,0.5"]
SEARCH = ["--search", "lr=log:1e-4:1e-2", "dropout=0:0.5", "--metric", METRIC, "--direction", "max",
          "--prune", "median"]


def start(kind: list[str], out: Path, common: list[str], core: int | None) -> subprocess.Popen:
    """Start one sweep command (on one core when given), its output in out.log."""
    command = [sys.executable, "-m", "toolkit", "sweep", "recipes/sasrec.py", *kind, "--out", str(out), "--",
               *common]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None)


def finish(process: subprocess.Popen, began: float) -> float:
    """Wait for a sweep to end; its wall time in seconds since `began`."""
    if process.wait() != 0:
        raise SystemExit(f"{' '.join(process.args)} failed (exit {process.returncode}); see its log")
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
    parser.add_argument("--one-after-the-other", action="store_true",
                        help="the grid, then the search, each with the whole machine")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="search-vs-grid-"))
    common = ["--epochs", str(args.epochs), "--eval-every", "1", "--log-with", "none", *extra]
    sys.path.insert(0, str(ROOT))
    from toolkit.run.precision import cpu_kind

    cores = sorted(os.sched_getaffinity(0))
    side_by_side = len(cores) >= 2 and not args.one_after_the_other
    search = [*SEARCH, "--trials", str(args.trials)]
    if side_by_side:  # each sweep on its own core, one thread each
        print(f"CPU: {cpu_kind(threads=1)}; the two sweeps side by side, one core each", flush=True)
        common += ["--threads", "1"]
        began = time.perf_counter()
        running = start(GRID, out / "grid", common, cores[0]), start(search, out / "search", common, cores[1])
        with concurrent.futures.ThreadPoolExecutor(2) as waiting:  # each sweep's own end, whichever ends first
            grid_time, search_time = waiting.map(lambda process: finish(process, began), running)
    else:
        print(f"CPU: {cpu_kind(threads='the recipe default')}; one sweep after the other", flush=True)
        began = time.perf_counter()
        grid_time = finish(start(GRID, out / "grid", common, None), began)
        began = time.perf_counter()
        search_time = finish(start(search, out / "search", common, None), began)
    pruned = sum((json.loads(p.read_text()).get("stop_reason") or "").startswith("pruned")
                 for p in (out / "search" / "runs").glob("*/summary.json"))
    for name, seconds, note in (("grid", grid_time, "16 runs"),
                                ("search", search_time, f"{args.trials} trials, {pruned} pruned")):
        value, run = best(out / name)
        print(f"{name:6s}  best {METRIC} {value:.4f} ({run})  wall {seconds:,.0f} s  ({note})")
    print(f"sweeps in {out}; python -m toolkit compare {out / 'search'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
