"""Faults a user meets: damaged checkpoints, a second run on a live run's directory, a killed launcher, resume with
changed settings, machines without a shared filesystem, a full disk. Each ends in one line and loses nothing."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import CONFIGS, ROOT, TOY, mounted_tmpfs, recipe_env, run_preloaded, run_recipe, start_machines

from toolkit.run import checkpoint
from toolkit.tools.verify import verify_run

pytestmark = pytest.mark.slow

ARGS = ["--checkpoint-every", "3", "--keep-checkpoints", "10", "--eval-every-steps", "3"]


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    run_recipe([*ARGS, "--max-steps", "9", "--output-dir", str(out)], recipe=TOY)
    return out


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path):
    path.write_bytes(os.urandom(path.stat().st_size))


def _random_4k(path):
    data = bytearray(path.read_bytes())
    data[-4096:] = os.urandom(min(4096, len(data)))
    path.write_bytes(bytes(data))


def _empty_progress(path):
    path.write_text("{}")


@pytest.mark.parametrize("damage", [lambda p: p.unlink(), lambda p: p.write_text("{not json"),
                                    lambda p: p.write_text('{"run_id": "x"}')], ids=["missing", "garbage", "no-config"])
def test_a_missing_or_unreadable_config_json_is_named_as_such(finished, damage, tmp_path):
    """Not "config.json differs ... (--batch-size 256 -> None ...)": an absent file has no values to compare."""
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    damage(copy / "config.json")
    result = run_recipe([*ARGS, "--max-steps", "12", "--output-dir", str(copy), "--resume-from", "auto"], recipe=TOY,
                        check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert error_lines(result) == [f"error: --resume-from: {copy}/config.json is missing or unreadable, so the run's "
                                   "settings cannot be checked; restore it or start a new run"]


@pytest.mark.parametrize("damage, name", [
    (_truncate, "model.safetensors"), (_garbage, "optimizer.bin"), (_random_4k, "model.safetensors"),
    (_empty_progress, "progress.json"), (lambda p: p.unlink(), "extra_state.pt"),
], ids=["truncated-model", "garbage-optimizer", "random-4k-weights", "empty-progress", "missing-state"])
def test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_path(finished, damage, name, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    newest = out / "checkpoints" / "step_9"
    damage(newest / name)
    assert any("step_9 is damaged" in p and name in p for p in verify_run(out))

    explicit = run_recipe([*ARGS, "--max-steps", "12", "--resume-from", str(newest)], recipe=TOY, check=False)
    assert explicit.returncode == 2 and len(error_lines(explicit)) == 1, explicit.stderr
    assert f"{newest} is damaged" in error_lines(explicit)[0] and name in error_lines(explicit)[0]
    assert "Traceback" not in explicit.stderr

    auto = run_recipe([*ARGS, "--max-steps", "12", "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY)
    warning = [line for line in auto.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warning) == 1 and name in warning[0] and "resuming from step_6 instead" in warning[0], auto.stdout
    assert "resumed at epoch 1, batch 0, step 6" in auto.stdout


def test_a_checkpoint_replaced_by_a_file_is_named_by_auto_and_by_path(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    newest = out / "checkpoints" / "step_9"
    shutil.rmtree(newest)
    newest.write_text("not a checkpoint\n")

    explicit = run_preloaded([*ARGS, "--max-steps", "12", "--resume-from", str(newest)], recipe=TOY, cwd=tmp_path)
    assert explicit.returncode == 2 and len(error_lines(explicit)) == 1, explicit.stderr
    assert f"--resume-from {newest} is not a directory" in error_lines(explicit)[0]
    assert "interrupted" not in error_lines(explicit)[0]  # it once said "its save was interrupted"

    auto = run_preloaded([*ARGS, "--max-steps", "12", "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY,
                         cwd=tmp_path)
    assert auto.returncode == 0, auto.stderr[-3000:]
    warning = [line for line in auto.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert warning == [f"warning: checkpoint {newest} is skipped: it is not a directory (a checkpoint is a directory "
                       "step_N holding a COMPLETE marker); resuming from step_6 instead"], auto.stdout  # once silent
    assert "resumed at epoch 1, batch 0, step 6" in auto.stdout
    # the file is kept aside when step 9 is saved again, and pruned like a checkpoint
    assert [p.read_text() for p in checkpoint.replaced_copies(out)] == ["not a checkpoint\n"]
    assert verify_run(out) == []


def test_config_json_edited_between_lives_is_refused_and_fails_verify(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    config = json.loads((out / "config.json").read_text())
    config["config"]["lr"] = 0.1  # the toy trains at 0.05
    (out / "config.json").write_text(json.dumps(config))
    assert any("config.json differs from the settings step_3, step_6, step_9 recorded (--lr 0.05 -> 0.1)" in p
               for p in verify_run(out)), verify_run(out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    result = run_preloaded([*ARGS, "--max-steps", "12", "--output-dir", str(out), "--resume-from", "auto", "--lr",
                            "0.1"], recipe=TOY, cwd=tmp_path)  # the flags agree with the edited config.json
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr
    assert f"cannot resume from {out / 'checkpoints' / 'step_9'}" in error_lines(result)[0]
    assert "differs from the settings that checkpoint was saved with (--lr 0.05 -> 0.1)" in error_lines(result)[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_resumed_life_that_ends_before_saving_removes_the_dead_lifes_leftovers(finished, tmp_path):
    # A launcher killed during a save leaves a staging directory; the life that resumes may end before it saves
    # (here it has no step left to take): it must still leave a run that verifies. Found by the launcher-kill test.
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    root = out / "checkpoints"
    shutil.copytree(root / "step_9", root / ".step_12.saving")
    shutil.copytree(root / "step_6", root / ".step_3.pruning")
    assert {p.name for p, _ in checkpoint.leftovers(out)} == {".step_12.saving", ".step_3.pruning"}
    assert len(verify_run(out)) == 2

    resumed = run_recipe([*ARGS, "--max-steps", "9", "--output-dir", str(out), "--resume-from", "auto"], recipe=TOY)
    removed = [line for line in resumed.stdout.splitlines() if line.startswith("removing checkpoints/")]
    assert sorted(removed) == ["removing checkpoints/.step_12.saving: the staging directory of an interrupted save",
                               "removing checkpoints/.step_3.pruning: a checkpoint whose deletion (pruning) was "
                               "interrupted"], resumed.stdout
    assert checkpoint.leftovers(out) == [] and verify_run(out) == []
    # and a life resumed at its --max-steps takes no step past it (it took one, step_10, before)
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_3", "step_6", "step_9"]


def test_a_run_directory_has_one_live_run_and_dead_launchers_take_their_workers(tmp_path):
    out = tmp_path / "run"
    args = [*ARGS, "--epochs", "100000", "--samples", "4096", "--no-carry", "--output-dir", str(out)]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
         "--main_process_port", "0", TOY, *args], cwd=ROOT, env=recipe_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while checkpoint.newest_complete(out) is None:
            assert time.monotonic() < deadline and launcher.poll() is None, "no checkpoint was written"
            time.sleep(0.05)  # polling a condition (a checkpoint exists), not a timed wait
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "toy_recipe" in " ".join(
            p.cmdline())]
        assert len(workers) == 2

        second = run_recipe([*args, "--resume-from", "auto"], recipe=TOY, check=False)
        assert second.returncode == 2 and len(error_lines(second)) == 1, second.stderr
        holder = json.loads((out / "config.json").read_text())
        assert "is in use by a live run (host " in error_lines(second)[0] and "pid" in error_lines(second)[0]
        assert holder["run_id"]  # the live run's files are untouched by the refused one

        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed_at = time.monotonic()
        gone = psutil.wait_procs(workers, timeout=20)[1]
        assert not gone, f"workers still alive {time.monotonic() - killed_at:.1f} s after the launcher died"
    finally:
        for proc in psutil.Process(os.getpid()).children(recursive=True):
            if "toy_recipe" in " ".join(proc.cmdline()):
                proc.kill()
    # At once, on one process: it resumes from the newest complete checkpoint (--epochs may change) and ends.
    resumed = run_recipe([*args, "--epochs", "1", "--resume-from", "auto"], recipe=TOY, check=False)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr
    assert verify_run(out) == []


# A worker whose launcher is killed before the worker has imported the toolkit (a kill during start-up on a busy
# machine): found by killing launchers at random moments, the worker then sat in the rendezvous for --dist-timeout.
ORPHAN = """
import os, sys
launcher = int(sys.argv[1])
while os.getppid() == launcher:  # polling a condition: the launcher is gone, so the worker is adopted
    os.sched_yield()
