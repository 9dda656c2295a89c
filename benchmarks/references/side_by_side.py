"""What the reference benchmarks share: the checkout check, running a program while timing its output lines, our
recipe's per-epoch time from its metrics.csv, and rounds that alternate the two sides so the machine's noise hits
both alike.

Nothing here fetches anything: the user gives the path of each reference's checkout.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def usage_error(message: str) -> None:
    """One line on stderr, exit 2 (bad input: nothing was run)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_checkout(reference: Path | None, needed: str, repo: str) -> Path:
    """The reference checkout's absolute path; without one that holds `needed`, one line saying where to get it."""
    if reference is None:
        where = "--reference is missing"
    elif not (reference.expanduser() / needed).is_file():
        where = f"--reference {reference} is not a checkout of {repo} (no {needed} in it)"
    else:
        return reference.expanduser().resolve()
    usage_error(f"{where}; get it with `git clone https://github.com/{repo} PATH` and give --reference PATH")
    raise AssertionError("unreachable")


def thread_settings(threads: int) -> dict[str, str]:
    """Environment that fixes a process's intra-op threads (torch reads OMP_NUM_THREADS when it starts); {} = its
    own default."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads > 0 else {}


@dataclass
class TimedLines:
    lines: list[tuple[float, str]]  # (time.perf_counter() when the line arrived, the line without its end)

    def first(self, starts_with: str) -> float | None:
        return next((t for t, line in self.lines if line.startswith(starts_with)), None)


def run_timed(name: str, command: list[str], cwd: Path, env: dict[str, str], log: Path) -> TimedLines:
    """Run `command`, stamping each line of its output (stdout and stderr together) as it arrives; the output is
    also kept in `log`. A failure stops the benchmark with one line and the log's path (exit 1)."""
    lines = []
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **env}  # unbuffered: a line's stamp is when it was printed
    with (
        open(log, "w") as kept,
        subprocess.Popen(
            command, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as process,
    ):
        for line in process.stdout:
            lines.append((time.perf_counter(), line.rstrip("\n")))
            kept.write(line)
    if process.returncode != 0:
        last = " | ".join(line for _, line in lines[-3:])
        print(f"error: {name} exited with status {process.returncode}: {last} (whole output: {log})", file=sys.stderr)
        raise SystemExit(1)
    return TimedLines(lines)


@dataclass
class EpochTime:
    """One side's training time in one round."""

    seconds_per_epoch: float
    steps_per_epoch: float
    quality: dict[str, float] = field(default_factory=dict)  # e.g. validation NDCG@10 at the last epoch
    # Ours only: the time inside the loop's batches per epoch (seconds_per_epoch less the checkpoint saves and the
    # loop's bookkeeping between batches).
    seconds_per_epoch_in_batches: float | None = None

    @property
    def seconds_per_step(self) -> float:
        return self.seconds_per_epoch / self.steps_per_epoch


def our_epoch_time(run_dir: Path, epochs: int, quality_columns: tuple[str, ...] = ()) -> EpochTime:
    """Our recipe's training time per epoch, from its metrics.csv row at the last epoch (run with --eval-every
    EPOCHS, so that one row spans every epoch): the row's interval, which is everything the training took (each
    batch's fetch, forward, backward and optimizer step, the loop's per-step bookkeeping and the checkpoint saved
    at each epoch end: a user pays for those too; the first epoch's warm-up included) and not the evaluation
    (toolkit/loop/training.py reads the interval before evaluating). Also the time inside the batches alone."""
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    row = rows[-1]
    quality = {name: float(row[name]) for name in quality_columns if row.get(name)}
    in_batches = float(row["data_load_time_sec"]) + float(row["compute_time_sec"])
    return EpochTime(float(row["epoch_time_sec"]) / epochs, int(row["step"]) / epochs, quality, in_batches / epochs)


def alternate(rounds: int, sides: dict[str, Callable[[int], EpochTime]]) -> dict[str, list[EpochTime]]:
    """Run each side once per round, the order reversed every other round, printing each round as it ends."""
    results: dict[str, list[EpochTime]] = {name: [] for name in sides}
    names = list(sides)
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            print(f"round {index + 1}/{rounds}: running {name} ...", flush=True)
            results[name].append(sides[name](index))
        ours, theirs = (results[name][-1] for name in names)
        print(
            f"round {index + 1}: {names[0]} {ours.seconds_per_epoch:.2f} s/epoch ({ours.steps_per_epoch:g} steps, "
            f"{ours.seconds_per_step * 1e3:.0f} ms/step); {names[1]} {theirs.seconds_per_epoch:.2f} s/epoch "
            f"({theirs.steps_per_epoch:g} steps, {theirs.seconds_per_step * 1e3:.0f} ms/step); "
            f"{names[1]}/{names[0]} = {theirs.seconds_per_epoch / ours.seconds_per_epoch:.2f}x per epoch, "
            f"{theirs.seconds_per_step / ours.seconds_per_step:.2f}x per step"
            + (
                f"; {names[0]} inside its batches {ours.seconds_per_epoch_in_batches:.2f} s/epoch"
                if ours.seconds_per_epoch_in_batches
                else ""
            ),
            flush=True,
        )
    return results


def report(results: dict[str, list[EpochTime]], threads: int) -> None:
    """The CPU's kind, medians over the rounds, the per-round ratios' range, and the ratio as the last line."""
    from toolkit.run.precision import cpu_kind

    (ours_name, ours), (theirs_name, theirs) = results.items()
    print(f"CPU: {cpu_kind(threads=threads or 'each program')}")
    per_round = [t.seconds_per_epoch / o.seconds_per_epoch for o, t in zip(ours, theirs, strict=True)]
    per_step = [t.seconds_per_step / o.seconds_per_step for o, t in zip(ours, theirs, strict=True)]
    for name, times in results.items():
        print(
            f"median {name:9} {statistics.median(t.seconds_per_epoch for t in times):8.2f} s/epoch "
            f"{statistics.median(t.seconds_per_step for t in times) * 1e3:7.0f} ms/step "
            f"({statistics.median(t.steps_per_epoch for t in times):g} steps/epoch)"
        )
    for name, times in results.items():
        for key in times[-1].quality:
            print(f"{name} {key} (last round): {times[-1].quality[key]:.4f}")
    if all(o.seconds_per_epoch_in_batches for o in ours):
        inside = [t.seconds_per_epoch / o.seconds_per_epoch_in_batches for o, t in zip(ours, theirs, strict=True)]
        print(
            f"{theirs_name}/{ours_name} per epoch, ours inside its batches only (no checkpoint saves, no "
            f"bookkeeping): median {statistics.median(inside):.2f}x (rounds {min(inside):.2f}-{max(inside):.2f})"
        )
    print(
        f"{theirs_name}/{ours_name} per step: median {statistics.median(per_step):.2f}x "
        f"(rounds {min(per_step):.2f}-{max(per_step):.2f})"
    )
    print(
        f"ratio {theirs_name}/{ours_name} per epoch = {statistics.median(per_round):.2f} (median of the rounds, "
        f"{min(per_round):.2f}-{max(per_round):.2f})"
    )
