"""A fault-injection campaign you can run: kills, signals and full disks at random moments, each followed by a resume
that must end byte-identical to an uninterrupted run.

    python tests/fault_campaign.py                    # every campaign, a new random seed (printed)
    python tests/fault_campaign.py --seed 7 --quick   # a few trials per campaign, reproducibly chosen
    python tests/fault_campaign.py --only signal --trials 20
    python tests/fault_campaign.py --plan             # the trials the seed gives, nothing run
    make faults

Three campaigns, each trial in a temporary directory of its own:
- kill: `kill -9` of the process (1 process), of the launcher (`python -m toolkit launch` or plain `accelerate
  launch`, 2 gloo processes) or of rank 0 / rank 1, at a random step or a random moment of the run (start-up,
  saves and the final test included);
- signal: SIGTERM or SIGUSR1 to the process, to either launcher or to a worker. At a step the run must checkpoint
  at the next step, say so in one line and exit 0 (docs/hardware.md, "Pre-emption and requeue"; a plain `accelerate
  launch` that gets SIGUSR1 dies and its workers stop without a checkpoint, as its signal table says); before training
  it may stop at once, in one line; a Python traceback is a failure wherever it appears;
- disk: the run directory on a tmpfs of a few KB (root only: `mount -t tmpfs -o size=N`), which fills at some
  write: one `error: no space left ...` line, exit 1, no partial or staging file left; then the disk is enlarged.

After each fault the run is resumed with `--resume-from auto` (same flags, same launcher) to its end and compared
with an uninterrupted reference run of the same recipe, flags and process count: the final checkpoint's
model.safetensors byte for byte, log.csv byte for byte, metrics.csv's header byte for byte and its rows less the
timing columns (`python -m toolkit verify` checks the resumed run as well). After every life no process of the trial
may be left alive (psutil). A "step" moment is exact: a hook after every optimizer step (toolkit.loop.training's
AFTER_STEP_HOOKS) writes the step and stops the chosen rank there (SIGSTOP) while the fault is delivered. A "time"
moment is a fraction of the reference run's wall time, so which code it hits varies with the machine's load; the
seed fixes the trials and their fractions, not what a busy machine makes of them.

The recipes run at the tests' tiny sizes (the toy recipe, tests/toy_recipe.py, in half of the trials). Prints one
line per trial, then one table (campaign | trials | passed | failures) and each failure's reason; exits 1 on any
failure. It is a tool, not part of `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from toolkit.run.tracking import TRAILING_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "accelerate_configs"
DATA_CACHE = ROOT / ".cache" / "test-data"  # shared with the tests (tests/conftest.py)
BIN = Path(sys.executable).parent
PYTHON = sys.executable

# Every recipe with the same cadence: checkpoints every 3 steps (the newest 3 kept: pruning runs), evaluations every
# 4, so step_3 is saved before metrics.csv's first row and a life killed after step 4 resumes from it with a row to
# cut; the loss read every 5 steps, so a pre-emption acted on at the read cadence instead of the next step shows.
CADENCE = [
    "--log-with",
    "csv",
    "--log-every",
    "5",
    "--checkpoint-every",
    "3",
    "--eval-every-steps",
    "4",
    "--keep-checkpoints",
    "3",
]
TIMING = set(TRAILING_COLUMNS) - {"world_size"}  # metrics.csv's measured columns: they differ run to run


@dataclass(frozen=True)
class Recipe:
    script: str
    steps: int  # --max-steps
    args: tuple[str, ...]  # the tests' tiny sizes


RECIPES = {
    "toy": Recipe(str(ROOT / "tests" / "toy_recipe.py"), 12, ()),
    "sasrec": Recipe(
        str(ROOT / "recipes" / "sasrec.py"),
        10,
        (
            "--hidden",
            "16",
            "--blocks",
            "1",
            "--maxlen",
            "20",
            "--batch-size",
            "64",
            "--dropout",
            "0.3",
            "--cache-dir",
            str(DATA_CACHE),
        ),
    ),
    "ufs_emulator": Recipe(str(ROOT / "recipes" / "ufs_emulator.py"), 10, ("--batch-size", "40", "--lr", "3e-3")),
    "dcrnn": Recipe(
        str(ROOT / "recipes" / "dcrnn.py"),
        8,
        (
            "--cache-dir",
            str(DATA_CACHE),
            "--units",
            "8",
            "--batch-size",
            "32",
            "--sampling-decay-steps",
            "3",
            "--lr-decay-epochs",
            "1",
            "--threads",
            "1",
        ),
    ),
    "hrm": Recipe(
        str(ROOT / "recipes" / "hrm.py"),
        6,
        (
            "--cache-dir",
            str(DATA_CACHE),
            "--train-puzzles",
            "48",
            "--aug",
            "1",
            "--val-puzzles",
            "16",
            "--test-puzzles",
            "16",
            "--max-blanks",
            "8",
            "--hidden",
            "16",
            "--heads",
            "2",
            "--expansion",
            "2",
            "--batch-size",
            "16",
            "--halt-max-steps",
            "2",
            "--exploration-prob",
            "0.5",
            "--warmup-steps",
            "2",
            "--threads",
            "1",
        ),
    ),
}
REAL = ["sasrec", "ufs_emulator", "dcrnn", "hrm"]

# The interrupted life runs the recipe through this: after every optimizer step each rank writes the step to
# FAULT_MARKS/rank<r> and, at FAULT_STOP_STEP, rank FAULT_STOP_RANK stops itself (SIGSTOP) until the campaign has
# delivered its fault and continues it (SIGCONT); FAULT_SAVE_STEP stops the main process inside the save of that
# step's checkpoint instead (its files written, not yet complete).
FAULTPOINT = """
import os, runpy, signal, sys
from toolkit.process import begin_process
begin_process()  # first, as every recipe: the signal handlers
from toolkit.loop.training import AFTER_STEP_HOOKS
rank = os.environ.get("RANK", "0")
marks = os.environ["FAULT_MARKS"]
stop_step, stop_rank = int(os.environ.get("FAULT_STOP_STEP", "0")), os.environ.get("FAULT_STOP_RANK", "0")
def mark(loop):
    step = loop.progress.global_step
    path = os.path.join(marks, "rank" + rank)
    with open(path + ".tmp", "w") as handle:
        handle.write(str(step))
    os.replace(path + ".tmp", path)
    if step == stop_step and rank == stop_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
