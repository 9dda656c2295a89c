"""The local two-node SLURM cluster of slurm/local_cluster.sh: one task per node, and a requeue round trip."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

ROOT = Path(__file__).resolve().parent.parent
def slurm(args: list[str], env: dict, timeout: float = 30) -> str:
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def job_fields(job_id: str, env: dict) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", slurm(["scontrol", "show", "job", "-o", job_id], env)))


def test_one_task_on_each_node(slurm_env, tmp_path):
    out = tmp_path / "nodes.out"
    wrap = "srun bash -c 'echo $SLURM_NODEID $(hostname)'"
    args = ["--wait", "-N", "2", "--ntasks-per-node=1", "--chdir", str(tmp_path), "-o", str(out), "--wrap", wrap]
    slurm(["sbatch", *args], slurm_env, timeout=120)
    node_ids = sorted(line.split()[0] for line in out.read_text().splitlines() if line.strip())
    assert node_ids == ["0", "1"], out.read_text()


REQUEUE_JOB = """#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
echo "life ${SLURM_RESTART_COUNT:-0}"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo "restart=$SLURM_RESTART_COUNT" > DONE
"""


def test_requeue_round_trip(slurm_env, tmp_path):
    done, log = tmp_path / "done", tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(REQUEUE_JOB.replace("DONE", str(done)))
    job_id = slurm(["sbatch", "--parsable", "--chdir", str(tmp_path), "-o", str(log), str(script)], slurm_env)
    job_id = job_id.strip().split(";")[0]

    # After the requeue the job waits ~120 s for its EligibleTime: release it as soon as it is pending again.
    deadline = time.monotonic() + 60
    while True:
        fields = job_fields(job_id, slurm_env)
        if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) >= 1:
            break
        assert time.monotonic() < deadline, f"job {job_id} never pending after a requeue: {fields}"
        time.sleep(0.2)
    slurm(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], slurm_env)

    deadline = time.monotonic() + 60
    while not (done.exists() and done.read_text().strip()):
        fields = job_fields(job_id, slurm_env)
        assert time.monotonic() < deadline, f"second life never finished: {fields}\n{log.read_text()}"
        time.sleep(0.2)
    assert done.read_text().strip() == "restart=1"
    lives = [line for line in log.read_text().splitlines() if line.startswith("life")]
    assert lives == ["life 0", "life 1"], log.read_text()  # --open-mode=append kept the first life's output
