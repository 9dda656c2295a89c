"""`--resume-from auto` without --output-dir picks the newest run with the same settings; when the newest run has
other settings, one line names the flags that differ (it once started afresh without a word)."""

from __future__ import annotations

from tests.conftest import TOY, run_recipe

ARGS = ["--max-steps", "2", "--log-with", "none"]


def test_auto_names_the_flags_that_differ_from_the_newest_run(tmp_path):
    run_recipe(ARGS, recipe=TOY, cwd=tmp_path)
    first = next((tmp_path / "runs" / "toy").iterdir())
    other = run_recipe([*ARGS, "--resume-from", "auto", "--lr", "0.01"], recipe=TOY, cwd=tmp_path)
    said = [line for line in (other.stdout + other.stderr).splitlines() if "has other settings" in line]
    assert len(said) == 1, other.stdout + other.stderr
    assert f"the newest run with a checkpoint, runs/toy/{first.name}, has other settings (--lr 0.05 -> 0.01)" in said[0]
    assert "starting a new run" in said[0]
    assert len(list((tmp_path / "runs" / "toy").iterdir())) == 2  # a new run, the old one untouched

    # The same settings as the first run: resumed (the newest with these settings), and nothing to remark on...
    same = run_recipe([*ARGS, "--max-steps", "3", "--resume-from", "auto"], recipe=TOY, cwd=tmp_path)
    output = same.stdout + same.stderr
    assert f"runs/toy/{first.name}" in output and "resumed at epoch" in output
    assert "has other settings" in output  # ...except that the lr=0.01 run is newer: it is named, not taken
    assert f"resuming the newest run with these settings, runs/toy/{first.name}" in output


def test_a_misspelled_main_metric_is_one_line_naming_the_metrics_there_are(tmp_path):
    result = run_recipe([*ARGS, "--main-metric", "val_mes", "--output-dir", str(tmp_path / "run")], recipe=TOY,
                        check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert errors == ["error: TrainingLoop(main_metric='val_mes') is not among the metrics evaluate() returned "
                      "(val_mse); give one of them"]
