"""The documentation's command-line pages, generated from the parsers themselves, and the check of the docs' commands.

    python docs/gen/cli.py reference --out DIR     # write the reference pages (Markdown) into DIR
    python docs/gen/cli.py reference --json        # the same pages as JSON {path: text} (the mkdocs hook reads it)
    python docs/gen/cli.py check FILE.md ...       # every command shown in the files, through its own parser

Nothing here is written by hand about a flag: a recipe's flags come from its config dataclass through tyro's parser
(the one `--help` prints), with each preset's values read from the preset's config instance; `python -m toolkit ...`
and the other `python -m toolkit.*` tools from the argparse parser their `main()` builds. The check passes a
command's arguments to that same parser and runs nothing: a recipe's `main()` is called with `parse_config` standing
in for itself, which parses the flags as the recipe would (tyro, the shared range checks, --batch-per-process,
--scale-lr) and stops before the recipe's own checks (those look at files) and before anything is made.

Importing a recipe runs its `begin_process()`, so both commands are meant to run in a process of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE_DIRS = ("recipes", "examples")
# The `python -m` tools whose parsers the docs show: module -> the argv that reaches its parser
TOOLS = {
    "toolkit": ["ls"],
    "toolkit.export": ["aoti", "RUN_DIR", "--out", "x.pt2"],
    "toolkit.data.ufs": ["synth", "--out", "x.nc"],
    "toolkit.data.traffic": ["synth", "--out", "x"],
    "toolkit.data.sudoku": ["build", "--out", "x"],
}
LAUNCHERS = {"accelerate": "accelerate launch", "torchrun": "torchrun", "sbatch": "sbatch", "srun": "srun"}


class _Caught(BaseException):
    """Raised in place of the real work once a parser or a recipe's presets are in hand (a BaseException, so that a
    main()'s one-line-errors wrapper lets it through)."""

    def __init__(self, value):
        super().__init__()
        self.value = value


# ---- finding the parsers --------------------------------------------------------------------------------------------


def recipe_paths() -> list[Path]:
    """Every recipe of recipes/ (the files with a main(), as `python -m toolkit ls` finds them)."""
    from toolkit.tools.catalog import find_recipes

    return [entry.path for entry in find_recipes(ROOT / "recipes")]


_modules: dict[Path, object] = {}


def load_recipe(path: Path):
    path = path.resolve()
    if path not in _modules:
        name = f"docs_recipe_{path.parent.name}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _modules[path] = module
    return _modules[path]


def recipe_presets(path: Path) -> tuple[dict, str | None]:
    """({preset name: (description, config)}, description) as the recipe's main() gives them to parse_config; a
    recipe without presets gives its config class, returned as one preset named "default"."""
    module = load_recipe(path)

    def catch(presets, args=None, description=None, check=None):
        raise _Caught((presets, description))

    real, module.parse_config = module.parse_config, catch
    try:
        module.main([])
    except _Caught as caught:
        presets, description = caught.value
    finally:
        module.parse_config = real
    if isinstance(presets, type):
        presets = {"default": ("", presets())}
    return dict(presets), description


def parse_recipe(path: Path, args: list[str]):
    """The recipe's config for `args`, parsed as its main() parses them (its own checks of files aside)."""
    from toolkit.run.config import parse_config

    module = load_recipe(path)

    def parse_only(presets, argv=None, description=None, check=None):
        raise _Caught(parse_config(presets, argv, description=description))

    real, module.parse_config = module.parse_config, parse_only
    try:
        module.main(list(args))
    except _Caught as caught:
        return caught.value
    finally:
        module.parse_config = real
    raise AssertionError(f"{path}: main() returned without parsing its flags")


_parsers: dict[str, argparse.ArgumentParser] = {}


def tool_parser(module_name: str) -> argparse.ArgumentParser:
    """The argparse parser that `python -m MODULE`'s main() builds, caught as main() asks it to parse."""
    if module_name not in _parsers:
        _parsers[module_name] = _build_tool_parser(module_name)
    return _parsers[module_name]


def _build_tool_parser(module_name: str) -> argparse.ArgumentParser:
    if module_name == "toolkit":
        from toolkit.__main__ import build_parser

        return build_parser()
    module = importlib.import_module(module_name)
    real = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        raise _Caught(self)

    argparse.ArgumentParser.parse_args = catch
    try:
        module.main(TOOLS[module_name])
    except _Caught as caught:
        return caught.value
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"python -m {module_name}: main() returned without parsing its arguments")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# ---- the reference pages --------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped, and outside code spans no HTML tag or emphasis."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def _code(value) -> str:
    if isinstance(value, Path):
        value = str(value)
    text = repr(value) if isinstance(value, str) and value == "" else str(value)
    if isinstance(value, (list, tuple)):
        text = " ".join(str(v) for v in value) or "(none)"
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _tyro_help(text: str | None) -> str:
    text = (text or "").replace("%%", "%")
    text = re.sub(r"\s*\((default|fixed to|required)[^()]*(\([^()]*\)[^()]*)*\)\s*$", "", text.strip())
    return _cell(text)