AFTER_STEP_HOOKS.append(mark)
from toolkit.run import checkpoint
save_step, write_manifest = int(os.environ.get("FAULT_SAVE_STEP", "0")), checkpoint.write_manifest
def stop_in_the_save(directory):  # the main process, its files written, before the manifest, rename and marker
    if save_step and os.path.basename(str(directory)) == f".step_{save_step}.saving":
        os.kill(os.getpid(), signal.SIGSTOP)
    return write_manifest(directory)
checkpoint.write_manifest = stop_in_the_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class Trial:
    campaign: str  # kill | signal | disk
    recipe: str
    world: int  # processes
    launcher: str  # python (1 process) | toolkit (`python -m toolkit launch`) | accelerate (plain `accelerate launch`)
    target: str = ""  # process | launcher | rank0 | rank1
    sig: str = ""  # KILL | TERM | USR1
    moment: tuple = ()  # ("step", k) | ("time", fraction of the reference's wall time) | ("kb", disk size)

    def describe(self) -> str:
        where = {"python": "1 process", "toolkit": "toolkit launch", "accelerate": "accelerate launch"}[self.launcher]
        if self.campaign == "disk":
            return f"{self.recipe} {where}, disk of {self.moment[1]} KB" + (" (filled)" if not self.moment[1] else "")
        kind, value = self.moment
        when = {"step": f"after step {value}", "save": f"during the save of step {value}"}.get(
            kind, f"at {value:.2f} x the run's time"
        )
        return f"{self.recipe} {where}, SIG{self.sig} to {self.target} {when}"


@dataclass
class Outcome:
    trial: Trial
    problems: list[str] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    verify: subprocess.Popen | None = None
    directory: Path | None = None


# ---- the plan --------------------------------------------------------------------------------------------------

SETUPS = {  # (processes, launcher, target)
    "kill": [
        (1, "python", "process"),
        (2, "toolkit", "launcher"),
        (2, "toolkit", "rank0"),
        (2, "toolkit", "rank1"),
        (2, "accelerate", "launcher"),
        (2, "accelerate", "rank1"),
    ],
    "signal": [
        (1, "python", "process"),
        (2, "toolkit", "launcher"),
        (2, "toolkit", "rank0"),
        (2, "toolkit", "rank1"),
        (2, "accelerate", "launcher"),
        (2, "accelerate", "rank0"),
        (2, "accelerate", "rank1"),
    ],
}
# The first trials of each campaign, always run (--quick runs these): the moments known to matter, before the first
# metrics row and at the first checkpoint among them. Their fractions and disk sizes still come from the seed.
PINNED = {
    "kill": [
        ("toy", 1, "python", "process", "KILL", ("save", 4)),  # after the row of step 4: from step_3, saved before it
        ("toy", 2, "toolkit", "rank1", "KILL", ("step", 5)),
        ("toy", 2, "accelerate", "launcher", "KILL", ("time", None)),
        ("toy", 2, "toolkit", "launcher", "KILL", ("step", 1)),  # before the first checkpoint
        ("toy", 2, "toolkit", "rank0", "KILL", ("time", None)),
    ],
    "signal": [
        ("toy", 2, "toolkit", "launcher", "TERM", ("step", 1)),  # saved at step 2: before the first row
        ("toy", 2, "accelerate", "launcher", "TERM", ("step", 3)),  # saved at step 4, an evaluation step
        ("toy", 1, "python", "process", "USR1", ("step", 1)),
        ("toy", 2, "toolkit", "rank1", "USR1", ("step", 6)),
        ("toy", 2, "accelerate", "launcher", "USR1", ("step", 5)),
        ("toy", 2, "accelerate", "rank0", "TERM", ("step", 2)),
        ("toy", 1, "python", "process", "TERM", ("time", None)),
    ],
    "disk": [("toy", 1, "python", 0), ("toy", 1, "python", 12), ("toy", 1, "python", 100)],
}
DEFAULT_TRIALS = {"kill": 12, "signal": 12, "disk": 6}
QUICK_TRIALS = {"kill": 3, "signal": 3, "disk": 3}


