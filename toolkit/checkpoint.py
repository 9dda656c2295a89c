"""Atomic checkpoints: `checkpoints/step_<N>/` = Accelerate `save_state` output + progress.json + COMPLETE.

Every rank writes its part (random states, per-rank state) into a temporary sibling directory; after a barrier the
main process writes progress.json and MANIFEST.json (sha256 of every file), renames the directory to step_<N> and
writes the COMPLETE marker last. Pruning renames a checkpoint to `.step_<N>.pruning` before deleting it. What a kill
leaves behind (a `.saving` or `.pruning` directory, a step_<N> without its marker) is a leftover: `auto` names each
one newer than the checkpoint it resumes from, an explicit --resume-from rejects it, verify names it, and the run's
next life removes it once it holds the directory's lock, as does every save (one line each). A complete checkpoint
whose files do not match the manifest (a file changed, missing, or not listed in it) is damaged: `auto` skips it
with one line naming the file, an explicit --resume-from refuses it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from toolkit.errors import RunFailed, UsageError
from toolkit.rundir import RunDir

MARKER = "COMPLETE"
PROGRESS_FILE = "progress.json"
MANIFEST = "MANIFEST.json"  # {"files": {name: {"bytes", "sha256"}}}, written before the marker
SHARED_STATE = "extra_state.pt"  # the recipe's state beyond Accelerate's (e.g. a data scaler), main process
RANK_STATE = "rank_state_{rank}.pt"  # per-rank state (e.g. HRM's carry), one file per rank
_PREFIX = "step_"


def checkpoints_root(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


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
    """An explicit --resume-from PATH: a complete, intact step_N dir, or a run dir (its newest intact checkpoint)."""
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
        damage = damage_of(path)
        if damage:
            raise UsageError(f"--resume-from {path} is damaged: {damage}; resume from an earlier step_N or use "
                             "--resume-from auto (it skips damaged checkpoints)")
        return path
    if newest_complete(path) is None:
        raise UsageError(
            f"--resume-from {path} is not a checkpoint: expected a checkpoints/step_N directory with a {MARKER} "
            "marker, or a run directory that holds one"
        )
    newest = newest_intact(path)
    if newest is None:
        raise UsageError(f"--resume-from {path}: every checkpoint in it is damaged (see the lines above)")
    return newest


def newest_intact(run_dir: Path, say=print) -> Path | None:
    """The newest complete checkpoint whose files match its manifest; every newer step_N it skips, damaged or
    incomplete, is named in one line (`say`)."""
    root = checkpoints_root(run_dir)
    steps = sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of) \
        if root.is_dir() else []
    skipped = []
    for path in reversed(steps):
        why = INCOMPLETE if not is_complete(path) else damage_of(path)
        if why is None:
            for bad, reason in skipped:
                say(f"warning: checkpoint {bad} is skipped: {reason}; resuming from {path.name} instead")
            return path
        skipped.append((path, why))
    for bad, reason in skipped:
        say(f"warning: checkpoint {bad} is skipped: {reason}; no intact checkpoint is older")
    return None


INCOMPLETE = f"it is incomplete (no {MARKER} marker: a save or a prune of it was interrupted)"


def leftovers(run_dir: Path) -> list[tuple[Path, str]]:
    """What interrupted saves and prunes left under checkpoints/, with why each is one (oldest step first)."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not path.is_dir():
            continue
        if path.name.startswith(f".{_PREFIX}") and path.name.endswith(".saving"):
            found.append((path, "the staging directory of an interrupted save"))
        elif path.name.startswith(f".{_PREFIX}") and path.name.endswith(".pruning"):
            found.append((path, "a checkpoint whose deletion (pruning) was interrupted"))
        elif step_of(path) is not None and not is_complete(path):
            found.append((path, INCOMPLETE))
    return sorted(found, key=lambda item: item[0].name)


def read_progress(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / PROGRESS_FILE).read_text())


# ---- manifests: a sha256 of every file, written before the COMPLETE marker ------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    _write_json(Path(directory) / MANIFEST, {"files": entries})


def damage_of(checkpoint: Path) -> str | None:
    """What is wrong with a complete checkpoint's files (None = every file matches its manifest and
    progress.json names this step)."""
    checkpoint = Path(checkpoint)
    try:
        entries = json.loads((checkpoint / MANIFEST).read_text())["files"]
        assert isinstance(entries, dict) and entries
    except FileNotFoundError:
        return f"it has no {MANIFEST}"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        return f"{MANIFEST} is unreadable"
    for name, entry in sorted(entries.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry.get("bytes") or _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST}"
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {MANIFEST, MARKER}
    unlisted = sorted(on_disk - set(entries))
    if unlisted:  # the manifest lists every file a save writes: one it does not list was added or dropped from it
        return f"{unlisted[0]} is not listed in {MANIFEST}"
    try:
        progress = read_progress(checkpoint)
    except (OSError, ValueError):
        return f"{PROGRESS_FILE} is unreadable"
    if not isinstance(progress, dict) or progress.get("global_step") != step_of(checkpoint):
        return f"{PROGRESS_FILE} does not name step {step_of(checkpoint)}"
    return None


