"""OpenMP's wait policy, chosen before torch loads its OpenMP runtime.

libgomp (torch's CPU wheels) lets a thread that finished its share of a parallel region spin before it sleeps. On a
machine whose cores other jobs share, the spinning thread takes the core the working one needs, and every parallel
region waits for the scheduler: the UFS MLP's step at 2 threads went from 1.7 ms to 105 ms on the 2-core machine
with two other jobs running (benchmarks/README.md); DCRNN stalled at 42 s a step. OMP_WAIT_POLICY=PASSIVE (threads
sleep at once) gave 2.2 ms. The runtime reads the variable once, when it is loaded, so `import toolkit` sets it
before torch is imported (the recipes import toolkit first); a value the user exported is kept.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"
_set_here = False  # did this process choose the policy (rather than the user)?


def prefer_passive_wait() -> None:
    global _set_here
    if VARIABLE not in os.environ and "torch" not in sys.modules:
        os.environ[VARIABLE] = "PASSIVE"
        _set_here = True


def wait_policy_line(threads: int) -> str | None:
    """One line for the run's start when this process runs several OpenMP threads under the policy chosen here."""
    if not _set_here or threads <= 1:
        return None
    return (f"threads: {threads}, with {VARIABLE}=PASSIVE set by the toolkit (OpenMP's spin-wait stalls a process "
            f"whose cores other jobs share); export {VARIABLE}=ACTIVE to keep the spin")
