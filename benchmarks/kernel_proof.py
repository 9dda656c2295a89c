"""What the start-up proof of the fast paths costs (toolkit.kernels.with_kernels under --kernels auto): the model as
written and the converted model each run one example batch forward and backward, at each family's preset sizes.

    python benchmarks/kernel_proof.py              # 1 thread, the median of 3 proofs per model
    python benchmarks/kernel_proof.py --threads 2

Each proof is made on a fresh model built as its recipe builds it, with an example as its recipe's (HRM: the
puzzles that take every kernel, 1 at hidden 512; SASRec: two users' sequences at maxlen and their scores; DCRNN: two
windows with teacher values and coins). Prints seconds per proof and the CPU's kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from toolkit.process import begin_process  # noqa: E402

begin_process()

import torch  # noqa: E402

from toolkit.kernels import with_kernels  # noqa: E402
from toolkit.run.precision import cpu_kind  # noqa: E402


def hrm_case(hidden: int, heads: int, layers: int, cycles: int, halting: int):
    from toolkit.models.hrm import HRM

    def build():
        torch.manual_seed(0)
        return HRM(11, 81, num_puzzle_ids=1, hidden=hidden, heads=heads, expansion=4.0, h_layers=layers,
                   l_layers=layers, h_cycles=cycles, l_cycles=cycles, halt_max_steps=halting, exploration_prob=0.1)

    from toolkit.kernels.hrm import rows_to_exercise

    puzzles = -(-rows_to_exercise(hidden) // 82)  # as the recipe takes them (its batch being larger)
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(2, 11, (puzzles, 81), generator=generator)
    batch = {"inputs": torch.where(torch.rand(puzzles, 81, generator=generator) < 0.3, 1, labels), "labels": labels,
             "puzzle_ids": torch.zeros(puzzles, dtype=torch.long), "ids": torch.arange(puzzles)}
    return build, lambda m: m(m.initial_carry(batch), batch, (0, 0, 0))


def sasrec_case(hidden: int, blocks: int, maxlen: int):
    from toolkit.models.sasrec import SASRec

    def build():
        torch.manual_seed(0)
        return SASRec(3416, hidden=hidden, blocks=blocks, heads=1, maxlen=maxlen, dropout=0.2)

    ids = torch.randint(1, 3417, (2, maxlen), generator=torch.Generator().manual_seed(1))

    def example(m):
        hidden_states = m(ids)
        return hidden_states, m.score_items(hidden_states, torch.stack([ids, ids.flip(1)], -1))

    return build, example


def dcrnn_case(sensors: int, units: int, kernel: str):
    from toolkit.data.traffic import generate
    from toolkit.models.dcrnn import DCRNN

    _, _, adjacency = generate(sensors=sensors, days=1, seed=0, progress=False)

    def build():
        torch.manual_seed(0)
        return DCRNN(adjacency, input_dim=2, output_dim=1, units=units, layers=2, diffusion_steps=2, horizon=12,
                     sequence_kernel=kernel)

    generator = torch.Generator().manual_seed(1)
    x, truth = torch.randn(2, 12, sensors, 2, generator=generator), torch.randn(2, 12, sensors, generator=generator)
    coins = torch.tensor([[True, False] * 6, [False, True] * 6])
    return build, lambda m: m(x, truth, coins)


CASES = {
    "HRM cpu-small (hidden 64, 1+1 layers)": lambda: hrm_case(64, 4, 1, 1, 16),
    "HRM sudoku-1k (hidden 512, 4+4 layers, 2x2 cycles)": lambda: hrm_case(512, 8, 4, 2, 16),
    "SASRec ml-100k (d 50, maxlen 50)": lambda: sasrec_case(50, 2, 50),
    "SASRec ml-1m (d 50, maxlen 200)": lambda: sasrec_case(50, 2, 200),
    "DCRNN cpu, fused (50 sensors, 16 units)": lambda: dcrnn_case(50, 16, "fused"),
    "DCRNN metr-la, fused (207 sensors, 64 units)": lambda: dcrnn_case(207, 64, "fused"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_kind()}; {args.threads} thread(s); torch {torch.__version__}")
    print("| model | proof (s, median) | modules swapped |\n| --- | ---: | ---: |")
    for name, case in CASES.items():
        build, example = case()
        times, swapped = [], []
        for _ in range(args.repeats):
            model = build()
            started = time.perf_counter()
            swapped = with_kernels(model, "auto", example)
            times.append(time.perf_counter() - started)
        print(f"| {name} | {statistics.median(times):.2f} | {len(swapped)} |", flush=True)


if __name__ == "__main__":
    main()
