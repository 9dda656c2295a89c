"""The divergence guards: a training loss or a metric that is not finite, or a loss that exploded, stops the run
without saving the bad step; the last good checkpoint and the best one stay, and no result is reported."""

from __future__ import annotations

import math
from pathlib import Path

from toolkit.errors import TrainingStopped
from toolkit.run import checkpoint


def loss_problem(step_loss: float, first_loss: float | None, max_loss_ratio: float, step: int) -> str | None:
    """What is wrong with optimizer step `step`'s training loss, or None: not finite, or (--max-loss-ratio) more than
    that many times the first step's."""
    if not math.isfinite(step_loss):
        return f"the training loss is {step_loss} at step {step}"
    if max_loss_ratio and first_loss is not None and abs(step_loss) > max_loss_ratio * abs(first_loss):
        return (f"the training loss exploded to {step_loss:.4g} at step {step}, more than --max-loss-ratio "
                f"{max_loss_ratio:g} x the first step's {first_loss:.4g}")
    return None


def nonfinite_metric(metrics: dict) -> str | None:
    """The first metric whose value is a float that is not finite, or None."""
    return next((k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)), None)


def stopped_without_saving(what: str, run_dir: Path, best_step: int | None) -> TrainingStopped:
    """The one-line stop for a run that went bad: `what` happened; what is kept on disk."""
    kept = checkpoint.newest_complete(run_dir)
    best = f"step_{best_step}" if best_step is not None else "none yet"
    return TrainingStopped(
        f"{what}: the run stopped without saving this step; the last good checkpoint "
        f"({kept.name if kept else 'none'}) and the best one ({best}) are kept and no result is reported; "
        "lower --lr or check the data"
    )
