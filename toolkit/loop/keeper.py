"""The checkpoint keeper: the run's checkpoints from the training loop's side.

It saves the loop's position once per step (with the lengths of metrics.csv and log.csv, so a resume cuts off what a
later life wrote, and the run's settings, so config.json can be checked against them), prunes to --keep-checkpoints
while sparing the best step, loads the resume checkpoint into the prepared objects and the extra state, and loads the
best weights at the end. The files themselves (atomic saves, manifests, damage checks) are toolkit.run.checkpoint's."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from safetensors.torch import load_file
from tqdm.auto import tqdm

from toolkit.errors import UsageError
from toolkit.run import checkpoint
from toolkit.run.rundir import LOG_FILE, METRICS_FILE, MODEL_FILE, RunDir
from toolkit.run.start import config_values
from toolkit.run.tracking import truncate_to_bytes


class CheckpointKeeper:
    def __init__(self, run, model, shared_state: dict, rank_state: dict):
        self.run, self.accelerator, self.model = run, run.accelerator, model
        self.shared_state, self.rank_state = shared_state, rank_state
        self.last_saved_step: int | None = None

    def load_best(self, best_step: int | None, current_step: int) -> Path | None:
        """The best step's weights into the model, unless they are the current ones; its checkpoint (None: no best)."""
        if best_step is None:
            return None
        best = self.step_dir(best_step)
        if best_step != current_step:
            self.load_weights(best)
        return best

    def refuse_another_world_size(self) -> None:
        """Per-rank state (a carry) is one piece per rank: a resume on another process count is refused."""
        run = self.run
        if run.resume_checkpoint is not None and self.rank_state and run.previous is not None:
            before = run.previous.get("world_size")
            if before != self.accelerator.num_processes:
                raise UsageError(
                    f"--resume-from {run.resume_checkpoint}: this recipe keeps per-rank state "
                    f"({', '.join(self.rank_state)}), so it resumes only with the run's {before} process(es), not "
                    f"{self.accelerator.num_processes}"
                )

    def resume(self) -> dict | None:
        """Load the run's resume checkpoint (if any) into the prepared objects and the extra state; returns the
        loop's saved progress. The main process cuts metrics.csv and log.csv back to their lengths at the save."""
        run = self.run
        if run.resume_checkpoint is None:
            return None
        saved = checkpoint.load_checkpoint(self.accelerator, run.resume_checkpoint, self.shared_state,
                                           self.rank_state)
        self.last_saved_step = saved["global_step"]
        if run.is_main:  # what a later life wrote after this checkpoint is written again
            for name, size in saved.get("file_bytes", {}).items():
                truncate_to_bytes(run.output_dir / name, size)
        return saved

    def saved(self, step: int) -> bool:
        return self.last_saved_step == step

    def save(self, progress) -> None:
        """A complete checkpoint of `progress`'s step (collective), then the prune (the best step is spared)."""
        run = self.run
        if run.is_main:
            progress.file_bytes = {name: _size(run.output_dir / name) for name in (METRICS_FILE, LOG_FILE)}
        checkpoint.save_checkpoint(self.accelerator, run.output_dir, progress.global_step,
                                   {**dataclasses.asdict(progress), **_settings(run)},
                                   self.shared_state, self.rank_state, say=tqdm.write)
        self.last_saved_step = progress.global_step
        protect = {progress.best_step} if progress.best_step is not None else set()
        checkpoint.prune_checkpoints(self.accelerator, run.output_dir, run.config.keep_checkpoints, protect)

    def step_dir(self, step: int) -> Path:
        return RunDir(self.run.output_dir).step(step)

    def load_weights(self, checkpoint_dir: Path) -> None:
        # Read on the CPU; load_state_dict copies onto the model's device. (A multi-process CPU run's device is
        # "cpu:0", which safetensors refuses as a device name.)
        state = load_file(str(Path(checkpoint_dir) / MODEL_FILE))
        self.accelerator.unwrap_model(self.model).load_state_dict(state)


def _settings(run) -> dict:
    """{SETTINGS: the run's flags as config.json records them, and its data's fingerprint} for progress.json (none
    for a run whose config is not a config dataclass, as in a test's stand-in)."""
    if not dataclasses.is_dataclass(run.config):
        return {}
    data = getattr(run, "extra_info", {}).get("data") or {}
    return {checkpoint.SETTINGS: {"config": config_values(run.config), "data": data.get("fingerprint")}}


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
