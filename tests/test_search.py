"""`python -m toolkit sweep --search`: Optuna studies of the template recipe run as real processes. A 6-trial search
finds a learning rate at which the template learns; a study killed mid-trial and run again equals the uninterrupted
one; two trials at once share one journal; a pruned trial ends clean at its step and stays ended; bad input is one
line before anything is made; `compare` shows the best trials, importances and a picture; a SLURM job array's tasks
take their trials from the study."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, recipe_env

from toolkit.run import checkpoint
from toolkit.tools.verify import verify_run

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("search")]  # the studies made once, on one worker

optuna = pytest.importorskip("optuna")

TEMPLATE = str(ROOT / "recipes" / "template.py")
# 200 steps (~2 s of training) with 4 evaluations and checkpoints: long enough for a kill to land mid-trial.
COMMON = ["--epochs", "8", "--max-steps", "200", "--eval-every-steps", "50", "--checkpoint-every", "50", "--log-with",
          "none"]
SEARCH = ["--search", "lr=log:1e-5:1e-1", "--metric", "val_mse", "--direction", "min"]


def toolkit(*args, check=True, env=None, **popen):
    command = [sys.executable, "-m", "toolkit", *map(str, args)]
    if popen:
        return subprocess.Popen(command, cwd=ROOT, env=recipe_env(env), **popen)
    result = subprocess.run(command, cwd=ROOT, env=recipe_env(env), capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def search(out, trials, *extra):
    return ["sweep", TEMPLATE, *SEARCH, "--trials", str(trials), "--out", out, *extra, "--", *COMMON]


def trials_of(out):
    """{number: (state, params, value)} from the study's journal."""
    from toolkit.loop.trial import open_storage

    study = optuna.load_study(study_name="search", storage=open_storage(out / "study.journal"))
    return {t.number: (t.state.name, t.params, t.value) for t in study.get_trials()}


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    """The 6-trial TPE study, run straight (one trial at a time)."""
    out = tmp_path_factory.mktemp("search") / "study"
    return out, toolkit(*search(out, 6))


def test_a_six_trial_search_finds_a_learning_rate_at_which_the_template_learns(studied, tmp_path):
    out, done = studied
    trials = trials_of(out)
    assert sorted(trials) == list(range(6)) and all(state == "COMPLETE" for state, _, _ in trials.values())
    best = min(value for _, _, value in trials.values())
    untrained = tmp_path / "untrained"  # the same run at a rate too small to move the weights
    subprocess.run([sys.executable, TEMPLATE, *COMMON, "--lr", "1e-12", "--output-dir", str(untrained)], cwd=ROOT,
                   env=recipe_env(), check=True, capture_output=True, timeout=300)
    before = json.loads((untrained / "summary.json").read_text())["best_metrics"]["val_mse"]
    assert best < before - 0.01, (best, before)
    assert f"best: trial {min(trials, key=lambda n: trials[n][2])}, val_mse {best:.6g}" in done.stdout
    manifest = json.loads((out / "sweep.json").read_text())
    assert manifest["search"] == {"lr": "log:1e-5:1e-1"} and manifest["common"] == COMMON
    for run in manifest["runs"]:  # each trial an ordinary run directory whose config holds its value
        config = json.loads((out / "runs" / run["name"] / "config.json").read_text())["config"]
        assert run["name"] == f"trial-{run['trial']:04d}" and config["lr"] == trials[run["trial"]][1]["lr"]
        assert run["flags"] == ["--lr", repr(config["lr"])] and verify_run(out / "runs" / run["name"]) == []


