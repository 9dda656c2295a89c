"""Workers whose launcher died stop within a second instead of training on.

`accelerate launch` / torchrun start the workers as child processes. After a `kill -9` of the launcher nobody
stops them: they keep training, keep saving and pruning checkpoints, and hold the run directory's lock, so an
immediate `--resume-from auto` would collide with them. Each worker started by a launcher (TORCHELASTIC_RUN_ID is
set) watches its parent from a daemon thread: when it is re-parented, the launcher is gone, and it exits.
"""

from __future__ import annotations

import os
import threading

_watching = False


def stop_when_launcher_dies(interval: float = 0.25) -> None:
    """Start the watch (once per process; only under a torchrun-style launcher)."""
    global _watching
    if _watching or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _watching = True
    launcher = os.getppid()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):  # a watchdog's period, not a synchronisation
            if os.getppid() != launcher:
                rank = os.environ.get("RANK", "?")
                line = (f"error: [rank {rank}] the launcher (pid {launcher}) died; worker pid {os.getpid()} stops "
                        "(complete checkpoints are intact: continue with --resume-from auto)\n")
                try:
                    os.write(2, line.encode())
                except OSError:
                    pass  # the launcher's pipes may be gone with it
                os._exit(1)

    threading.Thread(target=watch, name="toolkit-launcher-watch", daemon=True).start()
