"""--scale-lr: every learning rate follows the samples per optimizer step against the preset's (seed 004's rule)."""

import dataclasses

import pytest

from toolkit.run.config import TrainConfig, changed_flags, parse_config


@dataclasses.dataclass
class WithEmbeddingRate(TrainConfig):
    """A recipe with a second rate, as HRM's puzzle embeddings."""

    batch_size: int = 64
    lr: float = 1e-3
    puzzle_emb_lr: float = 1e-2
    log_with: str = "none"


PRESETS = {"small": ("a small preset", WithEmbeddingRate()),
           "big": ("a preset with batch 256", WithEmbeddingRate(batch_size=256, lr=4e-3))}


@pytest.mark.parametrize("rule, factor", [("linear", 4.0), ("sqrt", 2.0)])
def test_every_rate_follows_the_global_batch_of_batch_per_process(rule, factor, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse_config(PRESETS, ["--batch-per-process", "64", "--scale-lr", rule])
    assert config.batch_size == 256
    assert (config.lr, config.puzzle_emb_lr) == (pytest.approx(1e-3 * factor), pytest.approx(1e-2 * factor))
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"learning rate scaled ({rule}, samples per optimizer step 256 against the preset's 64")
    assert f"--lr 0.001 -> {1e-3 * factor:g}, --puzzle-emb-lr 0.01 -> {1e-2 * factor:g}" in line


def test_the_reference_is_the_chosen_presets_batch_and_accumulation_counts(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = parse_config(PRESETS, ["--preset", "big", "--batch-per-process", "64", "--scale-lr", "linear"])
    assert config.lr == pytest.approx(4e-3 * 128 / 256)  # the big preset's rate for its batch 256
    config = parse_config(PRESETS, ["--preset", "big", "--grad-accum", "2", "--scale-lr", "linear"])
    assert config.lr == pytest.approx(4e-3 * 2)  # 512 samples per optimizer step against 256


def test_none_and_an_unchanged_batch_leave_the_rates_as_given(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_config(PRESETS, ["--batch-per-process", "64", "--lr", "0.5"]).lr == 0.5  # default: none
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = parse_config(PRESETS, ["--batch-per-process", "64", "--scale-lr", "sqrt"])
    assert (config.lr, config.puzzle_emb_lr) == (1e-3, 1e-2)
    assert "x sqrt(64 / 64) = 1" in capsys.readouterr().out


def test_a_bad_rule_is_one_line_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(PRESETS, ["--scale-lr", "quadratic"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and "quadratic" in error and "linear" in error and "\n" not in error


@pytest.mark.parametrize("args, said", [
    (["--lr", "1e-323", "--batch-size", "1", "--scale-lr", "linear"], "--lr 9.88131e-324 scaled by --scale-lr linear "
     "(x 0.015625) is 0, which is invalid; the scaled rate must be a finite number > 0"),
    (["--lr", "1e308", "--grad-accum", "8", "--scale-lr", "linear"], "--lr 1e+308 scaled by --scale-lr linear (x 8) is "
     "inf, which is invalid; the scaled rate must be a finite number > 0"),
    (["--puzzle-emb-lr", "1e308", "--grad-accum", "8", "--scale-lr", "sqrt"], "--puzzle-emb-lr 1e+308 scaled by "
     "--scale-lr sqrt (x 2.82843) is inf"),
], ids=["to-zero", "to-inf", "second-rate"])
def test_the_rate_is_checked_after_scaling(args, said):
    from toolkit.errors import UsageError

    with pytest.raises(UsageError) as refused:
        parse_config(PRESETS, args)
    assert said in str(refused.value)


def test_a_scaled_rate_out_of_range_makes_no_run_directory(tmp_path):
    from conftest import TOY, run_recipe

    result = run_recipe(["--lr", "1e308", "--grad-accum", "8", "--scale-lr", "linear"], recipe=TOY, cwd=tmp_path,
                        check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "is inf, which is invalid" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


def test_a_run_made_before_the_flag_resumes_as_none():
    old = {"preset": "small", "lr": 1e-3, "batch_size": 64}
    assert changed_flags(old, {**old, "scale_lr": "none"}) == []
    assert changed_flags(old, {**old, "scale_lr": "linear"}) == ["--scale-lr 'none' -> 'linear'"]
    # a recipe's own added flag (DCRNN's, on its config class): compared with the value its runs had
    assert changed_flags(old, {**old, "sequence_kernel": "auto"}, {"sequence_kernel": "cells"}) == [
        "--sequence-kernel 'cells' -> 'auto'"]
