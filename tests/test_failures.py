"""A rank dies mid-run: the survivors exit non-zero with one line naming the lost rank, well within
--dist-timeout; the complete checkpoints stay intact and --resume-from auto continues."""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import CONFIGS, ROOT, TINY, free_port, recipe_env, run_recipe

from toolkit import checkpoint

pytestmark = pytest.mark.slow


def test_killed_rank_is_named_and_the_run_resumes(tmp_path, movielens_cache):
    out = tmp_path / "run"
    args = [*TINY, "--epochs", "40", "--checkpoint-every", "5", "--keep-checkpoints", "10", "--dist-timeout", "60",
            "--output-dir", str(out)]
    port = str(free_port())
    machines = []
    for rank in (0, 1):  # two "machines": rank 1's death is not seen by rank 0's launcher, only by rank 0 itself
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(CONFIGS / "2node_cpu.yaml"), "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
                   "--main_process_port", port, str(ROOT / "recipes" / "sasrec.py"), *args]
        machines.append(subprocess.Popen(command, cwd=ROOT, env=recipe_env(), stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
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
