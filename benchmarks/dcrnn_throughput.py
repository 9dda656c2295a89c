"""Training throughput of the DCRNN recipe in windows per second: 1 process x 1 and x 2 threads and 2 CPU processes
side by side, and 1 GPU where CUDA exists.

    python benchmarks/dcrnn_throughput.py [--steps 20] [--rounds 2] [--data DIR] [recipe flags...]

Runs the real recipe through `accelerate launch` (accelerate_configs/cpu.yaml, cpu_2proc.yaml; 1gpu.yaml when a GPU
is present), alternating the configurations round by round because this machine is shared and noisy, and reports the
median. Each run trains 2 x --steps optimizer steps with one evaluation after the first --steps: the second
metrics.csv row times steady-state training only (the first holds the warm-up). Without --data a generated
50-sensor, 28-day network (the CPU preset's data) is written to a temporary directory. The global batch is the
same for every configuration (the recipe's --batch-size, 64 by default), split over the processes.

    python benchmarks/dcrnn_throughput.py --profile 3 [--threads 1]

instead profiles 3 training steps (forward, backward, clip, Adam) of the cpu preset's model (2x16, K=2, batch 64,
scheduled-sampling coins at 0.5) on the generated network's graph with torch.profiler, in this process, and prints
the top of the table by self CPU time.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolkit.data.traffic import generate, write_dataset  # noqa: E402


def run_once(config: str, data: Path, steps: int, flags: list[str], workdir: Path, index: int) -> tuple[float, str]:
    out = workdir / f"{Path(config).stem}-{index}"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / config),
        "--main_process_port",
        "0",
        str(ROOT / "recipes" / "dcrnn.py"),
        "--data",
        str(data),
        "--cache-dir",
        str(workdir / "cache"),
        "--max-steps",
        str(2 * steps),
        "--eval-every-steps",
        str(steps),
        "--log-with",
        "none",
        "--output-dir",
        str(out),
        *flags,
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TQDM_DISABLE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{config} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    return float(rows[-1]["throughput_samples_per_sec"]), rows[-1]["world_size"]


def profile_steps(steps: int, threads: int) -> None:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from toolkit.kernels import converted
    from toolkit.models.dcrnn import DCRNN

    torch.set_num_threads(threads)
    _, _, adjacency = generate(sensors=50, days=2, seed=0, progress=False)  # the same graph as days=28's
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, 50, 2, generator=generator)
    y = torch.randn(64, 12, 50, generator=generator)
    coins = torch.rand(64, 12, generator=generator) < 0.5
    torch.manual_seed(0)
    model = converted(DCRNN(np.asarray(adjacency, np.float32), units=16, layers=2, diffusion_steps=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)

    def step():
        loss = (model(x, y, coins) - y).abs().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()

    step()  # warm-up: the sparse diffusion matrix and the optimizer state are made here
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    from toolkit.run.precision import cpu_kind

    print(f"{steps} training steps, cpu preset model, batch 64; CPU: {cpu_kind(threads=threads)}:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="steps timed per run (after as many warm-up steps)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every configuration once")
    parser.add_argument("--data", type=Path, default=None, help="traffic data directory (default: generated)")
    parser.add_argument("--profile", type=int, default=0, help="profile this many model steps instead (see above)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of --profile")
    known, recipe_flags = parser.parse_known_args()
    if known.profile > 0:
        profile_steps(known.profile, known.threads)
        return
    workdir = Path(tempfile.mkdtemp(prefix="dcrnn-throughput-"))
    data = known.data
    if data is None:
        data = workdir / "synth-50"
        write_dataset(data, *generate(sensors=50, days=28, seed=0, progress=False))

    import torch

    from toolkit.run.precision import cpu_kind

    print(f"CPU: {cpu_kind(threads='1 or 2 per process, as each row says')}", flush=True)
    # (label, accelerate config, extra recipe flags): 1 process x 1 thread (the cpu preset), x 2 threads, 2 x 1
    configs = [("1 process x 1 thread", "cpu.yaml", []), ("1 process x 2 threads", "cpu.yaml", ["--threads", "2"]),
               ("2 processes x 1 thread", "cpu_2proc.yaml", [])]
    if torch.cuda.is_available():
        configs.append(("1 GPU", "1gpu.yaml", []))
    results: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for round_ in range(known.rounds):
        for index, (label, config, extra) in enumerate(configs):
            rate, world = run_once(config, data, known.steps, [*recipe_flags, *extra], workdir,
                                   round_ * len(configs) + index)
            results[label].append(rate)
            print(f"round {round_ + 1}: {label:24s} world size {world}: {rate:8.1f} windows/s", flush=True)
    print(
        f"\nmedian training throughput over {known.rounds} round(s), {known.steps} timed steps each "
        f"(recipe flags: {' '.join(recipe_flags) or 'defaults'}); CPU: {cpu_kind(threads='as each row says')}:"
    )
    for label, rates in results.items():
        print(f"  {label:24s} {statistics.median(rates):8.1f} windows/s")
    one, threads, two = (statistics.median(results[label]) for label, _, _ in configs[:3])
    print(f"  1 x 2 threads / 1 x 1 = {threads / one:.2f}x; 2 processes / 1 process = {two / one:.2f}x")
    if "1 GPU" not in results:
        print("  1 GPU: not measured (CUDA is not available on this machine)")


if __name__ == "__main__":
    main()
