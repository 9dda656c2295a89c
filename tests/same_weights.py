"""Do two commits train the same weights? Each recipe, a few steps at sizes that take the fast paths, in this checkout
and in a git worktree of another commit; the sha256 of model.safetensors side by side.

    python tests/same_weights.py --before c6c21b2            # 7 configurations, 3 steps each, in both trees
    python tests/same_weights.py --before c6c21b2 --resume   # also: a run made by BEFORE, resumed here, equals ours

A refactoring that keeps the math keeps these hashes on the same machine (CPU, float32, one process). Exit 1 when
one differs. A tool, like tests/mutations.py, not part of `make test`: it trains 14 runs (about 3 minutes on 2 cores).

The other tree runs with PYTHONPATH at its root, so its recipes import its own toolkit (the editable install of this
checkout comes later on sys.path). Data: the tests' cache (.cache/test-data: MovieLens-100K, a 10-sensor traffic
table) and a generated UFS grid.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_CACHE = ROOT / ".cache" / "test-data"  # the tests' (tests/conftest.py)
STEPS = 3


def prepared_data() -> Path:
    """MovieLens-100K prepared in the tests' cache, and a 10-sensor traffic table (the DCRNN tests' size)."""
    from toolkit.data.movielens import prepare_movielens
    from toolkit.data.traffic import generate, write_dataset

    prepare_movielens("ml-100k", None, DATA_CACHE)
    traffic = DATA_CACHE.parent / "same-weights-traffic"
    if not (traffic / "adj_mx.pkl").exists():
        write_dataset(traffic, *generate(sensors=10, days=5, seed=0, progress=False))
    return traffic


def configurations(data: Path, grid: Path) -> dict[str, tuple[str, list[str]]]:
    """name: (recipe, flags); sizes where the CPU fast paths apply (HRM's oneDNN products start at ~1M multiply-adds:
    hidden 64 x 16 puzzles x 81 cells is 5.3M), dropout on where a recipe keys it."""
    sasrec = ["--hidden", "16", "--blocks", "1", "--maxlen", "20", "--batch-size", "64", "--eval-every", "1",
              "--dropout", "0.3", "--cache-dir", str(DATA_CACHE)]
    dcrnn = ["--cache-dir", str(DATA_CACHE), "--data", str(data), "--units", "8", "--batch-size", "32",
             "--sampling-decay-steps", "3", "--lr-decay-epochs", "1", "--threads", "1"]
    return {
        "hrm": ("hrm", ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "48", "--aug", "1", "--val-puzzles", "16",
                        "--test-puzzles", "16", "--max-blanks", "8", "--hidden", "64", "--heads", "2",
                        "--expansion", "2", "--batch-size", "16", "--halt-max-steps", "2",
                        "--exploration-prob", "0.5", "--warmup-steps", "2", "--threads", "1"]),
        "sasrec": ("sasrec", sasrec),
        "tisasrec-mhc": ("sasrec", [*sasrec, "--variant", "tisasrec-mhc"]),
        "dcrnn-fused": ("dcrnn", [*dcrnn, "--sequence-kernel", "fused"]),
        "dcrnn-cells": ("dcrnn", [*dcrnn, "--sequence-kernel", "cells"]),
        "ufs": ("ufs_emulator", ["--data", str(grid), "--hidden", "16", "--batch-size", "40", "--lr", "3e-3"]),
        "template": ("template", ["--samples", "640", "--threads", "1"]),
    }


def train(tree: Path, recipe: str, flags: list[str], out: Path, steps: int, resume: bool = False) -> str:
    """sha256 (16 hex) of the run's model.safetensors after `steps` steps, trained by `tree`'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "WANDB_MODE": "disabled"}
    command = [sys.executable, str(tree / "recipes" / f"{recipe}.py"), *flags, "--log-with", "none",
               "--max-steps", str(steps), "--output-dir", str(out), *(["--resume-from", "auto"] if resume else [])]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {recipe} in {tree} exited {done.returncode}:\n{done.stderr[-2000:]}")
    weights = sorted(out.rglob("model.safetensors"), key=lambda p: p.stat().st_mtime)[-1]
    return hashlib.sha256(weights.read_bytes()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with (e.g. c6c21b2)")
    parser.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    parser.add_argument("--resume", action="store_true",
                        help="also resume a BEFORE run of 3 steps here to 6 and compare with ours straight to 6")
    args = parser.parse_args()

    data = prepared_data()
    scratch = Path(tempfile.mkdtemp(prefix="same-weights-"))
    before = scratch / "before"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), args.before], cwd=ROOT, check=True)
    try:
        grid = scratch / "grid.nc"
        subprocess.run([sys.executable, "-m", "toolkit.data.ufs", "synth", "--out", str(grid), "--nlat", "24",
                        "--nlon", "48", "--seed", "5"], check=True, capture_output=True)
        chosen = configurations(data, grid)
        names = args.only or list(chosen)
        differ = []
        print(f"{'configuration':<14} {args.before:<18} {'this checkout':<18}")
        for name in names:
            recipe, flags = chosen[name]
            old = train(before, recipe, flags, scratch / f"{name}-before", STEPS)
            new = train(ROOT, recipe, flags, scratch / f"{name}-now", STEPS)
            print(f"{name:<14} {old:<18} {new:<18} {'same' if old == new else 'DIFFERENT'}", flush=True)
            differ += [name] if old != new else []
        if args.resume:
            print(f"\nresumed here from {args.before}'s step {STEPS} to {2 * STEPS}, against ours straight to "
                  f"{2 * STEPS}")
            for name in [n for n in names if n in ("template", "sasrec", "hrm")]:
                recipe, flags = chosen[name]
                out = scratch / f"{name}-resumed"
                train(before, recipe, flags, out, STEPS)
                resumed = train(ROOT, recipe, flags, out, 2 * STEPS, resume=True)
                straight = train(ROOT, recipe, flags, scratch / f"{name}-straight", 2 * STEPS)
                verify = subprocess.run([sys.executable, "-m", "toolkit", "verify", str(out)], capture_output=True,
                                        text=True)
                same = resumed == straight and verify.returncode == 0
                print(f"{name:<14} {resumed:<18} {straight:<18} {'same, verify ok' if same else 'DIFFERENT'}",
                      flush=True)
                differ += [] if same else [f"{name} resumed"]
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    if differ:
        print(f"different: {', '.join(differ)}")
        return 1
    print("all the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
