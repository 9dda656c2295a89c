"""Checkpoint integrity by rule, on every recipe's real checkpoints (1 process each, and 2 gloo processes for HRM):
the MANIFEST.json a save writes lists every file of its checkpoint, and EVERY file it lists, damaged in turn with
same-size bytes (so only its sha256 can tell), is named by `verify`, skipped by `--resume-from auto` (the older
checkpoint is taken, with one line naming the damaged one) and refused by an explicit --resume-from PATH (one line).
The file list comes from the manifest on disk, never from a hand-written list: a file a recipe adds is covered."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA_CACHE, ROOT, TINY, ranks_seen, recipe_env, run_recipe

from toolkit.errors import UsageError
from toolkit.run import checkpoint
from toolkit.tools.verify import verify_run

# one worker for the module: its module-scoped runs are made once, not once per xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("checkpoint-integrity")]

# Two checkpoints (step_2 and step_4) per run: the newest is damaged, the older one is where `auto` falls back to.
TWO_CHECKPOINTS = ["--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "2", "--log-with", "none"]
DCRNN = ["--cache-dir", str(DATA_CACHE), "--units", "8", "--batch-size", "32", "--threads", "1"]
HRM = [
    "--cache-dir",
    str(DATA_CACHE),
    *(
        "--train-puzzles 48 --aug 1 --val-puzzles 16 --test-puzzles 16 --max-blanks 8 --hidden 16 --heads 2 "
        "--expansion 2 --batch-size 16 --halt-max-steps 2 --warmup-steps 2 --threads 1"
    ).split(),
]
UFS = ["--batch-size", "40", "--threads", "1"]

# case: (recipe, launch config, world size, the fixture holding its data or None, flags given that data)
CASES = {
    "sasrec": ("sasrec", None, 1, "movielens_cache", lambda data: TINY),
    "dcrnn": ("dcrnn", None, 1, "synth_data", lambda data: [*DCRNN, "--data", str(data)]),
    "hrm": ("hrm", None, 1, None, lambda data: HRM),
    "ufs_emulator": ("ufs_emulator", None, 1, "ufs_grid", lambda data: ["--data", str(data), *UFS]),
    "hrm-2proc": ("hrm", "cpu_2proc.yaml", 2, None, lambda data: HRM),
}


@pytest.fixture(scope="module")
def ufs_grid(tmp_path_factory) -> Path:
    from toolkit.data.ufs import synthesize

    return synthesize(tmp_path_factory.mktemp("ufs-data") / "grid.nc", seed=7, nlat=24, nlon=48)


@pytest.fixture(scope="module", params=list(CASES))
def finished(request, tmp_path_factory):
    """(run dir, world size, the run's output): each case's run made once for the module; tests damage copies."""
    recipe, config, world, data_fixture, flags = CASES[request.param]
    data = request.getfixturevalue(data_fixture) if data_fixture else None
    run_dir = tmp_path_factory.mktemp(request.param) / "run"
    result = run_recipe([*flags(data), *TWO_CHECKPOINTS, "--output-dir", str(run_dir)], recipe=recipe, config=config)
    return run_dir, world, result.stdout + result.stderr


def checkpoints_of(run_dir: Path) -> tuple[Path, Path]:
    """(the older, the newest) complete checkpoint."""
    found = checkpoint.complete_checkpoints(run_dir)
    assert [checkpoint.step_of(p) for p in found] == [2, 4], found
    return found[-2], found[-1]


def manifest_of(step_dir: Path) -> dict[str, dict]:
    return json.loads((step_dir / checkpoint.MANIFEST).read_text())["files"]


def files_on_disk(step_dir: Path) -> set[str]:
    return {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()}


def flip_middle(path: Path) -> bytes:
    """Invert up to 8 bytes in the middle of the file; its size stays the same. Returns the original bytes."""
    original = path.read_bytes()
    assert original, f"{path} is empty: nothing to flip"
    data = bytearray(original)
    start = max(0, len(data) // 2 - 4)
    for i in range(start, min(len(data), start + 8)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    assert path.stat().st_size == len(original) and path.read_bytes() != original
    return original


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    return run_dir


def test_the_manifest_lists_every_file_of_each_checkpoint_and_the_run_verifies(finished):
    run_dir, world, output = finished
    assert ranks_seen(output) == {(rank, world) for rank in range(world)}, output[-3000:]
    for step_dir in checkpoints_of(run_dir):
        listed = manifest_of(step_dir)
        # Every file the save wrote is listed (only the manifest itself and the COMPLETE marker, written after it,
        # are not): a file silently left out of the manifest would never be checked.
        assert set(listed) == files_on_disk(step_dir) - {checkpoint.MANIFEST, checkpoint.MARKER}, step_dir
        for name, entry in listed.items():
            assert entry["bytes"] == (step_dir / name).stat().st_size > 0, name
        for rank in range(world):  # every rank's own files, not only the main process's
            assert f"random_states_{rank}.pkl" in listed, sorted(listed)
        assert {"model.safetensors", "optimizer.bin", checkpoint.PROGRESS_FILE} <= set(listed)
        assert checkpoint.damage_of(step_dir) is None
    assert verify_run(run_dir, expect_world_size=world) == []


def test_every_listed_file_damaged_at_the_same_size_is_named_skipped_and_refused(finished, copy):
    older, newest = checkpoints_of(copy)
    listed = sorted(manifest_of(newest))
    assert listed, "the manifest lists no file"
    failures = []
    for name in listed:
        path = newest / name
        original = flip_middle(path)
        expected = f"{name} does not match its sha256 in {checkpoint.MANIFEST}"
        # (a) verify (what `python -m toolkit verify RUN_DIR` reports) names the damaged checkpoint and file.
        problems = verify_run(copy)
        if not any(f"{newest.relative_to(copy)} is damaged: {expected}" in p for p in problems):
            failures.append(f"verify, {name}: {problems}")
        # (b) --resume-from auto: the older checkpoint, with exactly one line naming the damaged one and the file.
        said = []
        found = checkpoint.newest_intact(copy, say=said.append)
        if (
            found != older
            or len(said) != 1
            or str(newest) not in said[0]
            or expected not in said[0]
            or f"resuming from {older.name} instead" not in said[0]
        ):
            failures.append(f"auto, {name}: resumes from {found}, said {said}")
        # (c) an explicit --resume-from step_N is refused, in one line naming the checkpoint and the file.
        try:
            checkpoint.resolve_checkpoint_path(newest)
            failures.append(f"--resume-from PATH, {name}: accepted")
        except UsageError as error:
            message = str(error)
            if "\n" in message or f"{newest} is damaged: {expected}" not in message:
                failures.append(f"--resume-from PATH, {name}: {message!r}")
        path.write_bytes(original)
        assert checkpoint.damage_of(newest) is None, f"{name} was not restored"
    assert not failures, "\n".join(failures)
    assert checkpoint.newest_intact(copy, say=failures.append) == newest and not failures


def test_the_verify_command_names_a_damaged_rank_file(finished, copy):
    """The real CLI once per run, on the last rank's random states (the file no same-size damage had reached)."""
    _, world, _ = finished
    _, newest = checkpoints_of(copy)
    name = f"random_states_{world - 1}.pkl"
    flip_middle(newest / name)
    command = [sys.executable, "-m", "toolkit", "verify", str(copy), "--expect-world-size", str(world)]
    result = subprocess.run(command, cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("  FAIL")]
    assert failed == [
        f"  FAIL  checkpoints  checkpoints/{newest.name} is damaged: {name} does not match its sha256 "
        f"in {checkpoint.MANIFEST}"
    ], result.stdout
    assert "Traceback" not in result.stderr
