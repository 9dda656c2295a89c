"""Pre-emption and time limits: checkpoint at the next step, requeue, exit 0.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=B:USR1@120`, forwarded to the workers by the
sbatch script) or when an admin pre-empts the job. The handler only sets a flag: doing I/O inside a handler can
fire in the middle of backward. At the next optimizer-step boundary every rank learns whether ANY rank got the
signal (one all-reduce), the loop saves a complete checkpoint, the main process requeues the job (capped), and
every process exits 0. The requeued job starts with `--resume-from auto` and continues bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch
from accelerate import Accelerator

_requested = False


def _set_flag(signum, frame) -> None:
    global _requested
    _requested = True


def install_handler(signals: tuple[int, ...] = (signal.SIGUSR1,)) -> None:
    global _requested
    import toolkit

    _requested = _requested or toolkit._early_signal  # a signal caught by the import-time handler counts
    for sig in signals:
        signal.signal(sig, _set_flag)


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


def requeue_and_exit(run, step: int, max_requeues: int) -> None:
    """After the pre-empted step's checkpoint: the main process requeues the job (capped) and says so, flushed (the
    requeue may end this process right after); every rank leaves the process group together and exits 0."""
    from tqdm.auto import tqdm

    if run.is_main:
        def announce(what: str) -> None:
            tqdm.write(f"pre-empted at step {step}: checkpoint saved; {what}")
            sys.stdout.flush()

        requeue_job(max_requeues, announce)
    run.end()
    raise SystemExit(0)
