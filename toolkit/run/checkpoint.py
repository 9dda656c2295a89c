"""Atomic checkpoints: `checkpoints/step_<N>/` = Accelerate `save_state` output + progress.json + COMPLETE.

Every rank writes its part (random states, per-rank state) into a temporary sibling directory; after a barrier the
main process writes progress.json and MANIFEST.json (sha256 of every file), renames the directory to step_<N> and
writes the COMPLETE marker last. Pruning renames a checkpoint to `.step_<N>.pruning` before deleting it. What a kill
leaves behind (a `.saving` or `.pruning` directory, a step_<N> without its marker) is a leftover: `auto` names each
one newer than the checkpoint it resumes from, an explicit --resume-from rejects it, verify names it, and the run's
next life removes it once it holds the directory's lock, as does every save (one line each). A complete checkpoint
whose files do not match the manifest (a file changed, missing, or not listed in it) is damaged, and a step_<N> that
is not a directory cannot be one: `auto` skips either with one line saying why, an explicit --resume-from refuses it.
A save of a step that exists sets the old entry aside as step_<N>.replaced-<time> (one line); the prune keeps the
newest --keep-checkpoints of those. progress.json records the settings the run had (SETTINGS), so an edited
config.json is found (verify, resume). A write that fails on a full disk stops every rank with one line; the save is
undone (staging removed, a set-aside step_<N> put back).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from toolkit.errors import RunFailed, UsageError
from toolkit.run.config import ADDED_FLAGS_KEY, changed_flags
from toolkit.run.rundir import RunDir

MARKER = "COMPLETE"
PROGRESS_FILE = "progress.json"
MANIFEST = "MANIFEST.json"  # {"files": {name: {"bytes", "sha256"}}}, written before the marker
SHARED_STATE = "extra_state.pt"  # the recipe's state beyond Accelerate's (e.g. a data scaler), main process
RANK_STATE = "rank_state_{rank}.pt"  # per-rank state (e.g. HRM's carry), one file per rank
_PREFIX = "step_"
REPLACED = "replaced-"  # step_N.replaced-<time>: an earlier step_N a later save of step N set aside
NOT_A_DIRECTORY = "it is not a directory (a checkpoint is a directory step_N holding a COMPLETE marker)"


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
        if not path.is_dir():
            raise UsageError(f"--resume-from {path} is not a directory, so not a checkpoint (a checkpoint is a "
                             f"directory step_N holding a {MARKER} marker); resume from an earlier step_N or use "
                             "--resume-from auto")
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
    if not path.is_dir():
        raise UsageError(f"--resume-from {path} is not a directory, so not a checkpoint: give a checkpoints/step_N "
                         "directory, a run directory or 'auto'")
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
    """The newest complete checkpoint whose files match its manifest; every newer step_N it skips, damaged,
    incomplete or not a directory, is named in one line (`say`)."""
    skipped = []
    for path in reversed(step_entries(run_dir)):
        why = why_not_intact(path)
        if why is None:
            for bad, reason in skipped:
                say(f"warning: checkpoint {bad} is skipped: {reason}; resuming from {path.name} instead")
            return path
        skipped.append((path, why))
    for bad, reason in skipped:
        say(f"warning: checkpoint {bad} is skipped: {reason}; no intact checkpoint is older")
    return None


def step_entries(run_dir: Path) -> list[Path]:
    """Every checkpoints/step_N entry, directory or not, oldest step first."""
    root = checkpoints_root(run_dir)
    found = [p for p in root.iterdir() if step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=step_of)


def why_not_intact(path: Path) -> str | None:
    """Why a step_N entry cannot be resumed from (None: it can)."""
    if not Path(path).is_dir():
        return NOT_A_DIRECTORY
    return INCOMPLETE if not is_complete(path) else damage_of(path)


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


# progress.json's record of the settings the life that saved it ran with (toolkit.loop.keeper writes it): {"config": the
# flags as config.json's "config" holds them, "data": the data's fingerprint}. Covered by the manifest, unlike
# config.json, which a user may edit between lives.
SETTINGS = "settings"


def settings_changes(checkpoint: Path, config_json: dict) -> list[str] | None:
    """How a run's config.json differs from the settings `checkpoint` recorded, flag by flag ("--lr 0.001 -> 0.1";
    the flags a resume may change are left out); None when the checkpoint records none (an older toolkit's)."""
    try:
        record = read_progress(checkpoint).get(SETTINGS)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        return None
    config = config_json.get("config") if isinstance(config_json.get("config"), dict) else {}
    added = config_json.get(ADDED_FLAGS_KEY) if isinstance(config_json.get(ADDED_FLAGS_KEY), dict) else None
    changes = changed_flags(record["config"], config, added)
    data = config_json.get("data") if isinstance(config_json.get("data"), dict) else {}
    if record.get("data") is not None and record["data"] != data.get("fingerprint"):
        changes.append(f"data fingerprint {record['data']!r} -> {data.get('fingerprint')!r}")
    return changes


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
    A write that fails on any rank (a full disk: an OSError, safetensors' SafetensorError, torch.save's
    RuntimeError) stops every rank with the same one line naming the disk and the file (RunFailed); the staging
    directory is removed and whatever the save had moved is put back, so the directory holds what it held before.
    """
    root = checkpoints_root(run_dir)
    final = root / f"{_PREFIX}{step}"
    staging = root / f".{_PREFIX}{step}.saving"
    rank, main = accelerator.process_index, accelerator.is_main_process
    failure = None
    if main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for leftover, why in leftovers(run_dir):  # what saves and prunes that died left behind
                say(f"removing {leftover.relative_to(run_dir)}: {why}")
                shutil.rmtree(leftover)
        except OSError as error:
            failure = str(disk_error(error, root))
    if _first_failure(accelerator, failure) is None:  # every rank: its part, into the staging directory
        try:
            accelerator.save_state(str(staging), safe_serialization=True)
            if rank_state:
                torch.save({name: obj.state_dict() for name, obj in rank_state.items()},
                           staging / RANK_STATE.format(rank=rank))
            if main and shared_state:
                torch.save({name: obj.state_dict() for name, obj in shared_state.items()}, staging / SHARED_STATE)
        except WRITE_FAILURES as error:
            failure = str(write_failure(error, staging))
        if _first_failure(accelerator, failure) is None and main:  # the main process completes it
            failure = _complete(staging, final, step, progress, say)
    failure = _first_failure(accelerator, failure)
    if failure is not None:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        raise RunFailed(failure)
    return final


# What a write that does not fit raises: OSError (Python's own files), SafetensorError ("I/O error: No space left on
# device (os error 28)") and torch.save's RuntimeError from its C++ writer, which keeps no errno ("[enforce fail at
# inline_container.cc:672] . unexpected pos 8448 vs 8342", "basic_ios::clear: iostream error", "PytorchStreamWriter
# failed writing file data/0: file write failed"): found on a tmpfs filled to every 4 KB from 0 to 240 KB free.
WRITE_FAILURES = (OSError, SafetensorError, RuntimeError)
_TORCH_WRITE_FAILURE = re.compile(r"inline_container|PytorchStreamWriter|iostream error|file write failed")


def write_failure(error: Exception, staging: Path) -> RunFailed:
    """One line for a failed write into `staging` (a torch.save RuntimeError that is not a write failure is a bug:
    raised as it is)."""
    if isinstance(error, RuntimeError) and not _TORCH_WRITE_FAILURE.search(str(error)):
        raise error
    return disk_error(as_os_error(error, _newest_file(staging)), staging)


def _complete(staging: Path, final: Path, step: int, progress: dict, say) -> str | None:
    """Main process: progress.json and the manifest into the staging directory, renamed to step_N, marker last. A
    failure puts back what it moved (an earlier step_N set aside returns) and is returned as one line."""
    root = final.parent
    aside = renamed = None
    writing = staging / PROGRESS_FILE  # named in the line if the write fails
    try:
        _write_json(writing, progress)
        writing = staging / MANIFEST
        write_manifest(staging)
        writing = final
        if final.exists() or final.is_symlink():  # resumed from an older checkpoint into the same run, or a file in
            # the way: the old entry is kept aside (pruned like a checkpoint: at most --keep-checkpoints of them)
            aside = _replaced_name(final)
            final.rename(aside)
            say(f"keeping the earlier {root.name}/{final.name} as {root.name}/{aside.name}: this run saves its step "
                f"{step} again")
        staging.rename(final)
        renamed = final
        _fsync_dir(root)
        writing = final / MARKER
        writing.write_text(f"step {step}\n")
    except OSError as error:
        if renamed is not None:
            renamed.rename(staging)  # removed with the staging directory
        if aside is not None:
            aside.rename(final)
        return str(disk_error(error, writing))
    return None


def _replaced_name(final: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = final.with_name(f"{final.name}.{REPLACED}{stamp}"), 1
    while aside.exists() or aside.is_symlink():  # two saves of one step within a second
        n += 1
        aside = final.with_name(f"{final.name}.{REPLACED}{stamp}-{n}")
    return aside


def _newest_file(directory: Path) -> Path:
    """The file last written under `directory` (the one a failed write was writing), else the directory."""
    try:
        files = [p for p in Path(directory).rglob("*") if p.is_file()]
    except OSError:
        files = []
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=Path(directory))


def _first_failure(accelerator: Accelerator, failure: str | None) -> str | None:
    """Every rank's failure line (None: none); every rank gets the first one, in rank order. A barrier."""
    if accelerator.num_processes == 1:
        return failure
    import torch.distributed as dist

    failures: list = [None] * accelerator.num_processes
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f), None)


