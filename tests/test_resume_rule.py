"""Resume refusal by rule: every field of every recipe's config is either resumable or refused.

- Every field, enumerated from the config dataclasses (not a hand list), is changed in turn against a run's
  config.json: a field outside toolkit.run.start.RESUMABLE_CHANGES is refused in one line naming its flag; one inside is
  accepted.
- Every resumable field has a changed value in RESUME_CHANGES below, and a real resume of each recipe with ALL of
  them changed at once gives weights bit-identical to the uninterrupted run: no resumable field changes what a step
  computes. A field added to RESUMABLE_CHANGES without a value here fails the first test; with one, the resume shows
  whether it changes the training.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import DATA_CACHE, TINY, TOY, load_recipe, run_recipe
from toolkit.errors import UsageError
from toolkit.run.start import RESUMABLE_CHANGES, _previous_config, config_values
from toolkit.tools.catalog import REPO_RECIPES, find_recipes

# Every recipe `python -m toolkit ls` finds, and the toolkit API's toy: a new recipe is covered (and needs a RUNS
# entry below, which the resume test asks for by name).
RECIPES = (*(entry.name for entry in find_recipes(REPO_RECIPES)), TOY)

# The straight run: 6 steps, checkpoints at 3 and 6. The resumed life starts from a copy's step_3 with every
# resumable field changed (a function of the copy's directory and a scratch folder), and runs to step 7.
STEPS, HALF = 6, 3
RESUME_CHANGES = {
    "epochs": lambda run, scratch: ["--epochs", "9"],
    "max_steps": lambda run, scratch: ["--max-steps", str(STEPS + 1)],
    "log_every": lambda run, scratch: ["--log-every", "2"],
    "log_with": lambda run, scratch: ["--log-with", "none"],
    "wandb_project": lambda run, scratch: ["--wandb-project", "elsewhere"],
    "checkpoint_every": lambda run, scratch: ["--checkpoint-every", "1"],
    "keep_checkpoints": lambda run, scratch: ["--keep-checkpoints", "9"],
    "dist_timeout": lambda run, scratch: ["--dist-timeout", "123"],
    "num_workers": lambda run, scratch: ["--num-workers", "1"],
    "max_requeues": lambda run, scratch: ["--max-requeues", "7"],
    "max_loss_ratio": lambda run, scratch: ["--max-loss-ratio", "1e9"],
    "output_dir": lambda run, scratch: ["--output-dir", str(run)],
    "resume_from": lambda run, scratch: ["--resume-from", str(run / "checkpoints" / f"step_{HALF}")],
    "run_name": lambda run, scratch: ["--run-name", "renamed"],
    "cache_dir": lambda run, scratch: ["--cache-dir", str(scratch / "cache-copy")],
    "data_on_device": lambda run, scratch: ["--no-data-on-device"],  # the DataLoader path: the same batches
}


def config_class(recipe: str) -> type:
    module = load_recipe(recipe, f"_resume_rule_{Path(recipe).stem}")
    classes = {v for v in vars(module).values() if isinstance(v, type) and dataclasses.is_dataclass(v)
               and v.__module__ == module.__name__ and any(b.__name__ == "TrainConfig" for b in v.__mro__)}
    assert len(classes) == 1, (recipe, classes)
    return classes.pop()


@pytest.fixture(scope="module")
def configs() -> dict[str, type]:
    return {recipe: config_class(recipe) for recipe in RECIPES}


def changed(value):
    """Another value of the same kind (no check that a run would accept it: only the comparison sees it)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 0.5
    if isinstance(value, Path):
        return value / "elsewhere"
    if isinstance(value, str):
        return value + "-changed"
    if isinstance(value, (list, tuple)):
        return [*value, *(value[-1:] or ["changed"])]
    if value is None:
        return 3
    raise AssertionError(f"no changed value for {value!r}")


def test_every_resumable_field_has_a_decision_and_exists(configs):
    assert set(RESUME_CHANGES) == RESUMABLE_CHANGES, (
        "each field in toolkit.run.start.RESUMABLE_CHANGES needs a changed value in RESUME_CHANGES, which the resume "
        "test below proves changes no step's computation")
    every_field = {f.name for cls in configs.values() for f in dataclasses.fields(cls)}
    assert RESUMABLE_CHANGES <= every_field, RESUMABLE_CHANGES - every_field


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).stem)
def test_each_field_changed_on_resume_is_refused_in_one_line_unless_resumable(recipe, configs, tmp_path):
    cls = configs[recipe]
    base = dataclasses.replace(cls(), preset="default")  # a run's config.json names its preset (None: legacy run)
    (tmp_path / "config.json").write_text(json.dumps({"config": config_values(base)}))
    fields = [f.name for f in dataclasses.fields(cls)]
    assert len(fields) > 20, fields
    for name in fields:
        other = dataclasses.replace(base, **{name: changed(getattr(base, name))})
        assert config_values(other)[name] != config_values(base)[name], name
        if name in RESUMABLE_CHANGES:
            assert _previous_config(tmp_path, other)["config"] == config_values(base), name
            continue
        with pytest.raises(UsageError) as refused:
            _previous_config(tmp_path, other)
        message = str(refused.value)
        assert "\n" not in message, message
        flag = f"--{name.replace('_', '-')} "
        assert message.count(flag) == 1 and message.count(" -> ") == 1, (name, message)


