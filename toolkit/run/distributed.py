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


def mean_over_processes(accelerator: Accelerator, value: torch.Tensor) -> torch.Tensor:
    """The mean over the processes of a per-rank value (e.g. a loss logged per step). On one process the value
    itself: Accelerate's reduce copies and divides even then, ~5 us every step of a 1 ms model."""
    if accelerator.num_processes == 1:
        return value
    return accelerator.reduce(value, reduction="mean")


# ----------------------------------------------------------------------------------------------------
# Per-feature mean and variance over every rank's shard (normalisation statistics), exact in float64
# ----------------------------------------------------------------------------------------------------


def local_moments(x: torch.Tensor, ignore_nan: bool = False) -> torch.Tensor:
    """[4, F] float64 per-feature (count, mean, residual, M2) of x [n, F], two-pass.

    mean is the float64 mean; residual = mean(x - mean), what rounding the mean to float64 lost (it lets merges
    of large-mean fields keep full precision); M2 = sum of squared deviations from the exact mean. n may be 0
    (all zeros). ignore_nan: per feature, leave out non-finite values (counts then differ per feature);
    otherwise a NaN makes that feature's mean and M2 NaN.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, features], got shape {tuple(x.shape)}")
    x = x.detach().double()
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    if ignore_nan:
        finite = torch.isfinite(x)
        count = finite.sum(dim=0).double()
        x = torch.where(finite, x, zero)
    else:
        finite = None
        count = torch.full((x.shape[1],), float(x.shape[0]), dtype=torch.float64, device=x.device)
    divisor = count.clamp_min(1.0)
    mean = x.sum(dim=0) / divisor
    deviation = x - mean
    if finite is not None:
        deviation = torch.where(finite, deviation, zero)
    residual = deviation.sum(dim=0) / divisor
    m2 = deviation.square().sum(dim=0) - count * residual.square()
    return torch.stack([count, mean, residual, m2])


def combine_moments(parts: torch.Tensor) -> torch.Tensor:
    """Merge [R, 4, F] per-part local_moments into one [4, F], in part order (Chan, Golub & LeVeque 1979):
    delta = mean_b - mean_a, mean = mean_a + delta n_b / n, M2 = M2_a + M2_b + delta^2 n_a n_b / n.

    For M2, the means are taken relative to the first non-empty part's mean (differences of nearby floats are
    exact) plus the residuals, so delta keeps full precision even for a 273.15 K field whose spread is 1e-4 (plain
    float64 means lose ~1e-12 of M2 there). The returned mean merges the float64 means themselves (within an ulp
    of the exact mean; a residual carries summation noise where the spread dwarfs the mean). Parts with count 0
    change nothing. Deterministic: the same parts in the same order give the same bits.
    """
    parts = parts.double()
    counts, means, m2s = parts[:, 0], parts[:, 1], parts[:, 3]
    first = torch.argmax((counts > 0).to(torch.int8), dim=0)  # the first non-empty part, per feature
    base = means.gather(0, first.unsqueeze(0)).squeeze(0)
    shifted = (means - base) + parts[:, 2]  # each part's exact mean minus base, to rounding of a small number
    count, mean, shift, m2 = (torch.zeros_like(base) for _ in range(4))
    for n_b, mean_b, shift_b, m2_b in zip(counts, means, shifted, m2s, strict=True):
        total = count + n_b
        weight = n_b / total.clamp_min(1.0)
        delta = shift_b - shift
        use = n_b > 0  # an empty part must not pull the mean
        mean = torch.where(use, torch.where(count > 0, mean + (mean_b - mean) * weight, mean_b), mean)
        shift = torch.where(use, shift + delta * weight, shift)
        m2 = torch.where(use, m2 + m2_b + delta.square() * (count * weight), m2)
        count = total
    return torch.stack([count, mean, shift - (mean - base), m2])


def merge_moments(accelerator: Accelerator, x: torch.Tensor, ignore_nan: bool = False):
    """(count, mean, M2), each float64 [F], of the rows of x [n, F] over ALL ranks, identical on every rank.

    n may differ per rank (and be 0). Each rank's two-pass local_moments (fixed size [4, F]) are gathered with
    accelerator.gather and merged in rank order by combine_moments, so the result equals the single-process
    statistics of the concatenated rows to rounding (~1e-15 relative), unlike sqrt(E[x^2] - mean^2), which
    loses the variance of large-mean fields (temperatures in K). Use std_from_moments(count, m2) for the std.
    A collective: every rank must call it. Results are on x's device.
    """
    stats = local_moments(x, ignore_nan=ignore_nan)
    if accelerator.num_processes > 1:
        gathered = accelerator.gather(stats.to(accelerator.device).unsqueeze(0))  # [world, 4, F]
        stats = combine_moments(gathered.cpu()).to(x.device)  # merged on the CPU: the same bits on every rank
    count, mean, _, m2 = stats
    return count, mean, m2


def std_from_moments(count: torch.Tensor, m2: torch.Tensor, floor: float = 1e-6, ddof: int = 0) -> torch.Tensor:
    """sqrt(M2 / (count - ddof)) (ddof 0: the population std, like numpy's default); a std below `floor` (a constant
    feature) becomes 1, so normalising by it neither divides by ~0 nor changes the feature. A NaN std (NaN in the
    data, or count <= ddof) stays NaN: a feature with no usable rows is an error to see, not to hide."""
    count = torch.as_tensor(count, dtype=torch.float64)
    m2 = torch.as_tensor(m2, dtype=torch.float64)
    divisor = count - ddof
    std = torch.sqrt(m2 / torch.where(divisor > 0, divisor, torch.full_like(divisor, float("nan"))))
    return torch.where(std < floor, torch.ones_like(std), std)


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