def test_compare_on_a_study_shows_the_best_trials_the_importances_and_a_picture(studied):
    out, _ = studied
    shown = toolkit("compare", out).stdout
    assert "study study: 6 of 6 trials (6 complete); min val_mse" in shown
    assert "best trials (val_mse, min):" in shown and "  trial-00" in shown
    assert "importance: lr 1.00" in shown
    assert (out / "search.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "compare.png").is_file()


def test_a_study_killed_mid_trial_and_run_again_equals_the_uninterrupted_one(studied, tmp_path):
    """Sequential trials with the same --search-seed: the killed trial resumes from its checkpoint with its own
    value, and every trial draws and reaches what the uninterrupted study's trial of that number did."""
    reference, _ = studied
    out = tmp_path / "killed"
    first = toolkit(*search(out, 3), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    second = out / "runs" / "trial-0001"
    try:
        while checkpoint.newest_complete(second) is None:
            assert first.poll() is None, first.stdout.read().decode()
            time.sleep(0.05)  # polling a condition (a checkpoint exists), not a timed wait
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the sweep and the trial's process
        first.wait()
    assert not (second / "summary.json").exists(), "the trial ended before the kill: make it longer"
    assert trials_of(out)[1][0] == "RUNNING"
    again = toolkit(*search(out, 3))
    assert "[trial 1] --lr " in again.stdout and ": resumed (log " in again.stdout
    assert "resuming from" in (out / "logs" / "trial-0001.log").read_text()
    assert trials_of(out) == {n: t for n, t in trials_of(reference).items() if n < 3}
    for number in range(3):
        assert verify_run(out / "runs" / f"trial-{number:04d}") == []


def test_two_trials_at_once_share_one_journal_and_number_each_trial_once(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    out = tmp_path / "pair"
    done = toolkit(*search(out, 4, "--runs-per-device", "2"))
    lines = [line for line in done.stdout.splitlines() if line.startswith("[trial")]
    running = [i for i, line in enumerate(lines) if ": running" in line]
    ended = [i for i, line in enumerate(lines) if " complete, value " in line]
    assert len(running) == 4 and len(ended) == 4 and running[1] < ended[0], lines  # two began before one ended
    trials = trials_of(out)
    assert sorted(trials) == [0, 1, 2, 3] and all(state == "COMPLETE" for state, _, _ in trials.values())
    manifest = json.loads((out / "sweep.json").read_text())
    assert sorted(run["trial"] for run in manifest["runs"]) == [0, 1, 2, 3]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [f"trial-000{n}" for n in range(4)]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """Median pruning after one finished trial: lr 0.01 first (--search-seed 0's grid order), then lr 1e-5, which is
    behind it at the first evaluation."""
    out = tmp_path_factory.mktemp("pruned") / "study"
    args = ["sweep", TEMPLATE, "--search", "lr=0.01,0.00001", "--sampler", "grid", "--trials", "2", "--metric",
            "val_mse", "--direction", "min", "--prune", "median", "--prune-after-trials", "1", "--out", out, "--",
            *COMMON]
    return out, args, toolkit(*args)


def test_a_pruned_trial_ends_clean_at_its_step_and_is_not_resumed(pruned):
    out, args, done = pruned
    assert "[trial 0] complete" in done.stdout and "[trial 1] pruned at step 50 in" in done.stdout
    assert {n: (state, params) for n, (state, params, _) in trials_of(out).items()} == {
        0: ("COMPLETE", {"lr": "0.01"}), 1: ("PRUNED", {"lr": "0.00001"})}
    run = out / "runs" / "trial-0001"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 50 and summary["stop_reason"].startswith("pruned at step 50 by the search's "
                                                                              "median pruner (val_mse ")
    assert checkpoint.step_of(checkpoint.newest_complete(run)) == 50
    assert verify_run(run) == []
    again = toolkit(*args)
    assert "all 2 trials ended" in again.stdout and "[trial" not in again.stdout
    assert "resuming from" not in (out / "logs" / "trial-0001.log").read_text()


def test_a_two_process_trial_is_pruned_on_every_rank_at_the_same_step(tmp_path):
    """At 2 processes only the main process asks the study; the decision reaches the other rank through the loop's
    stop agreement, so both stop, checkpoint and exit 0 at the step the summary names."""
    out = tmp_path / "study"
    toolkit("sweep", TEMPLATE, "--search", "lr=0.01,0.00001", "--sampler", "grid", "--trials", "2", "--metric",
            "val_mse", "--direction", "min", "--prune", "median", "--prune-after-trials", "1", "--out", out,
            "--config-file", ROOT / "accelerate_configs" / "cpu_2proc.yaml", "--", *COMMON)
    run = out / "runs" / "trial-0001"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["stop_reason"].startswith("pruned at step 50 ")
    assert checkpoint.step_of(checkpoint.newest_complete(run)) == 50
    assert verify_run(run, expect_world_size=2) == []
    # rank 1 stopped there too: the step's checkpoint is collective, and both processes exited 0 (the trial ended)
    assert "stopping at step 50: pruned at step 50" in (out / "logs" / "trial-0001.log").read_text()


@pytest.mark.parametrize("args, fragment", [
    (["--search", "lr=abc:1"], "--search 'lr=abc:1': the bounds must be numbers"),
    (["--search", "lr=log:0:1"], "a log range needs a low bound above 0"),
    (["--search", "lr=0.1"], "give two or more different values"),
    (["--search", "hidden=int:1.5:4"], "the bounds must be integers"),
    (["--search", "lr=1:0"], "the low bound must be below the high one"),
    (["--search", "output-dir=a,b"], "--output-dir is set by the sweep"),
    (["--search", "dropout=0:2"], "refused by template.py: --dropout 2.0 is invalid"),
    (["--search", "nope=0:1"], "refused by template.py: Unrecognized options: --nope"),
    (["--search", "lr=0:1", "--grid", "seed=0,1"], "--grid and --search are two kinds of sweep"),
    (["--search", "lr=1e-3:1e-2", "--sampler", "grid"], "--sampler grid takes integer and one-of specs only"),
    (["--search", "hidden=int:16:18", "--sampler", "grid", "--trials", "4"], "more than the grid's 3 combinations"),
    (["--search", "lr=1e-3:1e-2", "--trials", "0"], "--trials 0 is invalid"),
    (["--search", "lr=1e-3:1e-2", "--metric", ""], "--metric is missing"),
], ids=["not-numbers", "log-at-0", "one-value", "int-bounds", "low-above-high", "output-dir", "recipe-check",
        "unknown-flag", "with-grid", "grid-of-floats", "grid-too-small", "trials-0", "no-metric"])
def test_bad_searches_are_one_line_and_make_nothing(args, fragment, tmp_path):
    base = {"--trials": "2", "--metric": "val_mse"}
    given = [*args] + [part for flag, value in base.items() if flag not in args for part in (flag, value)]
    result = toolkit("sweep", TEMPLATE, *given, "--out", tmp_path / "new", "--", "--max-steps", "2", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and fragment in errors[0], result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_a_search_without_optuna_is_one_line_naming_the_pip_command(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['optuna'] = None  # import raises ImportError\n")
    result = toolkit("sweep", TEMPLATE, *SEARCH, "--trials", "2", "--out", tmp_path / "new", check=False,
                     env={"PYTHONPATH": f"{site}:{ROOT}"})
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: searching flag values (toolkit sweep --search) needs optuna, which is not installed: pip install "
        "'accelerate-recipes[search]'"], result.stderr
    assert not (tmp_path / "new").exists()


def test_a_metric_the_recipe_does_not_report_or_the_wrong_direction_is_one_line_before_any_trial(tmp_path):
    """The recipe's loop is built once (TOOLKIT_METRIC_PROBE) and checks --metric and --direction before the study
    exists: nothing is made, no trial runs."""
    cases = [("val_nope", "min", "--metric val_nope is not among the metrics the recipe reports (val_mse); give one "
              "of them"),
             ("val_mse", "max", "--direction max, but the recipe's val_mse is better lower; give --direction min")]
    for metric, direction, line in cases:
        out = tmp_path / f"{metric}-{direction}"
        result = toolkit("sweep", TEMPLATE, "--search", "lr=log:1e-4:1e-2", "--metric", metric, "--direction",
                         direction, "--trials", "3", "--out", out, "--", *COMMON, check=False)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {line}"], result.stderr
        assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine where --cuda-graphs fails")
def test_flags_that_fail_before_training_refuse_a_local_search_and_leave_a_slurm_one_to_its_nodes(tmp_path):
    """--cuda-graphs fails on this CPU machine at the recipe's start: locally every trial would fail alike (one line,
    nothing made); under SLURM the trials run on the cluster's nodes, so the search says the metric was not checked
    here and goes on to sbatch (refused here by an option sbatch does not know: nothing is queued)."""
    base = ["sweep", TEMPLATE, *SEARCH, "--trials", "2"]
    local = toolkit(*base, "--out", tmp_path / "local", "--", *COMMON, "--cuda-graphs", check=False)
    assert local.returncode == 2 and len(local.stderr.strip().splitlines()) == 1, local.stderr
    assert "fails before training: --cuda-graphs needs a CUDA device" in local.stderr
    assert not (tmp_path / "local").exists()
    slurm = toolkit(*base, "--out", tmp_path / "slurm", "--launcher", "slurm", "--sbatch-option=--no-such-option",
                    "--", *COMMON, "--cuda-graphs", check=False)
    lines = slurm.stderr.strip().splitlines()
    assert lines[0].startswith("--metric val_mse not checked here (template.py does not start on this machine: "
                               "--cuda-graphs needs a CUDA device"), slurm.stderr
    assert slurm.returncode == 2 and len(lines) == 2 and lines[1].startswith("error: sbatch refused the job array: ")


def test_the_metric_probe_evaluates_only_for_a_metric_other_than_the_main_one(monkeypatch):
    from toolkit.loop.trial import PROBE_ENV, probe_metric

    calls = []

    def evaluate():
        calls.append(1)
        return {"val_mse": 1.0, "val_mae": 2.0}

    assert probe_metric("val_mse", False, evaluate) is None and calls == []  # outside a probe: nothing
    for metric, direction, evaluations in (("val_mse", "min", 0), ("val_mae", "max", 1)):
        monkeypatch.setenv(PROBE_ENV, json.dumps({"metric": metric, "direction": direction}))
        with pytest.raises(SystemExit) as exited:
            probe_metric("val_mse", False, evaluate)
        assert exited.value.code == 0 and len(calls) == evaluations


def test_the_wrong_direction_for_the_recipes_main_metric_is_one_line_on_every_rank():
    from toolkit.errors import UsageError
    from toolkit.loop.trial import TrialReporter

    spec = {"metric": "val_mse", "direction": "max", "pruner": "none"}
    for is_main in (True, False):  # refused before any rank talks to the study
        reporter = TrialReporter(spec, is_main, main_metric="val_mse", higher_is_better=False)
        with pytest.raises(UsageError, match="--direction max, but the recipe's val_mse is better lower; give "
                                             "--direction min"):
            reporter.report({"val_mse": 0.5}, step=10)
    other = TrialReporter({**spec, "metric": "val_mae"}, False, main_metric="val_mse", higher_is_better=False)
    assert other.report({"val_mse": 0.5, "val_mae": 0.4}, step=10) is None  # another metric: its direction is yours


def test_the_training_loop_does_not_import_optuna():
    code = "import sys, toolkit, toolkit.loop.training, toolkit.tools.sweep; print('optuna' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=recipe_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.slurm
def test_a_search_as_a_slurm_job_array_gives_each_task_its_own_trial_also_after_a_requeue(slurm_env, tmp_path):
    """Two array tasks take trials 0 and 1 from the study; one is pre-empted (SIGUSR1), requeued, takes its own trial
    again and resumes it; the same command again records both and submits nothing."""
    from conftest import logged_steps
    from test_slurm import _nodes_idle, job_field, wait_for

    cluster = {"SLURM_CONF": slurm_env["SLURM_CONF"]}
    out = tmp_path / "study"
    common = ["--epochs", "120", "--max-steps", "3000", "--eval-every-steps", "1000", "--log-with", "csv",
              "--log-every", "1"]
    args = ["sweep", TEMPLATE, *SEARCH, "--trials", "2", "--out", out, "--launcher", "slurm", "--max-parallel", "2",
            "--sbatch-option=--nodes=1", "--", *common]
    submitted = toolkit(*args, env=cluster)
    job = submitted.stdout.split("submitted job array ")[1].split(":")[0]
    run = out / "runs" / "trial-0000"
    wait_for(lambda: logged_steps(run) >= 2, what="trial 0 to train")
    owner = wait_for(lambda: json.loads((out / "sweep.json").read_text()).get("claims", {}).get("0"),
                     what="trial 0's task in the manifest")
    task = owner  # JOB_TASK, as scontrol names an array task
    subprocess.run(["scancel", "--batch", "--signal=USR1", task], env=recipe_env(cluster), capture_output=True)
    wait_for(lambda: job_field(cluster, task, "Restarts") == "1", what=f"the requeue of {task}")

    def others_done():
        states = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], env=recipe_env(cluster),
                                capture_output=True, text=True).stdout.split()
        return all(state == task for state in states) and _nodes_idle(cluster)

    wait_for(others_done, timeout=600, what="the other task to end")
    # Released early (SLURM would wait ~120 s); it may have started, and ended, by itself already
    subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], env=recipe_env(cluster),
                   capture_output=True)
    wait_for(lambda: (run / "summary.json").exists() and job_field(cluster, task, "JobState") == "COMPLETED",
             timeout=600, what="the requeued task to finish")
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "pre-empted at step" in logs and "resuming from" in logs
    again = toolkit(*args, env=cluster)  # records the finished trials; nothing left to submit
    assert "all 2 trials ended" in again.stdout, again.stdout
    trials = trials_of(out)
    assert sorted(trials) == [0, 1] and all(state == "COMPLETE" for state, _, _ in trials.values())
    assert json.loads((out / "sweep.json").read_text())["claims"]["0"] == owner  # the same task, its own trial
    for number in (0, 1):
        run = out / "runs" / f"trial-{number:04d}"
        assert verify_run(run, expect_world_size=1) == []
        assert json.loads((run / "config.json").read_text())["config"]["lr"] == trials[number][1]["lr"]