from toolkit.process import begin_process
begin_process()  # what every recipe calls first
print("the worker survived its launcher", file=sys.stderr)
"""
LAUNCHER = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stderr=open(sys.argv[2], "w"),
                          env={**os.environ, "TORCHELASTIC_RUN_ID": "none", "RANK": "1"})
print(os.getpid(), worker.pid, flush=True)
os._exit(0)  # as if killed: nobody waits for the worker
"""


def test_a_launcher_killed_before_its_worker_started_takes_the_worker_too(tmp_path):
    log = tmp_path / "worker.err"
    started = subprocess.run([sys.executable, "-c", LAUNCHER, ORPHAN, str(log)], cwd=ROOT, env=recipe_env(),
                             capture_output=True, text=True, check=True)
    launcher, worker = map(int, started.stdout.split())
    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(worker).wait(timeout=60)
    lines = log.read_text().splitlines()
    assert "the worker survived its launcher" not in lines
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, lines
    adopter = re.fullmatch(
        rf"error: \[rank 1\] the launcher died before this worker started \(its parent is now pid (\d+), not a "
        rf"launcher\); worker pid {worker} stops \(complete checkpoints are intact: continue with --resume-from auto\)",
        errors[0])
    assert adopter and int(adopter.group(1)) != launcher, errors[0]


