"""The optional parts of the install, each an extra of the package: a missing one is one line naming the pip command.

    pip install accelerate-recipes            # the core: torch, accelerate, tyro, wandb, datasets (SASRec, HRM)
    pip install 'accelerate-recipes[ufs]'     # + xarray, netCDF4: the UFS emulator's netCDF files
    pip install 'accelerate-recipes[traffic]' # + tables: DCRNN's pandas HDF5 speed tables
    pip install 'accelerate-recipes[plots]'   # + matplotlib: curves.png, compare's picture, the UFS scatter plots
    pip install 'accelerate-recipes[search]'  # + optuna: `python -m toolkit sweep --search`
    pip install 'accelerate-recipes[all]'     # everything (what `make` installs)
"""

from __future__ import annotations

import importlib
from types import ModuleType

from toolkit.errors import UsageError

PACKAGE = "accelerate-recipes"
EXTRAS = {  # extra: (the modules it brings, what needs them)
    "ufs": (("xarray", "netCDF4"), "reading and writing netCDF files (the UFS emulator)"),
    "traffic": (("tables",), "reading pandas HDF5 speed tables (DCRNN)"),
    "plots": (("matplotlib",), "drawing plots"),
    "search": (("optuna",), "searching flag values (toolkit sweep --search)"),
}


class MissingExtra(UsageError):
    """An optional dependency is not installed: one line naming the extra to install."""


def missing_line(extra: str, module: str) -> str:
    what = EXTRAS[extra][1]
    return f"{what} needs {module}, which is not installed: pip install '{PACKAGE}[{extra}]'"


def require(extra: str) -> None:
    """Every module of `extra` importable, else MissingExtra (one line)."""
    for module in EXTRAS[extra][0]:
        load(extra, module)


def load(extra: str, module: str) -> ModuleType:
    """import module (one of the extra's), or MissingExtra (one line)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(missing_line(extra, module.split(".")[0])) from None


def xarray():
    """xarray with its netCDF engine (netCDF4), or MissingExtra naming [ufs]."""
    require("ufs")
    return importlib.import_module("xarray")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or MissingExtra."""
    matplotlib = load("plots", "matplotlib")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