def plan(campaign: str, trials: int, rng: random.Random) -> list[Trial]:
    chosen = []
    for i in range(trials):
        if i < len(PINNED[campaign]):
            spec = PINNED[campaign][i]
        elif campaign == "disk":
            world = 2 if rng.random() < 0.3 else 1
            spec = ("toy", world, "toolkit" if world == 2 else "python", rng.randrange(0, 244, 4))
        else:
            recipe = "toy" if rng.random() < 0.5 else rng.choice(REAL)
            world, launcher, target = rng.choice(SETUPS[campaign])
            sig = "KILL" if campaign == "kill" else rng.choice(["TERM", "USR1"])
            steps = RECIPES[recipe].steps
            draw = rng.random()
            saves = range(3, steps, 3)  # the checkpoint cadence's saves before the last step
            moment = (
                ("step", rng.randint(1, steps - 2))
                if draw < 0.45
                else (("save", rng.choice(saves)) if draw < 0.65 else ("time", None))
            )
            spec = (recipe, world, launcher, target, sig, moment)
        if campaign == "disk":
            recipe, world, launcher, kb = spec
            chosen.append(Trial("disk", recipe, world, launcher, moment=("kb", kb)))
            continue
        recipe, world, launcher, target, sig, moment = spec
        if moment == ("time", None):
            moment = ("time", round(rng.uniform(0.03, 1.0), 2))
        chosen.append(Trial(campaign, recipe, world, launcher, target, sig, moment))
    return chosen


# ---- running lives ---------------------------------------------------------------------------------------------


def recipe_env(extra: dict | None = None, idle_load: Path | None = None) -> dict:
    """The environment of a recipe started from a user's shell, as tests/conftest.py's recipe_env: one OpenMP thread,
    gloo on the loopback, no bars, and the machine's load read as idle (no restart under PASSIVE mid-trial)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "ACCELERATE_", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    }
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
            "TQDM_DISABLE": "1",
            "PYTHONWARNINGS": "ignore",
        }
    )
    if idle_load is not None:
        env["TOOLKIT_LOAD_FILE"] = str(idle_load)
    env.update(extra or {})
    return env


def command(trial: Trial, args: list[str], faultpoint: Path | None) -> list[str]:
    script = [str(faultpoint), RECIPES[trial.recipe].script] if faultpoint else [RECIPES[trial.recipe].script]
    if trial.launcher == "python":
        return [PYTHON, *script, *args]
    launch = [PYTHON, "-m", "toolkit", "launch"] if trial.launcher == "toolkit" else [str(BIN / "accelerate"), "launch"]
    return [*launch, "--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", "0", *script, *args]


def run_args(trial: Trial, data: dict[str, Path], out: Path) -> list[str]:
    recipe = RECIPES[trial.recipe]
    extra = ["--data", str(data[trial.recipe])] if trial.recipe in data else []
    return [*recipe.args, *extra, *CADENCE, "--max-steps", str(recipe.steps), "--output-dir", str(out)]


@dataclass
class Life:
    rc: int | None
    output: str  # stdout and stderr
    seconds: float
    seen: int = 0  # the newest step any rank had finished when the fault came
    ended_first: bool = False  # the run ended before the fault could be delivered


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive_in(directory: Path) -> list[psutil.Process]:
    """Processes whose command line names the trial's directory (orphans re-parented to init included)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and str(directory) in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


