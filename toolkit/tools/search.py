"""Search flag values with Optuna: `python -m toolkit sweep RECIPE --search SPEC... --trials N --metric NAME`.

    python -m toolkit sweep recipes/template.py --search lr=log:1e-4:1e-1 hidden=int:16:64 --trials 20 \\
        --metric val_mse --direction min --prune median --out DIR -- --max-steps 200

SPEC: `lr=log:1e-4:1e-2` (a float, log-uniform), `dropout=0:0.5` (a float, uniform), `hidden=int:32:256` (an
integer), `variant=sasrec,tisasrec` (one of the values). Each trial is an ordinary run, DIR/runs/trial-0003, started
with its values as flags (config.json has them), the flags after `--` and --resume-from auto; DIR/sweep.json lists
the trials and their values. The study is Optuna's journal file DIR/study.journal (a file on a shared file system
serves every SLURM task). A trial's value is its --metric at the run's best step (summary.json's best_metrics, the
step whose checkpoint the recipe tests); a pruned trial (--prune median|hyperband) ends clean at the evaluation the
pruner stopped it at (toolkit.loop.trial).

Running the same command again continues the study: finished and pruned trials stay; a trial that was killed
(RUNNING in the journal, no summary.json) runs again with its own values and resumes from its checkpoint; more
--trials adds trials. Every sample is drawn by a sampler seeded with --search-seed + the trial's number, so a study
run one trial at a time draws the same values whether or not it was interrupted. `--launcher local
--runs-per-device N` runs N trials at once; `--launcher slurm` submits one job array whose tasks each take a trial
from the study (`python -m toolkit sweep --trial-worker DIR`, run by slurm/common.sh; a requeued task takes its
own trial again). `python -m toolkit compare DIR` adds the best trials, each value's importance and DIR/search.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import itertools
import json
import math
import os
import queue
import random
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UsageError
from toolkit.loop.trial import ENV, PROBE_ENV, make_pruner, open_storage, pruned_step
from toolkit.process import extras
from toolkit.run.rundir import RunDir
from toolkit.run.tracking import save_png
from toolkit.tools import sweep

JOURNAL = "study.journal"
STUDY = "search"  # the study's name in its journal (one study per sweep directory)
PICTURE = "search.png"
LOCK = ".search.lock"  # held while a process changes the study's trials or the manifest
SAME_STUDY = ("recipe", "search", "common", "metric", "direction", "sampler", "search_seed", "prune",
              "prune_after_trials")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("search (instead of --grid; needs optuna: pip install "
                                      "'accelerate-recipes[search]')")
    group.add_argument("--search", nargs="*", default=None, metavar="SPEC",
                       help="the flags to search: lr=log:1e-4:1e-2 (log-uniform), dropout=0:0.5 (uniform), "
                            "hidden=int:32:256 (integer), variant=sasrec,tisasrec (one of)")
    group.add_argument("--trials", type=int, default=None, metavar="N",
                       help="trials in the study (again with a larger N: the study goes on)")
    group.add_argument("--metric", default=None, metavar="NAME",
                       help="the validation metric to optimise, as metrics.csv names it (e.g. val_mse)")
    group.add_argument("--direction", choices=("max", "min"), default="max",
                       help="maximise or minimise --metric (min for a loss or an error)")
    group.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe",
                       help="Optuna's sampler (grid: integer and one-of specs only, every combination once)")
    group.add_argument("--search-seed", type=int, default=0, metavar="N", help="the sampler's seed")
    group.add_argument("--prune", choices=("none", "median", "hyperband"), default="none",
                       help="end a trial at an evaluation where it is behind (median: below the median of the "
                            "finished trials at that step)")
    group.add_argument("--prune-after-trials", type=int, default=5, metavar="N",
                       help="--prune median: prune only once N trials have finished")


@dataclass(frozen=True)
class Spec:
    """One searched flag: kind "log" or "float" (low, high), "int" (low, high) or "one-of" (choices)."""

    key: str
    kind: str
    low: str = ""
    high: str = ""
    choices: tuple[str, ...] = ()

    def text(self) -> str:
        if self.kind == "one-of":
            return ",".join(self.choices)
        return f"{'' if self.kind == 'float' else self.kind + ':'}{self.low}:{self.high}"

    def bounds(self) -> list[str]:
        """The values the recipe must take: each bound of a range, each choice."""
        return list(self.choices) if self.kind == "one-of" else [self.low, self.high]

    def grid(self) -> list:
        return list(self.choices) if self.kind == "one-of" else list(range(int(self.low), int(self.high) + 1))

    def suggest(self, trial) -> str:
        """Draw this flag's value for the trial; the flag's text (a float as its shortest exact repr)."""
        if self.kind == "one-of":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return str(trial.suggest_int(self.key, int(self.low), int(self.high)))
        return repr(trial.suggest_float(self.key, float(self.low), float(self.high), log=self.kind == "log"))


def parse_specs(items: list[str]) -> dict[str, Spec]:
    """{flag name: Spec} in the order given; one line naming the bad item otherwise."""
    if not items:
        raise UsageError("--search is empty; give at least one SPEC (e.g. --search lr=log:1e-4:1e-2)")
    specs: dict[str, Spec] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("_", "-")
        if not sep or not key or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", key) or not value:
            raise UsageError(f"--search {item!r} is not KEY=SPEC (e.g. lr=log:1e-4:1e-2, dropout=0:0.5, "
                             "hidden=int:32:256, variant=a,b)")
        if key in sweep.SET_BY_THE_SWEEP:
            raise UsageError(f"--search {item!r}: --{key} is set by the sweep for each run; search other flags")
        if key in specs:
            raise UsageError(f"--search names {key} twice; give each flag once")
        specs[key] = _spec(item, key, value)
    return specs


def _spec(item: str, key: str, value: str) -> Spec:
    if ":" not in value:
        choices = tuple(v.strip() for v in value.split(","))
        if len(choices) < 2 or any(not v for v in choices) or len(set(choices)) != len(choices):
            raise UsageError(f"--search {item!r}: give two or more different values (e.g. {key}=a,b) or a range "
                             f"(e.g. {key}=0:1)")
        return Spec(key, "one-of", choices=choices)
    parts = value.split(":")
    kind = parts.pop(0) if parts[0] in ("log", "int") else "float"
    if len(parts) != 2:
        raise UsageError(f"--search {item!r} is not a range; give LOW:HIGH, log:LOW:HIGH or int:LOW:HIGH")
    low, high = parts
    try:
        numbers = [int(v) for v in parts] if kind == "int" else [float(v) for v in parts]
    except ValueError:
        what = "integers" if kind == "int" else "numbers"
        raise UsageError(f"--search {item!r}: the bounds must be {what}") from None
    if not all(math.isfinite(n) for n in numbers) or not numbers[0] < numbers[1]:
        raise UsageError(f"--search {item!r}: the low bound must be below the high one")
    if kind == "log" and numbers[0] <= 0:
        raise UsageError(f"--search {item!r}: a log range needs a low bound above 0")
    return Spec(key, kind, low, high)


def bound_flags(specs: dict[str, Spec]) -> list[list[str]]:
    """Flag lists that together give the recipe every bound and choice once: the lowest values of every spec
    together, then the next, and so on (as few parses as the longest list of values)."""
    values = [spec.bounds() for spec in specs.values()]
    return [[part for spec, each in zip(specs.values(), values, strict=True) if i < len(each)
             for part in (f"--{spec.key}", each[i])] for i in range(max(map(len, values)))]


# ---- the study ------------------------------------------------------------------------------------------------
def trial_name(number: int) -> str:
    return f"trial-{number:04d}"


def flags_of(params: dict, specs: dict[str, Spec]) -> list[str]:
    """A trial's values as flags, in the specs' order (a float as its shortest exact repr)."""
    parts = []
    for key in specs:
        value = params[key]
        parts += [f"--{key}", repr(value) if isinstance(value, float) else str(value)]
    return parts


def load_study(out: Path, manifest: dict, create: bool = False):
    optuna = extras.load("search", "optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(out / JOURNAL)
    pruner = make_pruner(manifest["prune"], manifest["prune_after_trials"])
    direction = "maximize" if manifest["direction"] == "max" else "minimize"
    if create:
        return optuna.create_study(study_name=STUDY, storage=storage, direction=direction, pruner=pruner,
                                   load_if_exists=True)
    return optuna.load_study(study_name=STUDY, storage=storage, pruner=pruner)


def sampler_for(manifest: dict, specs: dict[str, Spec], number: int):
    """The sampler that draws trial `number`: seeded with --search-seed + number, so what it draws depends on the
    finished trials and the number alone (a resumed study draws what an uninterrupted one drew)."""
    optuna = extras.load("search", "optuna")
    seed = manifest["search_seed"] + number
    if manifest["sampler"] in ("random", "grid"):  # grid: the values are enqueued (ask)
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)  # parallel trials: no two alike


def ask(study, manifest: dict, specs: dict[str, Spec]):
    """A new trial with its values drawn. --sampler grid: the first combination no trial has taken, in an order
    shuffled by --search-seed (Optuna's GridSampler stops a study from inside tell(), which ask-and-tell cannot use)."""
    trials = study.get_trials(deepcopy=False)
    study.sampler = sampler_for(manifest, specs, len(trials))
    if manifest["sampler"] == "grid":
        taken = {tuple(t.params.get(key) for key in specs) for t in trials}
        order = list(itertools.product(*(spec.grid() for spec in specs.values())))
        random.Random(manifest["search_seed"]).shuffle(order)
        study.enqueue_trial(dict(zip(specs, next(c for c in order if c not in taken), strict=True)))
    trial = study.ask()
    for spec in specs.values():
        spec.suggest(trial)
    return trial


def result(summary: dict, metric: str) -> float | None:
    value = (summary.get("best_metrics") or {}).get(metric, (summary.get("final_metrics") or {}).get(metric))
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def record(study, out: Path, manifest: dict) -> None:
    """Tell the study the outcome of every RUNNING trial whose run has finished (its summary.json): its value, or
    pruned. The run directories are the truth; the journal learns from them (after the trial's process, or later)."""
    optuna = extras.load("search", "optuna")
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if not set(manifest["search"]) <= set(trial.params):  # killed while its values were drawn: never ran
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            continue
        summary = RunDir(out / "runs" / trial_name(trial.number)).read_summary()
        if summary is None:
            continue
        value = result(summary, manifest["metric"])
        if pruned_step(summary) is not None:
            study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
        elif value is None or not math.isfinite(value):
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial.number, value)


