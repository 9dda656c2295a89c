"""`python -m toolkit verify RUN_DIR`: did this run finish, and is what it wrote consistent?

Checks a run directory written by a recipe (toolkit/run/start.py, loop.py, tracking.py), e.g. after a SLURM job:

    files        config.json, summary.json parse; metrics.csv parses; curves.png is a PNG
    completion   summary epochs_completed == config epochs; with config max_steps: global_step == max_steps
                 (or every epoch done before reaching it); or the run stopped early (summary stop_reason)
    metrics      metrics.csv has rows and the toolkit's columns plus val_* ones; steps strictly increase and end at
                 global_step; train_loss finite in every row
    results      final_metrics and best_metrics present, numbers finite (test_metrics_at_best too, when present)
    checkpoints  the best checkpoint and one at the final global_step exist and are complete (COMPLETE marker);
                 every complete checkpoint's files match its MANIFEST.json (sha256), which lists every file;
                 config.json says what each checkpoint recorded the run's settings were (the flags a resume may
                 change aside); every step_N is a directory; no leftovers of interrupted saves or prunes
                 (.step_N.saving, .step_N.pruning, step_N w/o marker)
    world_size   config.json, summary.json and every metrics.csv row agree (and --expect-world-size); a process
                 count may change only at a resume recorded in config.json's world_sizes
    backend      config.json's backend is --expect-backend (only with that flag; `none` = a single process)
    throughput   throughput_samples_per_sec > 0 in every row that has one (at least one); wall_time_sec > 0

Prints a line per check (OK/FAIL and the problems), then the key figures; exits 0 when all is well, else 1.
`verify_run(run_dir, expect_world_size=None, expect_backend=None)` returns the problems as a list (empty = fine).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.run import checkpoint
from toolkit.run.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from toolkit.run.tracking import CURVES_FILE, LEADING_COLUMNS, OPTIONAL_COLUMNS, TRAILING_COLUMNS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (holds config.json)")
    parser.add_argument(
        "--expect-world-size", type=int, default=None, metavar="N", help="fail unless the run used exactly N processes"
    )
    parser.add_argument(
        "--expect-backend",
        default=None,
        metavar="NAME",
        help="fail unless the run's backend was NAME (gloo, nccl; none = a single process)",
    )


@dataclass
class Check:
    name: str
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None  # why it could not run (its inputs are missing; reported under `files`)


@dataclass
class Report:
    run_dir: Path
    checks: list[Check]
    figures: dict

    @property
    def problems(self) -> list[str]:
        return [f"{c.name}: {p}" for c in self.checks for p in c.problems]


def verify_run(
    run_dir: Path | str, expect_world_size: int | None = None, expect_backend: str | None = None
) -> list[str]:
    """Everything missing or wrong in a finished run directory, as `check: problem` lines (empty = fine)."""
    return inspect_run(run_dir, expect_world_size, expect_backend).problems


def inspect_run(run_dir: Path | str, expect_world_size: int | None = None, expect_backend: str | None = None) -> Report:
    run_dir = Path(run_dir)
    files = Check("files")
    config = _read_json(run_dir / CONFIG_FILE, files)
    summary = _read_json(run_dir / SUMMARY_FILE, files)
    rows, columns = _read_metrics(run_dir / METRICS_FILE, files)
    curves = run_dir / CURVES_FILE
    if not curves.is_file():
        files.problems.append(f"{CURVES_FILE} is missing")
    elif not curves.read_bytes()[:8] == PNG_SIGNATURE:
        files.problems.append(f"{CURVES_FILE} is not a PNG image")

    checks = [
        files,
        _completion(config, summary),
        _metrics(rows, columns, summary),
        _results(summary),
        _checkpoints(run_dir, summary, config),
        _world_size(config, summary, rows, expect_world_size),
        _backend(config, expect_backend),
        _throughput(rows, summary),
    ]
    return Report(run_dir, checks, _figures(config, summary, rows))


# ---- reading ---------------------------------------------------------------------------------------------------


def _read_json(path: Path, files: Check) -> dict | None:
    if not path.is_file():
        files.problems.append(f"{path.name} is missing")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        files.problems.append(f"{path.name} does not parse as JSON ({error})")
        return None
    if not isinstance(data, dict):
        files.problems.append(f"{path.name} is not a JSON object")
        return None
    return data


def _read_metrics(path: Path, files: Check) -> tuple[list[dict] | None, list[str]]:
    if not path.is_file():
        files.problems.append(f"{METRICS_FILE} is missing")
        return None, []
    try:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            columns = list(reader.fieldnames or [])
    except (csv.Error, UnicodeDecodeError) as error:
        files.problems.append(f"{METRICS_FILE} does not parse as CSV ({error})")
        return None, []
    if any(None in row for row in rows):  # more cells than header columns
        files.problems.append(f"{METRICS_FILE} has rows with more cells than its header")
    return rows, columns


def _number(value) -> float | None:
    """A finite float, or None (missing, empty, not a number, nan, inf)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _integer(value) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number == int(number) else None