def as_os_error(error: Exception, where: Path) -> OSError:
    """The OSError behind a failed write. safetensors reports one as SafetensorError("Error while serializing: I/O
    error: No space left on device (os error 28)"): the errno is read back out of it. torch.save's RuntimeError keeps
    none: the disk is asked (a small write beside `where`) whether it is full."""
    if isinstance(error, OSError):
        return error
    code = re.search(r"os error (\d+)|code: (\d+)", str(error))
    if code:
        number = int(code.group(1) or code.group(2))
    else:
        number = _full(Path(where)) or errno.EIO
    return OSError(number, os.strerror(number), str(where))


def _full(where: Path) -> int | None:
    """ENOSPC or EDQUOT when 64 KiB no longer fit on the disk that holds `where`, else None."""
    directory = where if where.is_dir() else where.parent
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return error.errno if error.errno in (errno.ENOSPC, errno.EDQUOT) else None
    return None


def disk_error(error: OSError, where: Path) -> RunFailed:
    """One line for an OS error while writing (exit 1): a full disk names the disk (mount point) and its free
    space."""
    path = Path(error.filename) if error.filename else Path(where)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunFailed(f"{disk_usage_words(error, where)}; complete checkpoints are intact: free space, then "
                         "continue with --resume-from auto")
    return RunFailed(f"could not write {path} ({error.strerror or error}); complete checkpoints are intact")