def write_manifest(out: Path, manifest: dict, study, specs: dict[str, Spec]) -> None:
    """sweep.json with every trial of the study: its number, run directory, values, flags and state."""
    manifest["runs"] = [{"name": trial_name(t.number), "trial": t.number, "state": t.state.name,
                         "values": dict(zip(specs, flags_of(t.params, specs)[1::2], strict=True)),
                         "flags": flags_of(t.params, specs), "value": t.value,
                         "output_dir": str(out / "runs" / trial_name(t.number))}
                        for t in study.get_trials(deepcopy=False) if set(specs) <= set(t.params)]
    if claims := study.user_attrs.get("claims"):  # SLURM: the array task (JOB_TASK) that runs each trial
        manifest["claims"] = claims
    partial = out / f".{sweep.MANIFEST}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(out / sweep.MANIFEST)


@contextlib.contextmanager
def locked(out: Path):
    """The study's trials and the manifest change under this lock (a local sweep's threads, SLURM's tasks)."""
    with open(out / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def trial_environment(out: Path, manifest: dict, number: int) -> str:
    """TOOLKIT_TRIAL for the trial's processes (toolkit.loop.trial)."""
    return json.dumps({"journal": str(out / JOURNAL), "study": STUDY, "trial": number, "metric": manifest["metric"],
                       "direction": manifest["direction"], "pruner": manifest["prune"],
                       "prune_after_trials": manifest["prune_after_trials"]})


# ---- the command ----------------------------------------------------------------------------------------------
def prepare(args: argparse.Namespace) -> tuple[Path, dict, dict[str, Spec]]:
    """Check everything (optuna, the specs, the options, every bound through the recipe) and write or re-read the
    manifest; nothing is made before every check has passed."""
    extras.load("search", "optuna")
    specs = parse_specs(args.search)
    sweep.check_options(args)
    if args.trials is None or args.trials < 1:
        raise UsageError(f"--trials {args.trials} is invalid; give the number of trials, 1 or more")
    if not args.metric or not re.fullmatch(r"[\w@/.-]+", args.metric):
        raise UsageError("--metric is missing; give the validation metric to optimise as metrics.csv names it "
                         "(e.g. --metric val_mse)")
    if args.prune_after_trials < 0:
        raise UsageError(f"--prune-after-trials {args.prune_after_trials} is invalid; give 0 or more")
    if args.sampler == "grid":
        floats = [spec.key for spec in specs.values() if spec.kind in ("log", "float")]
        if floats:
            raise UsageError(f"--sampler grid takes integer and one-of specs only; {', '.join(floats)} is a float "
                             "range (give values, e.g. lr=1e-3,1e-2, or use --sampler tpe)")
        size = math.prod(len(spec.grid()) for spec in specs.values())
        if args.trials > size:
            raise UsageError(f"--trials {args.trials} is more than the grid's {size} combinations; give at most {size}")
    common = sweep.common_flags(list(args.common))
    out = args.out
    manifest = {"recipe": str(args.recipe.resolve()), "search": {key: spec.text() for key, spec in specs.items()},
                "common": common, "metric": args.metric, "direction": args.direction, "sampler": args.sampler,
                "search_seed": args.search_seed, "prune": args.prune, "prune_after_trials": args.prune_after_trials,
                "trials": args.trials, "launcher": args.launcher, "runs": []}
    previous = out / sweep.MANIFEST
    if previous.exists():
        try:
            before = json.loads(previous.read_text())
        except (OSError, ValueError):
            raise UsageError(f"{previous} is unreadable; restore it or choose another --out") from None
        if {k: before.get(k) for k in SAME_STUDY} != {k: manifest[k] for k in SAME_STUDY}:
            raise UsageError(f"--out {out} holds another sweep (its {sweep.MANIFEST} has another recipe, search, "
                             "metric, sampler or common flags); run the same command to continue it, or choose "
                             "another --out")
        manifest["array_job"] = before.get("array_job")
    elif out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty and holds no {sweep.MANIFEST}; choose a new or empty directory")
    bounds = bound_flags(specs)
    for flags in bounds:
        why = sweep.refusal(args.recipe, [*flags, *common])
        if why is not None:
            raise UsageError(f"--search {' '.join(flags)} (the ranges' bounds) is refused by {args.recipe.name}: "
                             f"{why}")
    if not previous.exists():  # a new study: its metric and direction through the recipe's own loop
        why = metric_refusal(args.recipe, [*bounds[0], *common], args.metric, args.direction)
        if why is not None and why.startswith(("--metric", "--direction")):
            raise UsageError(why)
        if why is not None and args.launcher == "local":  # every trial would fail alike, on this machine
            raise UsageError(f"{args.recipe.name} {shlex.join([*bounds[0], *common])} fails before training: {why}")
        if why is not None:  # SLURM: the trials run on the cluster's nodes (a GPU this machine may not have)
            print(f"--metric {args.metric} not checked here ({args.recipe.name} does not start on this machine: "
                  f"{why}); each trial's first evaluation checks it", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    return out.resolve(), manifest, specs


def metric_refusal(recipe: Path, flags: list[str], metric: str, direction: str) -> str | None:
    """The recipe built as a trial builds it (data, model, loop) in a scratch directory, told to check --metric and
    --direction (TOOLKIT_METRIC_PROBE: its main metric without evaluating, another by evaluating the untrained
    model once) and exit; its one line, or None."""
    with tempfile.TemporaryDirectory(prefix="metric-probe-") as scratch:
        env = {PROBE_ENV: json.dumps({"metric": metric, "direction": direction})}
        return sweep.refusal(recipe, [*flags, "--output-dir", str(Path(scratch) / "run"), "--log-with", "none"], env)


def is_study(directory: Path) -> bool:
    return (directory / JOURNAL).is_file() and (directory / sweep.MANIFEST).is_file()


def main(args: argparse.Namespace) -> int:
    """`python -m toolkit sweep`: a search with --search, else the grid (toolkit.tools.sweep)."""
    if args.search is None:
        return sweep.main(args)
    if args.grid:
        raise UsageError("--grid and --search are two kinds of sweep; give one of them")
    out, manifest, specs = prepare(args)
    with locked(out):
        study = load_study(out, manifest, create=True)
        write_manifest(out, manifest, study, specs)
    print(f"search of {Path(manifest['recipe']).name}: {manifest['trials']} trials of "
          f"{' '.join(f'{k}={v}' for k, v in manifest['search'].items())}, {manifest['direction']} "
          f"{manifest['metric']} ({manifest['sampler']} sampler, seed {manifest['search_seed']}, pruning "
          f"{manifest['prune']}) in {out}", flush=True)
    if args.launcher == "slurm":
        return run_slurm(out, manifest, specs, args.sbatch, args.sbatch_option, args.max_parallel)
    return run_local(out, manifest, specs, args.config_file, args.runs_per_device)


def _states():
    return extras.load("search", "optuna").trial.TrialState


def _outcome(study, out: Path, number: int) -> str:
    trial = study.get_trials(deepcopy=False)[number]
    if trial.state == _states().PRUNED:
        return f"pruned at step {pruned_step(RunDir(out / 'runs' / trial_name(number)).read_summary())}"
    return f"{trial.state.name.lower()}" + (f", value {trial.value:.6g}" if trial.value is not None else "")


def _log_error(log: Path) -> str | None:
    try:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    except OSError:
        return None
    return errors[-1].removeprefix("error: ") if errors else None


def run_local(out: Path, manifest: dict, specs: dict[str, Spec], config_file: Path | None,
              runs_per_device: int = 1) -> int:
    """The study here: killed trials first (resumed with their values), then new ones until --trials; one at a time,
    or with --runs-per-device N, N at once (one per device slot). Only this thread asks and tells the study."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    try:
        guard = open(out / ".search.local", "a")
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"another `toolkit sweep` is running the study in {out}; wait for it to end") from None
    states = _states()
    with locked(out):
        study = load_study(out, manifest)
        record(study, out, manifest)  # runs that finished after their sweep was killed
        killed = [t.number for t in study.get_trials(deepcopy=False, states=(states.RUNNING,))]
        write_manifest(out, manifest, study, specs)
    slots = queue.Queue()
    for slot in sweep.device_slots(runs_per_device) if runs_per_device > 1 else [None]:
        slots.put(slot)
    width, say = slots.qsize(), threading.Lock()
    failed: dict[int, str] = {}
    stop: list[str] = []  # a usage error in a trial (a --metric the recipe does not report): no new trials

    def one(number: int, flags: list[str], again: bool) -> int:
        slot = slots.get()
        try:
            own_threads = any(f == "--threads" or f.startswith("--threads=") for f in manifest["common"])
            threads = ["--threads", str(slot["threads"])] if slot and slot["threads"] and not own_threads else []
            run_dir = out / "runs" / trial_name(number)
            command = [*sweep.launcher(config_file), manifest["recipe"], *flags, *manifest["common"], *threads,
                       "--output-dir", str(run_dir), "--resume-from", "auto"]
            log = logs / f"{trial_name(number)}.log"
            with say:
                print(f"[trial {number}] {' '.join(flags)}: {'resumed' if again else 'running'} (log {log}"
                      f"{', ' + slot['name'] if slot else ''})", flush=True)
            with open(log, "a") as handle:
                handle.write(f"$ {shlex.join(command)}\n")
                handle.flush()
                cores = slot["cores"] if slot else None
                env = {**os.environ, **(slot["env"] if slot else {}), ENV: trial_environment(out, manifest, number)}
                return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None
                                      ).returncode
        finally:
            slots.put(slot)

    def finished(number: int, status: int, took: float) -> None:
        with locked(out):
            record(study, out, manifest)
            log = logs / f"{trial_name(number)}.log"
            trial = study.get_trials(deepcopy=False)[number]
            if trial.state == states.RUNNING:  # no summary.json: the run failed
                why = _log_error(log) or f"exit {status}"
                if status == 2 and why.startswith(("--metric", "--direction")):
                    study.tell(number, state=states.FAIL)  # every trial would fail alike: the study stops
                    stop.append(why)
                elif "no result is reported" in why:  # diverged (e.g. a learning rate too high): a result
                    study.tell(number, state=states.FAIL)
                else:
                    failed[number] = why  # left RUNNING: the same command again resumes it
            write_manifest(out, manifest, study, specs)
        with say:
            print(f"[trial {number}] {_outcome(study, out, number)} in {took:.0f} s"
                  + (f": {failed[number]} (see {log})" if number in failed else ""), flush=True)

    def timed(number, flags, again):
        began = time.perf_counter()
        return number, one(number, flags, again), time.perf_counter() - began

    with concurrent.futures.ThreadPoolExecutor(max_workers=width) as pool:
        active: set = set()
        while True:
            while len(active) < width and not stop and (killed or len(study.get_trials(deepcopy=False))
                                                        < manifest["trials"]):
                if killed:
                    number, again = killed.pop(0), True
                    params = study.get_trials(deepcopy=False)[number].params
                else:
                    with locked(out):
                        trial = ask(study, manifest, specs)
                        write_manifest(out, manifest, study, specs)
                    number, again, params = trial.number, False, trial.params
                active.add(pool.submit(timed, number, flags_of(params, specs), again))
            if not active:
                break
            done, active = concurrent.futures.wait(active, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                finished(*future.result())
    guard.close()
    if stop:
        raise UsageError(f"{stop[0]} (the study in {out} stopped; run it again with another --out)")
    report_best(study, manifest)
    if failed:
        print(f"{len(failed)} trial(s) failed: {', '.join(map(str, sorted(failed)))}; fix and run the same command "
              "again (they resume with their values)")
        return 1
    print(f"all {manifest['trials']} trials ended; compare them with: python -m toolkit compare {out}")
    return 0


def report_best(study, manifest: dict) -> None:
    try:
        best = study.best_trial
    except ValueError:  # no finished trial
        print("no trial has finished yet")
        return
    print(f"best: trial {best.number}, {manifest['metric']} {best.value:.6g} with "
          f"{' '.join(f'{k}={v}' for k, v in best.params.items())}")


# ---- SLURM ----------------------------------------------------------------------------------------------------
def run_slurm(out: Path, manifest: dict, specs: dict[str, Spec], sbatch: Path, options: list[str],
              max_parallel: int = 0) -> int:
    """One job array of as many tasks as trials are left; each task takes a trial from the study when it starts
    (claim). A previous array of this study still queued or running is waited for, not doubled."""
    previous = manifest.get("array_job")
    if previous:
        queued = subprocess.run(["squeue", "-h", "-j", str(previous), "-o", "%i"], capture_output=True, text=True)
        if queued.returncode == 0 and queued.stdout.strip():
            raise UsageError(f"job array {previous} of this study is still queued or running; wait for it to end "
                             f"(or scancel {previous}), then run the same command again")
    states = _states()
    with locked(out):
        study = load_study(out, manifest)
        record(study, out, manifest)
        ended = len(study.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED, states.FAIL)))
        write_manifest(out, manifest, study, specs)
    left = manifest["trials"] - ended
    if left <= 0:
        report_best(study, manifest)
        print(f"all {manifest['trials']} trials ended; compare them with: python -m toolkit compare {out}")
        return 0
    (out / "logs").mkdir(exist_ok=True)
    (out / "tasks").mkdir(exist_ok=True)
    throttle = f"%{max_parallel}" if max_parallel else ""
    command = ["sbatch", "--parsable", f"--array=0-{left - 1}{throttle}", f"--job-name=search-{out.name}",
               f"--output={out / 'logs' / 'slurm-%A_%a.out'}", f"--export=ALL,TOOLKIT_SEARCH={out}", *options,
               str(sbatch.resolve()), manifest["recipe"], *manifest["common"]]
    job = sweep.submit_array(command)
    with locked(out):
        manifest["array_job"] = job
        write_manifest(out, manifest, study, specs)
    print(f"submitted job array {job}: {left} task(s), one trial each; when they end: python -m toolkit compare "
          f"{out}")
    return 0


def claim(out: Path) -> int:
    """An array task's trial (`python -m toolkit sweep --trial-worker DIR`): its own again after a requeue, else a
    trial a previous array left unfinished, else a new one; prints its name (nothing when the study is complete) and
    writes DIR/tasks/<name>.args, .dir and .trial (the flags, the run directory, TOOLKIT_TRIAL) for slurm/common.sh."""
    out = out.resolve()
    manifest = json.loads((out / sweep.MANIFEST).read_text())
    specs = parse_specs([f"{key}={text}" for key, text in manifest["search"].items()])
    job, task = os.environ.get("SLURM_ARRAY_JOB_ID", ""), os.environ.get("SLURM_ARRAY_TASK_ID", "")
    owner = f"{job}_{task}"
    states = _states()
    with locked(out):
        study = load_study(out, manifest)
        record(study, out, manifest)
        claims = {int(k): v for k, v in study.user_attrs.get("claims", {}).items()}
        running = [t.number for t in study.get_trials(deepcopy=False, states=(states.RUNNING,))]
        mine = [n for n in running if claims.get(n) == owner]
        orphans = [n for n in running if claims.get(n, "_").split("_")[0] != job]
        if mine or orphans:
            number = (mine or orphans)[0]
        elif len(study.get_trials(deepcopy=False)) < manifest["trials"]:
            number = ask(study, manifest, specs).number
        else:
            return 0
        claims[number] = owner
        study.set_user_attr("claims", {str(k): v for k, v in claims.items()})
        write_manifest(out, manifest, study, specs)
        params = study.get_trials(deepcopy=False)[number].params
    name = trial_name(number)
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.args").write_text(shlex.join(flags_of(params, specs)) + "\n")
    (tasks / f"{name}.dir").write_text(str(out / "runs" / name) + "\n")
    (tasks / f"{name}.trial").write_text(trial_environment(out, manifest, number) + "\n")
    print(name)
    return 0


# ---- compare --------------------------------------------------------------------------------------------------
def report(out: Path, top: int = 5) -> None:
    """For `python -m toolkit compare DIR` on a study: the best trials, each flag's importance, DIR/search.png."""
    manifest = json.loads((out / sweep.MANIFEST).read_text())
    specs = parse_specs([f"{key}={text}" for key, text in manifest["search"].items()])
    optuna = extras.load("search", "optuna")
    states = _states()
    with locked(out):
        study = load_study(out, manifest)
        record(study, out, manifest)
        write_manifest(out, manifest, study, specs)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == states.COMPLETE]
    done.sort(key=lambda t: t.value, reverse=manifest["direction"] == "max")
    counts = {state.name.lower(): sum(t.state == state for t in trials) for state in states}
    print(f"\nstudy {out.name}: {len(trials)} of {manifest['trials']} trials "
          f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}); {manifest['direction']} {manifest['metric']}")
    if done:
        print(f"best trials ({manifest['metric']}, {manifest['direction']}):")
        for t in done[:top]:
            print(f"  {trial_name(t.number)}  {t.value:.6g}  {' '.join(f'{k}={v}' for k, v in t.params.items())}")
    try:
        with warnings.catch_warnings():  # too few trials: said below in one line instead
            warnings.simplefilter("ignore")
            importances = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError) as error:
        print(f"importance: not computed ({str(error).splitlines()[0]})")
    else:
        if len(done) < 2 or not importances:
            print("importance: needs two or more finished trials")
        else:
            print("importance: " + ", ".join(f"{k} {v:.2f}" for k, v in importances.items()))
    try:
        plot(study, manifest, specs, out / PICTURE)
        print(f"wrote {out / PICTURE}")
    except extras.MissingExtra as missing:
        print(f"{out / PICTURE} not drawn: {missing}")