def recipe_page(path: Path) -> str:
    """One recipe's page: its presets, then every flag (its own first, then the shared ones) with each preset's
    value. From the config class through tyro's parser: the flag, its type as --help writes it, its help."""
    import tyro

    from toolkit.run.config import TrainConfig

    presets, description = recipe_presets(path)
    configs = {name: config for name, (_, config) in presets.items()}
    first = next(iter(configs.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_parser is deprecated in tyro 1.x: it is the parser --help prints
        parser = tyro.extras.get_parser(type(first))
    actions = {action.dest.replace("-", "_"): action for action in parser._actions if action.option_strings}
    shared = {field.name for field in dataclasses.fields(TrainConfig)}
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path("recipes") / path.name
    names = list(configs)
    lines = [f"# `{rel}`", ""]
    summary = (description or "").split("\n\n")[0]
    if summary:
        lines += [" ".join(summary.split()), ""]
    lines += [f"Generated from `{rel}`'s config class `{type(first).__name__}` and its presets when the site is built "
              f"(the same text as `python {rel} --help`).", ""]
    if len(names) > 1 or names != ["default"]:
        lines += ["## Presets", "", "| preset | what it is |", "| --- | --- |"]
        lines += [f"| `{name}`{' (default)' if i == 0 else ''} | {_cell(presets[name][0])} |"
                  for i, name in enumerate(names)]
        lines += ["", f"`--preset NAME` picks one (`python {rel} --preset {names[-1]} --help` shows its values); any "
                  "other flag overrides the preset's value.", ""]
    own = [f for f in dataclasses.fields(first) if f.name not in shared and f.name in actions]
    common = [f for f in dataclasses.fields(first) if f.name in shared and f.name in actions]
    for title, fields in ((f"Flags of `{rel.stem}`", own), ("Shared flags, with this recipe's defaults", common)):
        if not fields:
            continue
        head = "default" if len(names) == 1 else f"default (`{names[0]}`)"
        lines += [f"## {title}", "", f"| flag | type | {head} | help |", "| --- | --- | --- | --- |"]
        for field in fields:
            action = actions[field.name]
            flag = " / ".join(f"`{option}`" for option in action.option_strings)
            kind = "flag" if action.metavar is None and action.nargs == 0 else _cell(action.metavar or "")
            values = [getattr(config, field.name) for config in configs.values()]
            default = _code(values[0])
            others = [f"{name}: {_code(value)}" for name, value in zip(names[1:], values[1:], strict=True)
                      if value != values[0]]
            if others:
                default += "; " + "; ".join(others)
            lines.append(f"| {flag} | {kind} | {default} | {_tyro_help(action.help)} |")
        lines.append("")
    return "\n".join(lines)


def _argparse_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = " / ".join(f"`{option}`" for option in action.option_strings)
        else:
            name = f"`{action.metavar or action.dest}` (positional)"
        if action.nargs == 0:
            kind = "flag"
        elif action.choices:
            kind = "{" + ",".join(str(c) for c in action.choices) + "}"
        else:
            kind = action.metavar or (getattr(action.type, "__name__", None) or "str").upper()
            if action.nargs in ("+", "*"):
                kind += " ..."
            elif action.nargs == argparse.REMAINDER:
                kind = "..."
        if action.required and action.nargs not in ("?", "*"):
            default = "required"
        elif action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            default = ""
        else:
            default = _code(action.default)
        rows.append(f"| {name} | {_cell(kind)} | {default} | {_cell((action.help or '').replace('%%', '%'))} |")
    return rows


def tools_page() -> str:
    lines = ["# Commands", "",
             "Every `python -m toolkit ...` command and the other command-line tools, generated from the argparse "
             "parsers their `main()` builds when the site is built (the same text as `--help`).", ""]
    for module_name in TOOLS:
        parser = tool_parser(module_name)
        lines += [f"## `python -m {module_name}`", ""]
        description = " ".join((parser.description or "").split("\n\n")[0].split())
        if description:
            lines += [description, ""]
        for name, sub in subcommands(parser).items():
            lines += [f"### `python -m {module_name} {name}`", ""]
            text = " ".join((sub.description or "").split("\n\n")[0].split())
            if text:
                lines += [text, ""]
            if module_name == "toolkit" and name == "launch":
                lines += ["Takes exactly `accelerate launch`'s arguments (`accelerate launch --help`), then the "
                          "script and its flags: it adds a rendezvous timeout (120 s, or `$TOOLKIT_RDZV_TIMEOUT`) and "
                          "turns launch failures into one line.", ""]
                continue
            usage = " ".join(sub.format_usage().split())
            lines += ["```text", usage.removeprefix("usage: "), "```", ""]
            lines += ["| argument | type | default | help |", "| --- | --- | --- | --- |", *_argparse_rows(sub), ""]
    return "\n".join(lines)


def api_page() -> str:
    """The public API a recipe imports (toolkit/__init__.py's PUBLIC), each name from its docstring by
    mkdocstrings."""
    import toolkit

    lines = ["# Python API", "",
             "What a recipe imports: `from toolkit import start_run, TrainingLoop, ...`. Every name of "
             "`toolkit/__init__.py`'s `PUBLIC`, from its module, with its docstring (generated when the site is "
             "built).", ""]
    by_module: dict[str, list[str]] = {}
    for name, module in toolkit.PUBLIC.items():
        by_module.setdefault(module, []).append(name)
    for module, names in by_module.items():
        lines += [f"## `{module}`", ""]
        for name in names:
            lines += [f"::: {module}.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


def reference_pages() -> dict[str, str]:
    pages = {f"reference/recipes/{path.stem}.md": recipe_page(path) for path in recipe_paths()}
    pages["reference/commands.md"] = tools_page()
    pages["reference/api.md"] = api_page()
    listing = ["# Reference", "",
               "Generated when the site is built, from the code: a renamed or added flag shows here with the next "
               "build.", "", "- [Commands](commands.md): `python -m toolkit ...`, `python -m toolkit.export ...` "
               "and the data tools", "- [Python API](api.md): what a recipe imports from `toolkit`"]
    listing += [f"- [`recipes/{path.stem}.py`](recipes/{path.stem}.md): its presets and every flag"
                for path in recipe_paths()]
    pages["reference/index.md"] = "\n".join(listing) + "\n"
    return pages


# ---- the docs' commands through their parsers -----------------------------------------------------------------------

COMMAND_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(python3?|accelerate|torchrun|sbatch|srun)\s")


def _logical_lines(block: str) -> list[str]:
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if line.startswith("$ "):
            line = line[2:]
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    if current:
        lines.append(current)
    return lines


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(=.*)?$|\.\.\.|[<>\[\]|]")


def extract_commands(text: str) -> list[tuple[str, bool]]:
    """The command lines a Markdown text shows, each with whether it is checked strictly: every line of a fenced code
    block (not text, python, yaml, ...) that starts with python, accelerate, torchrun, sbatch or srun (environment
    assignments before it allowed), joined across backslash continuations; and inline code spans that start so. An
    inline span is prose naming a command (`python -m toolkit verify`), so it is checked only when it gives a flag
    and no placeholder (RUN_DIR, N, <run>, ..., [--flag])."""
    found = []
    fences = re.compile(r"^( *)(```|~~~)([^\n]*)\n(.*?)^\1\2[ \t]*$", re.M | re.S)
    for match in fences.finditer(text):
        if match.group(3).strip() not in ("", "bash", "sh", "shell", "console"):
            continue
        found += [(line.strip(), True) for line in _logical_lines(match.group(4)) if COMMAND_START.match(line.strip())]
    prose = fences.sub("", text)
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose):
        span = span.strip()
        if not COMMAND_START.match(span + " "):
            continue
        tokens = span.split()
        if any(token.startswith("--") for token in tokens) and not any(PLACEHOLDER.search(t) for t in tokens):
            found.append((span, False))
    return found


def copies(text: str) -> dict[str, str]:
    """`cp recipes/template.py recipes/gru.py` in a code block: the new recipe's commands are checked against the
    file it was copied from."""
    return {dst: src for src, dst in re.findall(r"^\s*cp\s+(\S+\.py)\s+(\S+\.py)\b", text, re.M)}


def _tokens(command: str) -> list[str]:
    tokens = shlex.split(command, comments=True)
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        tokens.pop(0)
    return tokens


def _script_index(tokens: list[str]) -> int | None:
    for i, token in enumerate(tokens):
        if token.endswith(".py") and token.split("/")[0] in RECIPE_DIRS:
            return i
    return None


def check_command(command: str, aliases: dict[str, str] | None = None) -> str | None:
    """None when every argument of the command passes its own parser; else why not. aliases: {a recipe the docs
    make by copying: the file copied}."""
    tokens = _tokens(command)
    if not tokens:
        return None
    if tokens[0].startswith("python") and tokens[1:2] == ["-m"] and tokens[2] in TOOLS and tokens[3:4] != ["launch"]:
        return _check_tool(tokens[2], tokens[3:], aliases)
    i = _script_index(tokens)
    if i is not None:
        script = ROOT / (aliases or {}).get(tokens[i], tokens[i])
        if not script.is_file():
            return f"{tokens[i]} does not exist"
        if tokens[:1] == ["accelerate"] or tokens[1:4] == ["-m", "toolkit", "launch"]:
            launch_args = tokens[2:i] if tokens[0] == "accelerate" else tokens[4:i]
            problem = _check_accelerate(launch_args, tokens[i])
            if problem:
                return problem
        return _check_recipe(script, tokens[i + 1:])
    if "-m" in tokens[:-1] and tokens[tokens.index("-m") + 1] in TOOLS:  # a launcher running a tool (doctor)
        at = tokens.index("-m")
        return _check_tool(tokens[at + 1], tokens[at + 2:], aliases)
    return None  # another program (a benchmark, cmake, ...): not checked here


def _parses(parse) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            return " ".join(err.getvalue().split()) or f"exit {exit_.code}"
    except Exception as error:  # a UsageError from the shared checks
        return f"{type(error).__name__}: {error}"
    return None


_checked: dict[tuple, str | None] = {}


def _check_recipe(script: Path, args: list[str]) -> str | None:
    key = (script, tuple(args))
    if key not in _checked:  # the docs show some lines more than once
        _checked[key] = _parses(lambda: parse_recipe(script, args))
    return _checked[key]


def _check_accelerate(launch_args: list[str], script: str) -> str | None:
    from accelerate.commands.launch import launch_command_parser

    for j, arg in enumerate(launch_args):
        if arg in ("--config_file", "--config-file") and j + 1 < len(launch_args):
            if not (ROOT / launch_args[j + 1]).is_file():
                return f"{arg} {launch_args[j + 1]} does not exist"
    return _parses(lambda: launch_command_parser().parse_args([*launch_args, script]))


def _check_tool(module_name: str, args: list[str], aliases: dict[str, str] | None = None) -> str | None:
    if module_name == "toolkit" and args[:1] == ["launch"]:
        return None  # launch without a recipe script: nothing of ours to parse
    common: list[str] = []
    if module_name == "toolkit" and args[:1] == ["sweep"]:
        from toolkit.tools.sweep import split_common

        args, common = split_common(args)
    parser = tool_parser(module_name)
    problem = _parses(lambda: parser.parse_args(args))
    if problem or args[:1] != ["sweep"] or module_name != "toolkit":
        return problem
    # a sweep: the flags for every run, and each value of the grid or bound of the search, through the recipe's
    # parser
    from toolkit.tools.sweep import parse_grid

    parsed = parser.parse_args(args)
    recipe = ROOT / (aliases or {}).get(str(parsed.recipe), parsed.recipe)
    if not recipe.is_file():
        return f"{parsed.recipe} does not exist"
    if parsed.search is not None:  # a search: each bound of a range and each value of a one-of spec
        from toolkit.tools.search import bound_flags, parse_specs

        runs = [list(common)] + [[*common, *flags] for flags in bound_flags(parse_specs(parsed.search))]
    else:
        grid = parse_grid(parsed.grid)
        runs = [list(common)] + [[*common, f"--{key.replace('_', '-')}", value]
                                 for key, values in grid.items() for value in values]
    for argv in runs:
        problem = _check_recipe(recipe, argv)
        if problem:
            return problem
    return None


def check_files(paths: list[Path]) -> list[dict]:
    results = []
    for path in paths:
        text = path.read_text()
        aliases = copies(text)
        for command, strict in extract_commands(text):
            results.append({"file": str(path), "command": command, "strict": strict,
                            "problem": check_command(command, aliases)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/gen/cli.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    reference = commands.add_parser("reference", help="write the reference pages")
    reference.add_argument("--out", type=Path, help="directory to write the pages into")
    reference.add_argument("--json", action="store_true", help="print the pages as JSON {path: text}")
    check = commands.add_parser("check", help="pass every command the files show to its own parser")
    check.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    if args.command == "reference":
        with contextlib.redirect_stdout(sys.stderr):  # only the pages on stdout
            pages = reference_pages()
        if args.json:
            sys.stdout.write(json.dumps(pages))
        if args.out:
            for name, text in pages.items():
                (args.out / name).parent.mkdir(parents=True, exist_ok=True)
                (args.out / name).write_text(text)
        return 0
    with contextlib.redirect_stdout(sys.stderr):
        results = check_files(args.files)
    sys.stdout.write(json.dumps(results))
    return 1 if any(result["problem"] for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
