"""What a training process sets up for itself: installed by the entry point's first call, never by an import.

    from toolkit.process import begin_process  # a recipe's first lines, before torch
    begin_process()

begin_process() makes SIGUSR1 (SLURM's pre-emption / time-limit signal) set a flag instead of killing the process, so
a signal that arrives while a recipe is still importing torch or preparing data is not lost: the training loop
checkpoints and stops at its next step. SIGTERM before a run has started still ends the process, with one line
saying so (not a silent -15); from the run's start it is pre-emption too (toolkit.process.preemption), except in a
launcher's worker before training (see there). It chooses OpenMP's wait policy for the machine's load, which only
works before torch (and its OpenMP runtime) is loaded (toolkit.process.openmp). Under a launcher it starts the watch
that
stops this worker when the launcher dies (toolkit.process.orphans), as early as possible: a launcher killed during
start-up
must not leave a worker waiting for a rendezvous. And it registers the exit hook that ends what the process left
running, its process group included (toolkit.process.shutdown), so that no script ends one by hand.

start_run() installs what is still meaningful when begin_process() was not called (a notebook, another program):
the pre-emption handlers, the launcher watch, the exit hook and the heap setting; not the OpenMP policy (torch is
loaded by then: the run's start says so where it matters). Importing any toolkit module changes nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

_early_signal = False
_begun = False


def _remember(signum, frame) -> None:
    global _early_signal
    _early_signal = True


def _stop_before_the_run(signum, frame) -> None:
    """SIGTERM before a run started: nothing to save. One line, then the default action (the exit status a parent
    expects from SIGTERM: -15)."""
    sys.stderr.write("stopped by SIGTERM before the run started: nothing to save\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def signalled_early() -> bool:
    """Whether SIGUSR1 arrived between begin_process() and the run's own handler (toolkit.process.preemption)."""
    return _early_signal


def begin_process() -> None:
    """The entry point's first call, before torch is imported: early SIGUSR1 kept, SIGTERM said in one line, OpenMP's
    wait policy, the launcher watch, the exit hook (this module's docstring). Once per process."""
    global _begun
    if _begun:
        return
    _begun = True
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            signal.signal(signal.SIGUSR1, _remember)
        # A launcher's worker keeps SIGTERM's default until it trains: the launcher stops the other workers with it
        # when one failed while starting (e.g. rank 0's one-line usage error), and they must end quietly.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and "TORCHELASTIC_RUN_ID" not in os.environ:
            signal.signal(signal.SIGTERM, _stop_before_the_run)
    from toolkit.process import openmp, orphans, shutdown

    openmp.prefer_passive_wait()  # before anything imports torch (and its OpenMP runtime)
    orphans.stop_when_launcher_dies()
    shutdown.release_at_exit()
