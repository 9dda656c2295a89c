"""Checkpoint files: atomic saves, what `auto` picks, what pruning may delete."""

import errno
import shutil

import pytest
import torch
from accelerate import Accelerator

from toolkit.errors import UsageError
from toolkit.run import checkpoint


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)


def _save(accelerator, run_dir, step, model):
    return checkpoint.save_checkpoint(accelerator, run_dir, step, {"global_step": step})


def test_save_writes_state_progress_and_marker_last(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    path = _save(accelerator, tmp_path, 7, model)
    assert path == tmp_path / "checkpoints" / "step_7"
    names = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "progress.json", "COMPLETE", "random_states_0.pkl"} <= names
    assert checkpoint.read_progress(path) == {"global_step": 7}
    assert not list((tmp_path / "checkpoints").glob(".*saving"))  # no staging dir left behind


def test_auto_ignores_incomplete_and_explicit_path_rejects_it(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    _save(accelerator, tmp_path, 5, model)
    interrupted = _save(accelerator, tmp_path, 9, model)
    (interrupted / "COMPLETE").unlink()  # as if the save died before the marker
    assert checkpoint.newest_complete(tmp_path).name == "step_5"
    assert checkpoint.resolve_checkpoint_path(tmp_path).name == "step_5"
    with pytest.raises(UsageError, match="incomplete checkpoint"):
        checkpoint.resolve_checkpoint_path(interrupted)
    with pytest.raises(UsageError, match="is not a checkpoint"):
        # a copy under a name that is not step_N and holds no checkpoints/ is not a checkpoint
        checkpoint.resolve_checkpoint_path(shutil.copytree(tmp_path / "checkpoints" / "step_5", tmp_path / "x"))


def test_pruning_keeps_newest_best_and_leaves_incomplete_ones_to_the_next_save(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    for step in (1, 2, 3, 4, 5):
        _save(accelerator, tmp_path, step, model)
    (tmp_path / "checkpoints" / "step_3" / "COMPLETE").unlink()  # an interrupted one
    checkpoint.prune_checkpoints(accelerator, tmp_path, keep=2, protect={1})
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_1", "step_3", "step_4", "step_5"]


def test_saving_a_step_again_keeps_the_old_one_aside(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    _save(accelerator, tmp_path, 4, model)
    _save(accelerator, tmp_path, 4, model)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names[0] == "step_4" and names[1].startswith("step_4.replaced-")


def test_auto_names_every_newer_checkpoint_it_skips_incomplete_or_damaged(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    for step in (2, 4, 6):
        _save(accelerator, tmp_path, step, model)
    (tmp_path / "checkpoints" / "step_6" / "COMPLETE").unlink()  # its save died before the marker
    (tmp_path / "checkpoints" / "step_4" / "model.safetensors").write_bytes(b"damaged")
    said = []
    assert checkpoint.newest_intact(tmp_path, say=said.append).name == "step_2"
    assert len(said) == 2
    assert "step_6 is skipped: it is incomplete (no COMPLETE marker" in said[0] and "from step_2" in said[0]
    assert "step_4 is skipped: model.safetensors does not match its sha256" in said[1]


def test_a_file_the_manifest_does_not_list_is_damage(tmp_path, accelerator):
    import json

    model = accelerator.prepare(torch.nn.Linear(3, 2))
    _save(accelerator, tmp_path, 3, model)
    path = _save(accelerator, tmp_path, 5, model)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    del manifest["files"]["model.safetensors"]  # the entry dropped: the file would go unchecked
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    assert checkpoint.damage_of(path) == "model.safetensors is not listed in MANIFEST.json"
    assert checkpoint.resolve_checkpoint_path(tmp_path).name == "step_3"  # auto (a run dir) skips it
    with pytest.raises(UsageError, match="is damaged: model.safetensors is not listed"):
        checkpoint.resolve_checkpoint_path(path)
    (path / "notes.txt").write_text("added later")  # an added file, too
    assert checkpoint.damage_of(path).startswith("model.safetensors is not listed")


def test_leftovers_of_interrupted_saves_and_prunes_are_named_and_the_next_save_removes_them(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    for step in (1, 2, 3):
        _save(accelerator, tmp_path, step, model)
    root = tmp_path / "checkpoints"
    (root / "step_3" / "COMPLETE").unlink()  # an older toolkit's prune killed halfway, or a save before its marker
    shutil.copytree(root / "step_1", root / ".step_1.pruning")  # a prune killed during its rmtree
    (root / ".step_7.saving").mkdir()  # a save killed while staging
    found = {p.name: why for p, why in checkpoint.leftovers(tmp_path)}
    assert set(found) == {"step_3", ".step_1.pruning", ".step_7.saving"}
    assert "interrupted" in found["step_3"] and "pruning" in found[".step_1.pruning"]
    said = []
    checkpoint.save_checkpoint(accelerator, tmp_path, 4, {"global_step": 4}, say=said.append)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2", "step_4"]
    assert sorted(line.split(":")[0] for line in said) == [
        "removing checkpoints/.step_1.pruning", "removing checkpoints/.step_7.saving", "removing checkpoints/step_3"]


def test_a_prune_renames_before_it_deletes(tmp_path, accelerator, monkeypatch):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    for step in (1, 2, 3):
        _save(accelerator, tmp_path, step, model)

    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt  # the process dies inside the deletion

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune_checkpoints(accelerator, tmp_path, keep=2, protect=set())
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [".step_1.pruning", "step_2", "step_3"]  # never a step_1 that looks like a checkpoint


def test_set_aside_copies_are_pruned_with_the_checkpoints(tmp_path, accelerator, monkeypatch):
    """A save of a step that exists keeps the old one as step_N.replaced-<time>; the prune keeps the newest
    --keep-checkpoints of those copies too (they once were never deleted)."""
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    stamps = iter(f"20250101-00000{i}" for i in range(10))
    monkeypatch.setattr(checkpoint.time, "strftime", lambda _: next(stamps))
    for step in (2, 4, 4, 4, 4):  # three resumes from step 2 that saved step 4 again
        _save(accelerator, tmp_path, step, model)
    (tmp_path / "checkpoints" / "step_6").write_text("a file where a checkpoint belongs")
    _save(accelerator, tmp_path, 6, model)  # sets the file aside as well
    copies = [p.name for p in checkpoint.replaced_copies(tmp_path)]
    assert copies == ["step_4.replaced-20250101-000000", "step_4.replaced-20250101-000001",
                      "step_4.replaced-20250101-000002", "step_6.replaced-20250101-000003"]
    checkpoint.prune_checkpoints(accelerator, tmp_path, keep=2, protect=set())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_4", "step_4.replaced-20250101-000002", "step_6", "step_6.replaced-20250101-000003"]


def test_a_checkpoint_that_is_not_a_directory_is_named(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    for step in (2, 4):
        _save(accelerator, tmp_path, step, model)
    shutil.rmtree(tmp_path / "checkpoints" / "step_4")
    (tmp_path / "checkpoints" / "step_4").write_text("not a checkpoint")  # a directory replaced by a file
    said = []
    assert checkpoint.newest_intact(tmp_path, say=said.append).name == "step_2"
    assert said == [f"warning: checkpoint {tmp_path / 'checkpoints' / 'step_4'} is skipped: it is not a directory (a "
                    "checkpoint is a directory step_N holding a COMPLETE marker); resuming from step_2 instead"]
    with pytest.raises(UsageError, match="step_4 is not a directory, so not a checkpoint") as refused:
        checkpoint.resolve_checkpoint_path(tmp_path / "checkpoints" / "step_4")
    assert "interrupted" not in str(refused.value)  # it once said "its save was interrupted"


def test_a_save_that_fails_after_its_rename_puts_everything_back(tmp_path, accelerator, monkeypatch):
    """The disk fills between the rename and the COMPLETE marker: the new step_N goes, the old one returns."""
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    old = _save(accelerator, tmp_path, 4, model)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "_fsync_dir", full)
    with pytest.raises(checkpoint.RunFailed, match="no space left on the disk at .* while writing"):
        _save(accelerator, tmp_path, 4, model)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert checkpoint.damage_of(old) is None


def test_a_checkpoint_records_the_settings_config_json_must_keep(tmp_path, accelerator):
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    settings = {"config": {"lr": 0.001, "seed": 0, "max_steps": 4, "preset": "tiny"}, "data": "toy-512"}
    path = checkpoint.save_checkpoint(accelerator, tmp_path, 4, {"global_step": 4, checkpoint.SETTINGS: settings})
    config_json = {"config": {**settings["config"], "max_steps": 8}, "data": {"fingerprint": "toy-512"}}
    assert checkpoint.settings_changes(path, config_json) == []  # --max-steps may change at a resume
    config_json["config"]["lr"] = 0.1
    config_json["data"]["fingerprint"] = "toy-1024"
    assert checkpoint.settings_changes(path, config_json) == ["--lr 0.001 -> 0.1",
                                                              "data fingerprint 'toy-512' -> 'toy-1024'"]
    older = _save(accelerator, tmp_path, 2, model)  # an older toolkit's checkpoint: no record, nothing to compare
    assert checkpoint.settings_changes(older, config_json) is None
