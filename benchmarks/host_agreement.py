"""What the per-step pre-emption agreement costs: one all-reduce of one flag on the host (toolkit.loop.agreement's
any_rank_on_host), which every rank of an N-process run makes after every optimizer step so that a signal to any
rank is saved at the next step.

    python benchmarks/host_agreement.py                       # 2 processes on gloo, 3 rounds of 2,000 agreements
    python benchmarks/host_agreement.py --processes 4 --calls 5000

Each process joins a gloo group on loopback and times `calls` agreements back to back; the figure is the median
over the rounds of the slowest rank's mean microseconds per agreement. Set it against a recipe's step time (its
metrics.csv `epoch_time_sec` / steps) to read the share. Prints the CPU's kind with the figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.loop.agreement import any_rank_on_host  # noqa: E402
from toolkit.run.precision import cpu_kind  # noqa: E402


class _Processes:  # what any_rank_on_host reads of an Accelerator
    def __init__(self, n: int):
        self.num_processes = n


def _worker(rank: int, world: int, port: int, calls: int, rounds: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    accelerator = _Processes(world)
    any_rank_on_host(accelerator, False)  # the first call connects
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            any_rank_on_host(accelerator, False)
        results.put((rank, (time.perf_counter() - started) / calls * 1e6))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(
        _worker,
        args=(args.processes, port, args.calls, args.rounds, results),
        nprocs=args.processes,
        start_method="spawn",
    )
    per_round: dict[int, list[float]] = {}
    for _ in range(args.processes * args.rounds):
        rank, micros = results.get()
        per_round.setdefault(rank, []).append(micros)
    slowest = [max(per_round[r][i] for r in per_round) for i in range(args.rounds)]
    print(
        f"host agreement, {args.processes} processes on gloo (loopback), {args.calls} calls x {args.rounds} rounds: "
        f"{statistics.median(slowest):.1f} us per step (rounds: {', '.join(f'{m:.1f}' for m in slowest)})"
    )
    print(f"on {cpu_kind(threads=1)}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
