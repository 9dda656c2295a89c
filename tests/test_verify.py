"""`python -m toolkit verify RUN_DIR` on a real finished run of the SASRec recipe, and on damaged copies of it."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, recipe_env, run_recipe

from toolkit.tools.verify import verify_run

# one worker for the module: its module-scoped runs are made once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("verify")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, movielens_cache) -> Path:
    out = tmp_path_factory.mktemp("verify") / "run"
    run_recipe([*TINY, "--max-steps", "3", "--output-dir", str(out)])
    return out


@pytest.fixture
def damaged(finished_run, tmp_path):
    """A copy of the finished run to damage (also moves it: recorded absolute paths no longer point inside)."""
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    return copy


def verify_cli(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "toolkit", "verify", str(run_dir), *flags]
    return subprocess.run(command, cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=120)


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def has(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


def test_finished_run_passes(finished_run):
    result = verify_cli(finished_run)
    assert result.returncode == 0, result.stdout + result.stderr
    for check in ["files", "completion", "metrics", "results", "checkpoints", "world_size", "throughput"]:
        assert f"OK    {check}" in result.stdout
    assert "verify: OK" in result.stdout
    assert "steps 3 (max_steps 3)" in result.stdout and "world size 1" in result.stdout
    assert "samples/s" in result.stdout and "wall time" in result.stdout
    assert verify_run(finished_run) == []
    assert verify_run(finished_run, expect_world_size=1, expect_backend="none") == []


def test_moved_copy_still_passes(damaged):
    assert verify_run(damaged) == []  # the checkpoints are looked up inside the run dir, not at recorded paths


def test_missing_metrics_csv(damaged):
    (damaged / "metrics.csv").unlink()
    result = verify_cli(damaged)
    assert result.returncode == 1
    assert "FAIL  files        metrics.csv is missing" in result.stdout
    assert "verify: 1 problem(s): files: metrics.csv is missing" in result.stdout
    assert verify_run(damaged) == ["files: metrics.csv is missing"]


def test_final_checkpoint_without_complete_marker(damaged):
    (damaged / "checkpoints" / "step_3" / "COMPLETE").unlink()
    problems = verify_run(damaged)
    assert has(problems, "checkpoints:", "final checkpoint", "step_3", "incomplete")
    assert has(problems, "best checkpoint", "step_3", "incomplete")  # step 3 is also the best one
    assert verify_cli(damaged).returncode == 1


@pytest.mark.parametrize("leftover", ["step_2", ".step_2.pruning", ".step_4.saving"])
def test_leftovers_of_interrupted_saves_and_prunes_are_named(damaged, leftover):
    shutil.copytree(damaged / "checkpoints" / "step_3", damaged / "checkpoints" / leftover)
    (damaged / "checkpoints" / leftover / "COMPLETE").unlink()
    problems = verify_run(damaged)
    assert len(problems) == 1 and has(problems, "checkpoints:", f"checkpoints/{leftover} is a leftover"), problems


def test_a_checkpoint_file_missing_from_the_manifest_is_damage(damaged):
    manifest = damaged / "checkpoints" / "step_3" / "MANIFEST.json"
    entries = json.loads(manifest.read_text())
    del entries["files"]["model.safetensors"]
    manifest.write_text(json.dumps(entries))
    assert has(verify_run(damaged), "step_3 is damaged: model.safetensors is not listed in MANIFEST.json")


def test_config_json_edited_after_the_saves_fails(damaged):
    """config.json is checked against the settings each checkpoint recorded (an edited --lr once passed)."""
    config = json.loads((damaged / "config.json").read_text())
    edit_json(damaged / "config.json", config={**config["config"], "lr": 0.5})
    assert verify_run(damaged) == [f"checkpoints: config.json differs from the settings step_3 recorded (--lr "
                                   f"{config['config']['lr']!r} -> 0.5): it was changed after those saves"]


def test_a_checkpoint_replaced_by_a_file_is_named(damaged):
    step = damaged / "checkpoints" / "step_3"
    shutil.rmtree(step)
    step.write_text("not a checkpoint")
    problems = verify_run(damaged)
    assert has(problems, "checkpoints:", "the final checkpoint checkpoints/step_3 is not a directory"), problems
    assert not has(problems, "missing")


def test_world_size_disagreement(damaged):
    edit_json(damaged / "summary.json", world_size=2)
    problems = verify_run(damaged)
    assert has(problems, "world_size:", "summary.json says world size 2, the last life had 1")


def test_expect_world_size_2_on_a_one_process_run(finished_run):
    result = verify_cli(finished_run, "--expect-world-size", "2")
    assert result.returncode == 1
    assert "FAIL  world_size" in result.stdout and "expected world size 2, the run had 1" in result.stdout
    assert verify_run(finished_run, expect_backend="gloo") == ["backend: expected backend gloo, config.json says none"]


def test_unfinished_and_non_finite_values(damaged):
    edit_json(
        damaged / "config.json", config={**json.loads((damaged / "config.json").read_text())["config"], "max_steps": 5}
    )
    path = damaged / "metrics.csv"
    rows = list(csv.DictReader(open(path)))
    rows[-1]["train_loss"] = "nan"
    rows[-1]["throughput_samples_per_sec"] = "0"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = json.loads((damaged / "summary.json").read_text())
    edit_json(damaged / "summary.json", best_metrics={**summary["best_metrics"], "val_full_ndcg@10": None})
    problems = verify_run(damaged)
    assert has(problems, "completion:", "global_step 3 < config max_steps 5")
    assert has(problems, "metrics:", "train_loss", "not finite")
    assert has(problems, "throughput:", "not > 0")
    assert has(problems, "results:", "best_metrics", "val_full_ndcg@10")


def test_the_epoch_count_agrees_with_metrics_csv(finished_run, damaged):
    """verify said "epochs 1 of 3" for a run whose metrics.csv's last row is in epoch 2 (stopped inside it by
    --max-steps): it says both now, and a summary whose count cannot be metrics.csv's fails."""
    done = json.loads((finished_run / "summary.json").read_text())["epochs_completed"]
    last = int(list(csv.DictReader(open(finished_run / "metrics.csv")))[-1]["epoch"])
    assert last in (done, done + 1)
    said = verify_cli(finished_run).stdout
    inside = f", stopped inside epoch {last}" if last != done else ""
    assert f"; epochs {done} of " in said and f" completed{inside}; world size" in said, said
    edit_json(damaged / "summary.json", epochs_completed=last + 3)
    assert has(verify_run(damaged), "metrics:", f"last row is in epoch {last}", f"{last + 3} epoch(s) completed")


