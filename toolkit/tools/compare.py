"""Compare runs: one table of the groups of runs that differ only by seed, and one picture of their curves.

    python -m toolkit compare DIR... [--metric NAME] [--out curves.png] [--csv FILE] [--markdown FILE]

Each DIR is a run directory (it holds config.json) or a directory of runs (a sweep directory, runs/<recipe>): every
run under it is taken. Runs are grouped by their settings and process count, less the seed and less what never
changes a step's computation (paths, logging, checkpoint cadence, the number of epochs or steps). A group's row holds
n and the mean ± std over its runs (sample standard deviation, both shown to its second significant digit; one value
alone for one run or equal values) of the main metric's final and best values, of each test metric, of the wall time
and of the training throughput. The picture holds the main metric at
each evaluation step: per group, the mean line and a min..max band over its runs. It is written into the sweep
directory (a single DIR), or to --out. A run that has not finished (no summary.json) or that is of another recipe
than the first run is named in one line and left out.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.process import extras
from toolkit.run.config import RESUMABLE_CHANGES
from toolkit.run.rundir import CHECKPOINTS_DIR, CONFIG_FILE, RunDir
from toolkit.run.tracking import save_png
from toolkit.tools import search

PICTURE = "compare.png"
# Flags that never change what a step computes (those a resume may change), plus the seed: runs that differ only in
# these are one group.
NOT_A_SETTING = RESUMABLE_CHANGES | {"seed"}


@dataclass
class RunResult:
    path: Path
    recipe: str
    settings: dict  # config less NOT_A_SETTING
    seed: int
    summary: dict
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, main metric) of each evaluation
    throughput: float | None = None  # mean training samples/s over metrics.csv's rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="*", type=Path, metavar="DIR", help="run directories or directories of runs")
    parser.add_argument("--metric", default=None, help="the metric to compare (default: the runs' main metric)")
    parser.add_argument("--out", type=Path, default=None, help=f"the picture (default: DIR/{PICTURE} for one DIR)")
    parser.add_argument("--csv", type=Path, default=None, help="also write the table as CSV")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown")
    parser.add_argument("--columns", nargs="+", default=None, metavar="TEXT",
                        help="show only the test metrics whose name contains one of these (default: all)")


def find_runs(dirs: list[Path]) -> list[Path]:
    """Every run directory (one holding config.json) given or under the given directories, in path order."""
    if not dirs:
        raise UsageError("compare needs at least one DIR: a run directory or a directory of runs (a sweep)")
    found: list[Path] = []
    for directory in dirs:
        if not directory.exists():
            raise UsageError(f"{directory} does not exist; give a run directory or a directory of runs")
        if not directory.is_dir():
            raise UsageError(f"{directory} is a file; give a run directory or a directory of runs")
        runs = [directory] if RunDir(directory).is_run() else sorted(
            p.parent for p in directory.rglob(CONFIG_FILE) if CHECKPOINTS_DIR not in p.parts)
        if not runs:
            raise UsageError(f"{directory} holds no run (no config.json under it); give run directories or a sweep")
        found += [run for run in runs if run not in found]
    return found


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def load_run(path: Path, metric: str | None, say=print) -> RunResult | None:
    """The run's results, or None (after one line saying why) when it cannot be compared."""
    config = RunDir(path).read_config()
    if config is None or not isinstance(config.get("config"), dict):
        say(f"skipped {path}: its config.json is unreadable")
        return None
    summary = RunDir(path).read_summary()
    if summary is None:
        say(f"skipped {path}: not finished (no summary.json; continue it with --resume-from auto)")
        return None
    settings = {k: v for k, v in config["config"].items() if k not in NOT_A_SETTING}
    # The process count is a setting of its own: N processes equal one only to rounding (and not at all with
    # --batch-per-process), so a 1-process and a 2-process sweep are two groups.
    settings["world_size"] = config.get("world_size", 1)
    run = RunResult(path, str(config.get("recipe")), settings, int(config["config"].get("seed", 0)), summary)
    main = metric or summary.get("main_metric") or next(iter(summary.get("final_metrics") or {}), None)
    rates = []
    try:
        with open(RunDir(path).metrics, newline="") as handle:
            for row in csv.DictReader(handle):
                value, step = _number(row.get(main)), _number(row.get("step"))
                if value is not None and step is not None:
                    run.curve.append((int(step), value))
                rate = _number(row.get("throughput_samples_per_sec"))
                if rate:
                    rates.append(rate)
    except OSError:
        pass
    run.throughput = statistics.fmean(rates) if rates else None
    return run


def group_label(settings: dict, varying: list[str]) -> str:
    return " ".join(f"{key}={settings.get(key)}" for key in varying) or "all runs"