def _skip(name: str, *needs: tuple[str, object]) -> Check | None:
    missing = [what for what, value in needs if value is None]
    if missing:
        return Check(name, skipped=f"needs {', '.join(missing)}")
    return None


# ---- the checks --------------------------------------------------------------------------------------------------


def _completion(config: dict | None, summary: dict | None) -> Check:
    check = _skip("completion", (CONFIG_FILE, config), (SUMMARY_FILE, summary))
    if check:
        return check
    check = Check("completion")
    settings = config.get("config") if isinstance(config.get("config"), dict) else {}
    epochs, max_steps = _integer(settings.get("epochs")), _integer(settings.get("max_steps"))
    done_epochs, step = _integer(summary.get("epochs_completed")), _integer(summary.get("global_step"))
    if step is None:
        check.problems.append(f"{SUMMARY_FILE} has no global_step")
    if done_epochs is None:
        check.problems.append(f"{SUMMARY_FILE} has no epochs_completed")
    if epochs is None:
        check.problems.append(f"{CONFIG_FILE} has no config.epochs")
    if check.problems:
        return check
    if summary.get("stop_reason"):  # ended early on purpose (early stopping): fewer epochs are expected
        return check
    if max_steps is not None:
        # Stopped at --max-steps; or every epoch ended before that many steps (a run shorter than max_steps).
        # (A resume with a smaller --max-steps or --epochs than already done ends at once: more is fine.)
        if step < max_steps and done_epochs < epochs:
            check.problems.append(
                f"global_step {step} < config max_steps {max_steps} (and {done_epochs} of {epochs} epochs completed)"
            )
    elif done_epochs < epochs:
        check.problems.append(f"epochs_completed {done_epochs} < config epochs {epochs}")
    return check


def _metrics(rows: list[dict] | None, columns: list[str], summary: dict | None) -> Check:
    check = _skip("metrics", (METRICS_FILE, rows))
    if check:
        return check
    check = Check("metrics")
    missing = [c for c in LEADING_COLUMNS + TRAILING_COLUMNS if c not in columns and c not in OPTIONAL_COLUMNS]
    if missing:
        check.problems.append(f"{METRICS_FILE} lacks column(s) {', '.join(missing)}")
    if not any(c.startswith("val_") for c in columns):
        check.problems.append(f"{METRICS_FILE} has no val_* column")
    if not rows:
        check.problems.append(f"{METRICS_FILE} has no rows")
        return check
    steps = [_integer(row.get("step")) for row in rows]
    bad = [i + 2 for i, s in enumerate(steps) if s is None]  # +2: the CSV line (header is line 1)
    if bad:
        check.problems.append(f"{METRICS_FILE} line(s) {bad} have no integer step")
    known = [s for s in steps if s is not None]
    if any(b <= a for a, b in zip(known, known[1:], strict=False)):
        check.problems.append(f"{METRICS_FILE} steps do not strictly increase: {known}")
    final_step = _integer(summary.get("global_step")) if summary else None
    if known and final_step is not None and known[-1] != final_step:
        check.problems.append(f"{METRICS_FILE}'s last step {known[-1]} != summary global_step {final_step}")
    done, last_epoch = _integer((summary or {}).get("epochs_completed")), _integer(rows[-1].get("epoch"))
    if done is not None and last_epoch is not None and last_epoch not in (done, done + 1):  # 1-based: the row's epoch
        check.problems.append(f"{METRICS_FILE}'s last row is in epoch {last_epoch}, but {SUMMARY_FILE} says "
                              f"{done} epoch(s) completed (expected epoch {done}, or {done + 1} stopped inside)")
    if "train_loss" in columns:
        bad = [i + 2 for i, row in enumerate(rows) if _number(row.get("train_loss")) is None]
        if bad:
            check.problems.append(f"{METRICS_FILE} train_loss is missing or not finite on line(s) {bad}")
    return check


