"""Run a grid of flag values over a recipe: one run per combination, under one sweep directory.

    python -m toolkit sweep recipes/sasrec.py --grid seed=0,1,2 variant=sasrec,tisasrec --out DIR -- --epochs 50
    python -m toolkit sweep ... --launcher local --config-file accelerate_configs/cpu_2proc.yaml
    python -m toolkit sweep ... --launcher slurm [--sbatch slurm/multinode_cpu.sbatch] [--sbatch-option --nodes=1]

Flags after `--` go to every run. Each run is named after its values (`seed-0_variant-sasrec`) and lives in
DIR/runs/<name>; DIR/sweep.json (the manifest) records the recipe, the grid, the common flags and every run.
Every run is started with --resume-from auto, so running the same command again skips the finished runs (their
summary.json) and resumes the unfinished ones; a different grid, recipe or common flags in the same DIR is refused.

--launcher local runs them one after another here, each through `accelerate launch` (with --config-file, else
Accelerate's default config); its output goes to DIR/logs/<name>.log. --launcher slurm submits one job array, one
task per run, through the given sbatch script (slurm/common.sh reads the task's flags and run directory from
DIR/tasks/), so each task keeps the script's pre-emption and requeue. `python -m toolkit compare DIR` then prints
the table and draws the curves.

Before anything is made, every value of the grid is checked by the recipe's own flag parser (one `error:` line).
With --search instead of --grid, the values are drawn by an Optuna study (toolkit.tools.search).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.run.config import CHECK_ARGS
from toolkit.run.rundir import RunDir

MANIFEST = "sweep.json"
SET_BY_THE_SWEEP = {"output-dir", "resume-from", "run-name"}  # each run's own; a grid or `--` cannot set them
ROOT = Path(__file__).resolve().parents[2]  # the repository (toolkit/tools/sweep.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, metavar="RECIPE", help="the recipe script, e.g. recipes/sasrec.py")
    parser.add_argument("--grid", nargs="*", default=[], metavar="KEY=V1,V2",
                        help="flag values to combine, e.g. seed=0,1,2 lr=1e-3,3e-4 (KEY is the flag without --)")
    parser.add_argument("--out", type=Path, required=True, help="the sweep directory (made if missing)")
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local")
    parser.add_argument("--config-file", type=Path, default=None,
                        help="accelerate config for --launcher local (default: Accelerate's own)")
    parser.add_argument("--sbatch", type=Path, default=Path("slurm/multinode_cpu.sbatch"),
                        help="the sbatch script each array task runs (--launcher slurm)")
    parser.add_argument("--runs-per-device", type=int, default=1, metavar="N",
                        help="--launcher local: N single-process runs at once on each device: each GPU "
                             "(CUDA_VISIBLE_DEVICES), or on a CPU machine each of N groups of the cores (pinned, "
                             "--threads set to the group's size)")
    parser.add_argument("--max-parallel", type=int, default=0, metavar="N",
                        help="--launcher slurm: at most N array tasks at once (0 = as SLURM schedules them)")
    parser.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                        help="passed to sbatch, e.g. --sbatch-option=--nodes=1 (repeatable)")
    parser.epilog = "Flags after -- go to every run, e.g. -- --epochs 50"


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """{flag name without dashes: [values]} in the order given; one line naming the bad item otherwise."""
    if not items:
        raise UsageError("--grid is empty; give at least one KEY=V1,V2 (e.g. --grid seed=0,1,2)")
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().lstrip("-").replace("_", "-")
        listed = [v.strip() for v in values.split(",")]
        if not sep or not key or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", key):
            raise UsageError(f"--grid {item!r} is not KEY=V1,V2 (e.g. seed=0,1,2)")
        if not values or any(v == "" for v in listed):
            raise UsageError(f"--grid {item!r} has an empty value; give comma-separated values (e.g. {key}=1,2)")
        if key in SET_BY_THE_SWEEP:
            raise UsageError(f"--grid {item!r}: --{key} is set by the sweep for each run; grid other flags")
        if key in grid:
            raise UsageError(f"--grid names {key} twice; give each flag once with all its values")
        if len(set(listed)) != len(listed):
            raise UsageError(f"--grid {item!r} repeats a value; give each value once")
        grid[key] = listed
    return grid


def run_name(values: dict[str, str]) -> str:
    """A directory name from the run's values: seed-0_variant-sasrec (characters a path cannot hold become +)."""
    return "_".join(f"{key}-{re.sub(r'[^A-Za-z0-9.+=-]', '+', value)}" for key, value in values.items())


