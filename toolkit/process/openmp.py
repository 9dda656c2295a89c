"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime, by how busy the machine is.

libgomp (torch's CPU wheels) lets a thread that finished its share of a parallel region spin before it sleeps. On an
idle machine that is what makes a second thread pay: the UFS MLP's step at 1 process x 2 threads ran 1.53x the
1 x 1 rate spinning and 0.77x with OMP_WAIT_POLICY=PASSIVE (threads sleep at once, and every parallel region then
waits for them to wake). On a machine whose cores other jobs hold, the spinning thread takes the core the working
one needs, and every parallel region waits for the scheduler: the same step went from 1.7 ms to 103 ms at 2 threads
with two other jobs on the 2 cores, and 6.2 ms passive; DCRNN stalled at 42 s a step (benchmarks/README.md).

So begin_process() (toolkit.process) looks at the machine when the process starts: when other work holds at least
half the usable CPUs, both over the last minute (the load average) and now (the processes running besides this one),
the policy becomes PASSIVE. Otherwise the threads spin, but a bounded while: GOMP_SPINCOUNT=1000 (libgomp's default
is 300,000 when it thinks the machine is its own), because load that arrives after the start cannot change a policy
the runtime read once: a run started idle at libgomp's default then fell 2-28x behind its fair share when other jobs
started (benchmarks/wait_policy.py); the bounded spin keeps the idle speed and sleeps soon enough under load. The
runtime reads the variables once, when it is loaded, hence before torch is imported (the recipes call begin_process()
first). A value the user exported (either variable) is kept.
TOOLKIT_LOADAVG stands in for /proc/loadavg's text (tests), e.g. "3.1 2.0 1.5 4/300".

Load that arrives after the start (issue 26, item 1): the bounded spin still ran the UFS MLP's 2-thread step 1.9x
slower than PASSIVE with one other busy process on 2 cores, and libgomp cannot be told later. So a single-process
run whose threads spin by the toolkit's choice looks at the machine every few seconds during training (LoadWatch):
when other processes have held at least half the CPUs at three looks in a row, the loop checkpoints that step, says
so in one line, and the process restarts itself (exec, the same PID, so a launcher or SLURM sees the one process)
under OMP_WAIT_POLICY=PASSIVE with `--resume-from auto` in its run directory. The wait policy changes no number and
resume is exact, so the run's results are those of an uninterrupted run. Changing the thread count instead (the
issue's third candidate) would change them: torch's reductions split by thread count. One way only: a run that
restarted stays PASSIVE. TOOLKIT_LOAD_FILE names a file that stands in for /proc/loadavg during training (tests);
TOOLKIT_LOAD_CHECK_SEC sets how often it is read (default 2 s).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

VARIABLE = "OMP_WAIT_POLICY"
SPIN = "GOMP_SPINCOUNT"
BOUNDED_SPIN = "1000"  # iterations a waiting thread spins before it sleeps (benchmarks/wait_policy.py)
_reason: str | None = None  # why this process chose PASSIVE (None: it chose nothing)
_too_late = False  # torch was imported before begin_process(): the policy could not be chosen
_looked = False  # prefer_passive_wait() ran in this process (begin_process())
_spinning = False  # this process chose the bounded spin (an idle start): LoadWatch may restart it under PASSIVE
RESTARTED = "TOOLKIT_RESTARTED_UNDER_LOAD"  # set on the restarted process: the step it restarted at
_restarted_at: str | None = None
restartable = False  # set by one_line_errors while a script's own main() runs (never a test's or a sweep's caller)


def _loadavg(stand_in: str | None) -> tuple[float, int, int]:
    """(1-minute load average, threads runnable now on the machine, usable CPUs), from /proc/loadavg or its
    stand-in's text."""
    fields = (stand_in or Path("/proc/loadavg").read_text()).split()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(fields[0]), int(fields[3].split("/")[0]), cpus


def _busy(others: float, cpus: int) -> bool:
    """Other work holds at least half the usable CPUs (at least one)."""
    return others >= max(1.0, cpus / 2)


def prefer_passive_wait() -> None:
    """PASSIVE when the machine is busy, else a bounded spin, before torch (and its OpenMP runtime) is loaded; the
    user's value stays."""
    global _reason, _too_late, _spinning, _restarted_at, _looked
    _looked = True
    _restarted_at = os.environ.pop(RESTARTED, None)  # said once, by this process; its children start afresh
    if VARIABLE in os.environ or SPIN in os.environ:
        return
    if "torch" in sys.modules:  # its OpenMP runtime is loaded and has read the variable already: nothing can change
        _too_late = True
        return
    try:
        load, running, cpus = _loadavg(os.environ.get("TOOLKIT_LOADAVG"))
    except (OSError, ValueError, IndexError):
        return  # no /proc/loadavg (not Linux): libgomp's default
    running -= 1  # this process (one thread yet)
    if math.isfinite(load) and _busy(load, cpus) and _busy(running, cpus):
        os.environ[VARIABLE] = "PASSIVE"
        _reason = f"load average {load:.1f} and {running} other running process(es) on {cpus} CPUs at the start"
    else:
        os.environ[SPIN] = BOUNDED_SPIN  # idle now: spin, but not so long that load arriving later stalls the run
        _spinning = True


def wait_policy_line(threads: int) -> str | None:
    """One line for the run's start when this process runs several OpenMP threads under the policy chosen here."""
    if threads <= 1:
        return None
    if (_too_late or not _looked) and VARIABLE not in os.environ and SPIN not in os.environ:
        return (f"threads: {threads}; torch was imported before toolkit.process.begin_process() ran, so OpenMP's wait "
                f"policy could not be chosen for this machine's load (spinning threads stall on a busy machine): call "
                f"it first, or export {VARIABLE}")
    if _restarted_at is not None:
        return (f"threads: {threads}, with {VARIABLE}=PASSIVE set by the toolkit (this process restarted itself at "
                f"step {_restarted_at} when other jobs took the cores its spinning threads needed)")
    if _reason is None:
        return None
    return (f"threads: {threads}, with {VARIABLE}=PASSIVE set by the toolkit ({_reason}: other jobs hold cores, and "
            f"OpenMP's spin-wait would stall every parallel region); export {VARIABLE} to choose yourself")


# ---- load that arrives after the start ---------------------------------------------------------------------------
def others_running() -> tuple[int, int]:
    """(threads runnable now that are not this process's, usable CPUs): /proc/loadavg's runnable count (every
    thread on the machine) less this process's own runnable threads (its spinning OpenMP workers among them)."""
    stand_in = os.environ.get("TOOLKIT_LOAD_FILE")
    _, running, cpus = _loadavg(Path(stand_in).read_text() if stand_in else None)
    mine = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        mine += stat[stat.rindex(")") + 2] == "R"  # the state follows the command name, which may hold spaces
    return max(0, running - mine), cpus


class LoadWatch:
    """Looks at the machine every `every` seconds (called at each optimizer step, so a look costs nothing between):
    `arrived()` gives the reason once other processes held at least half the CPUs at `looks` looks in a row."""

    def __init__(self, every: float, looks: int = 3, clock=time.monotonic, measure=others_running):
        self.every, self.looks, self.clock, self.measure = every, looks, clock, measure
        self.next_look = clock() + every
        self.seen: list[int] = []

    def arrived(self) -> str | None:
        now = self.clock()
        if now < self.next_look:
            return None
        self.next_look = now + self.every
        try:
            others, cpus = self.measure()
        except (OSError, ValueError, IndexError):
            return None  # nothing to read (not Linux): keep going as started
        self.seen = [*self.seen, others][-self.looks:] if _busy(others, cpus) else []
        if len(self.seen) < self.looks:
            return None
        return (f"{min(self.seen)}-{max(self.seen)} other running thread(s) on {cpus} CPUs at {self.looks} looks "
                f"{self.every:g} s apart")


def load_watch(threads: int, processes: int) -> LoadWatch | None:
    """A LoadWatch for a run whose OpenMP threads spin by the toolkit's choice (an idle start, the user's environment
    silent), with several threads in one process, in a script whose main() one_line_errors wraps (it restarts the
    process; a main() called from other code, a test's, is never restarted); else None. Several processes: a rank
    cannot restart alone."""
    if not (_spinning and restartable) or threads <= 1 or processes != 1:
        return None
    return LoadWatch(float(os.environ.get("TOOLKIT_LOAD_CHECK_SEC", "2")))


class RestartUnderPassive(SystemExit):
    """Raised by the training loop once the step is checkpointed and the run ended: main() unwinds as after a
    pre-emption (exit status 0 on the way), then one_line_errors restarts the process (restart_under_passive)."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(0)
        self.run_dir, self.step = Path(run_dir), step


def restart_command(argv: list[str], run_dir: Path) -> list[str]:
    """This process's command line (sys.orig_argv: the interpreter's own options too) with --output-dir the run's
    directory and --resume-from auto in place of any the user gave."""
    replaced = ("--output-dir", "--output_dir", "--resume-from", "--resume_from")
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg in replaced:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in replaced)):
            kept.append(arg)
    return [sys.executable, *kept, "--output-dir", str(Path(run_dir).resolve()), "--resume-from", "auto"]


def restart_under_passive(restart: RestartUnderPassive) -> None:
    """Replace this process by the same command under PASSIVE, resuming its run (does not return)."""
    env = {key: value for key, value in os.environ.items() if key != SPIN}
    env[VARIABLE] = "PASSIVE"
    env[RESTARTED] = str(restart.step)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, restart_command(sys.orig_argv, restart.run_dir), env)
    except OSError as error:  # the checkpoint is complete: the user resumes by hand
        print(f"error: could not restart this process ({error}); the checkpoint of step {restart.step} is complete: "
              f"resume with --output-dir {restart.run_dir} --resume-from auto", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
