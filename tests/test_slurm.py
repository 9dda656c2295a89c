"""The real sbatch scripts on a real SLURM cluster: slurm/local_cluster.sh runs slurmctld and two slurmd
"nodes" on this host (installed from Debian's packages when missing; skipped, with the reason, where that
cannot be done)."""

import json
import re
import subprocess
import time

import pytest
from conftest import ROOT, TINY, logged_steps, recipe_env

from toolkit.tools.verify import verify_run

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]

TRAIN = [*TINY, "--epochs", "10", "--dropout", "0.3", "--log-with", "csv", "--log-every", "1"]


@pytest.fixture
def cluster(slurm_env):
    return {"SLURM_CONF": slurm_env["SLURM_CONF"]}


def _env(cluster, **extra):
    return recipe_env({**cluster, **extra})


def sbatch(cluster, args, *, log, wait=True, **env):
    """Submit from the project root (as users do); the batch shell's own log goes to `log`."""
    command = ["sbatch", "--parsable", f"--output={log}", *(["--wait"] if wait else []), *args]
    result = subprocess.run(command, cwd=ROOT, env=_env(cluster, **env), capture_output=True, text=True, timeout=900)
    job = result.stdout.strip().split(";")[0] if result.stdout.strip() else None
    return job, result


def job_field(cluster, job, field):
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=_env(cluster), capture_output=True,
                         text=True).stdout
    match = re.search(rf"\b{field}=(\S+)", out)
    return match.group(1) if match else None


def wait_for(condition, timeout=300, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)  # polling a condition, not a timed wait
    raise AssertionError(f"timed out waiting for {what}")


def _nodes_idle(cluster):
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=_env(cluster), capture_output=True,
                            text=True).stdout.split()
    return bool(states) and all(state == "idle" for state in states)


def _read(path):
    return path.read_text() if path.exists() else ""


def test_two_node_cpu_training_finishes_and_verifies(cluster, tmp_path, movielens_cache):
    run_dir = tmp_path / "run"
    log = tmp_path / "batch.out"
    job, result = sbatch(cluster, ["slurm/multinode_cpu.sbatch", "recipes/sasrec.py", *TRAIN, "--max-steps", "6"],
                         log=log, RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stderr + _read(log)
    assert verify_run(run_dir, expect_world_size=2, expect_backend="gloo") == []
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert len(logs) == 2  # one per node
    seen = "".join(log.read_text() for log in logs)
    assert "[rank 0/2]" in seen and "[rank 1/2]" in seen and "node_rank=1" in seen


def test_test_distributed_job_passes_on_both_nodes(cluster, tmp_path):
    run_dir = tmp_path / "doctor"
    log = tmp_path / "batch.out"
    job, result = sbatch(cluster, ["slurm/test_distributed.sbatch", "--sizes-mb", "1", "8"], log=log,
                         RUN_DIR=str(run_dir))
    assert result.returncode == 0, result.stderr + _read(log)
    report = json.loads((run_dir / "doctor.json").read_text())
    assert report["ok"] and report["world_size"] == 2
    assert sorted(r["node_rank"] for r in report["ranks"]) == [0, 1]
    assert {c["name"] for c in report["checks"] if c["passed"]} >= {"all_reduce_int", "broadcast", "all_gather",
                                                                     "barrier"}




def test_preempted_job_requeues_resumes_and_matches_uninterrupted(cluster, tmp_path, movielens_cache):
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    args = ["slurm/multinode_cpu.sbatch", "recipes/sasrec.py", *TRAIN, "--max-steps", "60"]
    job, result = sbatch(cluster, args, log=tmp_path / "straight.out", RUN_DIR=str(straight))
    assert result.returncode == 0, result.stderr + _read(tmp_path / "straight.out")

    log = tmp_path / "preempted.out"
    job, result = sbatch(cluster, args, log=log, wait=False, RUN_DIR=str(preempted))
    assert result.returncode == 0, result.stderr
    wait_for(lambda: logged_steps(preempted) >= 3, what="training to start")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=_env(cluster), check=True)
    # The workers checkpoint and the main process requeues: the job goes back to PENDING with one restart.
    wait_for(lambda: job_field(cluster, job, "Restarts") == "1", what="the requeue")
    wait_for(lambda: job_field(cluster, job, "JobState") == "PENDING", what="the requeued job to be pending")
    # Release it early (SLURM would wait ~120 s), but only once the first life has left the nodes: a job started
    # while its old credential is still being revoked is killed ("Job credential revoked").
    wait_for(lambda: _nodes_idle(cluster), what="the nodes to finish cleaning up")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=_env(cluster), check=True)
    state = wait_for(lambda: (s := job_field(cluster, job, "JobState")) in ("COMPLETED", "FAILED", "CANCELLED")
                     and s, timeout=600, what="the requeued job to finish")
    text = _read(log)
    assert state == "COMPLETED", text
    assert "restart 0" in text and "restart 1" in text and "forwarding to the job steps" in text
    node_logs = "".join(p.read_text() for p in (preempted / "logs").glob("*.log"))
    stopped_at = int(re.search(r"pre-empted at step (\d+): checkpoint saved; requeueing SLURM job", node_logs).group(1))
    assert 3 <= stopped_at < 60
    final = [d / "checkpoints" / "step_60" / "model.safetensors" for d in (straight, preempted)]
    assert final[0].read_bytes() == final[1].read_bytes()
    assert verify_run(preempted, expect_world_size=2) == []