def _results(summary: dict | None) -> Check:
    check = _skip("results", (SUMMARY_FILE, summary))
    if check:
        return check
    check = Check("results")
    for key, required in (("final_metrics", True), ("best_metrics", True), ("test_metrics_at_best", False)):
        metrics = summary.get(key)
        if not metrics:
            if required:
                check.problems.append(f"{SUMMARY_FILE} has no {key}")
            continue
        if not isinstance(metrics, dict):
            check.problems.append(f"{SUMMARY_FILE} {key} is not an object")
            continue
        bad = [name for name, value in metrics.items() if _number(value) is None]
        if bad:
            check.problems.append(f"{SUMMARY_FILE} {key} not finite numbers: {', '.join(bad)}")
    return check


def _checkpoints(run_dir: Path, summary: dict | None, config: dict | None) -> Check:
    check = _skip("checkpoints", (SUMMARY_FILE, summary))
    if check:
        return check
    check = Check("checkpoints")
    root = checkpoint.checkpoints_root(run_dir)
    step = _integer(summary.get("global_step"))
    best_step = _integer(summary.get("best_step"))
    recorded = summary.get("best_checkpoint")
    if best_step is None and recorded:
        best_step = checkpoint.step_of(Path(recorded))
    # The recorded path may be relative to where the run was started, or the run dir moved since: look inside it.
    wanted = [("best", best_step), ("final", step)]
    if best_step is None:
        check.problems.append(f"{SUMMARY_FILE} names no best checkpoint (best_step / best_checkpoint)")
        wanted = wanted[1:]
    for what, number in wanted:
        if number is None:
            continue
        path = root / f"step_{number}"
        if not path.exists() and not path.is_symlink():
            check.problems.append(f"the {what} checkpoint {path.relative_to(run_dir)} is missing")
        elif not path.is_dir():
            check.problems.append(f"the {what} checkpoint {path.relative_to(run_dir)} is not a directory")
        elif not checkpoint.is_complete(path):
            check.problems.append(
                f"the {what} checkpoint {path.relative_to(run_dir)} is incomplete (no {checkpoint.MARKER} marker or "
                f"{checkpoint.PROGRESS_FILE}: its save was interrupted)"
            )
        elif what == "final":
            try:
                progress = checkpoint.read_progress(path)
            except (OSError, ValueError):  # not UTF-8 or not JSON: damage_of names the file (below)
                progress = None
            saved = _integer(progress.get("global_step")) if isinstance(progress, dict) else None
            if progress is not None and saved != number:
                check.problems.append(f"{path.relative_to(run_dir)}/{checkpoint.PROGRESS_FILE} says step {saved}")
    differing: dict[str, list[str]] = {}  # config.json's differences from a checkpoint's record -> those checkpoints
    for path in checkpoint.complete_checkpoints(run_dir):
        damage = checkpoint.damage_of(path)
        if damage:
            check.problems.append(f"{path.relative_to(run_dir)} is damaged: {damage}")
        elif config is not None:
            changes = checkpoint.settings_changes(path, config)
            if changes:
                differing.setdefault("; ".join(changes), []).append(path.name)
    for changes, names in differing.items():
        check.problems.append(f"{CONFIG_FILE} differs from the settings {', '.join(names)} recorded ({changes}): it "
                              "was changed after those saves")
    named = {str(root / f"step_{n}") for _, n in wanted if n is not None}  # already named above
    for path in checkpoint.step_entries(run_dir):
        if not path.is_dir() and str(path) not in named:
            check.problems.append(f"{path.relative_to(run_dir)} is not a directory: {checkpoint.NOT_A_DIRECTORY}")
    for path, why in checkpoint.leftovers(run_dir):
        if str(path) not in named:
            check.problems.append(f"{path.relative_to(run_dir)} is a leftover: {why}; the run's next life "
                                  "removes it, or delete it")
    return check