RUNS = {
    "sasrec": [*TINY, "--dropout", "0.3"],
    "dcrnn": ["--cache-dir", str(DATA_CACHE), "--units", "8", "--batch-size", "32", "--threads", "1",
              "--sampling-decay-steps", "3", "--log-with", "csv"],
    "hrm": ["--cache-dir", str(DATA_CACHE), "--train-puzzles", "48", "--aug", "1", "--val-puzzles", "16",
            "--test-puzzles", "16", "--max-blanks", "8", "--hidden", "16", "--heads", "2", "--expansion", "2",
            "--batch-size", "16", "--halt-max-steps", "2", "--exploration-prob", "0.5", "--warmup-steps", "2",
            "--threads", "1", "--log-with", "csv"],
    "ufs_emulator": ["--batch-size", "40", "--log-with", "csv"],
    "template": ["--samples", "512", "--log-with", "csv"],
    TOY: ["--log-with", "csv"],
}


def test_the_recipes_are_those_toolkit_ls_lists_and_each_has_a_tiny_run():
    assert {"sasrec", "dcrnn", "hrm", "ufs_emulator", "template"} <= set(RECIPES)
    assert set(RECIPES) == set(RUNS), f"give each recipe a tiny run in RUNS: {set(RECIPES) ^ set(RUNS)}"


@pytest.fixture(scope="module")
def ufs_file(tmp_path_factory):
    from toolkit.data.ufs import synthesize

    return synthesize(tmp_path_factory.mktemp("ufs") / "grid.nc", seed=7, nlat=24, nlon=48)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).stem)
def test_a_resume_with_every_resumable_field_changed_trains_bit_identically(recipe, configs, tmp_path, request):
    from safetensors.torch import load_file

    args = list(RUNS[recipe])
    if recipe == "sasrec":
        request.getfixturevalue("movielens_cache")
    if recipe == "dcrnn":
        args = ["--data", str(request.getfixturevalue("synth_data")), *args]
    if recipe == "ufs_emulator":
        args = ["--data", str(request.getfixturevalue("ufs_file")), *args]
    fields = {f.name for f in dataclasses.fields(configs[recipe])}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_recipe([*args, "--epochs", "3", "--max-steps", str(STEPS), "--checkpoint-every", str(HALF),
                "--output-dir", str(straight)], recipe=recipe, timeout=120)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS}")
    if "cache_dir" in fields:
        shutil.copytree(DATA_CACHE, tmp_path / "cache-copy", ignore=shutil.ignore_patterns("*.lock"))
    changes = [arg for name in sorted(RESUMABLE_CHANGES & fields) for arg in RESUME_CHANGES[name](resumed, tmp_path)]
    second = run_recipe([*args, *changes], recipe=recipe, timeout=120)
    assert f"step_{HALF}" in second.stdout + second.stderr
    a = load_file(str(straight / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / f"step_{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys()
    different = [k for k in a if not (a[k] == b[k]).all()]
    assert not different, f"resumable fields changed the training of {different}"
    assert (resumed / "checkpoints" / f"step_{STEPS + 1}").is_dir()  # the changed --max-steps took effect


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).stem)
def test_a_run_made_before_a_flag_was_added_resumes_with_its_recorded_value_and_verifies(recipe, configs, tmp_path):
    """A config.json without a flag added since (the shared ADDED_FLAGS, and the recipe's own `added_flags`, which
    the recipe registers, not the core) resumes as if the value that reproduces it had been given; another value is
    refused. verify compares a checkpoint's settings with config.json's record of the added flags alone (no recipe
    loaded)."""
    from toolkit.run.checkpoint import SETTINGS, settings_changes
    from toolkit.run.config import ADDED_FLAGS, ADDED_FLAGS_KEY, added_flags

    cls = configs[recipe]
    added = added_flags(cls)
    assert ADDED_FLAGS.items() <= added.items()
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(added) <= fields, set(added) - fields
    base = dataclasses.replace(cls(), preset="default", **added)
    values = config_values(base)
    older = {key: value for key, value in values.items() if key not in added}
    (tmp_path / "config.json").write_text(json.dumps({"config": older}))
    assert _previous_config(tmp_path, base)["config"] == older
    for name, value in added.items():
        with pytest.raises(UsageError, match=f"--{name.replace('_', '-')} "):
            _previous_config(tmp_path, dataclasses.replace(base, **{name: changed(value)}))
    step = tmp_path / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (step / "progress.json").write_text(json.dumps({"global_step": 1, SETTINGS: {"config": older}}))
    assert settings_changes(step, {"config": values, ADDED_FLAGS_KEY: added}) == []
    if set(added) - set(ADDED_FLAGS):  # without the record, a recipe's own added flag reads as a change
        assert settings_changes(step, {"config": values}) != []