def _figure(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def mean_std(values: list[float]) -> str:
    """"mean ± std", both to the decimal place of the std's second significant digit (0.711 ± 0.013, 1.00 ± 0.37,
    45,000 ± 1,200), so the columns read alike; one value, or values all equal (a count), alone."""
    if not values:
        return "-"
    if len(set(values)) == 1:
        value = values[0]
        return f"{value:,.0f}" if float(value).is_integer() and abs(value) >= 1 else _figure(value)
    mean, std = statistics.fmean(values), statistics.stdev(values)
    digits = 1 - math.floor(math.log10(std))  # decimals to keep; negative: round to tens, hundreds...
    if digits < 0:
        return f"{round(mean, digits):,.0f} ± {round(std, digits):,.0f}"
    return f"{mean:,.{digits}f} ± {std:,.{digits}f}"


@dataclass
class Comparison:
    metric: str
    header: list[str]
    rows: list[list[str]]
    groups: dict[str, list[RunResult]]


def compare(runs: list[RunResult], metric: str | None = None, columns: list[str] | None = None) -> Comparison:
    first = runs[0]
    main = metric or first.summary.get("main_metric") or next(iter(first.summary.get("final_metrics") or {}), "")
    varying = sorted({key for run in runs for key in run.settings if run.settings.get(key) != first.settings.get(key)})
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(group_label(run.settings, varying), []).append(run)
    tests = sorted({key for run in runs for key in (run.summary.get("test_metrics_at_best") or {})})
    if columns:
        shown = [key for key in tests if any(text in key for text in columns)]
        if not shown:
            raise UsageError(f"--columns {' '.join(columns)} matches none of the runs' test metrics: "
                             f"{', '.join(tests) or 'none'}")
        tests = shown
    header = ["group", "n", "seeds", f"final {main}", f"best {main}", *tests, "wall s", "samples/s"]
    rows = []
    for label, members in groups.items():
        def values(read, members=members):
            return [v for v in (_number(read(run)) for run in members) if v is not None]

        rows.append([
            label, str(len(members)), ",".join(str(run.seed) for run in members),
            mean_std(values(lambda r: (r.summary.get("final_metrics") or {}).get(main))),
            mean_std(values(lambda r: (r.summary.get("best_metrics") or {}).get(main))),
            *[mean_std(values(lambda r, t=t: (r.summary.get("test_metrics_at_best") or {}).get(t))) for t in tests],
            mean_std(values(lambda r: r.summary.get("wall_time_sec"))),
            mean_std(values(lambda r: r.throughput)),
        ])
    return Comparison(main, header, rows, groups)


def as_text(table: Comparison) -> str:
    widths = [max(len(row[i]) for row in [table.header, *table.rows]) for i in range(len(table.header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in [table.header, *table.rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def as_markdown(table: Comparison) -> str:
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def as_csv(table: Comparison) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(table.header)
    writer.writerows(table.rows)
    return out.getvalue()


def plot(table: Comparison, out: Path) -> None:
    """Per group: the mean of the main metric at each evaluation step over its runs, and a min..max band."""
    plt = extras.pyplot()

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for label, members in table.groups.items():
        by_step: dict[int, list[float]] = {}
        for run in members:
            for step, value in run.curve:
                by_step.setdefault(step, []).append(value)
        steps = sorted(by_step)
        if not steps:
            continue
        mean = [statistics.fmean(by_step[s]) for s in steps]
        line = axes.plot(steps, mean, label=f"{label} (n={len(members)})")[0]
        axes.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                          color=line.get_color(), alpha=0.2, linewidth=0)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(table.metric)
    axes.set_title(f"{table.metric}: mean and min..max over seeds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    save_png(figure, out, dpi=120)


def _check_output(path: Path | None, flag: str) -> None:
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise UsageError(f"{flag} {path} is {'a directory' if path.is_dir() else 'in a directory that does not exist'}"
                         "; give a file path in an existing directory")


def main(args: argparse.Namespace) -> int:
    for path, flag in ((args.out, "--out"), (args.csv, "--csv"), (args.markdown, "--markdown")):
        _check_output(path, flag)
    paths = find_runs(args.dirs)
    runs = [run for run in (load_run(path, args.metric) for path in paths) if run is not None]
    if runs:
        recipe = runs[0].recipe
        for other in [run for run in runs if run.recipe != recipe]:
            print(f"skipped {other.path}: a run of {other.recipe}, not {recipe} (the first run's recipe)")
        runs = [run for run in runs if run.recipe == recipe]
    if not runs:
        raise UsageError(f"nothing to compare: none of the {len(paths)} run(s) under {' '.join(map(str, args.dirs))} "
                         "has finished (summary.json)")
    table = compare(runs, args.metric, args.columns)
    print(as_text(table))
    out = args.out or (args.dirs[0] / PICTURE if len(args.dirs) == 1 and len(paths) > 1 else None)
    if out is not None:
        try:
            plot(table, out)
            print(f"wrote {out}")
        except extras.MissingExtra as missing:  # the table above is the result; the picture is a convenience
            print(f"{out} not drawn: {missing}")
    for path, render in ((args.csv, as_csv), (args.markdown, as_markdown)):
        if path is not None:
            path.write_text(render(table))
            print(f"wrote {path}")
    if len(args.dirs) == 1 and search.is_study(args.dirs[0]):  # a search: its best trials, importances, picture
        search.report(args.dirs[0])
    return 0
