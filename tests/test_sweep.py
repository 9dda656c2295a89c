"""`python -m toolkit sweep` and `python -m toolkit compare` on real tiny runs: a 2 x 2 grid run here (killed half-way
and run again: finished runs skipped, the killed one resumed), compared in one table and one picture; bad inputs;
and the same grid as a SLURM job array on the local cluster, one task pre-empted and requeued."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
from conftest import CONFIGS, ROOT, TINY, TOY, logged_steps, recipe_env

from toolkit.run import checkpoint
from toolkit.tools.verify import verify_run

pytestmark = pytest.mark.slow

# Long enough (80 checkpoints; the toy's 3 default epochs would end it at step 18) that the kill below lands while
# the second run is still training.
STEPS = 240
COMMON = ["--epochs", "100", "--max-steps", str(STEPS), "--eval-every-steps", "3", "--checkpoint-every", "3",
          "--log-with", "csv", "--log-every", "1", "--no-carry"]
NAMES = ["seed-0_lr-0.05", "seed-0_lr-0.1", "seed-1_lr-0.05", "seed-1_lr-0.1"]


def toolkit(*args, cwd=ROOT, check=True, **popen):
    command = [sys.executable, "-m", "toolkit", *map(str, args)]
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=recipe_env(), **popen)
    result = subprocess.run(command, cwd=cwd, env=recipe_env(), capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def sweep_args(out):
    return ["sweep", TOY, "--grid", "seed=0,1", "lr=0.05,0.1", "--out", out, "--config-file",
            CONFIGS / "cpu.yaml", "--", *COMMON]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The grid killed (whole process group, SIGKILL) once its second run has a checkpoint, then run again."""
    out = tmp_path_factory.mktemp("sweep") / "grid"
    first = toolkit(*sweep_args(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    second_run = out / "runs" / NAMES[1]
    try:
        while checkpoint.newest_complete(second_run) is None:  # polling a condition: the second run has saved
            assert first.poll() is None, first.stdout.read().decode()
            time.sleep(0.05)  # polling a condition (a checkpoint exists), not a timed wait
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = checkpoint.step_of(checkpoint.newest_complete(second_run))
    assert not (second_run / "summary.json").exists(), "the second run ended before the kill: make it longer"
    again = toolkit(*sweep_args(out))
    return out, killed_at, again


@pytest.mark.xdist_group("sweep-grid")  # the grid fixture made once, on one worker
def test_a_killed_sweep_run_again_skips_finished_runs_and_resumes_the_killed_one(swept):
    out, killed_at, again = swept
    manifest = json.loads((out / "sweep.json").read_text())
    assert [run["name"] for run in manifest["runs"]] == NAMES
    assert manifest["grid"] == {"seed": ["0", "1"], "lr": ["0.05", "0.1"]} and manifest["common"] == COMMON
    lines = again.stdout.splitlines()
    assert f"[1/4] {NAMES[0]}: finished before, skipped" in lines
    assert f"[2/4] {NAMES[1]}: done in" in again.stdout and "all 4 runs finished" in again.stdout
    assert f"resuming from {out}/runs/{NAMES[1]}/checkpoints/step_{killed_at}" in (
        out / "logs" / f"{NAMES[1]}.log").read_text()
    for name in NAMES:
        run = out / "runs" / name
        assert verify_run(run) == []
        config = json.loads((run / "config.json").read_text())["config"]
        seed, lr = name.split("_")
        assert (config["seed"], config["lr"], config["max_steps"]) == (int(seed[5:]), float(lr[3:]), STEPS)
    # the resumed run equals the same settings run straight (its log.csv has each step once)
    steps = [row["step"] for row in csv.DictReader(open(out / "runs" / NAMES[1] / "log.csv"))
             if row["name"] == "train/loss"]
    assert steps == [str(s) for s in range(1, STEPS + 1)] and killed_at < STEPS


@pytest.mark.xdist_group("sweep-grid")  # the grid fixture made once, on one worker
def test_compare_prints_one_row_per_group_with_mean_and_std_and_draws_the_curves(swept, tmp_path):
    out, _, _ = swept
    other = tmp_path / "other-recipe"  # a run of another recipe is named, not compared
    (other).mkdir()
    (other / "config.json").write_text(json.dumps({"recipe": "sasrec", "config": {"seed": 0}}))
    (other / "summary.json").write_text(json.dumps({"final_metrics": {"val_ndcg": 0.1}}))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_text((out / "runs" / NAMES[0] / "config.json").read_text())
    result = toolkit("compare", out, unfinished, other, "--out", tmp_path / "c.png", "--csv", tmp_path / "c.csv",
                     "--markdown", tmp_path / "c.md")
    assert f"skipped {unfinished}: not finished (no summary.json" in result.stdout
    assert f"skipped {other}: a run of sasrec, not toy" in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "c.csv")))
    assert [(r["group"], r["n"], r["seeds"]) for r in rows] == [("lr=0.05", "2", "0,1"), ("lr=0.1", "2", "0,1")]
    for row, names in zip(rows, [(NAMES[0], NAMES[2]), (NAMES[1], NAMES[3])], strict=True):
        finals = [json.loads((out / "runs" / n / "summary.json").read_text())["final_metrics"]["val_mse"]
                  for n in names]
        mean, std = row["final val_mse"].split(" ± ")
        unit = 10.0 ** -len(std.split(".")[1]) if "." in std else 1.0  # both shown to the std's 2nd digit
        assert float(mean) == pytest.approx(statistics.fmean(finals), abs=unit / 2)
        assert float(std) == pytest.approx(statistics.stdev(finals), abs=unit / 2)
        assert len(mean.split(".")[-1]) == len(std.split(".")[-1])
        assert " ± " in row["test_mse"] and " ± " in row["samples/s"]
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "c.md").read_text().startswith("| group | n | seeds | final val_mse |")
    assert "lr=0.05  2  0,1" in result.stdout
    by_default = toolkit("compare", out)  # one sweep directory: the picture goes into it
    assert f"wrote {out}/compare.png" in by_default.stdout and (out / "compare.png").stat().st_size > 10_000
    refused = toolkit("compare", out, "--columns", "nope", check=False)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --columns nope matches none of the runs' ")


