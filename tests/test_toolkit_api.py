"""The toolkit API the model families build on, through a tiny toy recipe (tests/toy_recipe.py): extra and per-rank
checkpoint state, step cadence, keyed randomness and dropout, early stopping, the split finish, DDP arguments;
each checked for bit-exact resume and N processes = 1 process. Also: resume keeps metrics.csv and log.csv true at
every kind of resume point, a non-finite loss or metric stops the run, and the process count may change at a
resume."""

import csv
import json
import shutil

import pytest
import torch
from conftest import TOY, final_weights, ranks_seen, run_recipe
from safetensors.torch import load_file

from toolkit.tools.verify import verify_run

# one worker for the module: its module-scoped runs are made once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("toolkit-api")]

# 409 training rows, batch 64: 6 steps per epoch. Evaluations and checkpoints every 3 steps, so step 6 is an epoch
# end that is also an evaluation and a checkpoint step, and step 9 is an evaluation + checkpoint step mid-epoch.
TOY_ARGS = ["--eval-every-steps", "3", "--checkpoint-every", "3", "--keep-checkpoints", "20"]
TIMING = {"epoch_time_sec", "throughput_samples_per_sec", "data_load_time_sec", "compute_time_sec", "cpu_util_avg",
          "gpu_util_avg", "peak_memory_mb"}


