"""mkdocs hook: the pages written from the code, and the figures that live beside the benchmarks.

At every build, `docs/gen/cli.py reference` runs in a process of its own (importing a recipe sets up its process:
signal handlers, OpenMP's policy) and its pages (reference/: every recipe's flags, every command, the Python API)
join the site as generated files: nothing is written into docs/. The pictures under benchmarks/figures/ are served
at the same path, so a page links `../benchmarks/figures/NAME.png` without a copy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "benchmarks" / "figures"


def on_files(files: Files, config) -> Files:
    generated = subprocess.run([sys.executable, str(ROOT / "docs" / "gen" / "cli.py"), "reference", "--json"],
                               cwd=ROOT, capture_output=True, text=True)
    if generated.returncode != 0:
        raise SystemExit(f"docs/gen/cli.py reference failed:\n{generated.stderr}")
    for path, text in json.loads(generated.stdout).items():
        files.append(File.generated(config, path, content=text))
    for picture in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/figures/{picture.name}", abs_src_path=str(picture)))
    return files
