"""A processed `datasets` dataset built once per raw input and kept on disk, safe against interruption.

    key = file_fingerprint(raw_path, version=FORMAT_VERSION)
    ds, meta = cached_dataset(cache_dir, "metr-la", key, lambda: build(raw_path))

The build lives at <cache_dir>/processed/<name>-<key>/ (dataset/ from save_to_disk, meta.json). It is written
to a temporary sibling (.<name>-<key>.<random>.tmp) and renamed when complete, so a build that was interrupted
(an exception, a kill, a full disk) is never loaded: only directories holding meta.json count, and the rename
is atomic. Several processes may build at once (every rank of a run, parallel tests): the first rename wins and
the others load its build.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import datasets

from toolkit.data.prepared import Prepared
from toolkit.errors import UsageError

META_FILE = "meta.json"
DATASET_DIR = "dataset"


def file_fingerprint(path: Path | str, version: int | str) -> str:
    """16 hex digits naming the file's CONTENT and `version` (bump it when the parsing or the processed layout
    changes: old builds are then not loaded). Reads the whole file (sha1)."""
    path = Path(path)
    sha1 = hashlib.sha1()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha1.update(block)
    ident = f"v{version}:{path.stat().st_size}:{sha1.hexdigest()}"
    return hashlib.sha1(ident.encode()).hexdigest()[:16]


# The cache directory cannot be written: the user's to fix (not ours to traceback on).
_UNUSABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC,
             errno.EDQUOT}


@contextlib.contextmanager
def writable(cache_dir: Path | str, flag: str = "--cache-dir"):
    """Writes inside this block that fail for a reason the user must fix (permissions, read-only or missing
    filesystem, a file in the way, a full disk) raise one UsageError line naming `flag` and the directory."""
    try:
        yield
    except OSError as error:
        if error.errno not in _UNUSABLE:
            raise
        if error.errno in (errno.ENOSPC, errno.EDQUOT):  # the directory is fine: its disk is full
            from toolkit.run.checkpoint import disk_usage_words  # here: it imports torch

            raise UsageError(f"{flag} {cache_dir}: {disk_usage_words(error, Path(cache_dir))}; free space there or "
                             f"pass a {flag} on another disk (nothing was cached)") from None
        where = f": {error.filename}" if error.filename else ""
        raise UsageError(
            f"{flag} {cache_dir} is not a writable directory ({error.strerror or error}{where}); "
            "pass a directory you can write to"
        ) from None


def is_complete(final: Path) -> bool:
    """A finished build (temporary directories never hold meta.json under the final name)."""
    return (Path(final) / META_FILE).is_file()


def write_bytes_atomically(target: Path, data: bytes) -> None:
    """target = data, written to a temporary sibling and renamed: readers see the old file or the whole new one."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def save_atomically(ds: datasets.Dataset, meta: dict, final: Path) -> None:
    """final/dataset (save_to_disk) + final/meta.json, built in a temporary sibling, renamed when complete.
    If another process completed `final` first, its build is kept and ours discarded."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    building = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        ds.save_to_disk(str(building / DATASET_DIR))
        (building / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists() and not is_complete(final):
            shutil.rmtree(final)  # not a build of ours: complete builds always hold meta.json (the rename is atomic)
        try:
            os.rename(building, final)
        except OSError:
            if not is_complete(final):  # else a concurrent builder finished first: use its build
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)


def cached_dataset(
    cache_dir: Path | str,
    name: str,
    key: str,
    build: Callable[[], tuple[datasets.Dataset, dict]],
    flag: str = "--cache-dir",
) -> Prepared:
    """Prepared(dataset, meta) from <cache_dir>/processed/<name>-<key> when a complete build is there (build() is not
    called); else build() -> (dataset, JSON-serialisable meta), saved atomically, then loaded from disk (so the
    first call returns exactly what later calls load). A cache directory that cannot be written raises a
    UsageError naming `flag`; it is checked before build() runs, and a disk that fills during the save is one line
    too (the partial build is removed). Exceptions from build() propagate, leaving nothing behind: the directories
    made for the check are removed again (a bad input creates nothing)."""
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / "processed" / f"{name}-{key}"
    if not is_complete(final):
        made = [d for d in (final.parent, *final.parent.parents) if not d.exists()]
        with writable(cache_dir, flag):
            final.parent.mkdir(parents=True, exist_ok=True)  # fail before a long build, not after it
        try:
            ds, meta = build()
        except BaseException:
            for directory in made:  # innermost first; rmdir leaves a directory someone has filled meanwhile
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise
        with writable(cache_dir, flag):  # a full disk: one line; the partial build is removed (save_atomically)
            save_atomically(ds, meta, final)
    meta = json.loads((final / META_FILE).read_text())
    return Prepared(datasets.load_from_disk(str(final / DATASET_DIR)), meta)