def plan(recipe: Path, grid: dict[str, list[str]], common: list[str], out: Path, launcher: str) -> dict:
    runs = []
    for combination in itertools.product(*grid.values()):
        values = dict(zip(grid, combination, strict=True))
        flags = [part for key, value in values.items() for part in (f"--{key}", value)]
        name = run_name(values)
        runs.append({"name": name, "values": values, "flags": flags, "output_dir": str(out / "runs" / name)})
    return {"recipe": str(recipe.resolve()), "grid": grid, "common": common, "launcher": launcher, "runs": runs}


def check_flags(recipe: Path, manifest: dict) -> None:
    """Every value through the recipe's parser (TOOLKIT_CHECK_ARGS: parse, check, exit), before anything is made.
    Runs are checked until each value of the grid has been seen once: as many parses as the longest value list."""
    unseen = {(key, value) for key, values in manifest["grid"].items() for value in values}
    for run in manifest["runs"]:
        if not unseen & set(run["values"].items()):
            continue
        unseen -= set(run["values"].items())
        why = refusal(recipe, [*run["flags"], *manifest["common"]])
        if why is not None:
            raise UsageError(f"run {run['name']} of the grid is refused by {recipe.name}: {why}")


def refusal(recipe: Path, flags: list[str], env: dict | None = None) -> str | None:
    """The recipe's own error for these flags (its parser and check(), TOOLKIT_CHECK_ARGS), or None if it takes them.
    env: other variables that make the recipe check something and exit (TOOLKIT_METRIC_PROBE) instead."""
    done = subprocess.run([sys.executable, str(recipe), *flags], env={**os.environ, **(env or {CHECK_ARGS: "1"})},
                          capture_output=True, text=True)
    if done.returncode == 0:
        return None
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return errors[0].removeprefix("error: ") if errors else (done.stderr.strip().splitlines() or ["?"])[-1]


def common_flags(common: list[str]) -> list[str]:
    for flag in common:
        if flag.startswith("--") and flag[2:].split("=")[0] in SET_BY_THE_SWEEP:
            raise UsageError(f"{flag} after -- is set by the sweep for each run; leave it out")
    return common


def check_options(args: argparse.Namespace) -> None:
    """The recipe, --out and the launcher's options (a grid's and a search's), each one line when wrong."""
    recipe, out = args.recipe, args.out
    if not recipe.is_file() or recipe.suffix != ".py":
        raise UsageError(f"RECIPE {recipe} is not a recipe script; give one of recipes/*.py")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory for the sweep")
    if args.launcher == "local" and args.config_file is not None and not args.config_file.is_file():
        raise UsageError(f"--config-file {args.config_file} does not exist; give an accelerate config file")
    if args.runs_per_device < 1:
        raise UsageError(f"--runs-per-device {args.runs_per_device} is invalid; give 1 or more")
    if args.runs_per_device > 1 and args.config_file is not None:
        raise UsageError("--runs-per-device runs single-process runs side by side; leave --config-file out (a "
                         "multi-process run takes the whole device)")
    if args.runs_per_device > 1 and args.launcher != "local":
        raise UsageError("--runs-per-device applies to --launcher local; under SLURM ask for the resources per task")
    if args.runs_per_device > 1:
        device_slots(args.runs_per_device)  # more runs than cores: refused here, before anything is made
    if args.max_parallel < 0:
        raise UsageError(f"--max-parallel {args.max_parallel} is invalid; give 0 (no limit) or a positive number")
    if args.launcher == "slurm" and not args.sbatch.is_file():
        raise UsageError(f"--sbatch {args.sbatch} does not exist; give an sbatch script (slurm/*.sbatch)")


