"""--threads (a shared flag): the intra-op threads of every process, as seed 000 runs one process with many threads
per CPU node. Each rank reports the count it runs with, and config.json records the flag and the count in effect."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT, TOY, ranks_seen, read_json, recipe_env, run_recipe

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

    probe = ("import os, sys; from toolkit.process import begin_process; begin_process(); "
             "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
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

    late = ("import torch, toolkit, os; from toolkit.process import openmp; print(os.environ.get('OMP_WAIT_POLICY')); "
            "print(openmp.wait_policy_line(2)); print(openmp.wait_policy_line(1))")
    for env, expected in (({"TOOLKIT_LOADAVG": BUSY}, "threads: 2; torch was imported before toolkit"),
                          ({"TOOLKIT_LOADAVG": BUSY, "OMP_WAIT_POLICY": "PASSIVE"}, "None")):
        done = subprocess.run([sys.executable, "-c", late], env=recipe_env(env), capture_output=True, text=True,
                              check=True)
        policy, two, one = done.stdout.splitlines()
        assert policy == env.get("OMP_WAIT_POLICY", "None")  # too late to set: not set
        assert two.startswith(expected) and one == "None", done.stdout


# ---- load that arrives after an idle start: the run restarts itself under PASSIVE (toolkit.loop.restart) ----------
IDLE = "0.1 0.1 0.1 1/300"


def test_a_load_watch_fires_after_three_busy_looks_in_a_row_at_its_cadence():
    from toolkit.loop.restart import LoadWatch

    now, machine = [0.0], [(0, 2)]
    watch = LoadWatch(every=2.0, clock=lambda: now[0], measure=lambda: machine[0])
    looks = []
    for t, others in [(1, 5), (2, 1), (4, 1), (5, 1), (6, 0), (8, 1), (10, 1), (11, 9), (12, 1)]:
        now[0], machine[0] = float(t), (others, 2)
        looks.append(watch.arrived())
    # t=1: not yet a look; 2, 4: busy; 5: between looks; 6: idle, the count restarts; 8, 10, 12: three in a row
    assert looks[:-1] == [None] * 8
    assert looks[-1] == "1-1 other running thread(s) on 2 CPUs at 3 looks 2 s apart"
    unreadable = LoadWatch(every=0.0, measure=lambda: int("x"))
    assert unreadable.arrived() is None  # nothing to read: the run goes on as it started


def test_the_restart_command_resumes_the_run_dir_in_place_of_the_users_flags(tmp_path):
    from toolkit.loop.restart import restart_command

    argv = ["python3", "-X", "dev", "recipes/sasrec.py", "--output-dir", "old", "--threads", "2",
            "--resume-from=auto", "--output_dir=x", "--lr", "0.1"]
    command = restart_command(argv, tmp_path / "run")
    assert command[1:] == ["-X", "dev", "recipes/sasrec.py", "--threads", "2", "--lr", "0.1", "--output-dir",
                           str((tmp_path / "run").resolve()), "--resume-from", "auto"]


def test_load_arriving_mid_run_restarts_it_under_passive_and_the_result_is_the_uninterrupted_ones(tmp_path):
    """An idle start (the bounded spin), then other jobs on the cores: the run checkpoints, restarts itself in the
    same process under PASSIVE, resumes, and ends with the weights of a run that never restarted."""
    from conftest import final_weights

    busy, idle = tmp_path / "busy-loadavg", tmp_path / "idle-loadavg"
    busy.write_text(BUSY + " 1\n")
    idle.write_text(IDLE + " 1\n")
    args = ["--max-steps", "300", "--epochs", "50", "--eval-every-steps", "100", "--threads", "2", "--log-with", "csv"]
    runs = {}
    for name, load in (("restarted", busy), ("uninterrupted", idle)):
        out = tmp_path / name
        result = run_recipe([*args, "--output-dir", str(out)], recipe=TOY, env={
            "TOOLKIT_LOADAVG": IDLE, "TOOLKIT_LOAD_FILE": str(load), "TOOLKIT_LOAD_CHECK_SEC": "0.02"})
        runs[name] = (out, result.stdout + result.stderr)
    out, said = runs["restarted"]
    assert said.count("load arrived during training") == 1, said[-3000:]
    step = int(re.search(r"checkpoint of step (\d+) saved, restarting this process under OMP_WAIT_POLICY=PASSIVE",
                         said).group(1))
    assert 0 < step < 300
    assert f"OMP_WAIT_POLICY=PASSIVE set by the toolkit (this process restarted itself at step {step} " in said
    assert "resumed at epoch" in said and ranks_seen(said) == {(0, 1)}
    assert "load arrived" not in runs["uninterrupted"][1]
    mine, reference = final_weights(out, 300), final_weights(runs["uninterrupted"][0], 300)
    assert mine.keys() == reference.keys() and all(mine[k].equal(reference[k]) for k in mine)
    verified = subprocess.run([sys.executable, "-m", "toolkit", "verify", str(out)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


LOAD_AND_SIGNAL = """
import sys, toolkit, torch
from toolkit.process import preemption
from toolkit.loop.restart import RestartUnderPassive
from toolkit.run.config import TrainConfig
from toolkit.loop.training import TrainingLoop
from toolkit.run.start import start_run