def metrics_rows(run_dir):
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def assert_same_run(a, b, step):
    assert (a / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes() == \
        (b / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes()
    assert metrics_rows(a) == metrics_rows(b)
    assert (a / "log.csv").read_text() == (b / "log.csv").read_text()
    assert verify_run(b) == []


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 1-process run: 3 epochs, 18 steps."""
    out = tmp_path_factory.mktemp("straight") / "run"
    run_recipe([*TOY_ARGS, "--output-dir", str(out)], recipe=TOY)
    assert verify_run(out) == []
    return out


@pytest.mark.parametrize("resume_step", [6, 9], ids=["epoch-end-eval-checkpoint", "mid-epoch-eval-checkpoint"])
def test_resume_from_an_older_checkpoint_reproduces_the_run(straight, resume_step, tmp_path):
    # A later life wrote rows, log lines, test results and checkpoints after step N; resuming from step N must
    # cut exactly those off and write them again, once.
    copy = tmp_path / "run"
    shutil.copytree(straight, copy)
    run_recipe([*TOY_ARGS, "--resume-from", str(copy / "checkpoints" / f"step_{resume_step}")], recipe=TOY)
    assert_same_run(straight, copy, 18)
    assert [int(r["step"]) for r in metrics_rows(copy)] == [3, 6, 9, 12, 15, 18]


def test_resume_from_every_checkpoint_keeps_every_row_and_header(tmp_path):
    """Checkpoints at every step, evaluations every 2: step 1 was saved before metrics.csv's first row. A resume
    from any of them cuts what came later and writes it again, header included (a file cut to 0 bytes once lost its
    header: the rows sat where it was)."""
    args = ["--eval-every-steps", "2", "--checkpoint-every", "1", "--keep-checkpoints", "20", "--max-steps", "4"]
    straight = tmp_path / "straight"
    run_recipe([*args, "--output-dir", str(straight)], recipe=TOY)
    assert [int(r["step"]) for r in metrics_rows(straight)] == [2, 4]
    for step in range(1, 4):
        copy = tmp_path / f"from-{step}"
        shutil.copytree(straight, copy)
        run_recipe([*args, "--resume-from", str(copy / "checkpoints" / f"step_{step}")], recipe=TOY)
        assert (copy / "metrics.csv").read_text().splitlines()[0].startswith("epoch,step,train_loss"), step
        assert_same_run(straight, copy, 4)


def test_a_log_cut_to_nothing_gets_its_header_again(tmp_path):
    from toolkit.run.tracking import CSVTracker, MetricsFile, truncate_to_bytes

    log, metrics = CSVTracker(tmp_path), MetricsFile(tmp_path)
    log.log({"loss": 1.5}, step=1)
    metrics.append({"epoch": 0, "step": 1, "train_loss": 1.5})
    for path in (log.path, metrics.path):
        truncate_to_bytes(path, 0)  # saved before the file's first row
    log.log({"loss": 1.5}, step=1)
    metrics.append({"epoch": 0, "step": 1, "train_loss": 1.5})
    assert log.path.read_text().splitlines() == ["step,name,value", "1,loss,1.5"]
    assert metrics.rows() == [{"epoch": "0", "step": "1", "train_loss": "1.5"}]
    metrics.path.write_text("")  # an empty file (a kill between its creation and the header's write)
    metrics.append({"epoch": 0, "step": 1, "train_loss": 1.5})
    assert metrics.rows() == [{"epoch": "0", "step": "1", "train_loss": "1.5"}]


def test_extending_a_finished_run_matches_the_longer_run(straight, tmp_path):
    out = tmp_path / "run"
    run_recipe([*TOY_ARGS, "--epochs", "2", "--output-dir", str(out)], recipe=TOY)
    assert json.loads((out / "summary.json").read_text())["global_step"] == 12
    run_recipe([*TOY_ARGS, "--epochs", "3", "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY)
    assert_same_run(straight, out, 18)
    log = (out / "log.csv").read_text()
    assert log.count("best/test_mse") == 1  # the shorter run's test result was cut off and written again once


def test_resume_needs_the_extra_and_per_rank_state(straight, tmp_path):
    """Without restoring the loss EMA (shared) or the carry (per rank) the resumed run would differ: the
    checkpoint holds them, and they change the training."""
    saved = tmp_path / "run"
    shutil.copytree(straight, saved)
    step_9 = saved / "checkpoints" / "step_9"
    shared = torch.load(step_9 / "extra_state.pt", weights_only=False)
    carry = torch.load(step_9 / "rank_state_0.pt", weights_only=False)
    assert 0 < float(shared["loss_ema"]["value"]) < 1 and carry["carry"]["last"].shape == (64, 1)
    no_carry = tmp_path / "no-carry"
    run_recipe([*TOY_ARGS, "--no-carry", "--output-dir", str(no_carry)], recipe=TOY)
    assert not torch.equal(final_weights(no_carry, 18)["0.weight"], final_weights(straight, 18)["0.weight"])


def test_two_processes_resume_bit_exact_and_match_one_process(straight, tmp_path):
    straight_two, resumed_two = tmp_path / "two", tmp_path / "two-resumed"
    first = run_recipe([*TOY_ARGS, "--output-dir", str(straight_two)], recipe=TOY, config="cpu_2proc.yaml")
    assert ranks_seen(first.stderr) == {(0, 2), (1, 2)}
    assert first.stderr.count("ddp broadcast_buffers=False") == 2  # start_run(ddp_kwargs=...) reached DDP
    run_recipe([*TOY_ARGS, "--max-steps", "9", "--output-dir", str(resumed_two)], recipe=TOY, config="cpu_2proc.yaml")
    run_recipe([*TOY_ARGS, "--output-dir", str(resumed_two), "--resume-from", "auto"], recipe=TOY,
               config="cpu_2proc.yaml")
    assert_same_run(straight_two, resumed_two, 18)
    # N = 1 with dropout 0.2, per-sample feature coins and the carry all on: the same training up to float sums.
    one, two = final_weights(straight, 18), final_weights(straight_two, 18)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst
    losses = [[float(r["train_loss"]) for r in metrics_rows(d)] for d in (straight, straight_two)]
    assert max(abs(a - b) for a, b in zip(*losses, strict=True)) < 1e-5


@pytest.mark.parametrize("first, second", [(None, "cpu_2proc.yaml"), ("cpu_2proc.yaml", None)], ids=["1to2", "2to1"])
def test_process_count_may_change_at_a_resume(first, second, tmp_path):
    args = [*TOY_ARGS, "--no-carry"]
    reference, out = tmp_path / "reference", tmp_path / "run"
    run_recipe([*args, "--output-dir", str(reference)], recipe=TOY)
    run_recipe([*args, "--max-steps", "9", "--output-dir", str(out)], recipe=TOY, config=first)
    resumed = run_recipe([*args, "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY, config=second)
    assert "where the run had" in resumed.stdout
    config = json.loads((out / "config.json").read_text())
    sizes = [1, 2] if first is None else [2, 1]
    assert config["world_sizes"] == [{"from_step": 0, "world_size": sizes[0]}, {"from_step": 9, "world_size": sizes[1]}]
    assert verify_run(out) == []
    a, b = final_weights(reference, 18), final_weights(out, 18)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_batch_per_process_makes_the_global_batch_grow_with_the_processes(tmp_path):
    """--batch-per-process 48 on 2 processes is a global batch of 96, as seed 000's "batch x processes", and
    --scale-lr linear follows it (seed 004's rule): the toy's lr 0.05 for its batch 64 becomes 0.075, said once and
    recorded. Resuming on 1 process would change the global batch and the rate: refused in one line naming them."""
    out = tmp_path / "run"
    args = [*TOY_ARGS, "--no-carry", "--batch-per-process", "48", "--scale-lr", "linear", "--max-steps", "3",
            "--output-dir", str(out)]
    result = run_recipe(args, recipe=TOY, config="cpu_2proc.yaml")
    assert ranks_seen(result.stdout + result.stderr) == {(0, 2), (1, 2)}
    said = [line for line in result.stdout.splitlines() if line.startswith("learning rate scaled")]
    assert said == ["learning rate scaled (linear, samples per optimizer step 96 against the preset's 64: x 96 / 64 "
                    "= 1.5): --lr 0.05 -> 0.075"], result.stdout
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["batch_size"], config["batch_per_process"], config["scale_lr"]) == (96, 48, "linear")
    assert config["lr"] == pytest.approx(0.075, rel=1e-12)
    assert verify_run(out) == []
    one = run_recipe([*args, "--resume-from", "auto"], recipe=TOY, check=False)
    errors = [line for line in one.stderr.splitlines() if line.startswith("error:")]
    assert one.returncode == 2 and len(errors) == 1 and "--batch-size 96 -> 48" in errors[0], one.stderr
    assert "--lr 0.075" in errors[0] and "-> 0.0375" in errors[0], one.stderr  # 0.05 x 48 / 64 on 1 process


def test_per_rank_state_refuses_another_process_count(tmp_path):
    out = tmp_path / "run"
    run_recipe([*TOY_ARGS, "--max-steps", "3", "--output-dir", str(out)], recipe=TOY)
    result = run_recipe([*TOY_ARGS, "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY,
                        config="cpu_2proc.yaml", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and "per-rank state (carry)" in errors[0], result.stderr


def test_early_stopping_ends_with_a_final_checkpoint_and_verifies(tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*TOY_ARGS, "--patience", "2", "--min-delta", "10", "--output-dir", str(out)], recipe=TOY)
    assert "stopping at step 9" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"].startswith("val_mse has not improved") and summary["global_step"] == 9
    progress = json.loads((out / "checkpoints" / "step_9" / "progress.json").read_text())
    assert progress["stop_reason"] == summary["stop_reason"]  # a resume does not train on
    assert verify_run(out) == []
    again = run_recipe([*TOY_ARGS, "--patience", "2", "--min-delta", "10", "--output-dir", str(out),
                        "--resume-from", "auto"], recipe=TOY)
    assert json.loads((out / "summary.json").read_text())["global_step"] == 9, again.stdout


def test_finish_runs_artifacts_with_gradients_on_the_best_weights(straight):
    jacobian = torch.load(straight / "jacobian.pt")
    assert jacobian.shape == (5,) and torch.isfinite(jacobian).all() and jacobian.abs().sum() > 0
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["test"]["test_mse"] == summary["test_metrics_at_best"]["test_mse"]
    best = load_file(str(straight / "checkpoints" / f"step_{summary['best_step']}" / "model.safetensors"))
    assert best["0.weight"].shape == (16, 5)


@pytest.mark.parametrize("hook, what", [("--diverge-at-step", "the training loss is nan at step 8"),
                                         ("--nan-metric-at-step", "the validation metric val_mse is nan at step 9")])
def test_non_finite_loss_or_metric_stops_with_one_line_and_keeps_the_good_checkpoints(hook, what, tmp_path):
    out = tmp_path / "run"
    step = "8" if hook == "--diverge-at-step" else "9"
    result = run_recipe([*TOY_ARGS, hook, step, "--output-dir", str(out)], recipe=TOY, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and what in errors[0], result.stderr  # runtime: 1
    assert "Traceback" not in result.stderr
    assert not (out / "summary.json").exists()  # never reported as a result
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_6"]
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == ["3", "6"] and all("nan" not in r["val_mse"] for r in rows)
    assert "best one (step_6)" in errors[0]


def test_an_exploding_loss_stops_like_a_non_finite_one_unless_turned_off(tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*TOY_ARGS, "--explode-at-step", "8", "--output-dir", str(out)], recipe=TOY, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert "the training loss exploded to" in errors[0] and "at step 8, more than --max-loss-ratio 1e+06 x" in errors[0]
    assert not (out / "summary.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_6"]
    off = tmp_path / "off"
    run_recipe([*TOY_ARGS, "--explode-at-step", "8", "--max-loss-ratio", "0", "--output-dir", str(off)], recipe=TOY)
    assert verify_run(off) == []


def test_every_new_best_between_checkpoints_is_saved(tmp_path):
    # Evaluations every 2 steps, checkpoints only at epoch ends (every 6 steps): a new best at step 2, 4, 8...
    # still gets its checkpoint, or load_best() would have nothing to load.
    out = tmp_path / "run"
    run_recipe(["--eval-every-steps", "2", "--epochs", "2", "--keep-checkpoints", "20", "--output-dir", str(out)],
               recipe=TOY)
    rows = metrics_rows(out)
    best, new_bests = float("inf"), []
    for row in rows:
        if float(row["val_mse"]) < best:
            best = float(row["val_mse"])
            new_bests.append(int(row["step"]))
    assert any(step % 6 for step in new_bests), new_bests  # at least one new best falls between epoch ends
    saved = {int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*")}
    assert set(new_bests) <= saved, (new_bests, saved)
    assert saved - set(new_bests) <= {6, 12}  # the others are the epoch ends
    assert verify_run(out) == []


def test_two_processes_load_a_best_checkpoint_older_than_the_last(tmp_path):
    # lr 1 overshoots after step 3, so the best step (3) is not the last (18): load_best() reads an older checkpoint
    # on a multi-process CPU run, whose device is 'cpu:0' (safetensors refused that device until load_weights read
    # on the CPU).
    out = tmp_path / "run"
    result = run_recipe([*TOY_ARGS, "--lr", "1.0", "--output-dir", str(out)], recipe=TOY, config="cpu_2proc.yaml")
    assert ranks_seen(result.stderr) == {(0, 2), (1, 2)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_step"] == 3 and summary["global_step"] == 18
    assert "test_mse" in json.dumps(summary)
    assert verify_run(out) == []


def test_accelerated_zero_grad_still_reads_the_optimizers_signature():
    """toolkit.run.start answers Accelerate's per-step question (does optimizer.zero_grad take set_to_none?) once per
    function: the answers stay right for each optimizer class."""
    import accelerate.optimizer

    import toolkit.run.start  # noqa: F401  (installs the cached signature)

    class NoSetToNone(torch.optim.SGD):
        def zero_grad(self):  # an optimizer whose zero_grad takes no set_to_none: Accelerate then refuses the flag
            super().zero_grad(set_to_none=False)

    weight = torch.nn.Parameter(torch.ones(2))
    sgd, other = torch.optim.SGD([weight], lr=0.1), NoSetToNone([weight], lr=0.1)
    ask = accelerate.optimizer.inspect.signature
    assert "set_to_none" in ask(sgd.zero_grad).parameters
    assert "set_to_none" not in ask(other.zero_grad).parameters
    assert ask(sgd.zero_grad) is ask(torch.optim.SGD([weight]).zero_grad)  # once per function, not per call


@pytest.mark.parametrize("checkpoint_every, read_at, kept", [("4", 8, "step_4"), ("0", 10, "step_6")])
def test_a_non_finite_loss_read_at_the_cadence_stops_within_it_and_no_checkpoint_holds_it(checkpoint_every, read_at,
                                                                                          kept, tmp_path):
    # The loss is read on the host every --log-every 10 steps and before every checkpoint (an epoch is 6 steps): a
    # NaN at step 7 is found at the first of those reads (step 8's checkpoint, or step 10), named with its own step,
    # and the run stops there; the checkpoint before it is the newest, and none after step 6 exists.
    out = tmp_path / "run"
    result = run_recipe(["--log-every", "10", "--diverge-at-step", "7", "--checkpoint-every", checkpoint_every,
                         "--eval-every-steps", "100", "--epochs", "20", "--keep-checkpoints", "20",
                         "--output-dir", str(out)], recipe=TOY, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert f"the training loss is nan at step 7 (read {read_at - 7} step(s) later" in errors[0], errors[0]
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints[-1] == kept and all(int(name.split("_")[1]) < 7 for name in checkpoints)
    assert f"the last good checkpoint ({kept})" in errors[0]
