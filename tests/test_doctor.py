"""`python -m toolkit doctor` through real launchers: plain python, accelerate launch, torchrun and srun-style env.

The multi-process tests start real processes that form a real gloo group on this host; the JSON report is read
back to check the values the processes saw, not only the exit status.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from conftest import CONFIGS, ROOT, recipe_env

from toolkit.__main__ import build_parser
from toolkit.__main__ import main as toolkit_main
from toolkit.errors import UsageError
from toolkit.tools.doctor import FAULT_ENV, slurm_env_mapping

CHECKS = ["world_size", "all_reduce_int", "all_reduce_float", "broadcast", "all_gather", "barrier"]
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    FAULT_ENV,
)


def doctor_env(extra: dict | None = None) -> dict:
    """The recipes' test env, minus any launcher/SLURM variables of the shell that runs pytest."""
    env = {k: v for k, v in recipe_env().items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(extra or {})
    return env


def run(command: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=doctor_env(env), capture_output=True, text=True, timeout=timeout)


def accelerate_launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / "cpu_2proc.yaml"),
            "--main_process_port",
            "0",
            "-m",
            "toolkit",
            "doctor",
            *args,
        ],
        env,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


# ---- quick, in-process ---------------------------------------------------------------------------------------------


def test_help_lists_both_commands():
    text = build_parser().format_help()
    assert "doctor" in text and "verify" in text


def test_slurm_variables_become_torch_distributed_ones():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29600",
    }
    assert slurm_env_mapping(env) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29600",
    }
    # uneven nodes: '3,1' -> the second node runs 1 task
    assert slurm_env_mapping(env | {"SLURM_TASKS_PER_NODE": "3,1"})["LOCAL_WORLD_SIZE"] == "1"
    # a launcher under srun (accelerate launch / torchrun) already set RANK/WORLD_SIZE: keep them
    assert slurm_env_mapping(env | {"RANK": "0", "WORLD_SIZE": "8"}) == {}
    assert slurm_env_mapping({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == {}  # one task: nothing to form
    assert slurm_env_mapping({}) == {}
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        slurm_env_mapping({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})


def test_unknown_fault_name_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "brodcast")
    with pytest.raises(SystemExit) as exit_info:
        toolkit_main(["doctor"])
    assert exit_info.value.code == 2
    assert "brodcast" in capsys.readouterr().err


# ---- real processes ------------------------------------------------------------------------------------------------


def test_single_process_passes(tmp_path):
    report_path = tmp_path / "doctor.json"
    result = run([sys.executable, "-m", "toolkit", "doctor", "--json", str(report_path)])
    assert result.returncode == 0, describe(result)
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["world_size"] == 1 and report["failed"] == []
    assert [c["name"] for c in report["checks"]] == CHECKS and all(c["passed"] for c in report["checks"])
    assert [r["rank"] for r in report["ranks"]] == [0]
    assert "skipped" in report["bandwidth_note"]
    for name in CHECKS:
        assert f"PASS  {name}" in result.stdout
    assert "world size 1" in result.stdout


@pytest.mark.slow
def test_two_processes_through_accelerate_launch_form_one_gloo_group(tmp_path):
    report_path = tmp_path / "doctor.json"
    result = accelerate_launch(["--iters", "3", "--warmup", "1", "--json", str(report_path)])
    assert result.returncode == 0, describe(result)
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["agreed"] and report["failed"] == []
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert {r["rank"] for r in report["ranks"]} == {0, 1}
    assert {r["local_rank"] for r in report["ranks"]} == {0, 1}
    assert len({r["pid"] for r in report["ranks"]}) == 2  # two real processes
    assert all(r["torch_threads"] == 1 and r["device"].startswith("cpu") for r in report["ranks"])
    names = [c["name"] for c in report["checks"]]
    assert names == [*CHECKS, "bandwidth_1MB", "bandwidth_64MB"] and all(c["passed"] for c in report["checks"])
    assert [b["size_mb"] for b in report["bandwidth"]] == [1, 64]
    for figure in report["bandwidth"]:
        assert figure["busbw_gbps"] > 0 and figure["algbw_gbps"] > 0 and figure["median_time_sec"] > 0
        assert figure["busbw_gbps"] == pytest.approx(figure["algbw_gbps"])  # 2(n-1)/n = 1 for n = 2
    assert figure["bytes"] == 64 * 2**20
    assert "PASS  bandwidth_64MB" in result.stdout and "GB/s" in result.stdout
    assert result.stdout.count("toolkit doctor:") == 1  # the report comes from the main process only


@pytest.mark.slow
def test_injected_broadcast_fault_fails_naming_the_check(tmp_path):
    report_path = tmp_path / "doctor.json"
    result = accelerate_launch(["--skip-bandwidth", "--json", str(report_path)], env={FAULT_ENV: "broadcast"})
    assert result.returncode != 0, describe(result)
    assert "FAIL  broadcast" in result.stdout and "doctor: FAILED: broadcast" in result.stdout
    report = json.loads(report_path.read_text())
    assert not report["ok"] and report["agreed"] and report["failed"] == ["broadcast"]
    broadcast = next(c for c in report["checks"] if c["name"] == "broadcast")
    assert 1 in broadcast["failed_ranks"] and "rank(s) [1]" in broadcast["detail"]  # the last rank corrupted its copy


@pytest.mark.slow
def test_srun_style_processes_map_slurm_variables_and_agree_on_a_failure(tmp_path):
    """Two processes started the way srun starts tasks: SLURM_* only, no RANK/WORLD_SIZE; one node each."""

    def start(rank: int, name: str, port: int, extra: dict) -> subprocess.Popen:
        env = doctor_env(
            {
                "SLURM_PROCID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_NODEID": str(rank),
                "SLURM_LOCALID": "0",
                "SLURM_TASKS_PER_NODE": "1(x2)",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **extra,
            }
        )
        command = [
            sys.executable,
            "-m",
            "toolkit",
            "doctor",
            "--skip-bandwidth",
            "--timeout",
            "30",
            "--json",
            str(tmp_path / f"{name}.json"),
        ]
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for name, extra in [("clean", {}), ("faulty", {FAULT_ENV: "all_reduce_int"})]:
        port = free_port()
        processes = [start(rank, name, port, extra) for rank in (0, 1)]
        outputs = [p.communicate(timeout=120) for p in processes]
        codes = [p.returncode for p in processes]
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["world_size"] == 2 and report["backend"] == "gloo" and report["launcher"].startswith("srun")
        assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in report["ranks"]] == [(0, 0, 0), (1, 1, 0)]
        if name == "clean":
            assert codes == [0, 0], outputs
            assert report["ok"]
        else:
            assert codes == [1, 1], outputs  # every rank agrees on the outcome, not only the one that saw it
            assert report["failed"] == ["all_reduce_int"]
            assert "FAIL  all_reduce_int" in outputs[0][0]


@pytest.mark.slow
def test_torchrun_module_launch(tmp_path):
    report_path = tmp_path / "doctor.json"
    result = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "toolkit",
            "doctor",
            "--skip-bandwidth",
            "--json",
            str(report_path),
        ]
    )
    assert result.returncode == 0, describe(result)
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["world_size"] == 2 and report["backend"] == "gloo"
    assert {r["rank"] for r in report["ranks"]} == {0, 1}
