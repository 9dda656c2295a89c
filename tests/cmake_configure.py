"""Why cmake could not configure export/cpp: this machine (skip the C++ consumer's tests) or our own CMakeLists.txt
(fail them).

A CUDA build of torch on a machine without the CUDA toolkit cannot be configured against: the wheel's LibTorch CMake
config (share/cmake/Caffe2, share/cmake/Torch) looks for CUDA and stops, e.g. `Could NOT find CUDA (missing:
CUDA_TOOLKIT_ROOT_DIR ...)` or `Your installed Caffe2 version uses CUDA but I cannot find the CUDA libraries`. cmake
names the file where the error was raised (`CMake Error at FILE:LINE (message):`), then its message, indented: an
error raised in a file outside our sources (torch's CMake config, cmake's own Find modules) says what this machine
lacks; one raised in our CMakeLists.txt, or a build (compile, link) that fails, is ours and fails the test."""

from __future__ import annotations

import re
from pathlib import Path

_ERROR_AT = re.compile(r"^CMake Error at (.+?):(\d+) \(([^)]*)\):\s*$")


def environment_problem(output: str, sources: Path) -> str | None:
    """The reason to skip with when cmake's configure `output` (stdout + stderr) failed in a file outside `sources`
    (our export/cpp): cmake's message, joined to one line, with what its Find modules said they could not find; None
    when an error is in our own files, or when there is no `CMake Error at` to judge by."""
    lines = output.splitlines()
    reason = None
    for i, line in enumerate(lines):
        found = _ERROR_AT.match(line.strip())
        if found is None:
            continue
        where = Path(found[1])
        if not where.is_absolute() or _inside(where, sources):  # cmake names our files relative to the source dir
            return None
        if reason is None:
            message = []
            for text in lines[i + 1 :]:  # the message: the indented lines up to a blank one or the call stack
                if not text.startswith("  ") or not text.strip():
                    break
                message.append(text.strip())
            missing = [text.removeprefix("-- ").strip() for text in lines if text.startswith("-- Could NOT find")]
            said = " ".join(" ".join(message).split())  # cmake wraps its message at 80 columns
            reason = said + "".join(f"; {text}" for text in missing) + f" ({where.name}:{found[2]})"
    return reason


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(Path(directory).resolve())
    except ValueError:
        return False
    return True