def disk_usage_words(error: OSError, where: Path) -> str:
    """"no space left on the disk at MOUNT (F MiB free) while writing PATH" for a full disk's OSError."""
    path = Path(error.filename) if error.filename else Path(where)
    mount = _mount_point(path)
    free = shutil.disk_usage(mount).free / 2**20 if mount.exists() else 0.0
    full = "no space left" if error.errno == errno.ENOSPC else "the disk quota is used up"  # EDQUOT
    return f"{full} on the disk at {mount} ({free:.1f} MiB free) while writing {path}"


def _mount_point(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def prune_checkpoints(accelerator: Accelerator, run_dir: Path, keep: int, protect: set[int]) -> None:
    """Delete complete checkpoints beyond the newest `keep`, except protected steps (the best one), and the
    step_N.replaced-<time> copies beyond the newest `keep`."""
    if not accelerator.is_main_process:
        return
    complete = complete_checkpoints(run_dir)
    doomed = [path for path in complete[: max(0, len(complete) - keep)] if step_of(path) not in protect]
    copies = replaced_copies(run_dir)
    for path in doomed + copies[: max(0, len(copies) - keep)]:
        if path.is_dir() and not path.is_symlink():
            # Renamed first (atomic): a kill halfway leaves a .pruning leftover, never a step_N that looks like one.
            pruning = path.with_name(f".{path.name}.pruning")
            path.rename(pruning)
            shutil.rmtree(pruning)
        else:  # a file that stood where a checkpoint belongs, set aside by a save
            path.unlink()


_REPLACED_COPY = re.compile(rf"{_PREFIX}(\d+)\.{REPLACED}(\d{{8}}-\d{{6}})(?:-(\d+))?")


def replaced_copies(run_dir: Path) -> list[Path]:
    """The step_N.replaced-<time> entries that saves set aside, oldest first (by the time in the name)."""
    root = checkpoints_root(run_dir)
    found = []
    for path in root.iterdir() if root.is_dir() else []:
        match = _REPLACED_COPY.fullmatch(path.name)
        if match:
            found.append(((match.group(2), int(match.group(3) or 1), int(match.group(1))), path))
    return [path for _, path in sorted(found)]


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
