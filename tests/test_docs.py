"""The documentation: every command it shows passes its program's own parser, the reference pages are generated from
the code and name every flag, README.md is a front page whose links lead into the site, and `make test` builds the
site strictly (no broken link or anchor).

The commands are checked by docs/gen/cli.py in a process of its own (importing a recipe runs its begin_process()):
a recipe's flags through its main()'s parse_config (tyro, the shared range checks), `python -m toolkit ...` and the
other tools through the argparse parser their main() builds, `accelerate launch` arguments through accelerate's own
launch parser, a sweep's grid values and common flags through the recipe's parser. Nothing runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, load_recipe, recipe_env

CLI = ROOT / "docs" / "gen" / "cli.py"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
FRONT = ROOT / "README.md"


def docs_cli():
    """docs/gen/cli.py as a module (its top level imports the standard library only)."""
    spec = importlib.util.spec_from_file_location("docs_gen_cli", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CLI), *args], cwd=ROOT, env=recipe_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_commands_are_found_in_code_blocks_and_inline_spans():
    cli = docs_cli()
    text = """
```bash
python recipes/sasrec.py --epochs 5 \\
    --lr 0.01          # a comment
TOOLKIT_X=1 python -m toolkit verify runs/sasrec/a
make run
```

```text
python recipes/sasrec.py --not-checked
```

Run `python -m toolkit doctor --timeout 30`; name `python -m toolkit verify` or `python -m toolkit verify RUN_DIR
--expect-world-size N` in prose.
"""
    assert cli.extract_commands(text) == [
        ("python recipes/sasrec.py --epochs 5      --lr 0.01          # a comment", True),
        ("TOOLKIT_X=1 python -m toolkit verify runs/sasrec/a", True),
        ("python -m toolkit doctor --timeout 30", False),
    ]
    copied = cli.copies("```bash\ncp recipes/template.py recipes/gru.py\n```")
    assert copied == {"recipes/gru.py": "recipes/template.py"}


def test_every_command_the_docs_show_passes_its_own_parser_and_a_renamed_flag_does_not(tmp_path):
    """Every command line of README.md, benchmarks/README.md and docs/ (a recipe under any launcher, python -m
    toolkit ..., the export and data tools, a sweep's grid) parses; the same lines with a flag renamed, a choice
    misspelt or a recipe renamed are each named with their parser's error."""
    broken = tmp_path / "broken.md"
    broken.write_text("\n".join([
        "```bash",
        "python recipes/sasrec.py --epoch 5",
        "python -m toolkit launch --config_file accelerate_configs/cpu_2proc.yaml recipes/dcrnn.py --unit 8",
        "python -m toolkit launch --config_file accelerate_configs/no_such.yaml recipes/dcrnn.py",
        "python recipes/hrm.py --preset sudoku-10k",
        "python -m toolkit verify runs/x --expect-size 2",
        "python -m toolkit sweep recipes/sasrec.py --grid varient=sasrec --out sweeps/x",
        "python -m toolkit sweep recipes/sasrec.py --grid seed=0 --out sweeps/x -- --log-with mlflow",
        "python -m toolkit.export aoti runs/x --output emulator.pt2",
        "python -m toolkit.data.traffic synth --out data/x --sensor-count 50",
        "python recipes/no_such_recipe.py",
        "```",
    ]))
    result = run_cli("check", str(FRONT), str(ROOT / "benchmarks" / "README.md"), *map(str, PAGES), str(broken))
    assert result.stdout, result.stderr[-3000:]
    results = json.loads(result.stdout)
    ours = [r for r in results if r["file"] != str(broken)]
    failed = [f"{r['file']}: {r['command']}\n    {r['problem']}" for r in ours if r["problem"]]
    assert failed == [], "\n".join(failed)
    strict = [r["command"] for r in ours if r["strict"]]
    assert len(strict) >= 60
    for program in ("recipes/sasrec.py", "recipes/ufs_emulator.py", "recipes/dcrnn.py", "recipes/hrm.py",
                    "recipes/template.py", "-m toolkit sweep", "-m toolkit compare", "-m toolkit verify",
                    "-m toolkit doctor", "-m toolkit.export aoti", "-m toolkit.export torchscript",
                    "-m toolkit.export predict", "-m toolkit.data.ufs synth", "-m toolkit.data.traffic synth"):
        assert any(program in command for command in strict), f"no command line of {program} is checked"
    problems = {r["command"]: r["problem"] for r in results if r["file"] == str(broken)}
    assert len(problems) == 10 and all(problems.values()), problems
    assert "--epoch" in problems["python recipes/sasrec.py --epoch 5"]
    assert "no_such.yaml does not exist" in problems[
        "python -m toolkit launch --config_file accelerate_configs/no_such.yaml recipes/dcrnn.py"]
    assert "sudoku-10k" in problems["python recipes/hrm.py --preset sudoku-10k"]
    assert "mlflow" in problems["python -m toolkit sweep recipes/sasrec.py --grid seed=0 --out sweeps/x -- --log-with "
                                "mlflow"]
    assert "does not exist" in problems["python recipes/no_such_recipe.py"]


def generated_reference(tmp_path) -> dict[str, str]:
    result = run_cli("reference", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    return {str(path.relative_to(tmp_path)): path.read_text() for path in tmp_path.rglob("*.md")}


def test_the_reference_is_generated_from_the_code_and_names_every_flag_command_and_public_name(tmp_path):
    import toolkit
    from toolkit.tools.catalog import REPO_RECIPES, find_recipes

    pages = generated_reference(tmp_path)
    for entry in find_recipes(REPO_RECIPES):
        page = pages[f"reference/recipes/{entry.name}.md"]
        module = load_recipe(entry.name, f"_docs_{entry.name}")
        presets = module.PRESETS
        config = next(iter(presets.values()))[1]
        missing = [field.name for field in dataclasses.fields(config) if field.name != "preset"
                   and f"`--{field.name.replace('_', '-')}`" not in page]
        assert missing == [], f"{entry.name}: flags missing from its reference page: {missing}"
        assert all(f"`{name}`" in page for name in presets), entry.name
    commands = pages["reference/commands.md"]
    for command in ("ls", "doctor", "verify", "compare", "sweep", "launch"):
        assert f"### `python -m toolkit {command}`" in commands
    for command in ("aoti", "torchscript", "predict"):
        assert f"### `python -m toolkit.export {command}`" in commands
    assert "`--expect-world-size`" in commands and "`--runs-per-device`" in commands
    api = pages["reference/api.md"]
    assert [name for name, where in toolkit.PUBLIC.items() if f"::: {where}.{name}" not in api] == []


def test_a_flag_added_to_a_recipe_appears_in_its_reference_page(tmp_path):
    """The page is made from the config class at build time: a new field is in the next build's table."""
    source = (ROOT / "recipes" / "template.py").read_text()
    field = "    features: int = 8\n"
    assert field in source
    copy = tmp_path / "template.py"
    copy.write_text(source.replace(field, field + '    warmup_ratio: float = 0.05\n    """Share of the steps spent '
                                                   'warming up."""\n'))
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(CLI.parent)!r}]\n"
            f"import cli, pathlib; print(cli.recipe_page(pathlib.Path({str(copy)!r})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=recipe_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = next(line for line in result.stdout.splitlines() if line.startswith("| `--warmup-ratio`"))
    assert row == "| `--warmup-ratio` | FLOAT | `0.05` | Share of the steps spent warming up. |"