class Now:  # a load watch that sees load at once
    def arrived(self):
        return "a stand-in load"

config = TrainConfig(output_dir=sys.argv[1], log_with="none", epochs=5, batch_size=4, threads=2)
data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
with start_run(config, recipe="t") as run:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader = run.accelerator.prepare(model, optimizer, loader)
    loop = TrainingLoop(run, model, loader, evaluate=lambda: {"val": 0.0}, main_metric="val")
    loop.restart_under_load.watch = Now()
    loop.start()
    try:
        for _ in loop.epochs():
            for x, y in loop.batches():
                if sys.argv[2] == "signal":
                    preemption._requested = True  # SIGUSR1 (SLURM's pre-emption) arrived in this step
                loss = torch.nn.functional.mse_loss(model(x), y)
                run.accelerator.backward(loss)
                loop.optimizer_step(optimizer, loss=loss.detach())
    except RestartUnderPassive as restart:
        print("RESTART", restart.step)
    except SystemExit as stop:
        print("EXIT", stop.code)
"""


@pytest.mark.parametrize("signal", ["none", "signal"])
def test_a_pending_preemption_wins_over_a_load_restart(signal, tmp_path):
    """Load and SLURM's signal at the same step: the run checkpoints and stops as pre-empted (the restarted process
    would not know of the signal, and the job would be killed at its time limit)."""
    result = subprocess.run([sys.executable, "-c", LOAD_AND_SIGNAL, str(tmp_path / "run"), signal], cwd=ROOT,
                            env=recipe_env(), capture_output=True, text=True, timeout=300)
    said = result.stdout + result.stderr
    assert result.returncode == 0, said[-3000:]
    if signal == "none":
        assert "RESTART 1" in said and "load arrived during training (a stand-in load)" in said
    else:
        assert "EXIT 0" in said and "pre-empted at step 1: checkpoint saved" in said and "load arrived" not in said
    assert (tmp_path / "run" / "checkpoints" / "step_1").is_dir()


def test_only_the_running_scripts_own_main_may_restart_the_process(tmp_path):
    """A restart replaces the process: never a test's, a notebook's or `python -c`'s (toolkit.process.entry)."""
    from toolkit.process.entry import _is_the_script

    def main():
        pass

    assert not _is_the_script(main)  # this test's
    probe = "from toolkit.process.entry import _is_the_script\ndef main():\n    pass\nprint(_is_the_script(main))\n"
    script = tmp_path / "script.py"
    script.write_text(probe)
    env = recipe_env({"PYTHONPATH": str(ROOT)})
    as_script = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    as_code = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert (as_script.stdout.strip(), as_code.stdout.strip()) == ("True", "False"), as_script.stderr + as_code.stderr