def finish_life(
    proc: subprocess.Popen,
    tracked: dict[int, psutil.Process],
    directory: Path,
    logs: tuple[Path, Path],
    started: float,
    timeout: float,
    problems: list[str],
) -> Life:
    """Wait for the life's first process and then for every process it started; any still alive after a grace
    period is a problem (and is killed)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        tracked.update({p.pid: p for p in descendants(proc.pid)})
        time.sleep(0.05)  # polling a condition (the life ended), not a timed wait
    if proc.poll() is None:
        problems.append(f"the life did not end within {timeout:.0f} s")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - started
    # Workers of a dead launcher stop within a second (toolkit.process.orphans); plain accelerate launch's agent may
    # wait
    # 30 s for its workers after a SIGTERM.
    rest = [p for p in {**tracked, **{p.pid: p for p in alive_in(directory)}}.values() if p.pid != proc.pid]
    _, left = psutil.wait_procs(rest, timeout=40)
    left = [p for p in left if running(p)]
    if left:
        names = ", ".join(f"pid {p.pid} ({' '.join(p.cmdline()[1:3])})" for p in left[:3])
        problems.append(f"{len(left)} process(es) left alive 40 s after the life ended: {names}")
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    output = logs[0].read_text(errors="replace") + logs[1].read_text(errors="replace")
    return Life(proc.returncode, output, seconds)


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_life(
    trial: Trial,
    args: list[str],
    directory: Path,
    name: str,
    env: dict,
    problems: list[str],
    timeout: float = 900,
    faultpoint: Path | None = None,
) -> Life:
    logs = (directory / f"{name}.out", directory / f"{name}.err")
    started = time.monotonic()
    with open(logs[0], "w") as out, open(logs[1], "w") as err:
        proc = subprocess.Popen(
            command(trial, args, faultpoint), cwd=directory, env=env, stdout=out, stderr=err, start_new_session=True
        )
    return finish_life(proc, {}, directory, logs, started, timeout, problems)


def state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def rank_of(proc: psutil.Process) -> str | None:
    try:
        if not any(part.endswith("faultpoint.py") for part in proc.cmdline()):
            return None
        return proc.environ().get("RANK")  # a launcher's own command line names the fault point too
    except psutil.Error:
        return None


def marks_seen(marks: Path) -> int:
    steps = []
    for path in marks.glob("rank?"):
        with contextlib.suppress(OSError, ValueError):
            steps.append(int(path.read_text()))
    return max(steps, default=0)


def interrupted_life(
    trial: Trial,
    args: list[str],
    directory: Path,
    env: dict,
    reference_seconds: float,
    faultpoint: Path,
    problems: list[str],
) -> Life:
    """Start the run through the fault point, deliver the trial's fault at its moment, and wait for every process."""
    marks = directory / "marks"
    marks.mkdir()
    kind, value = trial.moment
    stop_rank = trial.target[-1] if trial.target.startswith("rank") and kind == "step" else "0"
    extra = {
        "FAULT_MARKS": str(marks),
        "FAULT_STOP_STEP": str(value if kind == "step" else 0),
        "FAULT_SAVE_STEP": str(value if kind == "save" else 0),
        "FAULT_STOP_RANK": stop_rank,
    }
    logs = (directory / "life.out", directory / "life.err")
    started = time.monotonic()
    with open(logs[0], "w") as out, open(logs[1], "w") as err:
        proc = subprocess.Popen(
            command(trial, args, faultpoint),
            cwd=directory,
            env={**env, **extra},
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    tracked: dict[int, psutil.Process] = {}

    def processes() -> dict[str, psutil.Process]:
        found = {p.pid: p for p in descendants(proc.pid)}
        tracked.update(found)
        by_role = {"process": psutil.Process(proc.pid), "launcher": psutil.Process(proc.pid)}
        for p in found.values():
            rank = rank_of(p)
            if rank is not None:
                by_role[f"rank{rank}"] = p
        return by_role

    deadline = started + 600
    ended_first = False
    target = None
    with contextlib.suppress(psutil.NoSuchProcess):
        while True:
            if proc.poll() is not None:
                ended_first = True
                break
            if time.monotonic() > deadline:
                problems.append(f"the fault's moment ({kind} {value}) did not come within 600 s")
                break
            roles = processes()
            if kind in ("step", "save"):
                frozen = roles.get(f"rank{stop_rank}") if trial.world == 2 else roles["process"]
                ready = frozen is not None and state(frozen.pid) == "T"
            else:
                ready = time.monotonic() - started >= value * reference_seconds
            if ready and trial.target in roles:
                target = roles[trial.target]
                break
            time.sleep(0.02)  # polling a condition (the moment came), not a timed wait
    seen = marks_seen(marks)
    ended_first = ended_first or (target is None and proc.poll() is not None)
    if target is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            target.send_signal(getattr(signal, f"SIG{trial.sig}"))
        if kind in ("step", "save"):
            time.sleep(0.5)  # a launcher forwards the signal to its workers before they go on
            for pid in [proc.pid, *tracked]:  # the stopped rank (the process itself, with 1 process)
                if state(pid) == "T":
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGCONT)
    life = finish_life(proc, tracked, directory, logs, started, 600, problems)
    life.seen, life.ended_first = seen, ended_first
    return life


# ---- judging ---------------------------------------------------------------------------------------------------


def traceback_in(output: str) -> str | None:
    if "Traceback (most recent call last)" not in output:
        return None
    tail = [line for line in output.splitlines() if re.match(r"^\w[\w.]*(Error|Exception|Interrupt)\b", line)]
    return tail[-1][:160] if tail else "Traceback"