def test_the_random_sampler_draws_by_seed_and_hyperband_prunes_through_the_trial_reporter(tmp_path):
    """In process, no runs: --sampler random draws the same values for the same --search-seed and trial number
    (and others for another seed), within the ranges; a --prune hyperband trial far behind the finished ones is
    pruned by TrialReporter.report with the reason summary.json keeps."""
    from toolkit.loop.trial import PRUNED, TrialReporter
    from toolkit.tools import search as search_

    specs = search_.parse_specs(["lr=log:1e-4:1e-2", "hidden=int:8:64", "act=relu,gelu"])

    def drawn(seed, name):
        out = tmp_path / name
        out.mkdir()
        manifest = {"prune": "none", "prune_after_trials": 0, "direction": "min", "sampler": "random",
                    "search_seed": seed}
        study = search_.load_study(out, manifest, create=True)
        return [search_.ask(study, manifest, specs).params for _ in range(4)]

    first, again, other = drawn(7, "seed-7"), drawn(7, "seed-7-again"), drawn(8, "seed-8")
    assert first == again and first != other
    assert all(1e-4 <= p["lr"] <= 1e-2 and 8 <= p["hidden"] <= 64 and p["act"] in ("relu", "gelu") for p in first)

    out = tmp_path / "hyperband"
    out.mkdir()
    manifest = {"prune": "hyperband", "prune_after_trials": 0, "direction": "min", "sampler": "random",
                "search_seed": 0, "metric": "val_mse"}
    study = search_.load_study(out, manifest, create=True)

    def reported(values):  # a trial's reasons to stop at steps 1..32, as its run's evaluations would ask
        number = search_.ask(study, manifest, specs).number
        reporter = TrialReporter(json.loads(search_.trial_environment(out, manifest, number)), True,
                                 main_metric="val_mse", higher_is_better=False)
        return number, [reporter.report({"val_mse": value}, step) for step, value in enumerate(values, 1)]

    for _ in range(12):  # finished trials, alike, whose val_mse falls to 0.13 over 32 evaluations: none pruned
        number, reasons = reported([0.1 + 1 / step for step in range(1, 33)])
        assert not any(reasons)
        study.tell(number, 0.1 + 1 / 32)
    _, reasons = reported([50.0] * 32)
    pruned_at = next(step for step, reason in enumerate(reasons, 1) if reason)
    assert reasons[pruned_at - 1] == f"{PRUNED}{pruned_at} by the search's hyperband pruner (val_mse 50)"
    assert pruned_at < 32
