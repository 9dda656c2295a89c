"""A rank dies mid-run: the survivors exit non-zero with one line naming the lost rank, well within
--dist-timeout; the complete checkpoints stay intact and --resume-from auto continues."""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import CONFIGS, ROOT, TINY, free_port, recipe_env, run_recipe, start_machines

from toolkit.run import checkpoint

pytestmark = pytest.mark.slow


def test_killed_rank_is_named_and_the_run_resumes(tmp_path, movielens_cache):
    out = tmp_path / "run"
    args = [*TINY, "--epochs", "40", "--checkpoint-every", "5", "--keep-checkpoints", "10", "--dist-timeout", "60",
            "--output-dir", str(out)]
    machines = start_machines(args, config="2node_cpu.yaml")
    deadline = time.monotonic() + 300
    while checkpoint.newest_complete(out) is None or checkpoint.step_of(checkpoint.newest_complete(out)) < 10:
        assert time.monotonic() < deadline and machines[0].poll() is None, "training did not reach step 10"
        time.sleep(0.05)  # polling a condition (a checkpoint exists), not a timed wait
    worker = [p for p in psutil.Process(machines[1].pid).children(recursive=True)
              if "sasrec.py" in " ".join(p.cmdline()) and "accelerate" not in " ".join(p.cmdline()[:3])]
    killed_at = time.monotonic()
    worker[0].send_signal(signal.SIGKILL)
    _, stderr = machines[0].communicate(timeout=120)
    machines[1].communicate(timeout=120)
    assert machines[0].returncode != 0
    assert time.monotonic() - killed_at < 60  # never waits out the timeout, let alone hangs
    errors = [line for line in stderr.splitlines() if line.startswith("error: lost rank 1")]
    assert len(errors) == 1, stderr[-3000:]
    assert "--resume-from auto" in errors[0]

    newest = checkpoint.newest_complete(out)
    assert newest is not None and checkpoint.step_of(newest) >= 10
    resumed = run_recipe([*args, "--max-steps", str(checkpoint.step_of(newest) + 5), "--resume-from", "auto"])
    assert f"resuming from {newest}" in resumed.stdout.replace("\n", " ") or newest.name in resumed.stdout
    assert (out / "checkpoints" / f"step_{checkpoint.step_of(newest) + 5}" / "COMPLETE").exists()
    assert re.search(r"resumed at epoch \d+, batch \d+, step \d+", resumed.stdout)


def test_machines_launched_with_different_process_counts_get_one_line(tmp_path):
    port = str(free_port())
    machines = []
    for rank, processes in ((0, "4"), (1, "2")):  # machine 0 thinks 2 per machine, machine 1 thinks 1
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(CONFIGS / "2node_cpu.yaml"), "--num_processes", processes, "--machine_rank", str(rank),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", port, str(ROOT / "recipes" / "sasrec.py"),
                   *TINY, "--output-dir", str(tmp_path / "run")]
        machines.append(subprocess.Popen(command, cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
    outputs = [m.communicate(timeout=300) for m in machines]
    assert all(m.returncode != 0 for m in machines)
    errors = [line for _, err in outputs for line in err.splitlines() if "error: the machines" in line]
    assert errors and "machine 0: 2, machine 1: 1" in errors[0] and "world size 3" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def _toolkit_launch(args, **env):
    return subprocess.run([sys.executable, "-m", "toolkit", "launch", "--config_file", str(CONFIGS / "2node_cpu.yaml"),
                           *args, str(ROOT / "recipes" / "sasrec.py"), *TINY],
                          cwd=ROOT, env=recipe_env(env), capture_output=True, text=True, timeout=300)


def test_port_in_use_on_the_head_node_is_one_line(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _toolkit_launch(["--machine_rank", "0", "--main_process_port", str(port)])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and f"port `{port}`" in lines[0], result.stderr


def test_unreachable_head_node_is_one_line_within_the_rendezvous_timeout(tmp_path):
    port = free_port()  # nothing listens there: machine 0 never started
    started = time.monotonic()
    result = _toolkit_launch(["--machine_rank", "1", "--main_process_ip", "127.0.0.1", "--main_process_port",
                              str(port)], TOOLKIT_RDZV_TIMEOUT="5")
    assert time.monotonic() - started < 60
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"could not join the run at 127.0.0.1:{port}" in lines[0], result.stderr


def test_hung_rank_is_named_after_dist_timeout(tmp_path, movielens_cache):
    out = tmp_path / "run"
    args = [*TINY, "--epochs", "40", "--checkpoint-every", "5", "--dist-timeout", "15", "--output-dir", str(out)]
    machines = start_machines(args, config="2node_cpu.yaml")
    deadline = time.monotonic() + 300
    while checkpoint.newest_complete(out) is None:
        assert time.monotonic() < deadline and machines[0].poll() is None, "training did not reach a checkpoint"
        time.sleep(0.05)  # polling a condition (a checkpoint exists), not a timed wait
    worker = [p for p in psutil.Process(machines[1].pid).children(recursive=True)
              if "sasrec.py" in " ".join(p.cmdline()) and "accelerate" not in " ".join(p.cmdline()[:3])][0]
    stopped_at = time.monotonic()
    worker.send_signal(signal.SIGSTOP)  # alive but stuck: only the timeout can tell
    try:
        _, stderr = machines[0].communicate(timeout=180)
        waited = time.monotonic() - stopped_at
    finally:
        worker.send_signal(signal.SIGKILL)
        machines[1].communicate(timeout=120)
    assert machines[0].returncode != 0
    assert 10 < waited < 90, waited  # it waited for --dist-timeout (15 s), and not much longer
    assert any(line.startswith("error: lost rank 1") for line in stderr.splitlines()), stderr[-3000:]
