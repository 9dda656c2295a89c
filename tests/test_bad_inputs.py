"""Bad input: one `error:` line naming the flag/path/value, exit status 2, nothing trained or written."""

import shutil

import pytest
from conftest import TINY, run_recipe


def _fails_with(result, *fragments):
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in output
    return errors[0]


@pytest.mark.parametrize("args, fragments", [
    (["--data-path", "/no/such/ratings.dat"], ["--data-path", "/no/such/ratings.dat", "does not exist"]),
    (["--variant", "transformer-xl"], ["--variant", "transformer-xl", "sasrec"]),
    (["--batch-size", "-8"], ["--batch-size", "-8", "positive"]),
    (["--mixed-precision", "fp16"], ["fp16", "bf16"]),
    (["--norm", "sideways"], ["--norm", "sideways"]),
])
def test_bad_flag_is_one_line_error_before_training(args, fragments, tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*TINY, "--output-dir", str(out), *args], check=False)
    _fails_with(result, *fragments)
    assert result.returncode == 2
    assert not (out / "checkpoints").exists() and not (out / "metrics.csv").exists()


def test_batch_not_divisible_by_process_count(tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*TINY, "--batch-size", "63", "--output-dir", str(out)], config="cpu_2proc.yaml",
                        check=False)
    assert result.returncode != 0
    assert "error: --batch-size 63 is not divisible by the 2 processes" in result.stderr
    assert not (out / "checkpoints").exists()


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    not_a_checkpoint = tmp_path / "somewhere"
    not_a_checkpoint.mkdir()
    result = run_recipe([*TINY, "--resume-from", str(not_a_checkpoint)], check=False)
    _fails_with(result, "--resume-from", str(not_a_checkpoint), "not a checkpoint")


@pytest.mark.slow
def test_interrupted_checkpoint_is_ignored_by_auto_and_rejected_by_path(tmp_path, movielens_cache):
    out = tmp_path / "run"
    run_recipe([*TINY, "--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "5",
                "--output-dir", str(out)])
    interrupted = out / "checkpoints" / "step_4"
    (interrupted / "COMPLETE").unlink()  # as if the process died while saving step 4
    result = run_recipe([*TINY, "--resume-from", str(interrupted)], check=False)
    _fails_with(result, "--resume-from", "incomplete checkpoint")
    resumed = run_recipe([*TINY, "--max-steps", "5", "--resume-from", "auto", "--output-dir", str(out)])
    assert "step_2" in resumed.stdout.split("resuming from", 1)[1].splitlines()[0]
    assert (interrupted / "model.safetensors").exists()  # never deleted


def test_fresh_start_refuses_a_directory_that_holds_a_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_3").mkdir(parents=True)
    keep = out / "checkpoints" / "step_3" / "model.safetensors"
    keep.write_text("user data")
    result = run_recipe([*TINY, "--output-dir", str(out)], check=False)
    _fails_with(result, "--output-dir", "already holds a run", "--resume-from auto")
    assert keep.read_text() == "user data"
    shutil.rmtree(out)