@pytest.mark.parametrize("args, fragment", [
    (["--grid"], "--grid is empty"),
    (["--grid", "seed="], "--grid 'seed=' has an empty value"),
    (["--grid", "seed=0,1", "seed=2"], "--grid names seed twice"),
    (["--grid", "nope=1,2"], "run nope-1 of the grid is refused by toy_recipe.py: Unrecognized options: --nope"),
    (["--grid", "lr=abc"], "refused by toy_recipe.py: Error parsing --lr"),
    (["--grid", "output_dir=a,b"], "--output-dir is set by the sweep"),
    (["--grid", "seed=0", "--max-parallel", "-1"], "--max-parallel -1 is invalid"),
    (["--grid", "seed=0,0"], "repeats a value"),
    (["--grid", "seed=0", "--runs-per-device", "0"], "--runs-per-device 0 is invalid; give 1 or more"),
    (["--grid", "seed=0", "--runs-per-device", "2", "--config-file", str(CONFIGS / "cpu_2proc.yaml")],
     "leave --config-file out"),
    (["--grid", "seed=0", "--runs-per-device", str(len(os.sched_getaffinity(0)) + 1)], "CPU cores here; give at most"),
], ids=["empty-grid", "empty-value", "key-twice", "unknown-flag", "bad-value", "output-dir", "max-parallel",
        "repeated-value", "runs-per-device-0", "runs-per-device-with-config", "runs-per-device-above-cores"])
