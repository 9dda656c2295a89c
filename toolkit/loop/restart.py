"""The restart under load: one part of the training loop, and the one owner of everything the restart decides.

A single-process run whose OpenMP threads spin by the toolkit's choice (an idle start: toolkit.process.openmp) stalls
when other jobs arrive on its cores, and libgomp reads its wait policy once. So this part looks at the machine every
few seconds during training (`LoadWatch`, at an optimizer step): when other processes have held at least half the CPUs
at three looks in a row, the loop checkpoints that step and the part ends the run as after a pre-emption, saying so
in one line, and raises `RestartUnderPassive`; the entry point (toolkit.process.entry), once the run is released,
replaces the process by the same command (exec, the same PID, so a launcher or SLURM sees the one process) under
OMP_WAIT_POLICY=PASSIVE with `--resume-from auto` in its run directory (`restart_process`). The wait policy changes
no number and resume is exact, so the run's results are those of an uninterrupted run (tests/test_threads.py).
Changing the thread count instead would change them: torch's reductions split by thread count. One way only: a run
that restarted stays PASSIVE.

Who may restart: a script's own main() alone (`allowed`, which one_line_errors sets around it): never a test's,
a notebook's or a sweep's process; one process with several threads (a rank cannot restart alone).
TOOLKIT_LOAD_FILE names a file that stands in for /proc/loadavg during training (tests); TOOLKIT_LOAD_CHECK_SEC sets
how often it is read (default 2 s).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from toolkit.process import openmp

_allowed = False  # a script's own main() runs (one_line_errors): only then may the process be replaced


@contextlib.contextmanager
def allowed(may_restart: bool) -> Iterator[None]:
    """While a main() runs: whether a run in it may restart the process (one_line_errors: the script's own main)."""
    global _allowed
    outer, _allowed = _allowed, may_restart
    try:
        yield
    finally:
        _allowed = outer


def others_running() -> tuple[int, int]:
    """(threads runnable now that are not this process's, usable CPUs): /proc/loadavg's runnable count (every
    thread on the machine) less this process's own runnable threads (its spinning OpenMP workers among them)."""
    stand_in = os.environ.get("TOOLKIT_LOAD_FILE")
    _, running, cpus = openmp.loadavg(Path(stand_in).read_text() if stand_in else None)
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
        self.seen = [*self.seen, others][-self.looks:] if openmp.busy(others, cpus) else []
        if len(self.seen) < self.looks:
            return None
        return (f"{min(self.seen)}-{max(self.seen)} other running thread(s) on {cpus} CPUs at {self.looks} looks "
                f"{self.every:g} s apart")




class RestartUnderPassive(SystemExit):
    """Raised by the training loop once the step is checkpointed and the run ended: main() unwinds as after a
    pre-emption (exit status 0 on the way), then one_line_errors restarts the process (restart_process)."""

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


def restart_process(restart: RestartUnderPassive) -> None:
    """Replace this process by the same command under PASSIVE, resuming its run (does not return)."""
    env = {key: value for key, value in os.environ.items() if key != openmp.SPIN}
    env[openmp.VARIABLE] = "PASSIVE"
    env[openmp.RESTARTED] = str(restart.step)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, restart_command(sys.orig_argv, restart.run_dir), env)
    except OSError as error:  # the checkpoint is complete: the user resumes by hand
        print(f"error: could not restart this process ({error}); the checkpoint of step {restart.step} is complete: "
              f"resume with --output-dir {restart.run_dir} --resume-from auto", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


class RestartUnderLoad:
    """The loop's part: `arrived()` after each optimizer step (a reason, once the load has arrived; None without a
    watch), `leave(run, step, load)` once the loop has checkpointed that step."""

    def __init__(self, threads: int, processes: int):
        eligible = openmp.spinning() and _allowed and threads > 1 and processes == 1
        self.watch = LoadWatch(float(os.environ.get("TOOLKIT_LOAD_CHECK_SEC", "2"))) if eligible else None

    def arrived(self) -> str | None:
        return None if self.watch is None else self.watch.arrived()

    def leave(self, run, step: int, load: str) -> None:
        """The step is checkpointed: one line, the run ended, and RestartUnderPassive for the entry point."""
        run.print(f"load arrived during training ({load}): OpenMP's threads spin by the idle start's choice and "
                  f"stall under load; checkpoint of step {step} saved, restarting this process under "
                  f"{openmp.VARIABLE}=PASSIVE to resume it (the same numbers: the wait policy changes none)")
        run.end()
        raise RestartUnderPassive(run.output_dir, step)
