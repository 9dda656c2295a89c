"""The oldest torch each feature runs on, and the one-line refusal below it.

pyproject.toml claims `torch>=2.4`: training, resume, multi-process runs, `--compile` and the TorchScript export run
on torch 2.4 through the newest release (measured by .ci/smoke on the oldest and newest torch). Some features need a
newer torch; each names its floor here and refuses below it with one line, before any expensive work and before any
file is made:

- `python -m toolkit.export aoti` and the packages it writes (`predict --model FILE.pt2`, export/cpp's
  AOTIModelPackageLoader): torch 2.6 (measured: it exports; torch._inductor.aoti_compile_and_package takes the
  exported program alone), where torch 2.4 has no aoti_compile_and_package at all and fails inside torch.export.
"""

from __future__ import annotations

import re

import torch

from toolkit.errors import UsageError

AOTI = (2, 6)  # torch._inductor.aoti_compile_and_package(program, package_path=...) / aoti_load_package


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version`, default the installed torch's (read at each call, e.g. "2.13.0+cpu" -> (2, 13))."""
    text = str(torch.__version__ if version is None else version)
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found[1]), int(found[2])


def require_torch(floor: tuple[int, int], feature: str, instead: str) -> None:
    """UsageError (one line: `FEATURE needs torch >= X (this is Y); INSTEAD`) when the installed torch is older than
    `floor`; nothing otherwise."""
    if torch_release() < floor:
        raise UsageError(f"{feature} needs torch >= {floor[0]}.{floor[1]} (this is {torch.__version__}); {instead}")