def test_readme_is_a_front_page_whose_links_lead_into_the_site():
    text = FRONT.read_text()
    assert len(text.splitlines()) <= 150
    assert "make test" in text and "make run" in text  # CI reads `make test` here
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
    for page in ("get-started", "hardware", "writing-a-recipe", "checkpoints", "troubleshooting", "deploy-ufs",
                 "performance", "experiments"):
        assert f"docs/{page}.md" in links


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [str(path.relative_to(ROOT / "docs")) for path in PAGES]
    assert [page for page in pages if page not in nav] == []


def test_make_test_builds_the_site_strictly_beside_lint_imports():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\ntest:"):]
    target = target[:target.index("\n\n")]
    assert "lint-imports" in target and "mkdocs build --strict" in target
    assert "--quiet" not in target  # mkdocs --quiet hides the warnings --strict counts: a broken link would pass
    assert re.search(r"^docs:", makefile, re.M)


@pytest.mark.parametrize("page", ["deploy-ufs.md"])
def test_the_deployment_page_keeps_a_section_per_consumer(page):
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / page).read_text(), re.M)
    assert {"SOCA (IceNet)", "aibalance", "Our C++ consumer", "AOTInductor"} <= set(headings)


def test_the_docs_tell_what_the_software_does_not_how_it_was_made():
    """The pages, README, CHANGELOG and benchmarks/README speak of the software and its measurements, not of how the
    work that made it was organised (tracker numbers, how machines were obtained)."""
    texts = [*PAGES, FRONT, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md"]
    pattern = re.compile(r"issue[ -]?\d|\bitems? \d|\blease|\blent\b|\bborrow|\bsession\b|device time", re.I)
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in texts
             for match in pattern.finditer(path.read_text())]
    assert found == []
