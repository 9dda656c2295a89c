"""The toolkit. Importing it makes SIGUSR1 (SLURM's pre-emption / time-limit signal) set a flag instead of killing
the process, so a signal that arrives while a recipe is still importing torch or preparing data is not lost:
the recipes import `toolkit` first, and the training loop checkpoints and stops at its next step. Under a launcher,
importing it also starts the watch that stops this worker when the launcher dies (toolkit.orphans), as early as
possible: a launcher killed during start-up must not leave a worker waiting for a rendezvous. And at exit it ends
what the process left running, its process group included (toolkit.shutdown), so that no script ends one by hand."""

import signal
import threading

_early_signal = False


def _remember(signum, frame) -> None:
    global _early_signal
    _early_signal = True


if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
    signal.signal(signal.SIGUSR1, _remember)

from toolkit import openmp, orphans, shutdown  # noqa: E402  after the signal handler: that one must come first

openmp.prefer_passive_wait()  # before anything imports torch (and its OpenMP runtime)

orphans.stop_when_launcher_dies()
shutdown.release_at_exit()
