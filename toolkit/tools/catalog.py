"""`python -m toolkit ls [DIR]`: the recipes and their presets, each with its one-line description (as torchtune's
`tune ls`). Read from the recipe files' source (module docstring, PRESETS), so listing imports no model code."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import UsageError

REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class RecipeEntry:
    name: str
    path: Path
    summary: str
    presets: list[tuple[str, str]] = field(default_factory=list)  # (name, description); the first is the default


def _constant_text(node: ast.AST) -> str | None:
    """A string literal, also one written as adjacent literals or joined with +."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _constant_text(node.left), _constant_text(node.right)
        return None if left is None or right is None else left + right
    return None


def read_recipe(path: Path) -> RecipeEntry | None:
    """The recipe in `path`, or None when the file is not one (no `main` and no `PRESETS`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
             if isinstance(target, ast.Name)}
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    if "main" not in functions:
        return None
    doc = ast.get_docstring(tree) or ""
    entry = RecipeEntry(path.stem, path, " ".join(doc.split("\n\n")[0].split()))
    if "PRESETS" in names:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PRESETS"
                                                     for t in node.targets) and isinstance(node.value, ast.Dict)):
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    name = _constant_text(key) if key is not None else None
                    text = _constant_text(value.elts[0]) if isinstance(value, ast.Tuple) and value.elts else None
                    if name is not None:
                        entry.presets.append((name, " ".join((text or "").split())))
    return entry


def find_recipes(directory: Path) -> list[RecipeEntry]:
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory of recipes; give the folder that holds recipe .py files")
    found = [read_recipe(p) for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")]
    return [entry for entry in found if entry is not None]


def format_catalog(entries: list[RecipeEntry], width: int = 100) -> str:
    lines = []
    for entry in entries:
        lines.append(f"{entry.name:<14} {entry.summary}")
        for i, (preset, text) in enumerate(entry.presets):
            default = " (default)" if i == 0 else ""
            lines.append(f"  --preset {preset}{default}: {text}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", nargs="?", type=Path, default=None,
                        help="the folder of recipes (default: ./recipes, else the toolkit's own recipes/)")


def main(args: argparse.Namespace) -> int:
    directory = args.directory or (Path("recipes") if Path("recipes").is_dir() else REPO_RECIPES)
    entries = find_recipes(directory)
    if not entries:
        raise UsageError(f"{directory} holds no recipe (a .py file with a main() function)")
    print(format_catalog(entries))
    print(f"\nrun one: python {directory}/NAME.py [--preset NAME] [flags]   (--help lists its flags)")
    return 0
