"""The pre-emption flag and the requeue cap, without a cluster."""

import os
import signal
import subprocess

from toolkit.process import preemption


def test_requeue_is_capped_after_max_requeues(monkeypatch):
    calls = []
    monkeypatch.setattr(preemption.subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    said = []
    preemption.requeue_job(max_requeues=3, announce=said.append)
    assert len(said) == 1 and "not requeued" in said[0] and "3 times" in said[0] and calls == []


def test_requeue_outside_slurm_only_says_how_to_resume(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    said = []
    preemption.requeue_job(max_requeues=3, announce=said.append)
    assert len(said) == 1 and "--resume-from auto" in said[0]


def test_the_requeue_is_announced_before_scontrol_runs(monkeypatch):
    """`scontrol requeue` ends the job's steps at once: a line written after it may never reach the log."""
    said, order = [], []
    monkeypatch.setattr(preemption.subprocess, "run",
                        lambda *a, **k: order.append(("scontrol", len(said))) or subprocess.CompletedProcess(a, 0))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    preemption.requeue_job(max_requeues=3, announce=said.append)
    assert said == ["requeueing SLURM job 77 (restart 1 of at most 3)"] and order == [("scontrol", 1)]


def test_handler_only_sets_a_flag(monkeypatch):
    monkeypatch.setattr(preemption, "_requested", False)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        preemption.install_handler()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption._requested is True
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigusr1_before_the_run_starts_is_kept_not_fatal():
    import subprocess
    import sys

    code = ("import os, signal; from toolkit.process import begin_process; begin_process(); "
            "os.kill(os.getpid(), signal.SIGUSR1); "
            "from toolkit.process import preemption; preemption.install_handler(); print(preemption.requested())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr
