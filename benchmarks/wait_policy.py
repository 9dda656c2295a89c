"""OpenMP's wait policy under load that arrives after a run started.

    python benchmarks/wait_policy.py                      # SASRec and the UFS MLP, 2 threads, loads 0, 1, 2
    python benchmarks/wait_policy.py --recipes ufs_emulator --threads 2 --loads 0 2 --rounds 2
    python benchmarks/wait_policy.py --recipes ufs_emulator --loads 0 1 --ufs-steps 8000 --measure wall   # long runs

For each recipe, thread count and load (busy Python processes, one core each, started together with the run, so the
run starts on what begin_process() sees as an idle machine: TOOLKIT_LOADAVG says so), each candidate policy trains
the same short run; the figure is its training time (metrics.csv `epoch_time_sec`: no start-up, no evaluation), or
with `--measure wall` the whole command's wall time (start-up included: the measure for a run that restarts itself
under PASSIVE when load arrives, toolkit.process.openmp, which a short run ends before it looks three times).
Candidates: libgomp's spin (OMP_WAIT_POLICY and GOMP_SPINCOUNT unset), PASSIVE, GOMP_SPINCOUNT=N, and `toolkit`: what
begin_process() chooses on an idle machine. Rounds alternate the candidates. Prints one table row per (recipe,
threads, load): seconds per candidate (the median of the rounds) and each candidate's time over the best fixed one.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CANDIDATES = {
    "spin": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},
    "spin 100": {"GOMP_SPINCOUNT": "100"},
    "toolkit": None,  # nothing exported: begin_process() chooses (on what it sees as an idle machine: GOMP_SPINCOUNT)
}
BUSY = "while True: pass"


def recipe_args(recipe: str, data: dict, out: Path, threads: int, ufs_steps: int = 600,
                sasrec_steps: int = 40) -> list[str]:
    common = ["--threads", str(threads), "--log-with", "csv", "--output-dir", str(out), "--eval-every-steps", "100000"]
    if recipe == "ufs_emulator":
        return [str(ROOT / "recipes" / "ufs_emulator.py"), "--data", str(data["ufs"]), "--max-steps", str(ufs_steps),
                "--epochs", "100000", *common]
    return [str(ROOT / "recipes" / "sasrec.py"), "--cache-dir", str(data["cache"]), "--max-steps", str(sasrec_steps),
            "--epochs", "1000", *common]


def train_seconds(out: Path) -> float:
    with open(out / "metrics.csv", newline="") as handle:
        return sum(float(row["epoch_time_sec"]) for row in csv.DictReader(handle))


def one_run(recipe: str, data: dict, threads: int, load: int, candidate: str, scratch: Path, ufs_steps: int = 600,
            measure: str = "train", sasrec_steps: int = 40) -> float:
    out = Path(tempfile.mkdtemp(dir=scratch)) / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update({"TOOLKIT_LOADAVG": "0.00 0.00 0.00 1/300", "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"})
    env.update(CANDIDATES[candidate] or {})
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
    began = time.perf_counter()
    try:
        command = [sys.executable, *recipe_args(recipe, data, out, threads, ufs_steps, sasrec_steps)]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=1800)
        wall = time.perf_counter() - began
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return wall if measure == "wall" else train_seconds(out)


def main(argv=None) -> int:
    from toolkit.run.precision import cpu_kind

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["ufs_emulator", "sasrec"])
    parser.add_argument("--threads", nargs="+", type=int, default=[2])
    parser.add_argument("--loads", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".cache" / "test-data")
    parser.add_argument("--ufs-steps", type=int, default=600, help="the UFS MLP's optimizer steps per run")
    parser.add_argument("--sasrec-steps", type=int, default=40, help="SASRec's optimizer steps per run")
    parser.add_argument("--measure", choices=["train", "wall"], default="train",
                        help="training time from metrics.csv, or the whole command's wall time")
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_kind(threads=' and '.join(map(str, args.threads)) + ' per run')}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        from toolkit.data.ufs import synthesize

        data = {"ufs": scratch / "ufs.nc", "cache": args.cache_dir}
        synthesize(data["ufs"], seed=0, nlat=180, nlon=360)
        print("| recipe | threads | busy processes | " + " | ".join(args.candidates) + " | toolkit / best fixed |")
        print("| --- | ---: | ---: |" + " ---: |" * (len(args.candidates) + 1))
        for recipe in args.recipes:
            for threads in args.threads:
                for load in args.loads:
                    times = {c: [] for c in args.candidates}
                    for _ in range(args.rounds):
                        for candidate in args.candidates:
                            times[candidate].append(one_run(recipe, data, threads, load, candidate, scratch,
                                                            args.ufs_steps, args.measure, args.sasrec_steps))
                    median = {c: statistics.median(t) for c, t in times.items()}
                    fixed = [v for c, v in median.items() if c != "toolkit"]
                    best = min(fixed) if fixed else float("nan")
                    cells = " | ".join(f"{median[c]:.2f} s ({median[c] / best:.2f}x)" for c in args.candidates)
                    ratio = median.get("toolkit", float("nan")) / best
                    print(f"| {recipe} | {threads} | {load} | {cells} | {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