def plot(study, manifest: dict, specs: dict[str, Spec], path: Path) -> None:
    """The metric against each searched flag (a log axis for a log range), and over the trials with the best so far;
    pruned trials at their last reported value, hollow."""
    plt = extras.pyplot()
    states = _states()
    shown = [t for t in study.get_trials(deepcopy=False)
             if t.state == states.COMPLETE or (t.state == states.PRUNED and t.intermediate_values)]

    def value(t):
        return t.value if t.state == states.COMPLETE else t.intermediate_values[max(t.intermediate_values)]

    figure, axes = plt.subplots(1, len(specs) + 1, figsize=(3.6 * (len(specs) + 1), 3.4), squeeze=False)
    for axis, (key, spec) in zip(axes[0], specs.items(), strict=False):
        for pruned in (False, True):
            group = [t for t in shown if (t.state == states.PRUNED) == pruned]
            x = [t.params[key] if spec.kind != "one-of" else spec.choices.index(t.params[key]) for t in group]
            axis.scatter(x, [value(t) for t in group], facecolors="none" if pruned else "C0", edgecolors="C0",
                         label="pruned" if pruned else "finished")
        if spec.kind == "log":
            axis.set_xscale("log")
        if spec.kind == "one-of":
            axis.set_xticks(range(len(spec.choices)), spec.choices)
        axis.set_xlabel(key)
        axis.set_ylabel(manifest["metric"])
        axis.grid(alpha=0.3)
        if any(t.state == states.PRUNED for t in shown):
            axis.legend(fontsize=8)
    axis = axes[0][-1]
    ordered = sorted(shown, key=lambda t: t.number)
    for pruned in (False, True):
        group = [t for t in ordered if (t.state == states.PRUNED) == pruned]
        axis.scatter([t.number for t in group], [value(t) for t in group], facecolors="none" if pruned else "C0",
                     edgecolors="C0", s=14)
    best, line = None, []
    for t in ordered:
        if t.state == states.COMPLETE:
            better = best is None or (t.value > best if manifest["direction"] == "max" else t.value < best)
            best = t.value if better else best
        line.append(best)
    axis.step([t.number for t in ordered], line, where="post", color="C1", label="best so far")
    axis.set_xlabel("trial")
    axis.xaxis.get_major_locator().set_params(integer=True)
    axis.set_ylabel(manifest["metric"])
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    save_png(figure, path, dpi=110)