def metrics_rows(path: Path) -> tuple[str, list[dict]]:
    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO(text)))
    return text.split("\n", 1)[0], [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def compare(reference: Path, run: Path, steps: int) -> list[str]:
    """What differs between the resumed run and the uninterrupted one."""
    problems = []
    final = Path("checkpoints") / f"step_{steps}" / "model.safetensors"
    if not (run / final).exists():
        problems.append(f"no {final} after the resume")
    elif (run / final).read_bytes() != (reference / final).read_bytes():
        problems.append(f"{final} differs from the uninterrupted run's")
    if not (run / "metrics.csv").exists():
        problems.append("no metrics.csv after the resume")
    else:
        (head_a, rows_a), (head_b, rows_b) = metrics_rows(reference / "metrics.csv"), metrics_rows(run / "metrics.csv")
        if head_a != head_b:
            problems.append(f"metrics.csv's first line is {head_b[:50]!r}, not its header {head_a[:50]!r}")
        elif rows_a != rows_b:
            steps_a, steps_b = [r.get("step") for r in rows_a], [r.get("step") for r in rows_b]
            problems.append(
                f"metrics.csv's rows differ (steps {','.join(map(str, steps_b))} against {','.join(map(str, steps_a))})"
                if steps_a != steps_b
                else "metrics.csv's values differ (timing columns aside)"
            )
    if not (run / "log.csv").exists():
        problems.append("no log.csv after the resume")
    elif (run / "log.csv").read_bytes() != (reference / "log.csv").read_bytes():
        a, b = (reference / "log.csv").read_text(), (run / "log.csv").read_text()
        what = (
            "its header is missing"
            if a.split("\n", 1)[0] != b.split("\n", 1)[0]
            else (f"{b.count(chr(10))} lines against {a.count(chr(10))}")
        )
        problems.append(f"log.csv differs from the uninterrupted run's ({what})")
    return problems


def leftovers(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if re.search(r"\.saving|\.tmp$|partial|\.pruning", p.name)
    )


STOP_LINE = {
    "TERM": r"stopped by SIGTERM at step (\d+): checkpoint saved",
    "USR1": r"pre-empted at step (\d+): checkpoint saved",
}


def judge_signal(trial: Trial, life: Life, run: Path) -> tuple[list[str], str]:
    """What the docs promise for the signal at that moment (docs/hardware.md), against what the life did."""
    problems, steps = [], RECIPES[trial.recipe].steps
    kind, value = trial.moment
    said = re.search(STOP_LINE[trial.sig], life.output)
    if trial.launcher == "accelerate" and trial.target == "launcher" and trial.sig == "USR1" and not life.ended_first:
        # docs: the launcher dies, its workers stop within a second (toolkit.process.orphans) without a checkpoint
        if life.rc != -signal.SIGUSR1:
            problems.append(f"plain accelerate launch exited {life.rc} after SIGUSR1, not killed by it")
        return problems, f"exit {life.rc}"
    if life.ended_first or life.seen >= steps:
        if life.rc not in (0, -getattr(signal, f"SIG{trial.sig}")) or not (run / "summary.json").exists():
            problems.append(f"signalled after its last step, it exited {life.rc} without summary.json")
        return problems, f"exit {life.rc}, the run had ended"
    early = life.seen == 0 and said is None
    if early and not (trial.sig == "USR1" and trial.launcher == "python"):
        # before training: a launcher with no worker yet, SIGTERM before the run started, a worker that has not
        # imported the toolkit: each stops at once, in one line (1 process: SIGUSR1 is kept from the first 0.1 s)
        if life.rc == 0:
            problems.append("signalled before training, it exited 0 without a checkpoint line")
        elif not any(f"SIG{trial.sig}" in line or line.startswith("error:") for line in life.output.splitlines()):
            problems.append(f"signalled before training, it exited {life.rc} without a line saying why")
        return problems, f"exit {life.rc} before training"
    if said is None:
        problems.append(
            f"no '{STOP_LINE[trial.sig].split(' (')[0]} N' line (exit {life.rc}, last line "
            f"{(life.output.strip().splitlines() or [''])[-1][:100]!r})"
        )
        return problems, f"exit {life.rc}"
    stopped = int(said.group(1))
    if not (run / "checkpoints" / f"step_{stopped}" / "COMPLETE").exists():
        problems.append(f"it said step {stopped} was saved, but checkpoints/step_{stopped} is not complete")
    if kind in ("step", "save") and not value < stopped <= value + 2:
        problems.append(f"signalled after step {value}, it checkpointed at step {stopped} (the next step: {value + 1})")
    if trial.launcher == "accelerate" and trial.target == "launcher" and trial.sig == "TERM":
        # torchrun's agent raises the signal again once the workers saved: the launcher's one line, exit 1
        if life.rc != 1 or "accelerate launch: stopped by SIGTERM" not in life.output:
            problems.append(f"plain accelerate launch ended SIGTERM with exit {life.rc} and without its one line")
    elif life.rc != 0:
        problems.append(f"exit status {life.rc} after a checkpointed pre-emption, not 0")
    return problems, f"exit {life.rc}, saved step {stopped}"


# ---- the campaigns ---------------------------------------------------------------------------------------------


class Campaigns:
    def __init__(self, root: Path, keep_failed: bool):
        self.root, self.keep_failed = root, keep_failed
        self.idle_load = root / "idle-loadavg"
        self.idle_load.write_text("0.00 0.00 0.00 1/100 1\n")
        self.faultpoint = root / "faultpoint.py"
        self.faultpoint.write_text(FAULTPOINT)
        self.env = recipe_env(idle_load=self.idle_load)
        self.data: dict[str, Path] = {}
        self.references: dict[tuple[str, int], tuple[Path, float]] = {}
        self.pending: list[Outcome] = []  # resumed runs whose `toolkit verify` is still running
        self.mounts: list[Path] = []

    def prepare_data(self, recipes: set[str]) -> None:
        """The tests' data: MovieLens-100K prepared once in .cache/test-data, a generated UFS grid and road network,
        HRM's puzzles generated by the recipe into the cache."""
        if "sasrec" in recipes:
            from filelock import FileLock

            from toolkit.data.movielens import prepare_movielens

            DATA_CACHE.mkdir(parents=True, exist_ok=True)
            with FileLock(str(DATA_CACHE / ".prepare.lock")):
                prepare_movielens("ml-100k", None, DATA_CACHE)
        if "ufs_emulator" in recipes:
            from toolkit.data.ufs import synthesize

            os.environ["TQDM_DISABLE"] = "1"  # no bar from the generator (the recipes' env sets it too)
            self.data["ufs_emulator"] = synthesize(self.root / "ufs-grid.nc", seed=7, nlat=24, nlon=48)
        if "dcrnn" in recipes:
            from toolkit.data.traffic import generate, write_dataset

            self.data["dcrnn"] = self.root / "dcrnn-synth"
            write_dataset(self.data["dcrnn"], *generate(sensors=10, days=5, seed=0, progress=False))

    def reference(self, trial: Trial) -> tuple[Path | None, float, str]:
        """The uninterrupted run of the trial's recipe and process count (made once): (run dir, seconds, problem)."""
        key = (trial.recipe, trial.world)
        if key not in self.references:
            directory = self.root / f"reference-{trial.recipe}-{trial.world}"
            directory.mkdir()
            plain = Trial("reference", trial.recipe, trial.world, "python" if trial.world == 1 else "toolkit")
            problems: list[str] = []
            life = run_life(plain, run_args(plain, self.data, directory / "run"), directory, "life", self.env, problems)
            if life.rc != 0 or problems:
                tail = "; ".join(problems) or (life.output.strip().splitlines() or [""])[-1][:200]
                self.references[key] = (None, 0.0, f"the uninterrupted run failed (exit {life.rc}): {tail}")
            else:
                self.references[key] = (directory / "run", life.seconds, "")
        path, seconds, problem = self.references[key]
        return path, seconds, problem

    def start_verify(self, outcome: Outcome, run: Path) -> None:
        log = outcome.directory / "verify.out"
        with open(log, "w") as handle:
            outcome.verify = subprocess.Popen(
                [PYTHON, "-m", "toolkit", "verify", str(run), "--expect-world-size", str(outcome.trial.world)],
                cwd=outcome.directory,
                env=self.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        self.pending.append(outcome)

    def reap(self, wait: bool = False) -> None:
        for outcome in list(self.pending):
            if wait:
                outcome.verify.wait()
            if outcome.verify.poll() is None:
                continue
            self.pending.remove(outcome)
            if outcome.verify.returncode != 0:
                said = (outcome.directory / "verify.out").read_text().strip().splitlines()
                problem = next(
                    (line.strip() for line in said if "problem" in line.lower() or line.startswith(("  -", "error"))),
                    said[-1] if said else "",
                )
                outcome.problems.append(f"toolkit verify failed on the resumed run: {problem[:200]}")
                print(f"    verify FAILED: {outcome.trial.describe()}: {problem[:200]}", flush=True)
            self.tidy(outcome)

    def tidy(self, outcome: Outcome) -> None:
        if outcome.directory is not None and not (self.keep_failed and outcome.problems):
            shutil.rmtree(outcome.directory, ignore_errors=True)

    def run_trial(self, trial: Trial, index: int) -> Outcome:
        outcome = Outcome(trial)
        outcome.directory = directory = self.root / f"{trial.campaign}-{index:02d}"
        directory.mkdir()
        started = time.monotonic()
        reference, reference_seconds, problem = self.reference(trial)
        if reference is None:
            outcome.problems.append(problem)
            return outcome
        try:
            if trial.campaign == "disk":
                self.disk_trial(trial, reference, outcome)
            else:
                self.fault_trial(trial, reference, reference_seconds, outcome)
        finally:
            outcome.seconds = time.monotonic() - started
        return outcome

    def resume_and_compare(self, trial: Trial, run: Path, reference: Path, outcome: Outcome) -> None:
        directory = outcome.directory
        problems = outcome.problems
        resumed = run_life(
            trial, [*run_args(trial, self.data, run), "--resume-from", "auto"], directory, "resume", self.env, problems
        )
        if resumed.rc != 0:
            tail = [
                line for line in resumed.output.splitlines() if line.startswith("error:")
            ] or resumed.output.strip().splitlines()[-1:]
            problems.append(f"the resume exited {resumed.rc}: {(tail or [''])[0][:200]}")
            return
        if (where := traceback_in(resumed.output)) is not None:
            problems.append(f"traceback in the resume's output: {where}")
        said = re.search(r"resuming from \S*?(step_\d+)", resumed.output)
        outcome.note += f"; resumed from {said.group(1)}" if said else "; resumed afresh"
        problems.extend(compare(reference, run, RECIPES[trial.recipe].steps))
        if left := leftovers(run):
            problems.append(f"left after the resume: {', '.join(left[:3])}")
        if not problems:
            self.start_verify(outcome, run)

    def fault_trial(self, trial: Trial, reference: Path, reference_seconds: float, outcome: Outcome) -> None:
        run = outcome.directory / "run"
        life = interrupted_life(
            trial,
            run_args(trial, self.data, run),
            outcome.directory,
            self.env,
            reference_seconds,
            self.faultpoint,
            outcome.problems,
        )
        outcome.note = f"exit {life.rc} at step {life.seen}" + (", the run had ended" if life.ended_first else "")
        if trial.campaign == "signal":
            problems, outcome.note = judge_signal(trial, life, run)
            outcome.problems.extend(problems)
            if (where := traceback_in(life.output)) is not None:
                outcome.problems.append(
                    f"traceback after SIG{trial.sig} to the {trial.target} (exit {life.rc}): {where}"
                )
        elif trial.launcher != "accelerate" and (where := traceback_in(life.output)) is not None:
            # plain accelerate launch follows a failed worker with torchrun's traceback (docs): not counted there
            outcome.problems.append(f"traceback after the kill (exit {life.rc}): {where}")
        self.resume_and_compare(trial, run, reference, outcome)

    def mount(self, path: Path, kb: int) -> str | None:
        path.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={max(kb, 4)}k", "tmpfs", str(path)], capture_output=True, text=True
        )
        if result.returncode != 0:
            return (result.stderr.strip() or f"mount exited {result.returncode}").splitlines()[-1]
        self.mounts.append(path)
        if kb == 0:  # a 4 KB disk filled to the last byte
            with contextlib.suppress(OSError), open(path / "filler", "wb", buffering=0) as handle:
                while True:
                    handle.write(b"\0" * 4096)
        return None

    def unmount(self, path: Path) -> None:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
        with contextlib.suppress(ValueError):
            self.mounts.remove(path)

    def disk_trial(self, trial: Trial, reference: Path, outcome: Outcome) -> None:
        disk = outcome.directory / "disk"
        kb = trial.moment[1]
        run = disk / "run"
        if (refused := self.mount(disk, kb)) is not None:
            outcome.problems.append(f"cannot mount a {kb} KB tmpfs: {refused}")
            return
        try:
            life = run_life(
                trial, run_args(trial, self.data, run), outcome.directory, "life", self.env, outcome.problems
            )
            errors = [line for line in life.output.splitlines() if line.startswith("error:")]
            full = [line for line in errors if "no space left on the disk at" in line]
            if (where := traceback_in(life.output)) is not None:
                outcome.problems.append(f"traceback on a full disk: {where}")
            if life.rc == 0:
                outcome.note = "the run fit"
            elif life.rc != 1 or len(set(full)) != 1 or (trial.world == 1 and len(errors) != 1):
                shown = (errors or life.output.strip().splitlines()[-1:] or [""])[0][:160]
                outcome.problems.append(
                    f"exit {life.rc} with {len(set(full))} distinct 'no space left' line(s) "
                    f"among {len(errors)} error line(s), not one: {shown!r}"
                )
            else:
                written = full[0].split(" while writing ")[-1].split(";")[0]
                outcome.note = f"exit 1: {Path(written).name}"
            if left := leftovers(disk):
                outcome.problems.append(f"left on the full disk: {', '.join(left[:3])}")
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True, capture_output=True)
            self.resume_and_compare(trial, run, reference, outcome)
            if outcome.verify is not None:
                outcome.verify.wait()  # before the disk goes away
        finally:
            self.unmount(disk)