def _world_size(
    config: dict | None, summary: dict | None, rows: list[dict] | None, expect_world_size: int | None
) -> Check:
    """Every record agrees with the process count of the life that wrote it. config.json's world_sizes lists the
    lives ({from_step, world_size}); a row at step s comes from the life that started before s (a row at exactly a
    resume step may come from either: the earlier life evaluated, then saved the checkpoint the later one loaded)."""
    check = Check("world_size")
    if config is None and summary is None and rows is None:
        return Check("world_size", skipped=f"needs {CONFIG_FILE}, {SUMMARY_FILE} or {METRICS_FILE}")
    lives = (config or {}).get("world_sizes")
    if not isinstance(lives, list) or not lives:
        lives = [{"from_step": 0, "world_size": _integer((config or {}).get("world_size"))}]
    try:
        lives = sorted(((int(w["from_step"]), _integer(w["world_size"])) for w in lives), key=lambda w: w[0])
    except (KeyError, TypeError, ValueError):
        check.problems.append(f"{CONFIG_FILE} world_sizes is malformed")
        return check
    final = lives[-1][1]
    if config is not None and _integer(config.get("world_size")) != final:
        check.problems.append(f"{CONFIG_FILE} world_size {config.get('world_size')} != its last world_sizes entry "
                              f"{final}")
    if summary is not None and _integer(summary.get("world_size")) != final:
        check.problems.append(f"{SUMMARY_FILE} says world size {summary.get('world_size')}, the last life had {final}")
    for i, row in enumerate(rows or []):
        size, step = _integer(row.get("world_size")), _integer(row.get("step"))
        if size is None or size < 1:
            check.problems.append(f"{METRICS_FILE} line {i + 2} has no valid world_size")
            continue
        if step is None:
            continue
        allowed = {w for start, w in lives if start <= step}
        writer = [w for start, w in lives if start < step] or [lives[0][1]]
        if size != writer[-1] and not (size in allowed and any(start == step for start, _ in lives)):
            check.problems.append(f"{METRICS_FILE} line {i + 2} (step {step}) says world size {size}, but the run "
                                  f"had {writer[-1]} process(es) then (config.json world_sizes)")
    sizes = {w for _, w in lives}
    if expect_world_size is not None and sizes != {expect_world_size}:
        check.problems.append(
            f"expected world size {expect_world_size}, the run had "
            f"{', '.join(map(str, sorted(s for s in sizes if s is not None))) or 'none recorded'}"
        )
    return check


def _backend(config: dict | None, expect_backend: str | None) -> Check:
    if expect_backend is None:
        return Check("backend", skipped="no --expect-backend given")
    check = _skip("backend", (CONFIG_FILE, config))
    if check:
        return check
    check = Check("backend")
    backend = config.get("backend") or "none"
    if str(backend).lower() != expect_backend.lower():
        check.problems.append(f"expected backend {expect_backend}, {CONFIG_FILE} says {backend}")
    return check


