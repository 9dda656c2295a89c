"""--threads (a shared flag): the intra-op threads of every process, as seed 000 runs one process with many threads
per CPU node. Each rank reports the count it runs with, and config.json records the flag and the count in effect."""

import re

import pytest
from conftest import TOY, ranks_seen, read_json, run_recipe

pytestmark = pytest.mark.slow

ARGS = ["--max-steps", "2", "--eval-every-steps", "2"]
BUSY = "9.0 9.0 9.0 9/300"  # /proc/loadavg of a machine that other jobs hold


def threads_seen(stderr: str) -> dict[int, int]:
    return {int(rank): int(threads) for rank, threads in re.findall(r"^\[rank (\d+)/\d+\].* threads=(\d+)", stderr,
                                                                    re.MULTILINE)}


@pytest.mark.parametrize("config, threads, world", [(None, 2, 1), ("cpu_2proc.yaml", 1, 2)],
                         ids=["1proc-2threads", "2proc-1thread"])
def test_threads_are_set_in_every_process_and_recorded(config, threads, world, tmp_path):
    out = tmp_path / "run"
    # OMP_NUM_THREADS=3 from the environment must not win over the flag (torch alone would take 2 here: the cores).
    result = run_recipe([*ARGS, "--threads", str(threads), "--output-dir", str(out)], recipe=TOY, config=config,
                        env={"OMP_NUM_THREADS": "3", "TOOLKIT_LOADAVG": BUSY})  # a busy machine
    assert ranks_seen(result.stderr) == {(rank, world) for rank in range(world)}
    assert threads_seen(result.stderr) == {rank: threads for rank in range(world)}
    recorded = read_json(out / "config.json")
    assert recorded["config"]["threads"] == threads and recorded["threads"] == threads
    # Several OpenMP threads on a busy machine: the toolkit chose the passive wait policy (before torch loaded) and
    # says so once.
    said = (result.stdout + result.stderr).count("OMP_WAIT_POLICY=PASSIVE set by the toolkit")
    assert said == (1 if threads > 1 else 0)


def test_the_wait_policy_is_passive_on_a_busy_machine_unless_the_user_chose_one(tmp_path):
    import subprocess
    import sys

    from conftest import recipe_env

    probe = ("import toolkit, os, sys; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
             "'torch' in sys.modules)")
    # busy (others hold half the CPUs, over the last minute and now): PASSIVE; else a bounded spin; a user's value
    cases = ((None, BUSY, "PASSIVE None False"), (None, "9.0 9.0 9.0 1/300", "None 1000 False"),
             ("ACTIVE", BUSY, "ACTIVE None False"), ("GOMP_SPINCOUNT=50", BUSY, "None 50 False"))
    for given, load, expected in cases:
        chosen = dict([given.split("=")]) if given and "=" in given else {"OMP_WAIT_POLICY": given} if given else {}
        env = recipe_env({"TOOLKIT_LOADAVG": load, **chosen})
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == expected  # set before torch is imported, so its OpenMP runtime reads it
    for env in ({"OMP_WAIT_POLICY": "ACTIVE", "TOOLKIT_LOADAVG": BUSY}, {"TOOLKIT_LOADAVG": "0.1 0.1 0.1 1/300"}):
        out = tmp_path / f"run-{len(env)}"
        result = run_recipe([*ARGS, "--threads", "2", "--output-dir", str(out)], recipe=TOY, env=env)
        assert "OMP_WAIT_POLICY" not in result.stdout + result.stderr  # nothing chosen here, nothing remarked on


def test_without_the_flag_the_launcher_decides(tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*ARGS, "--output-dir", str(out)], recipe=TOY, env={"OMP_NUM_THREADS": "1"})
    assert threads_seen(result.stderr) == {0: 1}
    recorded = read_json(out / "config.json")
    assert recorded["config"]["threads"] == 0 and recorded["threads"] == 1


def test_torch_imported_before_toolkit_is_said_once_with_several_threads(tmp_path):
    import subprocess
    import sys

    from conftest import recipe_env

    late = ("import torch, toolkit, os; from toolkit import openmp; print(os.environ.get('OMP_WAIT_POLICY')); "
            "print(openmp.wait_policy_line(2)); print(openmp.wait_policy_line(1))")
    for env, expected in (({"TOOLKIT_LOADAVG": BUSY}, "threads: 2; torch was imported before toolkit"),
                          ({"TOOLKIT_LOADAVG": BUSY, "OMP_WAIT_POLICY": "PASSIVE"}, "None")):
        done = subprocess.run([sys.executable, "-c", late], env=recipe_env(env), capture_output=True, text=True,
                              check=True)
        policy, two, one = done.stdout.splitlines()
        assert policy == env.get("OMP_WAIT_POLICY", "None")  # too late to set: not set
        assert two.startswith(expected) and one == "None", done.stdout
