"""Checkpoint files: atomic saves, what `auto` picks, what pruning may delete."""

import shutil

import pytest
import torch
from accelerate import Accelerator

from toolkit import checkpoint
from toolkit.errors import UsageError


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


def test_pruning_keeps_newest_best_and_never_touches_incomplete(tmp_path, accelerator):
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
