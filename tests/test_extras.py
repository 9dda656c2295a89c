"""The core installs alone; each family's readers are an extra, and a missing one is one line naming the pip command.

Missing packages are made missing for real in the child process (a sitecustomize that blocks their import, as an
install without the extra would fail to import them), and the recipes and tools are run as users run them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, TOY, recipe_env, run_recipe

BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # import raises ImportError\n"


def without(tmp_path, *names: str) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK.format(names=list(names)))
    return {"PYTHONPATH": f"{site}:{ROOT}"}


def test_the_extras_hold_the_family_readers_and_the_core_does_not():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for package in ("xarray", "netCDF4", "tables", "matplotlib", "optuna"):
        assert package not in core
    extras = project["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["ufs"]] == ["xarray", "netCDF4"]
    assert [d.split(">")[0] for d in extras["traffic"]] == ["tables"]
    assert [d.split(">")[0] for d in extras["plots"]] == ["matplotlib"]
    assert [d.split(">")[0] for d in extras["search"]] == ["optuna"]
    assert extras["all"] == ["accelerate-recipes[ufs,traffic,plots,search]"]
    assert "'.[all,dev]'" in (ROOT / "Makefile").read_text()


def test_a_ufs_run_without_its_extra_is_one_line_naming_the_pip_command(tmp_path):
    result = run_recipe(["--data", str(tmp_path / "grid.nc"), "--output-dir", str(tmp_path / "run")],
                        recipe="ufs_emulator", env=without(tmp_path, "netCDF4"), check=False, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert errors == ["error: reading and writing netCDF files (the UFS emulator) needs netCDF4, which is not "
                      "installed: pip install 'accelerate-recipes[ufs]'"]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # before anything was made


def test_traffic_tables_without_their_extra_is_one_line(tmp_path):
    code = ("from pathlib import Path\nfrom toolkit.errors import UsageError\nfrom toolkit.data.traffic import "
            "read_speeds\ntry:\n    read_speeds(Path('x.h5'))\nexcept UsageError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=recipe_env(without(tmp_path, "tables")),
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == ("reading pandas HDF5 speed tables (DCRNN) needs tables, which is not installed: "
                                   "pip install 'accelerate-recipes[traffic]'"), done.stderr


def test_a_run_without_matplotlib_trains_and_says_the_plot_was_not_drawn(tmp_path):
    out = tmp_path / "run"
    result = run_recipe(["--max-steps", "2", "--output-dir", str(out)], recipe=TOY,
                        env=without(tmp_path, "matplotlib"))
    lines = [line for line in result.stdout.splitlines() if "curves.png not drawn" in line]
    assert lines == ["curves.png not drawn: drawing plots needs matplotlib, which is not installed: pip install "
                     "'accelerate-recipes[plots]'"]
    assert (out / "summary.json").is_file() and not (out / "curves.png").exists()


def test_a_ufs_run_without_matplotlib_trains_and_writes_no_scatter(tmp_path):
    from toolkit.data.ufs import synthesize

    data = synthesize(tmp_path / "grid.nc", seed=7, nlat=24, nlon=48)
    out = tmp_path / "run"
    result = run_recipe(["--data", str(data), "--batch-size", "40", "--max-steps", "3", "--log-with", "none",
                         "--output-dir", str(out)], recipe="ufs_emulator", env=without(tmp_path, "matplotlib"))
    said = [line for line in result.stdout.splitlines() if "not drawn" in line or "not written" in line]
    tail = "drawing plots needs matplotlib, which is not installed: pip install 'accelerate-recipes[plots]'"
    assert said == [f"val_scatter.png not written: {tail}", f"curves.png not drawn: {tail}"], result.stdout
    assert (out / "summary.json").is_file() and not list(out.glob("*.png"))
