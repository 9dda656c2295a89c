"""Pre-emption, time limits and stop requests: checkpoint at the next step, exit 0.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=B:USR1@120`, forwarded to the workers by the
sbatch script) or when an admin pre-empts the job; SIGTERM is what `scancel`, SLURM's time limit, Kubernetes and
most schedulers send first. The handler only sets a flag: doing I/O inside a handler can fire in the middle of
backward. At the next optimizer-step boundary every rank learns whether ANY rank got a signal (one all-reduce), the
loop saves a complete checkpoint and every process exits 0. After SIGUSR1 the main process requeues the SLURM job
(capped); after SIGTERM it does not (a cancelled job stays cancelled): continue with `--resume-from auto`. Either
way the resumed run continues bit for bit. A second signal during that save changes nothing: the save completes
(and were the process killed in it, the previous complete checkpoint is intact: saves are atomic).

When SIGTERM counts: a single process from start_run; a launcher's worker (torchrun's, TORCHELASTIC_RUN_ID set)
from its training loop's start, because before that the launcher's own SIGTERM is how it stops the other workers
when one failed while starting, and they must end at once (toolkit.process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from accelerate import Accelerator

_requested = False  # any pre-emption signal: checkpoint at the next step and exit 0
_terminated = False  # one of them was SIGTERM: do not requeue


def _set_flag(signum, frame) -> None:
    global _requested, _terminated
    _requested = True
    _terminated = _terminated or signum == signal.SIGTERM


def requested() -> bool:
    """A pre-emption signal (SIGUSR1, or SIGTERM from the run's start) reached this process."""
    return _requested


def terminated() -> bool:
    """One of them was SIGTERM: checkpoint and stop, but do not requeue."""
    return _terminated


def launched_worker() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


_previous: dict[int, object] = {}  # the handlers before the run's, restored when it ends


def _catch(sig: int) -> None:
    if signal.getsignal(sig) is not _set_flag:
        _previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _set_flag)


def install_handler() -> None:
    """At the run's start (start_run): SIGUSR1, and SIGTERM unless this is a launcher's worker (catch_sigterm)."""
    global _requested
    from toolkit import process

    _requested = _requested or process.signalled_early()  # a signal caught by begin_process()'s handler counts
    _catch(signal.SIGUSR1)
    if not launched_worker():
        _catch(signal.SIGTERM)


def catch_sigterm() -> None:
    """At the training loop's start: SIGTERM is pre-emption from here on, also in a launcher's worker."""
    _catch(signal.SIGTERM)


def restore_handlers() -> None:
    """At the run's end: the handlers from before it (a process that runs several, or a test, gets its own back)."""
    while _previous:
        sig, handler = _previous.popitem()
        signal.signal(sig, handler)


def requested_anywhere(accelerator: Accelerator) -> bool:
    """Collective: True on every rank when any rank has been signalled."""
    if accelerator.num_processes == 1:
        return _requested
    flag = torch.tensor([1.0 if _requested else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def requeue_job(max_requeues: int, announce=print) -> None:
    """Requeue the SLURM job this process belongs to, unless the cap is reached. What happens is announced
    BEFORE `scontrol requeue` runs: requeueing a running job ends its steps at once, so a line written after the
    call may never reach the log."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        announce("not under SLURM: continue with --resume-from auto")
        return
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts >= max_requeues:
        announce(f"not requeued: job {job} already restarted {restarts} times (--max-requeues {max_requeues})")
        return
    announce(f"requeueing SLURM job {job} (restart {restarts + 1} of at most {max_requeues})")
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        announce(f"scontrol requeue {job} failed: {result.stderr.strip()}; resume with --resume-from auto")


def requeue_and_exit(run, step: int, max_requeues: int, requeue: bool = True) -> None:
    """After the pre-empted step's checkpoint: the main process requeues the job (capped; not after a SIGTERM) and
    says so, flushed (the requeue may end this process right after); every rank leaves the process group together
    and exits 0."""
    from tqdm.auto import tqdm

    if run.is_main:
        def announce(what: str) -> None:
            tqdm.write(f"pre-empted at step {step}: checkpoint saved; {what}")
            sys.stdout.flush()

        if requeue:
            requeue_job(max_requeues, announce)
        else:
            tqdm.write(f"stopped by SIGTERM at step {step}: checkpoint saved; continue with --resume-from auto")
            sys.stdout.flush()
    run.end()
    raise SystemExit(0)
