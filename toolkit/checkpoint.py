"""Atomic checkpoints: `checkpoints/step_<N>/` = Accelerate `save_state` output + progress.json + COMPLETE.

Every rank writes its part (random states) into a temporary sibling directory; after a barrier the main process
writes progress.json, renames the directory to step_<N> and writes the COMPLETE marker last. A directory without
the marker is an interrupted save: `auto` ignores it, an explicit --resume-from rejects it, pruning never deletes it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from accelerate import Accelerator

from toolkit.errors import UsageError

MARKER = "COMPLETE"
PROGRESS_FILE = "progress.json"
_PREFIX = "step_"


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int | None:
    name = Path(path).name
    if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
        return int(name[len(_PREFIX) :])
    return None


def is_complete(path: Path) -> bool:
    path = Path(path)
    return step_of(path) is not None and (path / MARKER).is_file() and (path / PROGRESS_FILE).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def newest_complete(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_checkpoint_path(path: Path) -> Path:
    """An explicit --resume-from PATH: a complete step_N dir, or a run dir (its newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"--resume-from {path} does not exist; give a checkpoints/step_N directory, a run directory or 'auto'"
        )
    if step_of(path) is not None:
        if not is_complete(path):
            raise UsageError(
                f"--resume-from {path} is an incomplete checkpoint (no {MARKER} marker: its save was interrupted); "
                "resume from an earlier step_N or use --resume-from auto"
            )
        return path
    newest = newest_complete(path)
    if newest is None:
        raise UsageError(
            f"--resume-from {path} is not a checkpoint: expected a checkpoints/step_N directory with a {MARKER} "
            "marker, or a run directory that holds one"
        )
    return newest


def read_progress(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / PROGRESS_FILE).read_text())


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, progress: dict) -> Path:
    """Save model/optimizer/scheduler/scaler/RNG states and the loop's progress; collective (every rank calls)."""
    root = checkpoints_root(run_dir)
    final = root / f"{_PREFIX}{step}"
    staging = root / f".{_PREFIX}{step}.saving"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # our own leftover from a save of this same step that died: not user data
            shutil.rmtree(staging)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(staging / PROGRESS_FILE, progress)
        if final.exists():  # e.g. resumed from an older checkpoint into the same run: keep the old one aside
            final.rename(root / f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        staging.rename(final)
        _fsync_dir(root)
        (final / MARKER).write_text(f"step {step}\n")
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(accelerator: Accelerator, run_dir: Path, keep: int, protect: set[int]) -> None:
    """Delete complete checkpoints beyond the newest `keep`, except protected steps (the best one)."""
    if not accelerator.is_main_process:
        return
    complete = complete_checkpoints(run_dir)
    for path in complete[: max(0, len(complete) - keep)]:
        if step_of(path) not in protect:
            # Remove the marker first: a crash halfway leaves an incomplete dir, never a "complete" broken one.
            (path / MARKER).unlink()
            shutil.rmtree(path)


def load_checkpoint(accelerator: Accelerator, checkpoint: Path) -> dict:
    """Restore everything `save_checkpoint` saved; returns the progress dict."""
    accelerator.load_state(str(checkpoint))
    return read_progress(checkpoint)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.rename(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