# ---- saving and loading ---------------------------------------------------------------------------------------


def _state_files(rank: int) -> tuple[str, str]:
    return SHARED_STATE, RANK_STATE.format(rank=rank)


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, progress: dict,
                    shared_state: dict | None = None, rank_state: dict | None = None, say=print) -> Path:
    """Save model/optimizer/scheduler/scaler/RNG states, extra state and the loop's progress; collective.

    shared_state: {name: object with state_dict()} the same on every rank (written by the main process);
    rank_state: {name: object} that differs per rank (each rank writes its own file).
    A full disk (or any OS error) becomes one line naming the path; the staging directory is removed.
    """
    root = checkpoints_root(run_dir)
    final = root / f"{_PREFIX}{step}"
    staging = root / f".{_PREFIX}{step}.saving"
    rank = accelerator.process_index
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            for leftover, why in leftovers(run_dir):  # what saves and prunes that died left behind
                say(f"removing {leftover.relative_to(run_dir)}: {why}")
                shutil.rmtree(leftover)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging), safe_serialization=True)
        if rank_state:
            torch.save({name: obj.state_dict() for name, obj in rank_state.items()},
                       staging / RANK_STATE.format(rank=rank))
        if accelerator.is_main_process and shared_state:
            torch.save({name: obj.state_dict() for name, obj in shared_state.items()}, staging / SHARED_STATE)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _write_json(staging / PROGRESS_FILE, progress)
            write_manifest(staging)
            if final.exists():  # e.g. resumed from an older checkpoint into the same run: keep the old one aside
                final.rename(root / f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            staging.rename(final)
            _fsync_dir(root)
            (final / MARKER).write_text(f"step {step}\n")
    except (OSError, SafetensorError) as error:
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        raise disk_error(as_os_error(error, staging), staging) from None
    accelerator.wait_for_everyone()
    return final


def as_os_error(error: Exception, where: Path) -> OSError:
    """safetensors reports a failed write as SafetensorError("Error while serializing: I/O error: No space left on
    device (os error 28)"), not as an OSError: read the errno back out of it, so that a full disk is named as one."""
    if isinstance(error, OSError):
        return error
    code = re.search(r"os error (\d+)|code: (\d+)", str(error))
    number = int(code.group(1) or code.group(2)) if code else errno.EIO
    return OSError(number, os.strerror(number), str(where))


def disk_error(error: OSError, where: Path) -> RunFailed:
    """One line for an OS error while writing (exit 1): a full disk names the disk (mount point) and its free
    space."""
    path = Path(error.filename) if error.filename else Path(where)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        mount = _mount_point(path)
        free = shutil.disk_usage(mount).free / 2**20 if mount.exists() else 0.0
        return RunFailed(
            f"no space left on the disk at {mount} ({free:.1f} MiB free) while writing {path}; complete checkpoints "
            "are intact: free space, then continue with --resume-from auto"
        )
    return RunFailed(f"could not write {path} ({error.strerror or error}); complete checkpoints are intact")


def _mount_point(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def prune_checkpoints(accelerator: Accelerator, run_dir: Path, keep: int, protect: set[int]) -> None:
    """Delete complete checkpoints beyond the newest `keep`, except protected steps (the best one)."""
    if not accelerator.is_main_process:
        return
    complete = complete_checkpoints(run_dir)
    for path in complete[: max(0, len(complete) - keep)]:
        if step_of(path) not in protect:
            # Renamed first (atomic): a kill halfway leaves a .pruning leftover, never a step_N that looks like one.
            doomed = path.with_name(f".{path.name}.pruning")
            path.rename(doomed)
            shutil.rmtree(doomed)


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, shared_state: dict | None = None,
                    rank_state: dict | None = None) -> dict:
    """Restore everything `save_checkpoint` saved; returns the progress dict. A checkpoint that does not fit the
    prepared objects (another model size, say) is one line, not a traceback."""
    checkpoint = Path(checkpoint)
    try:
        accelerator.load_state(str(checkpoint))
        if shared_state:
            saved = torch.load(checkpoint / SHARED_STATE, map_location="cpu", weights_only=False)
            for name, obj in shared_state.items():
                obj.load_state_dict(saved[name])
        if rank_state:
            path = checkpoint / RANK_STATE.format(rank=accelerator.process_index)
            saved = torch.load(path, map_location="cpu", weights_only=False)
            for name, obj in rank_state.items():
                obj.load_state_dict(saved[name])
    except (RuntimeError, KeyError, ValueError, OSError, EOFError) as error:
        detail = " ".join(str(error).split())[:200]
        raise UsageError(f"--resume-from {checkpoint} could not be loaded ({type(error).__name__}: {detail}); "
                         "was it written by this recipe with the same model settings?") from None
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
