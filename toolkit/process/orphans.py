"""Workers whose launcher died stop within a second instead of training on.

`accelerate launch` / torchrun start the workers as child processes. After a `kill -9` of the launcher nobody
stops them: they keep training, keep saving and pruning checkpoints, and hold the run directory's lock, so an
immediate `--resume-from auto` would collide with them. Each worker started by a launcher (TORCHELASTIC_RUN_ID is
set) watches its parent from a daemon thread, started when `toolkit` is imported: when it is re-parented, the
launcher is gone, and it exits.

A launcher can also die before its worker has even imported the toolkit (seen: a kill during start-up on a busy
machine left a worker retrying the rendezvous for --dist-timeout). Its parent is then already the init process or a
subreaper, so the parent at start is checked too: torchrun's agent is always a Python process, an adopter is not.
"""

from __future__ import annotations

import os
import threading

_watching = False
_watch: tuple[threading.Thread, threading.Event] | None = None


def is_python_process(pid: int) -> bool:
    """Whether `pid` runs a Python interpreter (what a torchrun-style launcher is). Where /proc cannot tell (not
    Linux), True: the watch then relies on the re-parenting alone."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(("python", "pypy"))
    except OSError:
        pass  # another user's process (an init), or no /proc
    try:
        with open(f"/proc/{pid}/comm") as comm:
            name = comm.read().strip()
    except OSError:
        return True
    return name.startswith(("python", "pypy", "accelerate", "torchrun"))


def _stop(what: str) -> None:
    rank = os.environ.get("RANK", "?")
    line = (f"error: [rank {rank}] {what}; worker pid {os.getpid()} stops (complete checkpoints are intact: continue "
            "with --resume-from auto)\n")
    try:
        os.write(2, line.encode())
    except OSError:
        pass  # the launcher's pipes may be gone with it
    os._exit(1)


def stop_when_launcher_dies(interval: float = 0.25) -> None:
    """Start the watch (once per process; only under a torchrun-style launcher)."""
    global _watching, _watch
    if _watching or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _watching = True
    launcher = os.getppid()
    if launcher == 1 or not is_python_process(launcher):
        _stop(f"the launcher died before this worker started (its parent is now pid {launcher}, not a launcher)")
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval):  # a watchdog's period, not a synchronisation
            if os.getppid() != launcher:
                _stop(f"the launcher (pid {launcher}) died")

    thread = threading.Thread(target=watch, name="toolkit-launcher-watch", daemon=True)
    thread.start()
    _watch = (thread, stop)


def stop_watching() -> None:
    """End the watch (toolkit.process.shutdown.release, as the process ends): no thread of ours outlives the
    interpreter."""
    global _watch
    if _watch is not None:
        thread, stop = _watch
        _watch = None
        stop.set()
        if thread is not threading.current_thread():
            thread.join()