def mount_refused(root: Path) -> str | None:
    probe = root / "mount-probe"
    probe.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True, text=True
    )
    if result.returncode != 0:
        return (result.stderr.strip() or f"mount exited {result.returncode}").splitlines()[-1]
    subprocess.run(["umount", "-l", str(probe)], capture_output=True)
    return None


def table(results: dict[str, list[Outcome]], skipped: dict[str, str]) -> str:
    lines = ["| campaign | trials | passed | failures |", "| --- | ---: | ---: | ---: |"]
    for campaign, outcomes in results.items():
        if campaign in skipped:
            lines.append(f"| {campaign} | 0 | 0 | skipped: {skipped[campaign]} |")
            continue
        failed = sum(bool(o.problems) for o in outcomes)
        lines.append(f"| {campaign} | {len(outcomes)} | {len(outcomes) - failed} | {failed} |")
    reasons = [
        f"- {o.trial.campaign}: {o.trial.describe()}: {'; '.join(o.problems)}"
        for outcomes in results.values()
        for o in outcomes
        if o.problems
    ]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, help="choose the trials from this seed (default: a new one, printed)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a few trials per campaign ({', '.join(f'{k} {v}' for k, v in QUICK_TRIALS.items())})",
    )
    parser.add_argument(
        "--trials",
        type=int,
        metavar="N",
        help=f"trials per campaign (default: {', '.join(f'{k} {v}' for k, v in DEFAULT_TRIALS.items())})",
    )
    parser.add_argument("--only", choices=["kill", "signal", "disk"], nargs="+", help="run only these campaigns")
    parser.add_argument("--plan", action="store_true", help="print the trials the seed gives and stop")
    parser.add_argument("--keep-failed", action="store_true", help="keep the directories of failed trials")
    args = parser.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def trials_of(args: argparse.Namespace) -> dict[str, list[Trial]]:
    rng = random.Random(args.seed)
    chosen = {}
    for campaign in ("kill", "signal", "disk"):
        count = args.trials or (QUICK_TRIALS if args.quick else DEFAULT_TRIALS)[campaign]
        trials = plan(campaign, count, rng)  # drawn for every campaign: --only keeps the others' draws
        if not args.only or campaign in args.only:
            chosen[campaign] = trials
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = trials_of(args)
    again = (
        f"--seed {args.seed}"
        + (" --quick" if args.quick else "")
        + (f" --trials {args.trials}" if args.trials else "")
        + (f" --only {' '.join(args.only)}" if args.only else "")
    )
    print(
        f"fault campaign, seed {args.seed} (the same trials again: python tests/fault_campaign.py {again})", flush=True
    )
    if args.plan:
        for campaign, trials in chosen.items():
            for i, trial in enumerate(trials, 1):
                print(f"{campaign} {i:2d}: {trial.describe()}")
        return 0
    root = Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    campaigns = Campaigns(root, args.keep_failed)
    results: dict[str, list[Outcome]] = {campaign: [] for campaign in chosen}
    skipped: dict[str, str] = {}
    started = time.monotonic()
    try:
        if "disk" in chosen and (refused := mount_refused(root)) is not None:
            skipped["disk"] = f"cannot mount a tmpfs here ({refused})"
            print(f"disk: skipped, {skipped['disk']}", flush=True)
        campaigns.prepare_data({t.recipe for trials in chosen.values() for t in trials})
        for campaign, trials in chosen.items():
            if campaign in skipped:
                continue
            for i, trial in enumerate(trials, 1):
                campaigns.reap()
                outcome = campaigns.run_trial(trial, len(results[campaign]) + 1)
                results[campaign].append(outcome)
                verdict = "FAIL" if outcome.problems else "ok"
                print(
                    f"[{campaign} {i}/{len(trials)}] {verdict:4} {outcome.seconds:5.1f} s  {trial.describe()}: "
                    f"{outcome.note.lstrip('; ')}"
                    + (f"\n    {'; '.join(outcome.problems)}" if outcome.problems else ""),
                    flush=True,
                )
                if outcome.verify is None:
                    campaigns.tidy(outcome)
        campaigns.reap(wait=True)
    finally:
        for outcome in campaigns.pending:
            outcome.verify.kill()
        for mount in list(campaigns.mounts):
            campaigns.unmount(mount)
        for proc in alive_in(root):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        kept = [o.directory for outcomes in results.values() for o in outcomes if o.problems and args.keep_failed]
        if kept:
            print(f"failed trials kept under {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    minutes = (time.monotonic() - started) / 60
    print(f"\n{sum(len(o) for o in results.values())} trials in {minutes:.1f} min, seed {args.seed}\n")
    print(table(results, skipped))
    return 1 if any(o.problems for outcomes in results.values() for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
