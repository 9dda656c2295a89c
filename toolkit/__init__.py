"""The toolkit. Importing it makes SIGUSR1 (SLURM's pre-emption / time-limit signal) set a flag instead of killing
the process, so a signal that arrives while a recipe is still importing torch or preparing data is not lost:
the recipes import `toolkit` first, and the training loop checkpoints and stops at its next step."""

import signal
import threading

_early_signal = False


def _remember(signum, frame) -> None:
    global _early_signal
    _early_signal = True


if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
    signal.signal(signal.SIGUSR1, _remember)