def prepare(args: argparse.Namespace) -> tuple[Path, dict]:
    """Check everything and write (or re-read) the manifest; nothing is made before every check has passed."""
    recipe, out = args.recipe, args.out
    check_options(args)
    manifest = plan(recipe, parse_grid(args.grid), common_flags(list(args.common)), out.resolve(), args.launcher)
    previous = out / MANIFEST
    if previous.exists():
        try:
            before = json.loads(previous.read_text())
        except (OSError, ValueError):
            raise UsageError(f"{previous} is unreadable; restore it or choose another --out") from None
        same = {k: before.get(k) for k in ("recipe", "grid", "common")} == {
            k: manifest[k] for k in ("recipe", "grid", "common")}
        if not same:
            raise UsageError(f"--out {out} holds another sweep (its {MANIFEST} has another recipe, grid or common "
                             "flags); run the same command to continue it, or choose another --out")
    elif out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty and holds no {MANIFEST}; choose a new or empty directory")
    check_flags(recipe, manifest)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".{MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(previous)
    return out, manifest


def finished(run: dict) -> bool:
    return RunDir(run["output_dir"]).finished()


def launcher(config_file: Path | None) -> list[str]:
    """How a local run starts: `accelerate launch` with the given config, or with the user's default config (made by
    `accelerate config`); without either, plain python (one process), where `accelerate launch` would only add its
    warning about every default it filled in to each run's log."""
    if config_file is not None:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file.resolve())]
    from accelerate.commands.config import default_config_file

    if Path(default_config_file).is_file():
        return [sys.executable, "-m", "accelerate.commands.launch"]
    return [sys.executable]


def device_slots(runs_per_device: int) -> list[dict]:
    """Where side-by-side runs go: on a GPU machine, runs_per_device slots per GPU (CUDA_VISIBLE_DEVICES); else the
    cores this process may use, cut into runs_per_device groups, each run pinned to its group with as many threads.
    A slot: {"env": {...}, "cores": set or None, "threads": int or None, "name": str}."""
    import torch

    if torch.cuda.is_available():
        return [{"env": {"CUDA_VISIBLE_DEVICES": str(gpu)}, "cores": None, "threads": None, "name": f"GPU {gpu}"}
                for gpu in range(torch.cuda.device_count()) for _ in range(runs_per_device)]
    cores = sorted(os.sched_getaffinity(0))
    if runs_per_device > len(cores):
        raise UsageError(f"--runs-per-device {runs_per_device} is more than the {len(cores)} CPU cores here; give at "
                         f"most {len(cores)}")
    groups = [cores[i::runs_per_device] for i in range(runs_per_device)]
    return [{"env": {"OMP_NUM_THREADS": str(len(group))}, "cores": set(group), "threads": len(group),
             "name": f"cores {','.join(map(str, group))}"} for group in groups]


