"""UFS emulator training throughput (patterns/s): one process with 2 threads against 2 gloo processes with 1
thread each, side by side (the seeds' "threading vs distributed" question), with 1 process x 1 thread as the
baseline, 1 process x 2 threads with each OpenMP wait policy forced (ACTIVE: threads spin; PASSIVE: they sleep;
without either the toolkit chooses by the machine's load, toolkit/process/openmp.py), and 1 GPU where CUDA exists.

    python benchmarks/ufs_throughput.py [--data FILE] [--steps 300] [--batch-size 1000] [recipe flags...]

Runs the real recipe (reference model 3 x 64, batch 1000) one configuration after the other on the same file (a
generated 180 x 360 one when --data is not given), evaluating every steps/3 optimizer steps, and reports the last
interval's throughput from metrics.csv (the first intervals include warm-up). Patterns/s counts the GLOBAL batch.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(name: str, launch: list[str], flags: list[str], out: Path, env: dict) -> dict:
    command = [*launch, str(ROOT / "recipes" / "ufs_emulator.py"), *flags, "--output-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"name": name, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    last = rows[-1]
    return {
        "name": name,
        "patterns_per_sec": float(last["throughput_samples_per_sec"]),
        "interval_sec": float(last["epoch_time_sec"]),
        "world_size": int(last["world_size"]),
        "data_wait": float(last["data_load_time_sec"]) / float(last["epoch_time_sec"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="netCDF file (default: a generated 180 x 360 one)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per configuration")
    parser.add_argument("--batch-size", type=int, default=1000)
    known, recipe_flags = parser.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="ufs-throughput-"))
    data = known.data
    if data is None:
        from toolkit.data.ufs import synthesize

        data = synthesize(work / "gdas-like.nc")
    flags = [
        "--data",
        str(data),
        "--max-steps",
        str(known.steps),
        "--eval-every-steps",
        str(max(known.steps // 3, 1)),
        "--batch-size",
        str(known.batch_size),
        "--log-with",
        "none",
        "--epochs",
        "1000",
        "--patience",
        "0",
        *recipe_flags,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update({"TQDM_DISABLE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file"]
    env.pop("OMP_WAIT_POLICY", None)  # as from a user's shell: the recipe's begin_process() chooses by the load
    env.pop("GOMP_SPINCOUNT", None)
    two_procs = [*launch, str(ROOT / "accelerate_configs" / "cpu_2proc.yaml")]
    configs = [
        ("1 process x 1 thread (baseline)", [sys.executable], ["--threads", "1"], {}),
        ("1 process x 2 threads", [sys.executable], ["--threads", "2"], {}),
        ("2 processes x 1 thread (gloo)", two_procs, ["--threads", "1"], {}),
        # the two policies the toolkit chooses between by the load (toolkit/process/openmp.py), each forced
        ("1 process x 2 threads, ACTIVE", [sys.executable], ["--threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}),
        ("1 process x 2 threads, PASSIVE", [sys.executable], ["--threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
    ]
    import torch

    from toolkit.run.precision import cpu_kind

    if torch.cuda.is_available():
        configs.append(("1 GPU (bf16)", [*launch, str(ROOT / "accelerate_configs" / "1gpu.yaml")], [], {}))
    results = [run(name, cmd, [*flags, *extra], work / f"run{i}", {**env, **more})
               for i, (name, cmd, extra, more) in enumerate(configs)]
    print(
        f"UFS emulator training, {known.steps} steps of global batch {known.batch_size} on {data.name}; "
        f"last {max(known.steps // 3, 1)} steps timed; CPU: {cpu_kind(threads='as each row says')}"
    )
    print(f"{'configuration':<36} {'patterns/s':>12} {'data wait':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['name']:<36} failed: {r['error']}")
        else:
            print(f"{r['name']:<36} {r['patterns_per_sec']:>12.0f} {100 * r['data_wait']:>9.1f}%")
    if not torch.cuda.is_available():
        print(f"{'1 GPU':<36} not measured: no GPU on this machine (torch.cuda.is_available() is False)")
    ok = [r for r in results[:3] if "error" not in r]
    if len(ok) == 3:
        base = ok[0]["patterns_per_sec"]
        print(f"1 x 2 threads / 1 x 1: {ok[1]['patterns_per_sec'] / base:.2f}x; 2 processes / 1 x 1: "
              f"{ok[2]['patterns_per_sec'] / base:.2f}x; 2 processes / 1 x 2 threads: "
              f"{ok[2]['patterns_per_sec'] / ok[1]['patterns_per_sec']:.2f}x")


if __name__ == "__main__":
    main()
