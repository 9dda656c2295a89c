"""A run killed after it logged rows but before its first checkpoint, started again with `--resume-from auto`: it
starts afresh in the same directory, and its log.csv and metrics.csv are what an uninterrupted run writes (the dead
life's rows are removed, not kept: step 1 twice was the bug). A plain fresh start into such a directory is refused."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, logged_steps, recipe_env, recipe_script, run_recipe
from test_clean_exit import tiny_args, ufs_grid  # noqa: F401  (ufs_grid: a fixture tiny_args asks for)

from toolkit.run import checkpoint
from toolkit.tools.verify import verify_run

pytestmark = pytest.mark.slow
TIMING = {"epoch_time_sec", "throughput_samples_per_sec", "data_load_time_sec", "compute_time_sec", "cpu_util_avg",
          "gpu_util_avg", "peak_memory_mb"}
STEPS = 10  # every recipe's tiny epoch is longer: no checkpoint before the end
# The killed life stops itself right after step 2 is logged, and the test kills it there: a kill timed from outside
# (when 2 rows had appeared) came after the whole run had ended once the UFS MLP's steps took ~1 ms.
STOP_AFTER_STEP_2 = """
import os, runpy, signal, sys
from toolkit.loop.training import AFTER_STEP_HOOKS
def stop_after_step_2(loop):
    if loop.progress.global_step == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
AFTER_STEP_HOOKS.append(stop_after_step_2)  # the loop's documented hook: no private method patched
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] == "T"


def metrics(run_dir):
    with open(run_dir / "metrics.csv", newline="") as handle:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(handle)]


def tiny(recipe, request):
    args = tiny_args(recipe, request)
    args = [a for i, a in enumerate(args) if a != "--max-steps" and (i == 0 or args[i - 1] != "--max-steps")]
    args = [a for i, a in enumerate(args) if a not in ("--log-with",) and (i == 0 or args[i - 1] != "--log-with")]
    if recipe == "hrm":  # 192 puzzles: 12 steps an epoch
        args[args.index("--train-puzzles") + 1] = "192"
    return [*args, "--max-steps", str(STEPS), "--eval-every-steps", "100", "--log-with", "csv", "--log-every", "1"]


@pytest.mark.parametrize("recipe", ["sasrec", "ufs_emulator", "dcrnn", "hrm"])
def test_a_run_killed_before_its_first_checkpoint_restarts_with_the_rows_of_an_uninterrupted_one(recipe, request,
                                                                                                  tmp_path):
    args = tiny(recipe, request)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_recipe([*args, "--output-dir", str(straight)], recipe=recipe)

    proc = subprocess.Popen([sys.executable, "-c", STOP_AFTER_STEP_2, recipe_script(recipe), *args, "--output-dir",
                             str(killed)], cwd=ROOT, env=recipe_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not stopped(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition (the process stopped itself after step 2), not a timed wait
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert logged_steps(killed) >= 2 and checkpoint.complete_checkpoints(killed) == []  # the moment hit

    if recipe == "sasrec":  # the toolkit's rule, the same for every recipe: checked once
        refused = run_recipe([*args, "--output-dir", str(killed)], recipe=recipe, check=False)
        assert refused.returncode == 2 and "already holds a run; continue it with --resume-from auto" in refused.stderr
    again = run_recipe([*args, "--output-dir", str(killed), "--resume-from", "auto"], recipe=recipe)
    assert "stopped before its first checkpoint: starting it afresh" in again.stdout + again.stderr
    assert (killed / "log.csv").read_bytes() == (straight / "log.csv").read_bytes()
    assert metrics(killed) == metrics(straight)
    assert verify_run(killed) == []
