"""`python -m toolkit ls`: every recipe and every preset, with the descriptions the recipes declare."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, load_recipe, recipe_env

RECIPES = ("dcrnn", "hrm", "sasrec", "template", "ufs_emulator")


def toolkit_ls(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", "ls", *args], cwd=cwd, env=recipe_env(),
                          capture_output=True, text=True, timeout=60)


def test_ls_lists_every_recipe_and_preset_as_the_recipes_declare_them():
    result = toolkit_ls()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    listed = [line.split()[0] for line in lines if line and not line.startswith((" ", "run one"))]
    assert listed == list(RECIPES)
    for name in RECIPES:
        module = load_recipe(name, f"_catalog_{name}")
        block = lines[lines.index(next(line for line in lines if line.startswith(f"{name} "))):]
        summary = " ".join(module.__doc__.split("\n\n")[0].split())
        assert block[0].split(None, 1)[1] == summary
        for i, (preset, (description, _config)) in enumerate(getattr(module, "PRESETS", {}).items()):
            default = " (default)" if i == 0 else ""
            assert block[1 + i] == f"  --preset {preset}{default}: {' '.join(description.split())}"


def test_a_folder_of_ones_own_recipes_and_a_bad_folder(tmp_path):
    (tmp_path / "mine.py").write_text('"""My model on my data.\n\nMore."""\nPRESETS = {"small": ("tiny" " and quick", '
                                      'None)}\n\n\ndef main():\n    pass\n')
    (tmp_path / "helpers.py").write_text('"""Not a recipe: no main()."""\n')
    result = toolkit_ls(str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["mine           My model on my data.",
                                              "  --preset small (default): tiny and quick"]
    missing = toolkit_ls(str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'} is not a directory of recipes; give the folder that holds recipe .py files"]
