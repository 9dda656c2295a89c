"""HRM training throughput in puzzle-segments per second: the CPU preset in fp32 and in bf16 autocast side by side,
and on a GPU where CUDA exists, with and without --compile.

    python benchmarks/hrm_throughput.py [--steps 30] [--rounds 2] [recipe flags...]
    python benchmarks/hrm_throughput.py --preset sudoku-1k --batch-size 768 --steps 20   # on a GPU

Runs the real recipe through `accelerate launch` (cpu.yaml on the CPU, 1gpu.yaml on a GPU), alternating the
configurations round by round because these machines are noisy, and reports the median. Each run trains 2 x --steps
optimizer steps with one evaluation after the first --steps: the second metrics.csv row times steady-state training
only (the first holds the warm-up and, with --compile, the compilation). One training row is one segment of one
puzzle (ACT runs a puzzle for 1 to --halt-max-steps segments, one per batch), so rows/s = puzzle-segments/s; the
recipe's data, model and global batch are the preset's unless flags say otherwise.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(config: str, flags: list[str], steps: int, workdir: Path, name: str) -> float:
    out = workdir / name
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / config), "--main_process_port", "0", str(ROOT / "recipes" / "hrm.py"),
               "--max-steps", str(2 * steps), "--eval-every-steps", str(steps), "--log-with", "none",
               "--output-dir", str(out), *flags]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TQDM_DISABLE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    return float(rows[-1]["throughput_samples_per_sec"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="steps timed per run (after as many warm-up steps)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every configuration once")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "hrm-throughput-cache"),
                        help="where the preset's generated puzzles are kept between runs")
    known, recipe_flags = parser.parse_known_args()
    workdir = Path(tempfile.mkdtemp(prefix="hrm-throughput-"))
    flags = ["--cache-dir", known.cache_dir, *recipe_flags]

    import torch

    from toolkit.run.precision import cpu_kind

    # the recipe's own threads (the cpu-small preset's 1 unless the flags say --threads)
    threads = recipe_flags[recipe_flags.index("--threads") + 1] if "--threads" in recipe_flags else "the recipe's"
    print(f"CPU: {cpu_kind(threads=threads)}", flush=True)
    if torch.cuda.is_available():
        configs = {"gpu fp32": ("1gpu.yaml", ["--mixed-precision", "no"]),
                   "gpu bf16": ("1gpu.yaml", ["--mixed-precision", "bf16"]),
                   "gpu bf16 + compile": ("1gpu.yaml", ["--mixed-precision", "bf16", "--compile"])}
    else:
        configs = {"cpu fp32": ("cpu.yaml", ["--mixed-precision", "no"]),
                   "cpu bf16": ("cpu.yaml", ["--mixed-precision", "bf16"])}
    results: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(known.rounds):
        for name, (config, extra) in configs.items():
            rate = run_once(config, [*flags, *extra], known.steps, workdir, f"{name.replace(' ', '-')}-{round_}")
            results[name].append(rate)
            print(f"round {round_ + 1}: {name:20s} {rate:9.1f} puzzle-segments/s", flush=True)
    print(f"\nmedian over {known.rounds} round(s), {known.steps} timed steps each "
          f"(recipe flags: {' '.join(recipe_flags) or 'the cpu-small preset'}); CPU: {cpu_kind(threads=threads)}:")
    medians = {name: statistics.median(rates) for name, rates in results.items()}
    for name, rate in medians.items():
        print(f"  {name:20s} {rate:9.1f} puzzle-segments/s")
    base = "gpu fp32" if "gpu fp32" in medians else "cpu fp32"
    for name, rate in medians.items():
        if name != base:
            print(f"  {name} / {base} = {rate / medians[base]:.2f}x")
    if not torch.cuda.is_available():
        print("  GPU (with and without --compile): not measured: CUDA is not available on this machine")


if __name__ == "__main__":
    main()
