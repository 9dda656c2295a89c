"""Presets, once (toolkit.run.presets): every recipe's `--preset NAME` is tyro's named default configs, parsed by
toolkit.run.config.parse_config. --help lists the presets and shows the chosen one's values; an unknown name is one
line naming the valid ones; any flag overrides the preset's value; config.json records the preset's name."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from conftest import ROOT, assert_refused, load_recipe, run_preloaded

from toolkit.run.config import CHECK_ARGS, parse_config
from toolkit.run.start import config_values

RECIPES = ["sasrec", "dcrnn", "ufs_emulator", "hrm"]
# Each recipe's presets, the default first, and a flag to override with a value no preset has.
EXPECTED = {
    "sasrec": (["ml-100k", "ml-1m"], ["--maxlen", "20"], "maxlen", 20),
    "dcrnn": (["cpu", "metr-la"], ["--units", "8"], "units", 8),
    "ufs_emulator": (["cpu", "gdas", "soca"], ["--epochs", "7"], "epochs", 7),
    "hrm": (["cpu-small", "sudoku-1k"], ["--hidden", "32"], "hidden", 32),
}


@pytest.fixture(scope="module")
def recipes() -> dict[str, dict]:
    """Each recipe script's globals, imported as a module (its main() is not run; tyro resolves the config's type
    hints through sys.modules)."""
    modules = {}
    for name in RECIPES:
        modules[name] = load_recipe(name, f"presets_test_{name}")
    return {name: vars(module) for name, module in modules.items()}


def flat(text: str) -> str:
    """Help text without rich's box characters, whitespace collapsed (tyro wraps lines to the terminal)."""
    return " ".join(text.replace("│", " ").split())


def shown_default(help_text: str, flag: str) -> str:
    """The `(default: ...)` tyro shows for flag: in its entry of the options box (a line starting with the flag)."""
    raw = help_text.splitlines()
    lines = [line.strip("│ ") for line in raw]
    # an entry starts at the box's edge ("│ --flag"); a help text that wraps onto "--flag ..." is indented further
    start = next(i for i, line in enumerate(lines) if raw[i].startswith("│ --") and (
        line.startswith((f"{flag} ", f"{flag},")) or line == flag))
    match = re.search(r"\(default: (.*?)\)", flat("\n".join(lines[start:])))
    assert match, f"no default shown for {flag}"
    return match.group(1)