@pytest.mark.parametrize("flag, value", [("--batch-size", "32"), ("--seed", "3"), ("--lr", "0.1"),
                                         ("--grad-accum", "2"), ("--samples", "256")])
def test_resume_with_changed_settings_is_refused(finished, flag, value, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    result = run_recipe([*ARGS, "--output-dir", str(out), "--resume-from", "auto", flag, value], recipe=TOY,
                        check=False)
    assert result.returncode == 2 and len(error_lines(result)) == 1, result.stderr
    assert "cannot resume" in error_lines(result)[0] and flag in error_lines(result)[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_resume_with_allowed_changes_and_auto_never_picks_another_configuration(finished, tmp_path):
    runs = tmp_path / "runs" / "toy"
    shutil.copytree(finished, runs / "a")
    other = run_recipe([*ARGS, "--max-steps", "3", "--seed", "5"], recipe=TOY, cwd=tmp_path)  # the newest run
    assert "fresh start" in other.stdout
    result = run_recipe([*ARGS, "--max-steps", "12", "--resume-from", "auto", "--log-every", "5"], recipe=TOY,
                        cwd=tmp_path)
    assert "resuming from runs/toy/a/checkpoints/step_9" in result.stdout, result.stdout


def test_machines_without_a_shared_filesystem_are_told_in_one_line(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    machines = start_machines([*ARGS, "--max-steps", "3", "--output-dir", "run"], config="2node_cpu.yaml", recipe=TOY,
                              cwds=[node0, node1])
    outputs = [m.communicate(timeout=300) for m in machines]
    assert all(m.returncode != 0 for m in machines), outputs
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "machine 1" in errors[0] and "shared by all machines" in errors[0], errors
    assert not (node1 / "run").exists()


@pytest.fixture
def small_disk(tmp_path):
    with mounted_tmpfs(tmp_path / "disk", "size=400k") as mount:
        yield mount


def test_a_full_disk_names_the_disk_and_path_and_keeps_what_was_complete(small_disk):
    out = small_disk / "run"
    # Each checkpoint is ~25 kB (14 kB of RNG state): a 400 kB disk fills after a few of them.
    result = run_preloaded([*ARGS, "--checkpoint-every", "1", "--keep-checkpoints", "1000", "--epochs", "50",
                            "--output-dir", str(out)], recipe=TOY, cwd=small_disk)
    errors = error_lines(result)
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]  # a runtime failure
    assert f"no space left on the disk at {small_disk}" in errors[0] and str(out) in errors[0]
    assert "Traceback" not in result.stderr
    root = out / "checkpoints"
    assert not list(root.glob(".step_*.saving"))  # no staging dir left behind
    complete = checkpoint.complete_checkpoints(out)
    assert complete and all(checkpoint.damage_of(p) is None for p in complete)


@pytest.fixture
def disk_of(tmp_path):
    """disk_of(kb): a fresh tmpfs of kb KB (0: a 4 KB one filled to the last byte)."""
    mounts = []

    def make(kb: int) -> Path:
        mount = tmp_path / f"disk{kb}"
        mount.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={max(kb, 4)}k", "tmpfs", str(mount)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip()}")
        mounts.append(mount)
        if kb == 0:
            fill(mount)
        return mount

    yield make
    for mount in mounts:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# Disk sizes at which the toy run below meets a full disk in its writers (found by filling a tmpfs to every 4 KB
# from 0 to 300 KB; what each hits depends on the file sizes, so the test asserts only what must hold at any of
# them): the lock (0 KB), config.json, log.csv, metrics.csv, a checkpoint's optimizer.bin (torch.save through
# Accelerate: RuntimeError "unexpected pos" / "iostream error", once a traceback and a .step_N.saving left behind),
# rank_state_0.pt (torch.save), MANIFEST.json, the COMPLETE marker (after the rename: the save is undone),
# summary.json, curves.png; and with wandb writing its files beside them (its logging once printed dozens of
# "--- Logging error ---" tracebacks). model.safetensors: test_a_full_disk_inside_safetensors_is_named_as_one.
FULL_AT_KB = [(0, []), (4, []), (8, []), (12, []), (20, []), (40, []), (96, []), (100, []), (152, []), (180, []),
              (8, ["--log-with", "wandb"])]


def test_a_disk_that_fills_at_any_write_is_one_line_and_leaves_no_partial_file(disk_of):
    named = set()
    for kb, flags in FULL_AT_KB:
        disk = disk_of(kb) if not flags else disk_of(kb + 1)  # another mount point for the same size
        out = disk / "run"
        result = run_preloaded([*ARGS, "--max-steps", "9", "--output-dir", str(out), *flags], recipe=TOY, cwd=disk)
        errors = error_lines(result)
        assert result.returncode == 1 and len(errors) == 1, (kb, result.stderr[-3000:])
        assert errors[0].startswith(f"error: no space left on the disk at {disk} ("), (kb, errors[0])
        assert f"while writing {out}" in errors[0], (kb, errors[0])
        assert "Traceback" not in result.stderr and "Logging error" not in result.stderr, (kb, result.stderr[-3000:])
        named.add(Path(errors[0].split(" while writing ")[1].split(";")[0]).name)
        partial = [p for p in disk.rglob("*") if re.search(r"\.saving|\.tmp$|partial|\.pruning", p.name)]
        assert partial == [], (kb, partial)
        assert all(checkpoint.damage_of(p) is None for p in checkpoint.complete_checkpoints(out)), kb
        assert checkpoint.leftovers(out) == [], kb
        if kb == 100:  # the COMPLETE marker did not fit: step_3 stays the newest; with space, the run goes on
            assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_3"]
            subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
            resumed = run_preloaded([*ARGS, "--max-steps", "9", "--output-dir", str(out), "--resume-from", "auto"],
                                    recipe=TOY, cwd=disk)
            assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
            assert verify_run(out) == []
    # the writers above were met (a torch.save among them)
    assert {".lock", "config.json", "metrics.csv", "COMPLETE"} <= named and named & {
        "optimizer.bin", "random_states_0.pkl", "rank_state_0.pt", "extra_state.pt"}, named


def test_a_full_disk_while_caching_data_is_one_line_and_caches_nothing(disk_of):
    """A processed-data cache that does not fit: one line naming --cache-dir and the disk (it once said "is not a
    writable directory"), and no partial build left."""
    import datasets

    from toolkit.data.cache import cached_dataset
    from toolkit.errors import UsageError

    def build():
        rows = datasets.Dataset.from_dict({"user": list(range(3000)), "items": [[i, i + 1] for i in range(3000)]})
        return rows, {"users": 3000}

    for kb in (0, 12, 60):  # the cache directory itself, the build's first file, its last
        disk = disk_of(kb)
        with pytest.raises(UsageError) as refused:
            cached_dataset(disk / "cache", "rows", "key", build)
        message = str(refused.value)
        assert message.startswith(f"--cache-dir {disk / 'cache'}: no space left on the disk at {disk} ("), message
        assert "\n" not in message and "nothing was cached" in message
        assert [p for p in disk.rglob("*") if p.is_file() and p.name != "filler"] == [], kb


def test_a_full_disk_inside_torch_save_is_named_as_one(small_disk):
    """torch.save raises RuntimeError ("[enforce fail at inline_container.cc:672] . unexpected pos ...") when a file
    does not fit: a traceback once, with the staging directory left behind."""
    import torch
    from accelerate import Accelerator

    class Big:
        def state_dict(self):
            return {"x": torch.zeros(1_000_000)}  # 4 MB of per-rank state on a 400 kB disk

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(3, 2))
    with pytest.raises(checkpoint.RunFailed) as error:
        checkpoint.save_checkpoint(accelerator, small_disk / "run", 1, {"global_step": 1}, rank_state={"big": Big()})
    assert str(error.value).startswith(f"no space left on the disk at {small_disk}")
    assert "rank_state_0.pt" in str(error.value)
    assert not list((small_disk / "run" / "checkpoints").iterdir())  # the staging directory is removed


