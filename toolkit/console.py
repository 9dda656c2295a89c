"""One-line output on stderr: whole lines, never interleaved between ranks, never glued to a progress bar.

A leaf module: it imports nothing from the toolkit, so anything may use it (errors, shutdown, the loop)."""

from __future__ import annotations

import os
import sys


def write_line(line: str) -> None:
    """line and its newline to stderr in ONE write call, so lines of several ranks sharing a pipe never interleave
    mid-line (print() writes the text and the newline separately when PYTHONUNBUFFERED is set)."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured in-process)
        print(line, file=sys.stderr, flush=True)


def say(line: str) -> None:
    """write_line, after closing any live tqdm bar (on stderr, with no newline at its end), so the line starts on a
    line of its own."""
    try:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    except ImportError:
        pass
    write_line(line)
