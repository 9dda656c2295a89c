"""The run directory's layout, named once: every module reads the names from here.

    RUN_DIR/config.json         the run's settings, world size, data fingerprint (toolkit.run.start)
    RUN_DIR/metrics.csv         one row per evaluation (toolkit.run.tracking)
    RUN_DIR/log.csv             --log-with csv: every logged value
    RUN_DIR/summary.json        the finished run's results (toolkit.loop.training)
    RUN_DIR/checkpoints/step_N  complete checkpoints (toolkit.run.checkpoint), each with model.safetensors

A leaf module: it imports nothing of the toolkit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.csv"
LOG_FILE = "log.csv"
CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"  # in each checkpoint: the weights (safetensors)


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def log(self) -> Path:
        return self.path / LOG_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def step(self, step: int) -> Path:
        """The checkpoint directory of an optimizer step (it may not exist)."""
        return self.checkpoints / f"step_{int(step)}"

    def is_run(self) -> bool:
        return self.config.is_file()

    def finished(self) -> bool:
        return self.summary.is_file()

    def read_config(self) -> dict | None:
        return read_json(self.config)

    def read_summary(self) -> dict | None:
        return read_json(self.summary)


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