def run_local(out: Path, manifest: dict, config_file: Path | None, runs_per_device: int = 1) -> int:
    """The unfinished runs through `accelerate launch` (or plain python): one after another, or with
    --runs-per-device N several at once, one per device slot; a failed run is named and the others still run."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    failed = []
    total = len(manifest["runs"])
    slots = queue.Queue()
    for slot in device_slots(runs_per_device) if runs_per_device > 1 else [None]:
        slots.put(slot)
    say = threading.Lock()

    def one(index: int, run: dict) -> None:
        slot = slots.get()
        try:
            own_threads = any(flag == "--threads" or flag.startswith("--threads=") for flag in manifest["common"])
            threads = ["--threads", str(slot["threads"])] if slot and slot["threads"] and not own_threads else []
            command = [*launcher(config_file), manifest["recipe"], *run["flags"], *manifest["common"], *threads,
                       "--output-dir", run["output_dir"], "--resume-from", "auto"]
            log = logs / f"{run['name']}.log"
            where = f", {slot['name']}" if slot else ""
            with say:
                print(f"[{index}/{total}] {run['name']}: running (log {log}{where})", flush=True)
            began = time.perf_counter()
            with open(log, "a") as handle:
                handle.write(f"$ {shlex.join(command)}\n")
                handle.flush()
                cores = slot["cores"] if slot else None
                status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(slot["env"] if slot else {})},
                                        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
                                        ).returncode
            took = time.perf_counter() - began
            with say:
                if status == 0 and finished(run):
                    print(f"[{index}/{total}] {run['name']}: done in {took:.0f} s", flush=True)
                else:
                    failed.append(run["name"])
                    print(f"[{index}/{total}] {run['name']}: FAILED (exit {status}); see {log}", flush=True)
        finally:
            slots.put(slot)

    pending = []
    for index, run in enumerate(manifest["runs"], 1):
        if finished(run):
            print(f"[{index}/{total}] {run['name']}: finished before, skipped", flush=True)
        else:
            pending.append((index, run))
    with concurrent.futures.ThreadPoolExecutor(max_workers=slots.qsize()) as pool:
        for future in [pool.submit(one, index, run) for index, run in pending]:
            future.result()
    if failed:
        print(f"{len(failed)} of {total} runs failed: {', '.join(sorted(failed))}; fix and run the same command "
              "again (finished runs are skipped, the others resume)")
        return 1
    print(f"all {total} runs finished; compare them with: python -m toolkit compare {out}")
    return 0


def run_slurm(out: Path, manifest: dict, sbatch: Path, options: list[str], max_parallel: int = 0) -> int:
    """One job array: task i runs manifest run i through the sbatch script; finished runs are left out."""
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    wanted = [i for i, run in enumerate(manifest["runs"]) if not finished(run)]
    for i, run in enumerate(manifest["runs"]):
        (tasks / f"{i}.dir").write_text(run["output_dir"] + "\n")
        (tasks / f"{i}.args").write_text(shlex.join(run["flags"]) + "\n")
    if not wanted:
        print(f"all {len(manifest['runs'])} runs finished; compare them with: python -m toolkit compare {out}")
        return 0
    throttle = f"%{max_parallel}" if max_parallel else ""
    command = ["sbatch", "--parsable", f"--array={','.join(map(str, wanted))}{throttle}",
               f"--job-name=sweep-{out.name}",
               f"--output={out / 'logs' / 'slurm-%A_%a.out'}", f"--export=ALL,TOOLKIT_SWEEP={out}", *options,
               str(sbatch.resolve()), manifest["recipe"], *manifest["common"]]
    (out / "logs").mkdir(exist_ok=True)
    job = submit_array(command)
    print(f"submitted job array {job}: {len(wanted)} task(s) of {len(manifest['runs'])} runs "
          f"(tasks {','.join(map(str, wanted))}); when they end: python -m toolkit compare {out}")
    return 0


def submit_array(command: list[str]) -> str:
    """Run `sbatch --parsable ...` from the project root (the sbatch scripts source slurm/common.sh from there): the
    job array's id, or one line saying why not."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        raise UsageError("--launcher slurm: sbatch is not installed here; run on a SLURM login node, or use "
                         "--launcher local") from None
    if done.returncode != 0:  # sbatch's last line says why (its lines before it are the steps that led there)
        said = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise UsageError(f"sbatch refused the job array: {said}")
    return done.stdout.strip().split(";")[0]


def split_common(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the sweep's own arguments, the flags after the first `--` that go to every run)."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def main(args: argparse.Namespace) -> int:
    out, manifest = prepare(args)
    print(f"sweep of {Path(manifest['recipe']).name}: {len(manifest['runs'])} runs "
          f"({' x '.join(f'{len(v)} {k}' for k, v in manifest['grid'].items())}) in {out}", flush=True)
    if args.launcher == "slurm":
        return run_slurm(out, manifest, args.sbatch, args.sbatch_option, args.max_parallel)
    return run_local(out, manifest, args.config_file, args.runs_per_device)
