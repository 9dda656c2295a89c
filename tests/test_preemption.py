"""SIGUSR1 (what SLURM sends before a time limit or on pre-emption): every rank checkpoints at the next step and
exits 0; `--resume-from auto` then finishes bit-identical to an uninterrupted run."""

import csv
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import CONFIGS, ROOT, TINY, TOY, catches, logged_steps, ranks_seen, recipe_env, run_recipe

from toolkit.run.tracking import TRAILING_COLUMNS

pytestmark = pytest.mark.slow

ARGS = [*TINY, "--epochs", "10", "--max-steps", "60", "--dropout", "0.3", "--log-with", "csv", "--log-every", "1"]




def _workers(launcher: subprocess.Popen) -> list[psutil.Process]:
    children = psutil.Process(launcher.pid).children(recursive=True)
    return [p for p in children if any("sasrec.py" in part for part in p.cmdline()) and p.pid != launcher.pid
            and "accelerate" not in " ".join(p.cmdline()[:3])]


def test_signal_checkpoints_exits_zero_and_resume_is_exact(tmp_path, movielens_cache):
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    run_recipe([*ARGS, "--output-dir", str(straight)], config="cpu_2proc.yaml")

    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
               "--main_process_port", "0", str(ROOT / "recipes" / "sasrec.py"), *ARGS, "--output-dir", str(preempted)]
    launcher = subprocess.Popen(command, cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    deadline = time.monotonic() + 300
    while logged_steps(preempted) < 3 and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition (steps logged), not a timed wait
    workers = _workers(launcher)
    assert len(workers) == 2, [w.cmdline() for w in workers]
    workers[1].send_signal(signal.SIGUSR1)  # one rank is enough: all ranks agree at the next step
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    stopped_at = int(re.search(r"pre-empted at step (\d+): checkpoint saved", stdout).group(1))
    assert 3 <= stopped_at < 60
    assert (preempted / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").exists()

    run_recipe([*ARGS, "--output-dir", str(preempted), "--resume-from", "auto"], config="cpu_2proc.yaml")
    final = [d / "checkpoints" / "step_60" / "model.safetensors" for d in (straight, preempted)]
    assert final[0].read_bytes() == final[1].read_bytes()


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_signal_during_start_up_is_kept_not_fatal(tmp_path, movielens_cache):
    """SLURM may signal a job that has only just started: a recipe's first call (begin_process, before torch) makes
    SIGUSR1 set a flag, so a signal that arrives while torch is still being imported is remembered and the run
    checkpoints at its first step, exit 0. The signal is sent as soon as the handler is there (the kernel's mask
    says so), and torch is checked not yet loaded at that moment, so the window tested is the start-up's,
    whatever the machine's load."""
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "recipes" / "sasrec.py"), *TINY, "--max-steps", "20",
               "--output-dir", str(out)]
    proc = subprocess.Popen(command, cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGUSR1) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)  # polling a condition (the handler installed), not a timed wait
    torch_was_loaded = _torch_loaded(proc.pid)
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    assert not torch_was_loaded  # the signal did arrive during start-up, before torch
    assert proc.returncode == 0, stderr[-3000:]
    assert "pre-empted at step 1: checkpoint saved" in stdout + stderr
    assert (out / "checkpoints" / "step_1" / "COMPLETE").exists()


@pytest.mark.parametrize("rank", [1])  # not the main process: its flag must reach rank 0
def test_a_signal_on_any_rank_is_saved_at_the_next_step_not_the_next_read(rank, tmp_path):
    """2 processes reading the loss every 20 steps: SIGUSR1 to one rank during step 5 is saved at step 5 (the ranks
    agree on it every step, on the host), and the resumed run ends as the uninterrupted one, bit for bit."""
    args = ["--log-every", "20", "--max-steps", "8", "--checkpoint-every", "0", "--eval-every-steps", "4",
            "--no-carry"]
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    run_recipe([*args, "--output-dir", str(straight)], recipe=TOY, config="cpu_2proc.yaml")
    hook = ["--signal-at-step", "5", "--signal-rank", str(rank)]  # a resume keeps the run's flags (step 5 is past)
    signalled = run_recipe([*args, *hook, "--output-dir", str(preempted)], recipe=TOY, config="cpu_2proc.yaml")
    assert ranks_seen(signalled.stdout + signalled.stderr) == {(0, 2), (1, 2)}
    assert "pre-empted at step 5: checkpoint saved" in signalled.stdout, signalled.stdout[-2000:]
    assert sorted(p.name for p in (preempted / "checkpoints").iterdir()) == ["step_4", "step_5"]
    run_recipe([*args, *hook, "--output-dir", str(preempted), "--resume-from", "auto"], recipe=TOY,
               config="cpu_2proc.yaml")
    final = [d / "checkpoints" / "step_8" / "model.safetensors" for d in (straight, preempted)]
    assert final[0].read_bytes() == final[1].read_bytes()


def test_a_signal_at_an_evaluation_step_keeps_that_evaluation(tmp_path):
    """Pre-empted at step 4, where an evaluation is due: it is evaluated before the save (the resumed life starts at
    step 5), so metrics.csv and log.csv are the uninterrupted run's. The evaluation was lost: rows 8 and 12 only,
    step 8's train_loss the mean over steps 1-8."""
    args = ["--max-steps", "12", "--checkpoint-every", "2", "--eval-every-steps", "4", "--log-every", "5",
            "--signal-at-step", "4"]
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    run_recipe([*args[:-2], "--output-dir", str(straight)], recipe=TOY)
    first = run_recipe([*args, "--output-dir", str(preempted)], recipe=TOY)
    assert "pre-empted at step 4: checkpoint saved" in first.stdout, first.stdout[-2000:]
    run_recipe([*args, "--output-dir", str(preempted), "--resume-from", "auto"], recipe=TOY)
    timing = set(TRAILING_COLUMNS) - {"world_size"}  # measured: they differ run to run

    def rows(run_dir):
        return [{k: v for k, v in row.items() if k not in timing}
                for row in csv.DictReader(open(run_dir / "metrics.csv"))]

    assert [row["step"] for row in rows(preempted)] == ["4", "8", "12"]
    assert rows(preempted) == rows(straight)
    assert (preempted / "log.csv").read_text() == (straight / "log.csv").read_text()
    final = [d / "checkpoints" / "step_12" / "model.safetensors" for d in (straight, preempted)]
    assert final[0].read_bytes() == final[1].read_bytes()
