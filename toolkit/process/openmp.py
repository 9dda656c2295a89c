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

Load that arrives after the start: the bounded spin still ran the UFS MLP's 2-thread step 1.9x slower than PASSIVE
with one other busy process on 2 cores, and libgomp cannot be told later; toolkit.loop.restart restarts such a run
under PASSIVE (`spinning()` says whether this process spins by the toolkit's choice).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

VARIABLE = "OMP_WAIT_POLICY"
SPIN = "GOMP_SPINCOUNT"
BOUNDED_SPIN = "1000"  # iterations a waiting thread spins before it sleeps (benchmarks/wait_policy.py)
_reason: str | None = None  # why this process chose PASSIVE (None: it chose nothing)
_too_late = False  # torch was imported before begin_process(): the policy could not be chosen
_looked = False  # prefer_passive_wait() ran in this process (begin_process())
_spinning = False  # this process chose the bounded spin (an idle start): toolkit.loop.restart may restart it
RESTARTED = "TOOLKIT_RESTARTED_UNDER_LOAD"  # set on the restarted process (toolkit.loop.restart): the step
_restarted_at: str | None = None


def loadavg(stand_in: str | None) -> tuple[float, int, int]:
    """(1-minute load average, threads runnable now on the machine, usable CPUs), from /proc/loadavg or its
    stand-in's text."""
    fields = (stand_in or Path("/proc/loadavg").read_text()).split()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(fields[0]), int(fields[3].split("/")[0]), cpus


def busy(others: float, cpus: int) -> bool:
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
        load, running, cpus = loadavg(os.environ.get("TOOLKIT_LOADAVG"))
    except (OSError, ValueError, IndexError):
        return  # no /proc/loadavg (not Linux): libgomp's default
    running -= 1  # this process (one thread yet)
    if math.isfinite(load) and busy(load, cpus) and busy(running, cpus):
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


def spinning() -> bool:
    """This process chose the bounded spin (an idle start, the user's environment silent): load that arrives later
    may stall its threads, which toolkit.loop.restart watches for."""
    return _spinning
