"""Bad input: one `error:` line naming the flag/path/value, exit status 2, nothing trained or written."""

import dataclasses
import shutil
import types
import typing
from pathlib import Path

import pytest
import tyro
from conftest import TINY, assert_refused, load_recipe, run_recipe

from toolkit.run import checkpoint


def _fails_with(result, *fragments):
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert "Traceback" not in output
    return errors[0]


def _file(name, content):
    """A data file the case writes into its own directory."""

    def make(case_dir):
        path = case_dir / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    return make


def _dir(case_dir):
    (case_dir / "empty").mkdir()
    return str(case_dir / "empty")


def _dangling_link(case_dir):
    """A symbolic link whose target does not exist (it once gave "File exists; complete checkpoints are intact")."""
    (case_dir / "run").symlink_to(case_dir / "gone")
    return str(case_dir / "run")


def _new(name):
    """A path in the case's directory that does not exist yet (nothing may create it)."""
    return lambda case_dir: str(case_dir / name)


GOOD_ROWS = "".join(f"{u}\t{i}\t4\t{1000 + 10 * u + i}\n" for u in range(1, 6) for i in range(1, 30))

# (id, flags, fragments the one error line must contain). A callable in the flags makes a file/dir in the case's
# own directory first. Every case: exit 2, ONE `error:` line, no traceback, the directory tree unchanged.
BAD_INPUTS = [
    ("variant", ["--variant", "transformer-xl"], ["--variant", "transformer-xl"]),
    ("norm", ["--norm", "sideways"], ["--norm", "sideways"]),
    ("loss", ["--loss", "hinge"], ["--loss", "hinge"]),
    ("dataset", ["--dataset", "ml-25m"], ["--dataset", "ml-25m"]),
    ("batch-negative", ["--batch-size", "-8"], ["--batch-size", "-8", "positive"]),
    ("batch-zero", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("batch-text", ["--batch-size", "abc"], ["--batch-size", "abc"]),
    ("batch-per-process-zero", ["--batch-per-process", "0"], ["--batch-per-process 0", "positive"]),
    ("scale-lr-unknown-rule", ["--scale-lr", "quadratic"], ["--scale-lr", "quadratic", "linear", "sqrt"]),
    ("kernels-unknown-choice", ["--kernels", "fast"], ["--kernels", "fast", "auto", "plain"]),
    (
        "batch-size-and-batch-per-process",
        ["--batch-per-process", "8"],
        ["--batch-size", "--batch-per-process", "not both"],
    ),
    ("batch-larger-than-data", ["--batch-size", "4096"], ["--batch-size 4096", "training users"]),
    ("epochs-zero", ["--epochs", "0"], ["--epochs", "0"]),
    ("grad-accum-zero", ["--grad-accum", "0"], ["--grad-accum", "0"]),
    ("lr-zero", ["--lr", "0"], ["--lr", "0"]),
    ("lr-negative", ["--lr", "-1"], ["--lr", "-1"]),
    ("lr-inf", ["--lr", "inf"], ["--lr", "inf", "finite"]),
    ("lr-nan", ["--lr", "nan"], ["--lr", "nan"]),
    ("seed-negative", ["--seed", "-1"], ["--seed", "-1"]),
    ("seed-too-large", ["--seed", "99999999999"], ["--seed", "99999999999"]),
    ("weight-decay-negative", ["--weight-decay", "-1"], ["--weight-decay", "-1"]),
    ("warmup-negative", ["--warmup-steps", "-5"], ["--warmup-steps", "-5"]),
    ("dropout-one", ["--dropout", "1.0"], ["--dropout", "1.0"]),
    ("dropout-negative", ["--dropout", "-0.1"], ["--dropout", "-0.1"]),
    ("hidden-zero", ["--hidden", "0"], ["--hidden", "0"]),
    ("heads-not-dividing", ["--heads", "3"], ["--hidden 16", "--heads 3"]),
    ("blocks-zero", ["--blocks", "0"], ["--blocks", "0"]),
    ("maxlen-zero", ["--maxlen", "0"], ["--maxlen", "0"]),
    ("time-span-zero", ["--time-span", "0"], ["--time-span", "0"]),
    ("mhc-streams-zero", ["--mhc-streams", "0"], ["--mhc-streams", "0"]),
    ("eval-negatives-zero", ["--eval-negatives", "0"], ["--eval-negatives", "0"]),
    ("eval-negatives-above-catalogue", ["--eval-negatives", "5000"], ["--eval-negatives 5000", "at most"]),
    (  # refused before a new --cache-dir gets the processed data (it was written, then refused)
        "eval-negatives-above-catalogue-new-cache",
        ["--eval-negatives", "29", "--data-path", _file("u.data", GOOD_ROWS), "--cache-dir", _new("cache")],
        ["--eval-negatives 29", "give at most 0"],
    ),
    ("max-steps-zero", ["--max-steps", "0"], ["--max-steps", "0"]),
    ("checkpoint-every-negative", ["--checkpoint-every", "-1"], ["--checkpoint-every", "-1"]),
    ("keep-checkpoints-zero", ["--keep-checkpoints", "0"], ["--keep-checkpoints", "0"]),
    ("eval-every-zero", ["--eval-every", "0"], ["--eval-every", "0"]),
    ("eval-every-steps-negative", ["--eval-every-steps", "-1"], ["--eval-every-steps", "-1"]),
    ("log-every-zero", ["--log-every", "0"], ["--log-every", "0"]),
    ("num-workers-negative", ["--num-workers", "-1"], ["--num-workers", "-1"]),
    ("threads-negative", ["--threads", "-2"], ["--threads", "-2"]),
    ("dist-timeout-zero", ["--dist-timeout", "0"], ["--dist-timeout", "0"]),
    ("max-grad-norm-negative", ["--max-grad-norm", "-1"], ["--max-grad-norm", "-1"]),
    ("max-requeues-negative", ["--max-requeues", "-1"], ["--max-requeues", "-1"]),
    ("fp16-on-cpu", ["--mixed-precision", "fp16"], ["--mixed-precision fp16", "bf16"]),
    ("cuda-graphs-on-cpu", ["--cuda-graphs"], ["--cuda-graphs", "CUDA", "cpu"]),
    ("max-loss-ratio-one", ["--max-loss-ratio", "1"], ["--max-loss-ratio 1.0", "> 1"]),
    ("optimizer", ["--optimizer", "lamb"], ["lamb", "--optimizer"]),
    ("preset", ["--preset", "ml-25m"], ["--preset ml-25m", "unknown"]),
    ("cache-dir-is-a-file", ["--cache-dir", _file("taken", "a file")], ["--cache-dir", "not a writable directory"]),
    ("tracker", ["--log-with", "mlflow"], ["--log-with", "mlflow"]),
    ("unknown-flag", ["--no-such-flag", "1"], ["--no-such-flag"]),
    ("output-dir-empty", ["--output-dir", ""], ["--output-dir", "current directory"]),
    ("output-dir-is-a-file", ["--output-dir", _file("taken", "a file")], ["--output-dir", "is a file"]),
    ("output-dir-unwritable", ["--output-dir", "/proc/self/run"], ["--output-dir", "/proc/self/run"]),
    ("output-dir-dangling-link", ["--output-dir", _dangling_link], ["--output-dir", "symbolic link", "does not exist"]),
    ("output-dir-newline", ["--output-dir", "runs/a\nb"], ["--output-dir 'runs/a\\nb'", "control character"]),
    ("cache-dir-escape", ["--cache-dir", "cache\x1b[0m"], ["--cache-dir", "control character"]),
    ("run-name-tab", ["--run-name", "a\tb"], ["--run-name", "control character"]),
    ("resume-checkpoint-is-a-file", ["--resume-from", _file("step_3", "x")], ["--resume-from", "not a directory"]),
    ("resume-missing", ["--resume-from", "/no/such/run"], ["--resume-from", "/no/such/run", "does not exist"]),
    ("resume-not-a-checkpoint", ["--resume-from", _dir], ["--resume-from", "not a checkpoint"]),
    ("ml-1m-without-path", ["--dataset", "ml-1m"], ["--dataset ml-1m", "--data-path"]),
    ("data-missing", ["--data-path", "/no/such/ratings.dat"], ["--data-path", "/no/such/ratings.dat"]),
    ("data-dir-without-ratings", ["--data-path", _dir], ["--data-path", "u.data"]),
    ("data-empty", ["--data-path", _file("u.data", "")], ["--data-path", "u.data"]),
    ("data-garbage", ["--data-path", _file("u.data", bytes(range(256)) * 8)], ["--data-path", "u.data"]),
    ("data-text", ["--data-path", _file("notes.txt", "these are my notes\nnot ratings\n")], ["notes.txt"]),
    ("data-malformed", ["--data-path", _file("u.data", GOOD_ROWS + "7\t8\n")], ["u.data"]),
    ("data-two-rows", ["--data-path", _file("u.data", "1\t1\t5\t100\n1\t2\t5\t200\n")], ["u.data"]),
    (
        "data-user-not-a-number",
        ["--data-path", _file("u.data", GOOD_ROWS + "bob\t3\t4\t5000\n" + GOOD_ROWS)],
        ["u.data", "line 146"],
    ),
    ("data-negative-item", ["--data-path", _file("u.data", GOOD_ROWS + "3\t-4\t4\t5000\n")], ["u.data", "line 146"]),
]


@pytest.mark.parametrize("flags, fragments", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_nothing_created(flags, fragments, tmp_path, movielens_cache):
    flags = [flag(tmp_path) if callable(flag) else flag for flag in flags]
    output = ["--output-dir", str(tmp_path / "run")] if "--output-dir" not in flags else []
    assert_refused([*TINY, *output, *flags], fragments, case_dir=tmp_path)


_SUPPRESSED = typing.get_args(tyro.conf.Suppress[int])[1]  # tyro's marker: a field that is not a flag


def _takes_a_checkable_value(hint) -> bool:
    """A path, a number or a choice (Literal); not a switch (bool) or free text (str: a run name, a W&B project)."""
    if typing.get_origin(hint) is typing.Annotated:
        return _SUPPRESSED not in typing.get_args(hint)[1:] and _takes_a_checkable_value(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType, tuple):
        return any(_takes_a_checkable_value(arg) for arg in typing.get_args(hint) if arg not in (type(None), ...))
    if typing.get_origin(hint) is typing.Literal:
        return True
    return hint is not bool and isinstance(hint, type) and issubclass(hint, (Path, int, float))


def _flags_of(recipe: str) -> dict[str, bool]:
    """{--flag: whether it takes a path, number or choice} for recipes/<recipe>.py's config dataclass (TrainConfig's
    shared flags included), and its --preset NAME (a choice, not a field)."""
    module = load_recipe(recipe, f"_{recipe}_recipe")
    config_class = type(next(iter(module.PRESETS.values()))[1])
    hints = typing.get_type_hints(config_class, include_extras=True)
    flags = {
        "--" + field.name.replace("_", "-"): _takes_a_checkable_value(hints[field.name])
        for field in dataclasses.fields(config_class)
        if _SUPPRESSED not in typing.get_args(hints[field.name])[1:]
    }
    return {**flags, "--preset": len(module.PRESETS) > 1}


def test_the_table_is_long_enough():
    """Every SASRec flag that takes a path, a number or a choice has a case that passes it a bad value and expects the
    error line to name it; and every flag the table passes exists (a renamed flag leaves no stale case behind)."""
    flags = _flags_of("sasrec")
    assert {"--lr", "--seed", "--output-dir", "--resume-from", "--variant", "--data-path", "--preset"} <= {
        flag for flag, checkable in flags.items() if checkable
    }  # the enumeration itself sees all three kinds
    assert not flags["--run-name"] and not flags["--compile"]  # free text and switches have no bad value
    covered = {
        arg
        for _, case_flags, fragments in BAD_INPUTS
        for arg in case_flags
        if isinstance(arg, str) and any(fragment.startswith(arg) for fragment in fragments)
    }
    uncovered = sorted(flag for flag, checkable in flags.items() if checkable and flag not in covered)
    assert uncovered == [], "no bad-input case passes these flags a bad value and expects the error to name them"
    passed = {
        arg for _, case_flags, _ in BAD_INPUTS for arg in case_flags if isinstance(arg, str) and arg.startswith("--")
    }
    assert passed - set(flags) == {"--no-such-flag"}


def test_batch_not_divisible_by_process_count(tmp_path):
    out = tmp_path / "run"
    result = run_recipe([*TINY, "--batch-size", "63", "--output-dir", str(out)], config="cpu_2proc.yaml", check=False)
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
    run_recipe(
        [*TINY, "--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "5", "--output-dir", str(out)]
    )
    interrupted = out / "checkpoints" / "step_4"
    (interrupted / "COMPLETE").unlink()  # as if the process died while saving step 4
    result = run_recipe([*TINY, "--resume-from", str(interrupted)], check=False)
    _fails_with(result, "--resume-from", "incomplete checkpoint")
    resumed = run_recipe([*TINY, "--max-steps", "5", "--resume-from", "auto", "--output-dir", str(out)])
    assert "step_2" in resumed.stdout.split("resuming from", 1)[1].splitlines()[0]
    assert "checkpoint " + str(interrupted) + " is skipped: it is incomplete" in resumed.stdout  # named, one line
    assert "removing checkpoints/step_4: it is incomplete" in resumed.stdout  # the next save cleans it, named
    assert not interrupted.exists() and checkpoint.is_complete(out / "checkpoints" / "step_5")


def test_fresh_start_refuses_a_directory_that_holds_a_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_3").mkdir(parents=True)
    keep = out / "checkpoints" / "step_3" / "model.safetensors"
    keep.write_text("user data")
    result = run_recipe([*TINY, "--output-dir", str(out)], check=False)
    _fails_with(result, "--output-dir", "already holds a run", "--resume-from auto")
    assert keep.read_text() == "user data"
    shutil.rmtree(out)


def test_every_float_flag_is_refused_for_nan_and_inf_unless_the_recipe_allows_it():
    """A recipe's own float flag (a new family's --noise) had no check: `--noise nan` made a run directory and failed
    at step 1. Every float flag is now refused at parsing, unless the recipe names it in non_finite_allowed."""
    import dataclasses

    from toolkit.errors import UsageError
    from toolkit.run.config import TrainConfig, parse_config

    @dataclasses.dataclass
    class Noisy(TrainConfig):
        noise: float = 0.1
        bound: float = 1.0
        log_with: str = "none"

    for flag, value in [("--noise", "nan"), ("--bound", "inf"), ("--max-grad-norm", "-inf"),
                        ("--dist-timeout", "nan")]:
        with pytest.raises(UsageError) as refused:
            parse_config(Noisy, [flag, value])
        assert f"{flag} {float(value)} is invalid" in str(refused.value), refused.value

    @dataclasses.dataclass
    class Unbounded(Noisy):
        non_finite_allowed = frozenset({"bound"})

    assert parse_config(Unbounded, ["--bound", "inf"]).bound == float("inf")
    with pytest.raises(UsageError):
        parse_config(Unbounded, ["--noise", "nan"])