def as_shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_share_the_toolkit_presets_and_none_reads_argv_by_hand(recipe, recipes):
    script = (ROOT / "recipes" / f"{recipe}.py").read_text()
    assert "chosen_preset" not in script and "sys.argv" not in script
    assert "parse_config(PRESETS, argv" in script
    assert list(recipes[recipe]["PRESETS"]) == EXPECTED[recipe][0]


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_the_presets_and_shows_the_default_presets_values(recipe, recipes, tmp_path):
    result = run_preloaded(["--help"], recipe=recipe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    presets = recipes[recipe]["PRESETS"]
    default = next(iter(presets))
    for name, (line, _) in presets.items():
        assert flat(f"{name}{' (default)' if name == default else ''} {line}") in flat(result.stdout)
    assert f"--preset {default} [-h]" in result.stdout  # the usage line names the chosen preset
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_preset_help_shows_that_presets_values(recipe, recipes, tmp_path):
    presets = recipes[recipe]["PRESETS"]
    (_, default), *others = presets.values()
    for name, (_, other) in zip(EXPECTED[recipe][0][1:], others, strict=True):  # every preset but the default
        result = run_preloaded(["--preset", name, "--help"], recipe=recipe, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert f"The defaults below are those of preset `{name}`." in flat(result.stdout)
        changed = [f for f in dataclasses.fields(other) if f.name != "preset"
                   and getattr(other, f.name) != getattr(default, f.name)]
        assert changed
        for field in changed:
            flag = "--" + field.name.replace("_", "-")
            if isinstance(getattr(other, field.name), bool):  # --stop-early / --no-stop-early
                flag = f"{flag}, --no-{field.name.replace('_', '-')}"
            assert shown_default(result.stdout, flag) == as_shown(getattr(other, field.name)), (name, field.name)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("form", [["--preset", "nope"], ["--preset=nope"]], ids=["space", "equals"])
def test_unknown_preset_is_one_line_naming_the_valid_ones_and_creates_nothing(recipe, form, tmp_path):
    names = EXPECTED[recipe][0]
    line = assert_refused([*form, "--epochs", "1", "--output-dir", str(tmp_path / "run")],
                          ["--preset nope", "unknown", *names], recipe=recipe, case_dir=tmp_path)
    assert line == f"error: --preset nope is unknown; use one of {', '.join(names)}"


def test_preset_without_a_name_is_one_line(tmp_path):
    assert_refused(["--epochs", "1", "--preset"], ["--preset needs a NAME", "cpu, metr-la"], recipe="dcrnn",
                   case_dir=tmp_path)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_flag_overrides_the_preset_and_config_json_records_the_preset(recipe, recipes):
    presets = recipes[recipe]["PRESETS"]
    names, override, field, value = EXPECTED[recipe]
    # No preset: the first; `--preset NAME`, `--preset=NAME` and tyro's positional NAME choose the same one.
    assert parse_config(presets, []).preset == names[0]
    assert config_values(parse_config(presets, []))["preset"] == names[0]
    chosen = presets[names[1]][1]
    for args in (["--preset", names[1], *override], [*override, f"--preset={names[1]}"], [names[1], *override]):
        config = parse_config(presets, args)
        assert config.preset == names[1] and getattr(config, field) == value
        # every other value is the preset's
        assert dataclasses.replace(config, preset=None, **{field: getattr(chosen, field)}) == chosen
        assert config_values(config)["preset"] == names[1]  # what config.json's "config" holds


def test_sweep_flag_check_accepts_a_preset(recipes, monkeypatch):
    # `toolkit sweep --grid preset=a,b` parses each value with TOOLKIT_CHECK_ARGS=1: exit 0 after the parse.
    monkeypatch.setenv(CHECK_ARGS, "1")
    with pytest.raises(SystemExit) as exit_:
        parse_config(recipes["dcrnn"]["PRESETS"], ["--preset", "metr-la"])
    assert exit_.value.code == 0


def test_sasrec_ml_1m_preset_is_the_seeds_ml_1m_settings(recipes):
    # pmixer/SASRec.pytorch's ml-1m run and seed 004's single-GPU values (REFERENCE.md, seed 004): maxlen 200,
    # batch 128, lr 0.001, d 50, 2 blocks, 1 head, dropout 0.2, Adam; 1000 epochs evaluated every 20.
    config = recipes["sasrec"]["PRESETS"]["ml-1m"][1]
    seeds = dict(dataset="ml-1m", maxlen=200, batch_size=128, lr=1e-3, hidden=50, blocks=2, heads=1, dropout=0.2,
                 optimizer="adam", epochs=1000, eval_every=20)
    assert {key: getattr(config, key) for key in seeds} == seeds


def test_sasrec_ml_1m_run_records_its_preset_with_the_flags_on_top(tmp_path):
    # A tiny MovieLens-1M-format file (user::item::rating::time): the preset's dataset, maxlen overridden.
    rows = [f"{user}::{item}::4::{1000 + 10 * user + item}" for user in range(1, 21)
            for item in range(1 + user % 5, 41, 2)]
    (tmp_path / "ratings.dat").write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    result = run_preloaded(
        ["--preset", "ml-1m", "--data-path", str(tmp_path / "ratings.dat"), "--maxlen", "20", "--hidden", "16",
         "--blocks", "1", "--batch-size", "8", "--epochs", "1", "--max-steps", "2", "--eval-negatives", "10",
         "--log-with", "none", "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(out)],
        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["preset"], config["dataset"], config["maxlen"], config["hidden"]) == ("ml-1m", "ml-1m", 20, 16)
    assert (config["eval_every"], config["dropout"]) == (20, 0.2)  # the preset's, not the default's


def test_a_run_made_before_presets_resumes_under_the_default_preset():
    from toolkit.run.config import changed_flags as _changed_flags

    old = {"lr": 0.001, "maxlen": 50}  # config.json of a sasrec run from before presets: no `preset`
    assert _changed_flags(old, {**old, "preset": "ml-100k"}) == []
    assert _changed_flags({**old, "preset": None}, {**old, "preset": "ml-100k"}) == []
    assert _changed_flags({**old, "preset": "cpu"}, {**old, "preset": "metr-la"}) == ["--preset 'cpu' -> 'metr-la'"]
    assert _changed_flags(old, {**old, "maxlen": 200, "preset": "ml-1m"}) == ["--maxlen 50 -> 200"]