def fill(disk) -> None:
    """Fill a tmpfs to the last byte."""
    with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as handle:
        while True:
            handle.write(b"\0" * 4096)


def test_a_full_disk_inside_safetensors_is_named_as_one(small_disk):
    """safetensors raises SafetensorError (not OSError) when the model's file does not fit."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(1000, 1000))  # 4 MB of weights on a 400 kB disk
    with pytest.raises(checkpoint.RunFailed) as error:
        checkpoint.save_checkpoint(accelerator, small_disk / "run", 1, {"global_step": 1})
    assert str(error.value).startswith(f"no space left on the disk at {small_disk}")
    assert not list((small_disk / "run" / "checkpoints").iterdir())  # the staging directory is removed


def test_a_full_disk_while_writing_an_artifact_is_one_line(small_disk, monkeypatch):
    from toolkit.run.start import Run

    run = Run.__new__(Run)  # only what write_artifact uses
    run.output_dir = small_disk
    monkeypatch.setattr(Run, "is_main", property(lambda self: True))
    fill(small_disk)
    with pytest.raises(checkpoint.RunFailed, match=f"no space left on the disk at {small_disk}"):
        run.write_artifact("plot.png", lambda path: path.write_bytes(b"x" * 100_000))
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no partial file left


FULL_AT_METRICS = """
import errno
from toolkit.run import tracking

def full(self, row):  # the disk fills just as the first metrics row is written
    raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

tracking.MetricsFile.append = full
"""


def test_a_full_disk_while_writing_a_metrics_row_is_one_line(tmp_path):
    """A stand-in for a disk that fills between two writes: sitecustomize makes metrics.csv's append raise ENOSPC."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FULL_AT_METRICS)
    out = tmp_path / "run"
    result = run_recipe([*ARGS, "--output-dir", str(out)], recipe=TOY, check=False, env={"PYTHONPATH": str(hook)})
    errors = error_lines(result)
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]  # a runtime failure
    assert "no space left on the disk at" in errors[0] and str(out / "metrics.csv") in errors[0], errors
    assert "Traceback" not in result.stderr
    assert (out / "config.json").exists() and not (out / "summary.json").exists()