def test_bad_sweeps_are_one_line_and_make_nothing(args, fragment, tmp_path):
    result = toolkit("sweep", TOY, *args, "--out", tmp_path / "new", "--", "--max-steps", "2", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.xdist_group("sweep-grid")  # the grid fixture made once, on one worker
def test_a_sweep_dir_that_is_a_file_another_sweep_or_compare_of_nothing_is_one_line(swept, tmp_path):
    out, _, _ = swept
    cases = [
        (["sweep", TOY, "--grid", "seed=0", "--out", tmp_path / "file"], "--out", "is a file"),
        (["sweep", TOY, "--grid", "seed=5", "--out", out, "--", *COMMON], "holds another sweep", ""),
        (["compare"], "compare needs at least one DIR", ""),
        (["compare", tmp_path / "empty"], "holds no run", ""),
    ]
    (tmp_path / "file").write_text("mine")
    (tmp_path / "empty").mkdir()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for args, *fragments in cases:
        result = toolkit(*args, check=False)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1 and all(f in errors[0] for f in fragments), result.stderr
    assert (tmp_path / "file").read_text() == "mine" and list((tmp_path / "empty").iterdir()) == []
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_a_sweep_as_a_slurm_job_array_with_one_task_preempted_and_requeued(slurm_env, tmp_path, movielens_cache):
    from test_slurm import _nodes_idle, job_field, wait_for

    cluster = {"SLURM_CONF": slurm_env["SLURM_CONF"]}
    out = tmp_path / "grid"
    common = [*TINY, "--max-steps", "60", "--log-with", "csv", "--log-every", "1"]
    submit = subprocess.run(
        [sys.executable, "-m", "toolkit", "sweep", "recipes/sasrec.py", "--grid", "seed=0,1", "dropout=0.2,0.3",
         "--out", str(out), "--launcher", "slurm", "--max-parallel", "2", "--sbatch-option=--nodes=1", "--", *common],
        cwd=ROOT, env=recipe_env(cluster), capture_output=True, text=True, timeout=300)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.split("submitted job array ")[1].split(":")[0]
    task0 = f"{job}_0"
    first = out / "runs" / "seed-0_dropout-0.2"
    wait_for(lambda: logged_steps(first) >= 2, what="the first task to train")

    # Sent once: for an array task scancel delivers the signal (the batch shell forwards it, the task requeues) yet
    # may still exit 228, "Job can not be altered now", so the requeue is the evidence, not scancel's status.
    sent = subprocess.run(["scancel", "--batch", "--signal=USR1", task0], env=recipe_env(cluster),
                          capture_output=True, text=True)
    wait_for(lambda: job_field(cluster, task0, "Restarts") == "1", what=f"the requeue of task 0 ({sent.stderr})")

    def array_done():
        states = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], env=recipe_env(cluster),
                                capture_output=True, text=True).stdout.split("\n")
        return all(not line.strip() or line.split()[0] == task0 for line in states) and _nodes_idle(cluster)

    wait_for(array_done, timeout=600, what="the other tasks to end")
    subprocess.run(["scontrol", "update", f"JobId={task0}", "StartTime=now"], env=recipe_env(cluster), check=True)
    wait_for(lambda: (first / "summary.json").exists() and job_field(cluster, task0, "JobState") == "COMPLETED",
             timeout=600, what="the requeued task to finish")
    logs = "".join(p.read_text() for p in (first / "logs").glob("*.log"))
    assert "pre-empted at step" in logs and "resuming from" in logs
    for name in ("seed-0_dropout-0.2", "seed-0_dropout-0.3", "seed-1_dropout-0.2", "seed-1_dropout-0.3"):
        run = out / "runs" / name
        assert verify_run(run, expect_world_size=1) == [], name  # one node per task: two tasks run at once
        config = json.loads((run / "config.json").read_text())["config"]
        assert f"seed-{config['seed']}_dropout-{config['dropout']}" == name
    again = toolkit("sweep", "recipes/sasrec.py", "--grid", "seed=0,1", "dropout=0.2,0.3", "--out", out,
                    "--launcher", "slurm", "--max-parallel", "2", "--sbatch-option=--nodes=1", "--", *common)
    assert "all 4 runs finished" in again.stdout  # nothing submitted twice


def test_compare_columns_keeps_only_the_test_metrics_named():
    from pathlib import Path

    from toolkit.tools.compare import RunResult, compare

    tests = {"test_rmse": 1.0, "test_mae": 2.0, "test_jac/sst": 3.0}
    runs = [RunResult(Path(f"r{seed}"), "toy", {}, seed, {"main_metric": "val", "final_metrics": {"val": seed},
                      "best_metrics": {"val": seed}, "test_metrics_at_best": tests}) for seed in (0, 1)]
    assert [h for h in compare(runs).header if h.startswith("test_")] == ["test_jac/sst", "test_mae", "test_rmse"]
    assert [h for h in compare(runs, columns=["rmse", "mae"]).header if h.startswith("test_")] == ["test_mae",
                                                                                                 "test_rmse"]


