"""Collectives a recipe needs beyond what Accelerate's prepare() does for it."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator


def global_mean(accelerator: Accelerator, local_sum: torch.Tensor, local_count: torch.Tensor | int):
    """Mean over the whole GLOBAL batch of a loss summed over a varying number of items per rank (e.g. non-padding
    positions). Returns (loss to backpropagate, the global mean as a detached value).

    Each rank's mean would weight ranks equally whatever their item counts, so N processes would not match one
    process. Dividing the local sum by the global count and scaling by the world size makes DDP's gradient
    average equal the gradient of the global mean.
    """
    count = torch.as_tensor(local_count, dtype=torch.float32, device=local_sum.device)
    totals = torch.stack([local_sum.detach().float(), count])
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    global_count = totals[1].clamp_min(1.0)
    loss = local_sum * (accelerator.num_processes / global_count)
    return loss, totals[0] / global_count


class PeerWatch:
    """Names the rank that was lost when a collective fails.

    Every rank bumps its own counter in the process group's store from a daemon thread. When a collective
    raises (a peer died: gloo says "connection closed"; or hung past --dist-timeout), a survivor reads all
    counters, waits two beats, reads again: the ranks whose counter stood still are the lost ones.
    """

    def __init__(self, rank: int, world_size: int, interval: float = 1.0):
        import atexit
        import socket
        import threading

        import torch.distributed as dist

        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.store = dist.distributed_c10d._get_default_store()
        self.store.set(f"toolkit/host/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="toolkit-peer-watch", daemon=True)
        self._thread.start()
        # A thread still inside a store call while the interpreter tears the store down aborts the process
        # ("terminate called without an active exception"): stop and join it first.
        atexit.register(self.stop)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval) and not self._stop.is_set():
            try:
                self.store.add(f"toolkit/beat/{self.rank}", 1)
            except Exception:  # the store's host is gone: nothing left to report to
                return

    def silent_ranks(self) -> list[str]:
        """Ranks (with host and pid) whose heartbeat stopped; collective-free, so it works on a broken group."""
        def beats():
            return [self.store.add(f"toolkit/beat/{r}", 0) for r in range(self.world_size)]

        before = beats()
        self._stop.wait(2.5 * self.interval)
        after = beats()
        return [f"rank {r} ({self.store.get(f'toolkit/host/{r}').decode()})"
                for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval)


_watch: PeerWatch | None = None
_resume_hint = ""


def watch_peers(rank: int, world_size: int, run_dir) -> None:
    """Start the heartbeat for this process (multi-process runs only); see PeerWatch."""
    global _watch, _resume_hint
    if world_size > 1 and _watch is None:
        _watch = PeerWatch(rank, world_size)
    _resume_hint = f"complete checkpoints under {run_dir}/checkpoints are intact: continue with --resume-from auto"


def stop_watching_peers() -> None:
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None


def lost_peers_message(error: BaseException) -> str | None:
    """One line naming the lost rank(s) when `error` came from losing a peer, else None."""
    if _watch is None:
        return None
    try:
        silent = _watch.silent_ranks()
    except Exception:  # the store lived with the lost process (the master): name that
        silent = ["the master process (rank 0's store is unreachable)"]
    if not silent:
        return None
    cause = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    return f"lost {', '.join(silent)}: it stopped responding ({cause}); {_resume_hint}"