def _throughput(rows: list[dict] | None, summary: dict | None) -> Check:
    check = _skip("throughput", (METRICS_FILE, rows))
    if check:
        return check
    check = Check("throughput")
    # Empty = that row's epoch had no training left (a run resumed exactly at the epoch's end): nothing to time.
    values = [_number(row.get("throughput_samples_per_sec")) for row in rows]
    bad = [i + 2 for i, (row, value) in enumerate(zip(rows, values, strict=True))
           if row.get("throughput_samples_per_sec") not in ("", None) and not (value or 0) > 0]
    if bad:
        check.problems.append(f"{METRICS_FILE} throughput_samples_per_sec is not > 0 on line(s) {bad}")
    if not any((value or 0) > 0 for value in values):
        check.problems.append(f"{METRICS_FILE} has no row with a throughput_samples_per_sec > 0")
    if summary is not None and not (_number(summary.get("wall_time_sec")) or 0) > 0:
        check.problems.append(f"{SUMMARY_FILE} wall_time_sec is not > 0")
    return check


def _figures(config: dict | None, summary: dict | None, rows: list[dict] | None) -> dict:
    config, summary, rows = config or {}, summary or {}, rows or []
    settings = config.get("config") if isinstance(config.get("config"), dict) else {}
    throughputs = [t for t in (_number(r.get("throughput_samples_per_sec")) for r in rows) if t is not None]
    best = summary.get("best_metrics") if isinstance(summary.get("best_metrics"), dict) else {}
    return {
        "recipe": config.get("recipe") or summary.get("recipe"),
        "global_step": summary.get("global_step"),
        "max_steps": settings.get("max_steps"),
        "epochs_completed": summary.get("epochs_completed"),
        "epochs": settings.get("epochs"),
        "last_row_epoch": _integer(rows[-1].get("epoch")) if rows else None,
        "world_size": summary.get("world_size", config.get("world_size", rows[-1].get("world_size") if rows else None)),
        "backend": config.get("backend"),
        "device": config.get("device"),
        "mixed_precision": config.get("mixed_precision"),
        "best_step": summary.get("best_step"),
        "best_metrics": best,
        "throughput_samples_per_sec": sum(throughputs) / len(throughputs) if throughputs else None,
        "wall_time_sec": summary.get("wall_time_sec"),
    }


# ---- the command -------------------------------------------------------------------------------------------------


def format_report(report: Report) -> str:
    lines = [f"verify {report.run_dir}"]
    for check in report.checks:
        if check.skipped and not check.problems:
            lines.append(f"  --    {check.name:<12} skipped: {check.skipped}")
        elif check.problems:
            lines.append(f"  FAIL  {check.name:<12} {check.problems[0]}")
            lines.extend(f"        {'':<12} {p}" for p in check.problems[1:])
        else:
            lines.append(f"  OK    {check.name}")
    f = report.figures
    steps = f"{f['global_step']}" + (f" (max_steps {f['max_steps']})" if f["max_steps"] is not None else "")
    best = ", ".join(f"{k} {_short(v)}" for k, v in list(f["best_metrics"].items())[:4]) or "none"
    throughput = f["throughput_samples_per_sec"]
    epochs = f"epochs {f['epochs_completed']} of {f['epochs']} completed"
    if f["last_row_epoch"] is not None and f["last_row_epoch"] != f["epochs_completed"]:  # metrics.csv's epoch: 1-based
        epochs += f", stopped inside epoch {f['last_row_epoch']}"
    lines += [
        f"  steps {steps}; {epochs}; world size {f['world_size']}; "
        f"backend {f['backend'] or 'none'}; device {f['device']}; mixed precision {f['mixed_precision']}",
        f"  best (step {f['best_step']}): {best}",
        f"  throughput {throughput:.1f} samples/s (mean over metrics rows); wall time {f['wall_time_sec']} s"
        if throughput is not None
        else f"  throughput unknown; wall time {f['wall_time_sec']} s",
    ]
    problems = report.problems
    lines.append("verify: OK" if not problems else f"verify: {len(problems)} problem(s): " + "; ".join(problems))
    return "\n".join(lines)


def _short(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir} is not a directory; give a run directory (it holds {CONFIG_FILE})")
    if args.expect_world_size is not None and args.expect_world_size < 1:
        raise UsageError(f"--expect-world-size {args.expect_world_size}: give a positive number of processes")
    report = inspect_run(run_dir, args.expect_world_size, args.expect_backend)
    print(format_report(report), flush=True)
    return 0 if not report.problems else 1