def test_a_reader_that_leaves_early_gets_no_traceback(finished_run):
    """`python -m toolkit verify RUN | head -1` printed a BrokenPipeError traceback."""
    command = f"{sys.executable} -m toolkit verify {finished_run} | head -1"
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=recipe_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.stdout == f"verify {finished_run}\n" and result.stderr == "", result.stderr


def test_not_a_directory_is_a_usage_error(tmp_path):
    result = verify_cli(tmp_path / "nowhere")
    assert result.returncode == 2 and "nowhere" in result.stderr and "not a directory" in result.stderr


def test_two_process_run_passes_with_its_world_size_and_backend(tmp_path, movielens_cache):
    out = tmp_path / "run"
    run_recipe([*TINY, "--max-steps", "2", "--output-dir", str(out)], config="cpu_2proc.yaml")
    assert verify_run(out, expect_world_size=2, expect_backend="gloo") == []
    assert has(verify_run(out, expect_world_size=1), "expected world size 1, the run had 2")


def test_a_process_count_change_outside_a_recorded_resume_fails(damaged):
    rows = (damaged / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    cells = rows[-1].split(",")
    cells[header.index("world_size")] = "2"
    (damaged / "metrics.csv").write_text("\n".join([*rows[:-1], ",".join(cells)]) + "\n")
    problems = verify_run(damaged)
    assert has(problems, "world_size:", "says world size 2, but the run had 1 process(es) then")
