"""SIGTERM is pre-emption (what `scancel`, SLURM's time limit, Kubernetes and most schedulers send first): at the
next step the run saves a complete checkpoint, says so in one line and exits 0, with no requeue; `--resume-from auto`
then finishes bit-identical to an uninterrupted run. `python -m toolkit launch` forwards SIGTERM and SIGUSR1 to its
workers. Before the run has started, SIGTERM ends the process at once, in one line, leaving nothing behind."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import CONFIGS, ROOT, TINY, catches, logged_steps, ranks_seen, recipe_env, run_recipe

from toolkit.tools.verify import verify_run

# one worker for the module: its module-scoped runs are made once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sigterm")]

ARGS = [*TINY, "--epochs", "10", "--max-steps", "40", "--log-with", "csv", "--log-every", "1"]
SASREC = str(ROOT / "recipes" / "sasrec.py")
# A second SIGTERM in the middle of the save the first one asked for: sent by the process itself once the save's
# files are written and before it is marked complete (a signal timed from outside could not hit that moment).
SECOND_SIGTERM_DURING_THE_SAVE = """
import os, runpy, signal, sys
from toolkit.run import checkpoint
original = checkpoint.write_manifest
def write_manifest(directory):
    os.kill(os.getpid(), signal.SIGTERM)
    return original(directory)
checkpoint.write_manifest = write_manifest
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def wait_for_steps(run_dir, proc, steps: int) -> None:
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition (steps logged), not a timed wait
    assert proc.poll() is None and logged_steps(run_dir) >= steps, "the run ended before it could be signalled"


def final_weights_equal(a, b, step: int = 40) -> bool:
    return all((d / "checkpoints" / f"step_{step}" / "model.safetensors").exists() for d in (a, b)) and (
        (a / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes()
        == (b / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes())


def test_one_process_checkpoints_exits_zero_survives_a_second_sigterm_in_the_save_and_resumes_exactly(
        tmp_path, movielens_cache):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_recipe([*ARGS, "--output-dir", str(straight)])
    proc = subprocess.Popen([sys.executable, "-c", SECOND_SIGTERM_DURING_THE_SAVE, SASREC, *ARGS, "--output-dir",
                             str(stopped)], cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_steps(stopped, proc, 3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    lines = [line for line in (stdout + stderr).splitlines() if "SIGTERM" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"stopped by SIGTERM at step (\d+): checkpoint saved; continue with --resume-from auto", lines[0]), lines
    step = int(re.search(r"step (\d+)", lines[0]).group(1))
    assert 3 <= step < 40 and (stopped / "checkpoints" / f"step_{step}" / "COMPLETE").exists()
    assert "requeue" not in stdout + stderr
    run_recipe([*ARGS, "--output-dir", str(stopped), "--resume-from", "auto"])
    assert final_weights_equal(straight, stopped) and verify_run(stopped) == []


def launch(args, out) -> subprocess.Popen:
    command = [sys.executable, "-m", "toolkit", "launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
               "--main_process_port", "0", SASREC, *args, "--output-dir", str(out)]
    return subprocess.Popen(command, cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.fixture(scope="module")
def two_process_straight(tmp_path_factory, movielens_cache):
    out = tmp_path_factory.mktemp("straight") / "run"
    run_recipe([*ARGS, "--output-dir", str(out)], config="cpu_2proc.yaml")
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_the_toolkit_launcher_forwards_the_signal_and_the_workers_checkpoint(sig, tmp_path, two_process_straight):
    out = tmp_path / "run"
    launcher = launch(ARGS, out)
    wait_for_steps(out, launcher, 3)
    launcher.send_signal(sig)  # to the launcher only: torchrun's workers run in sessions of their own
    stdout, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    assert ranks_seen(stdout + stderr) == {(0, 2), (1, 2)}
    said = {signal.SIGTERM: r"stopped by SIGTERM at step (\d+): checkpoint saved; continue with --resume-from auto",
            signal.SIGUSR1: r"pre-empted at step (\d+): checkpoint saved; not under SLURM"}[sig]
    step = int(re.search(said, stdout).group(1))
    assert (out / "checkpoints" / f"step_{step}" / "COMPLETE").exists()
    assert f"launcher: {sig.name} forwarded to the workers" in stderr
    assert "Traceback" not in stderr
    if sig == signal.SIGTERM:  # and the resumed run is the uninterrupted one
        run_recipe([*ARGS, "--output-dir", str(out), "--resume-from", "auto"], config="cpu_2proc.yaml")
        assert final_weights_equal(two_process_straight, out) and verify_run(out) == []


def test_plain_accelerate_launch_ends_sigterm_in_one_line_and_the_run_resumes_exactly(tmp_path, two_process_straight):
    """torchrun's agent inside `accelerate launch` sends SIGTERM on to the workers, waits for their checkpoint, then
    raises the signal again: the launcher's last line is one line (toolkit.process.launcher_exit, installed by the
    project's .pth), not torch's traceback, and the resumed run ends as the uninterrupted one."""
    out = tmp_path / "run"
    accelerate = str(Path(sys.executable).parent / "accelerate")
    launcher = subprocess.Popen([accelerate, "launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
                                 "--main_process_port", "0", SASREC, *ARGS, "--output-dir", str(out)], cwd=ROOT,
                                env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, launcher, 3)
    launcher.send_signal(signal.SIGTERM)
    stdout, stderr = launcher.communicate(timeout=300)
    assert "Traceback" not in stderr, stderr[-3000:]
    assert launcher.returncode == 1  # the launcher itself was stopped
    assert stderr.strip().splitlines()[-1] == ("accelerate launch: stopped by SIGTERM, sent on to the workers: they "
                                               "checkpoint at their next step (continue with --resume-from auto)")
    assert ranks_seen(stdout + stderr) == {(0, 2), (1, 2)}
    step = int(re.search(r"stopped by SIGTERM at step (\d+): checkpoint saved", stdout).group(1))
    assert (out / "checkpoints" / f"step_{step}" / "COMPLETE").exists()
    run_recipe([*ARGS, "--output-dir", str(out), "--resume-from", "auto"], config="cpu_2proc.yaml")
    assert final_weights_equal(two_process_straight, out) and verify_run(out) == []


def test_sigterm_during_start_up_stops_in_one_line_and_leaves_nothing(tmp_path, movielens_cache):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, SASREC, *TINY, "--max-steps", "20", "--output-dir", str(out)], cwd=ROOT,
                            env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Sent once the recipe's first call has put its early handler in: before that, Python's own default kills silently
    # (a loaded machine can take any time to get there), and torch is not loaded yet at that moment.
    deadline = time.monotonic() + 60
    while not catches(proc.pid, signal.SIGTERM):
        assert time.monotonic() < deadline and proc.poll() is None, "the recipe never caught SIGTERM"
        time.sleep(0.001)  # polling a condition (the handler installed), not a timed wait
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "stopped by SIGTERM before the run started: nothing to save"
    assert not out.exists()

    launcher = launch([*TINY, "--max-steps", "20"], out)
    with pytest.raises(subprocess.TimeoutExpired):
        launcher.wait(timeout=0.1)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and "SIGTERM" in stderr and "Traceback" not in stderr, stderr[-3000:]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [] and not (out / "checkpoints").exists()