def test_a_recipe_check_refuses_a_grid_value_before_the_sweep_makes_anything(tmp_path):
    """SASRec's own check (--dropout in [0, 1)) runs inside parse_config, so the sweep's pre-check sees it: the new
    user's `--grid dropout=0,2` made the sweep directory and two failed runs with tracebacks before."""
    result = toolkit("sweep", "recipes/sasrec.py", "--grid", "dropout=0,2", "--out", tmp_path / "new", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    assert "--dropout 2.0 is invalid; it must be in [0, 1)" in errors[0], errors
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_mean_std_reads_alike_in_every_column():
    from toolkit.tools.compare import mean_std

    assert mean_std([0.7, 0.7222, 0.711]) == "0.711 ± 0.011"
    assert mean_std([1.0, 1.52, 0.8]) == "1.11 ± 0.37"
    assert mean_std([44000.0, 46000.0]) == "45,000 ± 1,400"
    assert mean_std([12.0, 14.0]) == "13.0 ± 1.4"
    assert mean_std([943.0, 943.0]) == "943"  # a count: no "± 0" and no "± n/a"
    assert mean_std([0.25]) == "0.25"
    assert mean_std([]) == "-"


def test_runs_on_other_process_counts_are_other_groups(tmp_path):
    from toolkit.tools.compare import compare, load_run

    for name, world, seed, value in (("a", 1, 0, 0.5), ("b", 1, 1, 0.7), ("c", 2, 0, 0.6), ("d", 2, 1, 0.8)):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"recipe": "toy", "world_size": world,
                                                     "config": {"seed": seed, "lr": 0.1}}))
        (run / "summary.json").write_text(json.dumps({"main_metric": "m", "final_metrics": {"m": value}}))
    table = compare([load_run(tmp_path / n, None) for n in "abcd"])
    assert [(row[0], row[1], row[2]) for row in table.rows] == [("world_size=1", "2", "0,1"),
                                                                ("world_size=2", "2", "0,1")]


def test_a_sweep_without_a_launch_config_runs_plain_python_and_its_logs_hold_no_launcher_warning(tmp_path):
    """Without --config-file and without a default accelerate config, `accelerate launch` warned in every run's log
    about the defaults it filled in ("num_processes was set to ..."): one process needs no launcher."""
    out = tmp_path / "grid"
    env = recipe_env({"HF_HOME": str(tmp_path / "hf")})  # no default accelerate config here
    command = [sys.executable, "-m", "toolkit", "sweep", TOY, "--grid", "seed=0", "--out", str(out), "--",
               "--max-steps", "2", "--log-with", "none"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    log = next((out / "logs").glob("*.log")).read_text()
    assert log.startswith(f"$ {sys.executable} {TOY}") and "[rank 0/1]" in log
    assert "were not passed to `accelerate launch`" not in log and "num_processes" not in log
    assert verify_run(out / "runs" / "seed-0") == []


def test_runs_per_device_runs_single_process_runs_side_by_side_each_pinned_to_its_cores(tmp_path):
    """--runs-per-device 2 on a CPU machine: two runs at once, each on its own half of the cores with as many threads;
    both started before either ended (the sweep's lines say so), and each is a complete, verifiable run."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    out = tmp_path / "side-by-side"
    template = str(ROOT / "recipes" / "template.py")
    env = recipe_env({"HF_HOME": str(tmp_path / "hf")})
    command = [sys.executable, "-m", "toolkit", "sweep", template, "--grid", "seed=0,1", "--runs-per-device", "2",
               "--out", str(out), "--", "--max-steps", "20", "--samples", "4096", "--log-with", "none"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    running = [i for i, line in enumerate(lines) if ": running" in line]
    finished = [i for i, line in enumerate(lines) if ": done in" in line]
    assert len(running) == 2 and len(finished) == 2 and max(running) < min(finished), lines
    groups = {line.split(", cores ")[1].rstrip(")") for line in lines if ": running" in line}
    assert groups == {",".join(map(str, cores[0::2])), ",".join(map(str, cores[1::2]))}
    threads = set()
    for seed in (0, 1):
        log = (out / "logs" / f"seed-{seed}.log").read_text()
        assert "--threads" in log.splitlines()[0]
        threads |= {int(n) for n in re.findall(r"threads=(\d+)", log)}
        assert verify_run(out / "runs" / f"seed-{seed}") == []
    assert threads == {len(cores[0::2]), len(cores[1::2])}  # each run as many threads as its group has cores
